"""Rewrite a DeepSeek model into the absorbed form and show that nothing changes but the cache.
Run: python samples/02_absorb_a_checkpoint/example.py [HF_CHECKPOINT_DIR]

With a Hugging Face DeepSeek-V2/V3 checkpoint folder (safetensors) it loads that; without one it builds the
tiny preset with random weights."""

import sys

import torch

from mla_deploy import absorb, build_model, load_recipe
from mla_deploy.cache_table import cache_rows

if len(sys.argv) > 1:
    from mla_deploy import load_checkpoint

    model = load_checkpoint(sys.argv[1], form="CC", dtype="fp32")
    print(model.load_report.summary())
else:
    model = build_model(load_recipe("tiny").model, "CC", std=0.3)
config = model.config
ids = torch.randint(0, config.vocab_size, (1, 12))
positions = torch.arange(12)[None]
with torch.no_grad():
    original, cc_cache = model(ids, positions, model.empty_cache(1))
    absorb(model, "A_CC")  # pure weight transform (kv_b_proj -> w_uk, w_uv) + module swap
    absorbed, latent_cache = model(ids, positions, model.empty_cache(1))
print("max |logits difference|:", float((original - absorbed).abs().max()))
print("latent cache per layer:", tuple(latent_cache[0].shape), "=", config.latent_dim, "numbers per token")
for row in cache_rows(config):
    print(f"  {row.kind:<7} {row.elements:>7} elements/token/layer  ({row.ratio_to_latent:.1f}x the latent cache)")

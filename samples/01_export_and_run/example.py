"""Export the tiny preset with the latent cache as explicit I/O, then generate with ONNX Runtime and check the
tokens against the PyTorch original. Run: python samples/01_export_and_run/example.py [OUT_DIR]"""

import sys
import tempfile
from pathlib import Path

import torch

from mla_deploy import load_recipe
from mla_deploy.exporter import export_recipe
from mla_deploy.model import build_model
from mla_deploy.ort.engine import OrtEngine

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "tiny"
recipe = load_recipe("tiny")  # export/tiny.toml: static (in-place) cache, fp32, opset 24
manifest = export_recipe(recipe, out, overwrite=True)  # a mla_deploy.artifact.Manifest
print("graphs:", {role: g.form for role, g in manifest.graphs.items()}, "cache:", manifest.cache["width"], "wide")

engine = OrtEngine(out, threads=1)
prompts = [[1, 2, 3, 4], [9, 8]]
result = engine.generate(prompts, max_new_tokens=16)
print("onnxruntime:", result.tokens, f"({result.provider})")

# the PyTorch original (same seed and std as the export), greedy by full recompute
model = build_model(recipe.model, "CC", std=recipe.export.init_std, seed=recipe.export.seed)
for prompt, tokens in zip(prompts, result.tokens):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            logits, _ = model(torch.tensor([ids]), torch.arange(len(ids))[None], model.empty_cache(1))
            ids.append(int(logits[0, -1].argmax()))
    assert ids[len(prompt):] == tokens, "ONNX Runtime and PyTorch disagree"
print("PyTorch agrees on every token")

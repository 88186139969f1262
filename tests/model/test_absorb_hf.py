"""``absorb`` accepts a transformers DeepseekV2/V3ForCausalLM: it returns our absorbed MLAForCausalLM,
sharing the HF model's tensors and computing its logits (float32, ``max|diff| / max|ref| <= 1e-5``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_oracle  # noqa: E402
import mla_deploy  # noqa: E402
from mla_deploy.model import ABSORBED_FORMS, MLAForCausalLM, build_model  # noqa: E402

TOL = 1e-5


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


@pytest.mark.parametrize("form", ABSORBED_FORMS)
@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("version", [2, 3], ids=["V2", "V3"])
def test_absorb_hf_model(version, q_lora_rank, form):
    hf = hf_oracle.hf_model(version, q_lora_rank=q_lora_rank, yarn=True)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
    model = mla_deploy.absorb(hf, form)
    assert isinstance(model, MLAForCausalLM) and model.form == form
    assert model.config.model_type == f"deepseek_v{version}"
    with torch.no_grad():
        # prefill 7 tokens, then 3 one at a time through the latent cache
        out, past = model(ids[:, :7], torch.arange(7).expand(2, 7), model.empty_cache(2))
        steps = [out]
        for t in range(7, 10):
            out, past = model(ids[:, t:t + 1], torch.full((2, 1), t), past)
            steps.append(out)
        assert rel_err(torch.cat(steps, dim=1), ref) <= TOL
        assert torch.equal(hf(ids).logits, ref)  # the HF model is left as it was

    # shared storage: every tensor but kv_b_proj (split into w_uk / w_uv) is the HF model's own
    theirs = hf.state_dict()
    ours = model.state_dict()
    shared = [k for k in theirs if not k.endswith("kv_b_proj.weight")]
    assert shared and all(ours[k].data_ptr() == theirs[k].data_ptr() for k in shared)
    for i in range(hf.config.num_hidden_layers):
        kv_b = theirs[f"model.layers.{i}.self_attn.kv_b_proj.weight"].view(4, 8 + 12, 16)  # [H, dn+dv, r]
        assert torch.equal(ours[f"model.layers.{i}.self_attn.w_uk"], kv_b[:, :8])
        assert torch.equal(ours[f"model.layers.{i}.self_attn.w_uv"], kv_b[:, 8:])


def test_absorb_our_model_still_rewrites_in_place():
    model = build_model(mla_deploy.load_recipe("tiny").model, "CC", std=0.3)
    assert mla_deploy.absorb(model) is model and model.form == "A_CC"
    with pytest.raises(ValueError):
        mla_deploy.absorb(model, "CC")

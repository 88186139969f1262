"""The HF comparison can fail: deliberate, plausible mistakes break agreement by far more than the tolerance.

Each test first checks the unmodified model agrees with HF (<= 1e-5), then applies one mistake and
checks the error exceeds 1e-2 relative to the output's scale.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

import hf_oracle  # noqa: E402
from helpers import BROKEN, TOL, positions, rel_err  # noqa: E402
from mla_deploy.model import FORMS, MLAForCausalLM, convert_form  # noqa: E402
from mla_deploy.model import mla as mla_module  # noqa: E402

VERSIONS = [pytest.param(2, id="V2"), pytest.param(3, id="V3")]


@torch.no_grad()
def _logits(model, start: int = 37) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(9))
    pos = positions(2, start, 11)
    if isinstance(model, MLAForCausalLM):
        return model(ids, pos, model.empty_cache(2))[0]
    return model(input_ids=ids, position_ids=pos).logits


def _split_kv_a_swapped(kv_a: torch.Tensor, kv_lora_rank: int):
    """The mistake: read kv_a_proj_with_mqa's output as [k_pe | c_kv] (k_pe first)."""
    rope = kv_a.shape[-1] - kv_lora_rank
    return kv_a[..., rope:], kv_a[..., :rope]


def _apply_rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The mistake: NeoX rotate_half, pairs (i, i + d/2), instead of DeepSeek's adjacent pairs (2i, 2i+1) (with
    the same angles: one per pair, read from the interleaved tables)."""
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


@pytest.mark.parametrize("mistake, replacement", [("split_kv_a", _split_kv_a_swapped),
                                                  ("apply_rope", _apply_rope_halves)],
                         ids=["kv_a_split_swapped", "rope_on_halves"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("version", VERSIONS)
def test_patched_mistake_breaks_hf_agreement(version, form, mistake, replacement, monkeypatch):
    """Monkeypatching the split of kv_a, or the rope pairing, in mla.py moves the logits far from HF's."""
    hf = hf_oracle.hf_model(version, yarn=True)
    ref = _logits(hf)
    model = hf_oracle.ours_from_hf(hf, form)
    assert rel_err(_logits(model), ref) <= TOL  # control: unpatched agrees
    monkeypatch.setattr(mla_module, mistake, replacement)
    assert rel_err(_logits(model), ref) > BROKEN


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("version", VERSIONS)
def test_yarn_mscale_left_out_breaks_hf_agreement(version, form):
    """Our config with rope_scaling.mscale_all_dim = 0 (no softmax mscale) against HF's YaRN with mscale_all_dim = 1."""
    hf = hf_oracle.hf_model(version, yarn=True)
    ref = _logits(hf)
    model = hf_oracle.ours_from_hf(hf, form)
    assert model.config.rope_scaling.mscale_all_dim == 1.0
    assert rel_err(_logits(model), ref) <= TOL
    wrong = model.config.replace(rope_scaling=dataclasses.replace(model.config.rope_scaling, mscale_all_dim=0.0))
    broken = MLAForCausalLM(wrong, "CC").eval()
    broken.load_state_dict(hf.state_dict(), strict=True)
    broken = convert_form(broken, form)
    assert wrong.softmax_scale < model.config.softmax_scale
    assert rel_err(_logits(broken), ref) > BROKEN

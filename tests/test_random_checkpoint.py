"""Random checkpoints in the released layout: transformers loads them, and so does our importer, identically."""

from __future__ import annotations

import json

import pytest
import torch

from hf_oracle import hf_config
from mla_deploy import from_hf_config
from mla_deploy.checkpoint import load_checkpoint
from mla_deploy.errors import ExportError
from mla_deploy.random_checkpoint import checkpoint_tensors, write_random_checkpoint


def tiny(version: int, **kw):
    return from_hf_config(hf_config(version, **kw).to_dict(), name=f"tiny-v{version}")


@pytest.mark.parametrize("version", [2, 3])
def test_transformers_and_our_importer_read_the_same_model(tmp_path, version):
    transformers = pytest.importorskip("transformers")
    config = tiny(version)
    seen = []
    summary = write_random_checkpoint(config, tmp_path / "ckpt", dtype="fp32", shard_bytes=200_000, seed=3, std=0.3,
                                      progress=lambda done, total, s: seen.append((done, total)))
    assert len(summary["files"]) > 1  # sharded, with an index naming every tensor
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == summary["tensors"] and seen[-1] == (summary["bytes"], summary["bytes"])
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]  # per-expert, as released
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    ours = load_checkpoint(tmp_path / "ckpt", form="CC", dtype="fp32")
    assert ours.config == config.replace(name=ours.config.name)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        got, _ = ours(ids, torch.arange(9).expand(2, 9), ours.empty_cache(2))
    assert expected.abs().max() > 1.0  # the random weights are not a near-zero model
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_same_seed_same_bytes_and_bf16_size(tmp_path):
    config = tiny(2)
    a = write_random_checkpoint(config, tmp_path / "a", seed=1)
    b = write_random_checkpoint(config, tmp_path / "b", seed=1)
    c = write_random_checkpoint(config, tmp_path / "c", seed=2)
    read = lambda s: (tmp_path / s / "model-00001-of-00001.safetensors").read_bytes()  # noqa: E731
    assert read("a") == read("b") != read("c")
    entries = checkpoint_tensors(config, "bf16")
    assert all(e.dtype == "BF16" for e in entries)  # a V2 config has no float32 routing bias
    params = sum(p.numel() for p in load_checkpoint(tmp_path / "a").parameters())
    assert a["bytes"] == 2 * params == len(read("a")) - 8 - int.from_bytes(read("a")[:8], "little")


def test_refuses_a_non_empty_folder_and_leaves_nothing_on_failure(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    with pytest.raises(ExportError, match="not an empty folder"):
        write_random_checkpoint(tiny(2), tmp_path / "taken")
    assert (tmp_path / "taken" / "mine.txt").read_text() == "keep"

    def interrupt(done, total, seconds):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_random_checkpoint(tiny(3), tmp_path / "new", progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no half-written folder, no temp folder

"""Quantized weights (int4) and the pre-built CPU engine (``build --target cpu``) on GLM-4.7-Flash's shape: the tiny
``glm4_moe_lite`` checkpoint written by transformers' own class (:mod:`family_checkpoints`: one dense layer, then
MoE with one group and ``routed_scaling_factor`` 1.8, v_head_dim != qk_nope_head_dim, rope theta 1e6, a
multi-token-prediction layer on disk) exported with ``--weights int4``, its engine built by the CLI, and run: the
engine's greedy tokens equal the same int4 artifact's without the engine (``run --no-engine``), and its prefill and
decode logits are the source graphs' within the bound tests/ort/test_cpu_engine.py holds for the tiny DeepSeek-V3
model (float sums in another order), or equal where the engine kept ONNX Runtime's kernels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

import family_checkpoints  # noqa: E402
from cli_run import cli, ok  # noqa: E402
from mla_deploy.ort.engine import OrtEngine  # noqa: E402

PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def glm_int4(tmp_path_factory) -> Path:
    """The tiny GLM-4.7-Flash checkpoint exported with int4 weights, its CPU engine built (through the CLI)."""
    root = tmp_path_factory.mktemp("glm-int4")
    family_checkpoints.write("glm4_moe_lite", root / "ckpt")
    ok(cli("export", "--hf", root / "ckpt", "--out", root / "int4", "--weights", "int4"))
    quantization = json.loads((root / "int4" / "manifest.json").read_text())["quantization"]
    assert quantization["weights"] == "int4" and quantization["format"] == "matmulnbits"
    assert "model.layers.1.mlp.experts.gate_up_proj" in quantization["keys"]  # the MoE layers' experts too
    out = ok(cli("build", root / "int4", "--target", "cpu"))
    assert f"{root / 'int4' / 'cpu'}" in out, out
    return root / "int4"


def _tokens(*args) -> tuple[list[int], str]:
    record = json.loads(ok(cli("run", *args, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12",
                               "--json")))
    return record["sequences"][0]["tokens"], record["graphs"]


def test_int4_engine_gives_the_source_graphs_tokens_and_logits(glm_int4):
    art = glm_int4
    (with_engine, graphs), (without, source) = _tokens(art), _tokens(art, "--no-engine")
    assert graphs == f"engine {art / 'cpu'}" and source == "source graphs"
    assert len(with_engine) == 12 and with_engine == without
    engines = [OrtEngine(art, threads=1), OrtEngine(art, threads=1, use_engine=False)]
    states = [e.new_state(1) for e in engines]
    ids = np.array([PROMPT], dtype=np.int64)
    outs = [np.array(e.step("prefill", ids, np.arange(len(PROMPT))[None], s)) for e, s in zip(engines, states)]
    outs += [np.array(e.step("decode", ids[:, :1], np.array([[len(PROMPT)]]), s)) for e, s in zip(engines, states)]
    own = json.loads((art / "cpu" / "engine.json").read_text())["operators"]
    # int4: the quantized products, the two MoE layers' routed experts among them, are the engine's own operators
    # where a C compiler and AVX-512 VNNI are there (why_not says otherwise why not)
    assert (own["linear"] > 0) == (own["experts"] == 2) == (own["why_not"] is None)
    for engine_out, source_out in ((outs[0], outs[1]), (outs[2], outs[3])):
        assert np.isfinite(source_out).all()
        if own["linear"]:
            assert np.abs(engine_out - source_out).max() <= 1e-5 * np.abs(source_out).max()
            assert not np.array_equal(engine_out, source_out)  # the own operators did run
        else:
            assert np.array_equal(engine_out, source_out)

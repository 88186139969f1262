"""DeepSeek Sparse Attention: `deepseek_v32` (DeepSeek-V3.2) and `glm_moe_dsa` (GLM-5) checkpoints written by
transformers' own classes (:mod:`family_checkpoints`) export through `mla-deploy export --hf`, with each layer's
indexer keys a second cache (``past_index.{i}`` / ``present_index.{i}``) beside the latent one and the top-k
selection in the graph. ONNX Runtime's greedy tokens equal transformers' `generate` and its logits are within 1e-4
of transformers' at the prefill and every decode step, with ``index_topk`` 4 (every prompt is past it from its fifth
token) and 64 (above every context: dense MLA), in both cache modes; `validate` passes; the manifest and
`inspect` count the index cache. Exporting the sparse checkpoint as dense fails the same comparison, so the sparse
one's pass is the selection's.
"""

from __future__ import annotations

import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")

import family_checkpoints  # noqa: E402
from cli_run import cli, ok  # noqa: E402
from hf_oracle import assert_engine_matches_hf  # noqa: E402
from mla_deploy.ort.engine import OrtEngine  # noqa: E402

#: an 11-token prompt (past index_topk 4 from its fifth token) and a 3-token one (past it from its second decode)
PROMPTS = [[5, 17, 99, 3, 42, 7, 88, 23, 61, 9, 14], [64, 2, 11]]
NEW = 8
EXPORTS = [(case, "static") for case in family_checkpoints.SPARSE_CASES] + [
    ("deepseek_v32-sparse", "concat"), ("glm_moe_dsa-sparse", "concat")]


def _one_line_failure(done, out) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert not out.exists()
    return lines[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{case: (transformers model, folder)}``, each written once."""
    root = tmp_path_factory.mktemp("dsa")
    return {case: (family_checkpoints.write(case, root / case), root / case) for case in family_checkpoints.SPARSE_CASES}


@pytest.fixture(scope="module", params=EXPORTS, ids=[f"{c}-{m}" for c, m in EXPORTS])
def exported(request, checkpoints, tmp_path_factory):
    """``(case, cache mode, transformers model, checkpoint folder, artifact folder)``, exported through the CLI."""
    case, mode = request.param
    hf, ckpt = checkpoints[case]
    out = tmp_path_factory.mktemp(f"{case}-{mode}") / "onnx"
    ok(cli("export", "--hf", ckpt, "--out", out, "--cache-mode", mode))
    return case, mode, hf, ckpt, out


@pytest.mark.slow
def test_tokens_and_logits_match_transformers(exported):
    case, mode, hf, _, out = exported
    assert_engine_matches_hf(OrtEngine(out, threads=1, capacity=32), hf, PROMPTS, NEW)


@pytest.mark.slow
def test_index_cache_is_graph_io_in_the_manifest(exported):
    """The graph's inputs and outputs hold one index cache per layer after the latent ones, ``index_head_dim``
    wide; the manifest's cache entry describes it; TopK and ScatterElements select in the graph."""
    import onnx

    case, mode, hf, _, out = exported
    manifest = json.loads((out / "manifest.json").read_text())
    layers, width = hf.config.num_hidden_layers, hf.config.index_head_dim
    index = manifest["cache"]["index"]
    assert index["width"] == width and index["index_topk"] == hf.config.index_topk
    assert index["layers"] == [{"past": f"past_index.{i}", "present": f"present_index.{i}"} for i in range(layers)]
    graph = next(iter(manifest["graphs"].values()))
    inputs = [t["name"] for t in graph["inputs"]]
    assert inputs[-2 * layers:] == [f"past_latent.{i}" for i in range(layers)] + [f"past_index.{i}" for i in range(layers)]
    assert [t["shape"][-1] for t in graph["inputs"][-layers:]] == [width] * layers
    outputs = [t["name"] for t in graph["outputs"]]
    assert outputs[-layers:] == [f"present_index.{i}" for i in range(layers)]
    ops = {node.op_type for node in onnx.load(out / graph["file"], load_external_data=False).graph.node}
    assert {"TopK", "ScatterElements"} <= ops


STATIC = [e for e in EXPORTS if e[1] == "static"]


@pytest.mark.slow
@pytest.mark.parametrize("exported", STATIC, ids=[c for c, _ in STATIC], indirect=True)
def test_validate_and_inspect(exported, tmp_path):
    """`validate` (the index caches compared too) passes; `inspect --hf` counts the index cache per token."""
    case, mode, hf, ckpt, out = exported
    shown = ok(cli("validate", out, "--steps", 2, "--threads", 1, "--out", tmp_path / "report"))
    assert "validation passed" in shown
    assert "present_index.0" in (tmp_path / "report" / "report.json").read_text()
    shown = ok(cli("inspect", "--hf", ckpt))
    index = next(line.split() for line in shown.splitlines() if line.split()[:1] == ["index"])
    assert int(index[1]) == hf.config.index_head_dim
    assert f"latent + index cache, all {hf.config.num_hidden_layers} layers" in shown


@pytest.mark.slow
@pytest.mark.parametrize("exported", STATIC[:1], ids=[c for c, _ in STATIC[:1]], indirect=True)
def test_cache_rows_copied_and_through_the_host_carry_the_index_keys(exported):
    """What the server's prefix cache and `n` > 1 do: a prompt's rows copied to other sequences (``copy_rows``) and
    through the host (``read_rows`` / ``write_rows``, each layer's latent row then its index keys), the rest of the
    prompt prefilled after them: every copy decodes the logits of the sequence prefilled whole."""
    import numpy as np

    case, mode, hf, _, out = exported
    engine, prompt = OrtEngine(out, threads=1, capacity=32), PROMPTS[0]
    state = engine.new_state(4)
    engine.prefill(np.array([prompt]), np.array([len(prompt)]), engine.rows(state, 0, 1))
    engine.copy_rows(state, 0, [2, 3], len(prompt))
    rows = engine.read_rows(state, 0, 0, len(prompt))
    c = hf.config
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    assert rows.shape == (c.num_hidden_layers, len(prompt), latent + c.index_head_dim)
    np.testing.assert_array_equal(engine.read_rows(state, 3, 0, len(prompt)), rows)
    engine.write_rows(state, 1, 0, rows[:, :6])
    engine.prefill(np.array([prompt[6:]]), np.array([len(prompt) - 6]), engine.rows(state, 1, 2))
    assert state.lengths.tolist() == [len(prompt)] * 4
    logits = engine.to_host(engine.decode(np.array([7, 7, 7, 7]), engine.rows(state, 0, 4)))
    for row in (1, 2, 3):
        np.testing.assert_allclose(logits[row], logits[0], atol=1e-5, rtol=0)
    keys_lost = rows * np.r_[np.ones(latent), np.zeros(c.index_head_dim)]  # the indexer then chooses other tokens
    engine.write_rows(state, 1, 0, keys_lost)
    lost = engine.to_host(engine.decode(np.array([7]), engine.rows(state, 1, 2)))
    assert np.abs(lost[0] - logits[0]).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("case", ["deepseek_v32-sparse", "glm_moe_dsa-sparse"])
def test_without_the_selection_the_comparison_fails(checkpoints, case, tmp_path):
    """The mutation check: the same weights exported with index_topk past every context (no token ever left out)
    differ from transformers' sparse model, so the sparse exports' pass above is the top-k selection's."""
    hf, ckpt = checkpoints[case]
    dense = tmp_path / "dense"
    shutil.copytree(ckpt, dense)
    config = json.loads((dense / "config.json").read_text())
    config["index_topk"] = 1 << 20
    (dense / "config.json").write_text(json.dumps(config))
    ok(cli("export", "--hf", dense, "--out", tmp_path / "onnx"))
    with pytest.raises(AssertionError):
        assert_engine_matches_hf(OrtEngine(tmp_path / "onnx", threads=1, capacity=32), hf, PROMPTS, NEW)


@pytest.mark.slow
@pytest.mark.parametrize("exported", STATIC, ids=[c for c, _ in STATIC], indirect=True)
def test_continuous_batching_carries_the_index_cache(exported):
    """Rows of one static state, prefilled and decoded one sequence at a time (what the server's batcher does with
    :meth:`rows` and :meth:`clear`), give each prompt the tokens it gets alone."""
    import numpy as np

    case, mode, hf, _, out = exported
    engine = OrtEngine(out, threads=1, capacity=32)
    alone = engine.generate(PROMPTS, NEW).tokens
    state = engine.new_state(2)
    engine.clear(state, 0)
    tokens = []
    for row, prompt in enumerate(PROMPTS):
        view = engine.rows(state, row, row + 1)
        logits = engine.step("prefill", np.array([prompt]), np.arange(len(prompt))[None], view)
        got = [int(engine.argmax(logits)[0, -1])]
        for _ in range(NEW - 1):
            logits = engine.step("decode", np.array([[got[-1]]]), view.lengths[:, None].copy(), view)
            got.append(int(engine.argmax(logits)[0, -1]))
        tokens.append(got)
    assert tokens == alone


@pytest.mark.slow
def test_int4_export_computes_its_quantized_reference(checkpoints, tmp_path):
    """`--weights int4`: the graph equals the PyTorch model carrying the same dequantized weights (validate's exact
    comparison, the index caches included), the indexer's weights kept in float like the MoE router's (its top-k is
    discontinuous in its scores). The cost against the unquantized model is not judged: random weights have no
    top-1 margins (tests/validate/test_quantization.py judges it on trained models)."""
    import onnx

    from mla_deploy.validate import ValidateOptions, validate_artifact

    _, ckpt = checkpoints["deepseek_v32-sparse"]
    ok(cli("export", "--hf", ckpt, "--out", tmp_path / "q4", "--weights", "int4"))
    result = validate_artifact(tmp_path / "q4", options=ValidateOptions(write_reports=False))
    assert result.graph_passed
    names = {i.name: i for i in onnx.load(tmp_path / "q4" / "model.onnx").graph.initializer}
    assert any(n.startswith("model.model.layers.1.self_attn.q_b_proj.weight") and n.endswith(".nbits") for n in names)
    indexer = [i for n, i in names.items() if ".indexer." in n]
    assert len(indexer) == 3 * 5 and all(i.data_type == onnx.TensorProto.FLOAT for i in indexer)


def test_sparse_model_is_refused_where_it_cannot_run(checkpoints, tmp_path):
    """The genai target and the TensorRT decode plugin hold no index cache: each is one line, exit 1, nothing
    written."""
    _, ckpt = checkpoints["deepseek_v32-sparse"]
    line = _one_line_failure(cli("export", "--hf", ckpt, "--out", tmp_path / "genai", "--target", "genai"),
                             tmp_path / "genai")
    assert "index-key cache has no place in it" in line
    line = _one_line_failure(cli("bench", "attention", "--preset", "deepseek-v3.2", "--layers", 1, "--context", 16,
                                 "--out", tmp_path / "bench"), tmp_path / "bench")
    assert "DeepSeek Sparse Attention's indexer and its key cache are not part of them (use `bench model`)" in line


@pytest.mark.slow
@pytest.mark.parametrize("case", ["deepseek_v32-sparse", "glm_moe_dsa-sparse"])
def test_int4_cpu_engine_keeps_the_top_k_and_swaps_the_products(checkpoints, tmp_path, case):
    """`build --target cpu` on an int4 sparse export: the quantized products and routed experts become the engine's
    own operators, the attention stays ONNX Runtime's (LatentAttention attends to every cached token, not to the
    indexer's top-k); greedy tokens past index_topk equal the same artifact's without the engine, logits within the
    bound tests/ort/test_cpu_engine_family.py holds (float sums in another order)."""
    import numpy as np

    _, ckpt = checkpoints[case]
    art = tmp_path / "q4"
    ok(cli("export", "--hf", ckpt, "--out", art, "--weights", "int4"))
    ok(cli("build", art, "--target", "cpu"))
    own = json.loads((art / "cpu" / "engine.json").read_text())["operators"]
    assert own["attention"] == 0
    engines = [OrtEngine(art, threads=1, capacity=32), OrtEngine(art, threads=1, capacity=32, use_engine=False)]
    runs = [e.generate(PROMPTS, NEW).tokens for e in engines]
    assert runs[0] == runs[1]
    if own["why_not"] is not None:  # no C compiler or no fast path here: the engine kept ONNX Runtime's kernels
        return
    assert own["linear"] > 0 and own["experts"] > 0
    ids = np.array([PROMPTS[0]], dtype=np.int64)
    states = [e.new_state(1) for e in engines]
    outs = [np.array(e.step("prefill", ids, np.arange(ids.shape[1])[None], s)) for e, s in zip(engines, states)]
    assert np.abs(outs[0] - outs[1]).max() <= 1e-5 * np.abs(outs[1]).max()
    assert not np.array_equal(outs[0], outs[1])  # the own operators did run


def test_decode_plugin_refuses_sparse_attention():
    """The TensorRT MlaDecode plugin attends to every slot: swapping it into a DeepSeek-V3.2 layer is refused."""
    import torch

    from mla_deploy.errors import ConfigError
    from mla_deploy.exporter.decode_plugin import use_decode_plugin
    from mla_deploy.model import MLAForCausalLM
    from mla_deploy.recipe import load_recipe

    with torch.device("meta"):
        model = MLAForCausalLM(load_recipe("deepseek-v3.2").model.first_layers(1), "A_CC")
    with pytest.raises(ConfigError, match="DeepSeek Sparse Attention \\(index_topk\\) needs decode_attention"):
        use_decode_plugin(model)


def _edit(folder, change):
    path = folder / "config.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _drop_tensor(folder, name):
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    del state[name]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("case, change, message", [
    ("deepseek_v32-sparse", lambda f: _drop_tensor(f, "model.layers.1.self_attn.indexer.wk.weight"),
     "model.layers.1.self_attn.indexer.wk.weight"),
    ("glm_moe_dsa-sparse", lambda f: _drop_tensor(f, "model.layers.0.self_attn.indexer.weights_proj.weight"),
     "model.layers.0.self_attn.indexer.weights_proj.weight"),
    ("deepseek_v32-sparse", lambda f: _edit(f, lambda d: d.update(index_topk=0)),
     "index_topk must be a positive integer (DeepSeek Sparse Attention), got 0"),
    ("glm_moe_dsa-sparse", lambda f: _edit(f, lambda d: d.update(index_topk=-3)),
     "index_topk must be a positive integer (DeepSeek Sparse Attention), got -3"),
    ("deepseek_v32-sparse", lambda f: _edit(f, lambda d: d.update(index_topk=4.5)), "index_topk must be an integer, got 4.5"),
    ("glm_moe_dsa-sparse", lambda f: _edit(f, lambda d: d.update(index_topk="4")), 'index_topk must be an integer, got "4"'),
    ("deepseek_v32-sparse", lambda f: _edit(f, lambda d: d.update(q_lora_rank=None)),
     "DeepSeek Sparse Attention's indexer reads the compressed query, and q_lora_rank is absent"),
    ("glm_moe_dsa-sparse", lambda f: _edit(f, lambda d: d.update(indexer_types=["full", "shared", "full"])),
     "layers reusing an earlier layer's top-k (indexer_types 'shared', layer 1) are not supported"),
], ids=["v32_missing_indexer_key", "glm_missing_indexer_weights", "topk_zero", "topk_negative", "topk_float",
        "topk_string", "no_q_lora", "glm_shared_indexer"])
def test_bad_sparse_checkpoint_is_one_line(checkpoints, tmp_path, case, change, message):
    """A malformed DeepSeek-V3.2 / GLM-5 checkpoint: `export --hf` exits 1 with one line, nothing written."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints[case][1], ckpt)
    change(ckpt)
    line = _one_line_failure(cli("export", "--hf", ckpt, "--out", tmp_path / "out"), tmp_path / "out")
    assert message in line


@pytest.mark.parametrize("case", ["deepseek_v32-sparse", "glm_moe_dsa-sparse"])
def test_in_memory_transformers_model(checkpoints, case):
    """``from_hf_model`` on the transformers model itself: DeepSeek-V3.2's half-rotated indexer rows permuted into new
    tensors; the logits of a prompt past index_topk are transformers'."""
    import torch

    from mla_deploy.model.hf import from_hf_model

    hf, _ = checkpoints[case]
    model = from_hf_model(hf).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        logits, _ = model(ids, torch.arange(ids.shape[1])[None], model.empty_cache(1))
        assert (logits - hf(ids).logits).abs().max() <= 1e-4

"""`mla-deploy bench model` (and its spelling from before the subcommands, `bench --whole-model`): smoke runs on a tiny transformers-written MoE checkpoint and on the tiny
preset (tiny points, one thread; no timing assertion) whose bench.json has what the issue asks for; the
uniform-routing fallback; one-line errors; the cost model."""

from __future__ import annotations

import json
import math
import re

import pytest
from click.testing import CliRunner

from mla_deploy.cli import main
from mla_deploy.quant import FLOAT

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

CONTEXTS, BATCHES, PROMPT, REPEAT, WARMUP = (0, 6), (1, 2), 6, 2, 1
SMOKE = ["bench", "model", "--context", "0,6", "--batch", "1,2", "--prompt-length", "6", "--repeat", "2",
         "--warmup", "1", "--threads", "1", "--probe-mib", "16"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """transformers' own tiny DeepSeek-V2 MoE model (8 routed experts, top-2, one dense and one MoE layer), saved."""
    from hf_oracle import hf_model

    folder = tmp_path_factory.mktemp("ckpt")
    hf_model(2).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def smoke(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = CliRunner().invoke(main, SMOKE + ["--hf", str(checkpoint), "--out", str(out)])
    assert result.exit_code == 0, result.output + (result.stderr or "") + repr(result.exception)
    return result, out, json.loads((out / "bench.json").read_text())


def test_the_bound_is_the_best_probe_and_is_checked_against_every_row(smoke):
    """The bound takes the best probe of the run (max), not the median; the report checks it against the bytes
    (FLOPs) per second every measured step achieved and says in the printed table whether it held."""
    result, _, report = smoke
    machine, check = report["machine"], report["bound_check"]
    assert check["read_gbps"] == machine["read_gbps"]["max"] and check["gemm_gflops"] == machine["gemm_gflops"]["max"]
    rows = [r for r in report["rows"] if r["status"] == "ok"]
    beaten = {f"{r['path']} {r['point']}" for r in rows if r["bound"]["achieved_gbps"] > check["read_gbps"]
              or r["bound"]["achieved_gflops"] > check["gemm_gflops"]}
    assert {b["label"] for b in check["beaten_by"]} == beaten and check["holds"] == (not beaten)
    line = "THE BOUND DID NOT HOLD" if beaten else "bound check: the measured read bandwidth"
    assert line in result.stdout


def test_quantized_steps_are_bounded_by_the_int8_gemm_rate_and_float_ones_by_the_fp32_rate():
    """A quantized artifact's step computes with int8 activations: it may beat the fp32 GEMM rate, not the int8
    one; a float step that beats the fp32 rate breaks the bound. Without an int8 probe the fp32 rate stands."""
    from mla_deploy.bench.bound import bound_check_line
    from mla_deploy.quant import plan
    from mla_deploy.bench.machine import probe
    from mla_deploy.bench.reporting import bound_rates, summarize
    from mla_deploy.bench.whole_model.report import bound_check

    measured = probe(1, probe_mib=16, reps=2)
    assert measured["int8_gemm_gops"] is None or measured["int8_gemm_gops"] > 0
    machine = {"read_gbps": summarize([40.0], "GB/s"), "gemm_gflops": summarize([150.0, 170.0], "GFLOP/s"),
               "int8_gemm_gops": summarize([800.0], "GOP/s")}
    assert bound_rates(machine) == (40.0, 170.0) and bound_rates(machine, "int8") == (40.0, 800.0)

    def row(path, gflops, gbps=1.0):
        return {"path": path, "point": "prefill/B1", "status": "ok",
                "bound": {"achieved_gbps": gbps, "achieved_gflops": gflops}}

    quantized = {"ours": "fp32", "ours-int4": "int8"}
    check = bound_check(machine, [row("ours", 160.0), row("ours-int4", 400.0, gbps=2.0)], quantized)
    assert check["holds"] and check["fastest"] == "ours-int4 prefill/B1"
    assert (check["gemm_gflops"], check["int8_gemm_gops"]) == (170.0, 800.0)
    assert "(int8 800 GOP/s for the quantized artifacts)" in bound_check_line(check)
    assert not bound_check(machine, [row("ours", 160.0), row("ours-int4", 900.0)], quantized)["holds"]
    failed = bound_check(machine, [row("ours", 200.0), row("ours-int4", 400.0)], quantized)
    assert not failed["holds"] and [b["label"] for b in failed["beaten_by"]] == ["ours prefill/B1"]
    assert not bound_check(machine, [row("ours-int4", 400.0)], {})["holds"]  # not said to be quantized: fp32
    del machine["int8_gemm_gops"]
    assert bound_rates(machine, "int8") == (40.0, 170.0)
    assert FLOAT.arithmetic == "fp32" and plan("int4").arithmetic == plan("int8").arithmetic == "int8"


def test_smoke_writes_the_report_and_keeps_the_export(smoke):
    result, out, _ = smoke
    assert sorted(p.name for p in out.iterdir()) == ["artifact", "bench.json", "bench.md"]  # no work leftovers
    assert (out / "artifact" / "manifest.json").is_file()
    md = (out / "bench.md").read_text()
    assert "## Decode" in md and "## Prefill" in md and "| ours |" in md and "| transformers |" in md
    assert "ms/token" in result.stdout and "achieved/bound" in result.stdout


def _check_bound(row, routed):
    bound = row["bound"]
    for key in ("bytes", "weight_bytes", "flops", "t_mem_ms", "t_flop_ms", "bound_ms", "achieved_over_bound"):
        assert bound[key] > 0, key
    assert bound["bound_ms"] == pytest.approx(max(bound["t_mem_ms"], bound["t_flop_ms"]))
    assert bound["achieved_over_bound"] == pytest.approx(row["latency_ms"]["median"] / bound["bound_ms"])
    assert bound["achieved_gbps"] == pytest.approx(bound["bytes"] / row["latency_ms"]["median"] / 1e6)
    assert bound["achieved_gflops"] == pytest.approx(bound["flops"] / row["latency_ms"]["median"] / 1e6)
    assert bound["routed_experts"] == routed


def test_smoke_rows_have_every_number(smoke):
    """Both paths at every point: decode ms/token and tokens/s per sequence and for the batch, prefill tokens/s,
    peak RSS, the bound (measured routing: top-2 of 8 experts, so 2..8 distinct per MoE layer) and its ratio."""
    _, _, report = smoke
    assert report["format"] == "mla-deploy-bench-whole-model"
    assert report["routing"]["method"] == "measured"
    for key in ("read_gbps", "gemm_gflops"):
        assert report["machine"][key]["median"] > 0 and report["machine"][key]["n"] >= 2
    assert report["machine"]["threads"] == 1
    paths = report["paths"]
    assert paths["ours"]["available"] and paths["transformers"]["available"], paths
    for info in paths.values():
        assert info["peak_rss_bytes"] > 0 and info["load_seconds"] > 0
    rows = {(r["path"], r["kind"], r["context"], r["batch"]): r for r in report["rows"]}
    expected = {(p, "prefill", None, b) for p in ("ours", "transformers") for b in BATCHES} | \
               {(p, "decode", t, b) for p in ("ours", "transformers") for t in CONTEXTS for b in BATCHES}
    assert set(rows) == expected
    for (path, kind, context, batch), row in rows.items():
        assert row["status"] == "ok", row
        ms = row["latency_ms"]["median"]
        assert ms > 0 and row["latency_ms"]["n"] == REPEAT and row["peak_rss_bytes"] > 0
        if kind == "decode":
            assert row["ms_per_token"] == ms
            assert row["tokens_per_s_per_sequence"] == pytest.approx(1e3 / ms)
            assert row["tokens_per_s_batch"] == pytest.approx(batch * 1e3 / ms)
            held = max(context, 1) + WARMUP
            assert row["cache_rows_timed"] == [held, held + REPEAT - 1]
        else:
            assert row["tokens_per_s"] == pytest.approx(batch * PROMPT * 1e3 / ms)
        _check_bound(row, "measured")
        assert 2 <= row["bound"]["distinct_experts_per_moe_layer"] <= 8
        if path == "ours":
            assert row["speedup_vs_transformers"] > 0
    for t in CONTEXTS:  # one sequence, one step: exactly its top-2
        assert rows[("ours", "decode", t, 1)]["bound"]["distinct_experts_per_moe_layer"] == 2
    # the same weights compute the same function: the greedy tokens agree
    for t in CONTEXTS:
        for b in BATCHES:
            assert rows[("ours", "decode", t, b)]["tokens_agree_with_reference"] >= 0.9
            assert rows[("transformers", "decode", t, b)]["tokens_agree_with_ours"] >= 0.9


def test_artifact_as_given_with_uniform_routing(smoke, tmp_path, monkeypatch):
    """--artifact benches an export as given (here without transformers); when the reference cannot run, the
    bound uses the expected distinct experts under uniform routing and the report says so."""
    from mla_deploy.bench.whole_model import driver as whole_model
    from mla_deploy.bench.whole_model.cost import expected_distinct_experts
    from mla_deploy.bench.whole_model.spec import WholeModelSpec

    real_plan = whole_model.plan

    def plan(spec, prepared):
        status, _ = real_plan(spec, prepared)
        return status, {"method": "uniform", "reason": "forced by the test"}

    monkeypatch.setattr(whole_model, "plan", plan)
    _, out, _ = smoke
    spec = WholeModelSpec(source="artifact", location=str(out / "artifact"), contexts=(3,), batches=(2,),
                          prompt_length=4, repeat=1, warmup=0, threads=1, probe_mib=16, transformers=False)
    report = whole_model.run_whole_model(spec, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md"]
    skipped = report["paths"]["transformers"]
    assert not skipped["available"] and skipped["reason"] == "skipped (--no-transformers)"
    assert report["routing"]["method"] == "uniform"
    assert {(r["path"], r["kind"]) for r in report["rows"]} == {("ours", "prefill"), ("ours", "decode")}
    for row in report["rows"]:
        assert row["status"] == "ok", row
        _check_bound(row, "uniform")
    decode = next(r for r in report["rows"] if r["kind"] == "decode")
    assert decode["bound"]["distinct_experts_per_moe_layer"] == pytest.approx(expected_distinct_experts(8, 2, 2))
    assert "NOT MEASURED" in (tmp_path / "bench.md").read_text()


def test_preset_writes_one_checkpoint_for_both_paths(tmp_path):
    """A preset is written as a random fp32 checkpoint that both paths load (transformers included); a second
    preparation reuses the checkpoint and the artifacts. With --weights float,int4 one artifact of each is exported
    and timed: the int4 rows sit beside the float ones with their speed-up over them, and the bound of a decode
    step reads exactly the manifest's quantized bytes (integers and scales) plus every tensor of the checkpoint
    the export did not quantize, one embedding row and the latent cache."""
    from mla_deploy.artifact import load_manifest
    from mla_deploy.bench.whole_model.driver import prepare
    from mla_deploy.bench.whole_model.spec import WholeModelSpec
    from mla_deploy.checkpoint import CheckpointTensors

    args = ["bench", "--whole-model", "--preset", "tiny", "--layers", "1", "--context", "2", "--batch", "1",
            "--prompt-length", "4", "--repeat", "1", "--warmup", "0", "--threads", "1", "--probe-mib", "16",
            "--weights", "float,int4", "--block-size", "64", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + (result.stderr or "") + repr(result.exception)
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["command"].startswith("mla-deploy bench model --preset tiny --layers 1 --context 2 --batch 1 ")
    assert report["model"]["num_hidden_layers"] == 1 and report["model"]["name"] == "tiny"
    assert report["routing"]["method"] == "none"  # the tiny preset is dense
    assert report["checkpoint"] == str(tmp_path / "checkpoint")
    assert report["artifact"]["weights"]["kind"] == "hf"
    rows = {(r["path"], r["kind"]): r for r in report["rows"]}
    assert set(rows) == {(p, k) for p in ("ours", "ours-int4", "transformers") for k in ("decode", "prefill")}
    assert all(r["status"] == "ok" and r["bound"]["bound_ms"] > 0 for r in rows.values()), rows
    # the quantized artifact and its rows
    manifest = load_manifest(tmp_path / "artifact-int4")
    assert manifest.quantization.weights == "int4" and manifest.quantization.block_size == 64
    assert load_manifest(tmp_path / "artifact").quantization is FLOAT
    assert report["paths"]["ours-int4"]["weights"]["quantized_bytes"] == manifest.quantization.bytes
    decode = rows[("ours-int4", "decode")]
    assert decode["weights"] == "int4" and decode["speedup_vs_float"] > 0 and decode["speedup_vs_transformers"] > 0
    assert decode["llama_bench"]["test"] == "tg1 @ d2" and decode["llama_bench"]["tokens_per_s_mean"] > 0
    source = CheckpointTensors(tmp_path / "checkpoint")
    sizes = {k: source.get(k).numel() * 4 for k in source.keys() if k != "model.embed_tokens.weight"}
    source.close()
    floats = sum(n for k, n in sizes.items() if k not in manifest.quantization.keys)
    config = manifest.config
    cache = decode["cache_rows_timed"][0] * config.latent_dim * 4 * config.num_hidden_layers
    assert decode["bound"]["cache_bytes"] == cache
    assert decode["bound"]["bytes"] == manifest.quantization.bytes + floats + config.hidden_size * 4 + cache
    assert rows[("ours", "decode")]["bound"]["weight_bytes"] == sum(sizes.values()) + config.hidden_size * 4
    md = (tmp_path / "bench.md").read_text()
    assert "| ours-int4 |" in md and "## llama-bench" in md and "tg1 @ d2" in md and "1 thread(s)" in md
    again = prepare(WholeModelSpec(source="preset", location="tiny", layers=1, contexts=(2,), batches=(1,),
                                   prompt_length=4, repeat=1, warmup=0, weights=("float", "int4"), block_size=64),
                    tmp_path, lambda line: None)
    # the checkpoint, then each export and its CPU engine (built once, for what the bench runs)
    assert [note.split(" ")[0] for note in again.notes] == ["reused"] * 5, again.notes
    assert sum("the CPU engine in" in note for note in again.notes) == 2, again.notes
    assert [v.path for v in again.variants] == ["ours", "ours-int4"]


@pytest.mark.parametrize("args, words", [
    pytest.param(["--preset", "tiny", "--batch", "0"], "--batch", id="batch_zero"),
    pytest.param(["--preset", "tiny", "--context", "x"], "--context", id="context_not_int"),
    pytest.param(["--preset", "tiny", "--context", "-1"], "--context", id="context_negative"),
    pytest.param(["--preset", "tiny", "--context", "100000"], "max_position_embeddings 1024", id="context_past_positions"),
    pytest.param(["--preset", "tiny", "--prompt-length", "0"], "--prompt-length", id="prompt_zero"),
    pytest.param(["--preset", "tiny", "--repeat", "two"], "--repeat", id="repeat_not_int"),
    pytest.param(["--artifact", "{tmp}/missing"], "no artifact", id="artifact_missing"),
    pytest.param(["--hf", "{tmp}/missing"], "config", id="checkpoint_missing"),
    pytest.param([], "exactly one", id="no_source"),
    pytest.param(["--preset", "tiny", "--hf", "x"], "exactly one", id="two_sources"),
    pytest.param(["--hf", "x", "--layers", "1"], "--layers", id="layers_with_checkpoint"),
    pytest.param(["--preset", "tiny", "--layers", "9"], "layers", id="layers_beyond_model"),
    pytest.param(["--preset", "deepseek-v3"], "GiB in fp32", id="model_beyond_memory"),
    pytest.param(["--preset", "tiny", "--weights", "int9"], "--weights", id="weights_unknown"),
    pytest.param(["--preset", "tiny", "--block-size", "64"], "--block-size", id="block_without_int"),
    pytest.param(["--artifact", "x", "--weights", "int8"], "--artifact", id="weights_of_artifact"),
])
def test_invalid_option_is_one_line(tmp_path, args, words):
    """A bad value exits 1 with one `mla-deploy: error:` line naming the problem, and writes nothing; the spelling
    from before the subcommands (`bench --whole-model ...`) reaches the same command and says the same."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    said = []
    for bench in (["bench", "model"], ["bench", "--whole-model"]):
        result = CliRunner().invoke(main, [*bench, "--out", str(tmp_path / "o"), *args])
        assert result.exit_code == 1, result.output
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: ") and words in lines[0], result.stderr
        assert not (tmp_path / "o").exists()
        said.append(re.sub(r"[0-9.]+ GiB", "N GiB", lines[0]))  # the memory available changes between the calls
    assert said[0] == said[1]


@pytest.mark.parametrize("args, words", [
    pytest.param(["bench", "model", "--preset", "tiny", "--passes", "2"], "--passes is an option of `bench attention`",
                 id="attention_option"),
    pytest.param(["bench", "--whole-model", "--preset", "tiny", "--max-seconds", "2"],
                 "--max-seconds is an option of `bench attention`", id="attention_option_old_spelling"),
    pytest.param(["bench", "attention", "--preset", "tiny", "--prompt-length", "8"],
                 "--prompt-length is an option of `bench model`", id="model_option"),
    pytest.param(["bench", "--preset", "tiny", "--artifact", "x"], "--artifact is an option of `bench model`",
                 id="artifact_without_whole_model"),
    pytest.param(["bench", "--preset", "tiny", "--weights", "int8"], "--weights is an option of `bench model`",
                 id="weights_without_whole_model"),
    pytest.param(["bench", "model", "--whole-model", "--preset", "tiny"], "No such option '--whole-model'",
                 id="flag_after_the_subcommand"),
])
def test_option_of_the_other_bench_is_one_line(tmp_path, args, words):
    """Each bench takes only its own options: another bench's is a usage error (exit 2, one line) naming the bench
    it belongs to."""
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: ") and words in lines[0], result.stderr
    assert not (tmp_path / "o").exists()


def test_help_names_what_each_option_takes():
    """`bench --help` names both benches; each bench's help lists only its own options."""
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0 and "attention" in result.output and "model" in result.output
    model = CliRunner().invoke(main, ["bench", "model", "--help"]).output
    attention = CliRunner().invoke(main, ["bench", "attention", "--help"]).output
    assert "TEXT" not in model + attention
    assert "--no-transformers" in model and "--prompt-length" in model and "--passes" not in model
    assert "--passes" in attention and "--max-seconds" in attention and "--weights" not in attention
    assert CliRunner().invoke(main, ["bench", "--whole-model", "--help"]).output == model


def test_weight_groups_of_v2_lite():
    """DeepSeek-V2-Lite: 26 MoE layers of 64 experts (3 x 2048 x 1408 each), top-6; the lm_head and one embedding
    row; every other weight read by every step."""
    from mla_deploy.weight_bytes import weight_groups
    from mla_deploy.recipe import load_recipe

    c = load_recipe("deepseek-v2-lite").model
    g = weight_groups(c)
    assert g.moe_layers == tuple(range(1, 27)) and g.n_experts == 64 and g.top_k == 6
    assert g.expert_bytes == 3 * 2048 * 1408 * 4
    assert g.lm_head_bytes == 102400 * 2048 * 4 and g.embedding_row_bytes == 2048 * 4
    all_experts = 26 * 64 * g.expert_bytes
    assert g.always_bytes + all_experts + g.lm_head_bytes + 102400 * 2048 * 4 == g.total_bytes
    assert g.total_params == 15_706_484_224
    # int4 in blocks of 32 (one fp32 scale each) for the experts and the lm_head, as a manifest would list them
    from mla_deploy.quant import QDQ, Quantized, WeightQuantization

    keys = tuple(f"model.layers.{i}.mlp.experts.{p}" for i in range(1, 27) for p in ("gate_up_proj", "down_proj"))
    q = weight_groups(c, 4, Quantized(WeightQuantization("int4", 32), QDQ, keys=(*keys, "lm_head.weight")))
    assert q.expert_bytes == 3 * (2048 * 1408 // 2 + 2048 * 1408 // 32 * 4)  # gate, up: K = 2048; down: K = 1408
    assert q.lm_head_bytes == 102400 * 2048 // 2 + 102400 * 2048 // 32 * 4 and q.always_bytes == g.always_bytes
    assert q.quantized_bytes == 26 * 64 * q.expert_bytes + q.lm_head_bytes
    saved = (g.lm_head_bytes - q.lm_head_bytes) + 26 * 64 * (g.expert_bytes - q.expert_bytes)
    assert q.total_bytes == g.total_bytes - saved


def test_step_cost_counts_routed_experts_and_cache():
    from mla_deploy.bench.bound import attention_flops
    from mla_deploy.bench.whole_model.cost import expected_distinct_experts, step_cost
    from mla_deploy.weight_bytes import weight_groups
    from mla_deploy.recipe import load_recipe

    c = load_recipe("deepseek-v2-lite").model
    g = weight_groups(c)
    experts = [10] * 26
    cost = step_cost(c, g, batch=8, new=1, held=4096, distinct_experts=experts, distinct_ids=8)
    assert cost["expert_bytes"] == 260 * g.expert_bytes
    assert cost["cache_bytes"] == 8 * 4096 * 576 * 4 * 27
    assert cost["bytes"] == g.always_bytes + 260 * g.expert_bytes + g.lm_head_bytes + 8 * 2048 * 4 + cost["cache_bytes"]
    per_token = g.always_matrix_params + 6 * (g.expert_bytes // 4) * 26
    assert cost["flops"] == 2 * 8 * per_token + 27 * attention_flops(c, 8 * 4097) + 2 * 8 * g.lm_head_params
    prefill = step_cost(c, g, batch=1, new=4, held=0, distinct_experts=experts, distinct_ids=4)
    assert prefill["attention_flops"] == 27 * attention_flops(c, 1 + 2 + 3 + 4) and prefill["cache_bytes"] == 0
    assert expected_distinct_experts(64, 6, 1) == pytest.approx(6)
    assert expected_distinct_experts(64, 6, 8) == pytest.approx(64 * (1 - (58 / 64) ** 8))
    assert expected_distinct_experts(64, 6, 10**6) == pytest.approx(64)


def test_fill_chunk_keeps_logits_and_scores_small():
    from mla_deploy.bench.whole_model.cost import CHUNK_BYTES, MAX_CHUNK, fill_chunk
    from mla_deploy.recipe import load_recipe

    c = load_recipe("deepseek-v2-lite").model
    for batch, total in ((1, 1), (1, 512), (8, 4096), (8, 65536)):
        n = fill_chunk(c, batch, total)
        assert 1 <= n <= min(MAX_CHUNK, total) and n & (n - 1) == 0
        assert n == 1 or batch * n * 4 * max(c.vocab_size, 16 * total) <= CHUNK_BYTES
    assert math.isclose(fill_chunk(c, 1, 3), 2)


def test_the_memory_refusal_counts_the_smallest_export_asked_for(tmp_path):
    """``--hf CKPT --weights int4`` on a model whose fp32 weights exceed the memory (the full-size V2-Lite here) is
    not refused for fp32's size: the check before anything is written counts the smallest export asked for (int4
    streams), and names it when even that does not fit."""
    from hf_oracle import hf_model

    from mla_deploy import quant
    from mla_deploy.weight_bytes import export_bytes
    from mla_deploy.bench.whole_model.driver import prepare
    from mla_deploy.bench.whole_model.spec import WholeModelSpec
    from mla_deploy.config import from_hf_config
    from mla_deploy.errors import InputError

    hf_model(2).save_pretrained(tmp_path / "ckpt")
    config = from_hf_config(tmp_path / "ckpt")
    sizes = {q.weights: export_bytes(config, q) for q in quant.plans(("float", "int8", "int4"), 32)}
    assert sizes["int4"] < sizes["int8"] < sizes["float"]
    common = dict(source="hf", location=str(tmp_path / "ckpt"), contexts=(2,), batches=(1,), prompt_length=4,
                  repeat=1, warmup=0, memory_fraction=1e-12)  # nothing fits
    for weights, named in ((("float",), "fp32"), (("float", "int8"), "int8"), (("int4", "float"), "int4")):
        block = {"block_size": 32} if weights != ("float",) else {}
        with pytest.raises(InputError, match=f"GiB in {named} and"):
            prepare(WholeModelSpec(**common, weights=weights, **block), tmp_path / "out", lambda line: None)
        assert not (tmp_path / "out").exists()

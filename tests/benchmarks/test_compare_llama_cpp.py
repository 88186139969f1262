"""benchmarks/compare_llama_cpp.sh, the parts that run without llama.cpp: a GGUF file written by llama.cpp's own
converter read and its decode bytes counted, llama-bench's JSON from a real run parsed, the table and the bound
check of that run, the plan a --dry-run prints (nothing made), our side of the paired and interleaved decode on a
real engine, and the one-line refusals (no checkpoint, not a DeepSeek one, no cmake or compiler, no network);
ik_llama.cpp's side (``--ik-llama``): its plan, its patched copy, its refusals.
llama.cpp's side of the interleaved decode (llama-stepper) is compiled and run only where a llama.cpp build is in
the cache (a run of the tool made it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "compare_llama_cpp.sh"
DATA = Path(__file__).resolve().parent / "data" / "llama_compare"
sys.path.insert(0, str(ROOT / "benchmarks"))

from llama_compare import burst_worker, gguf, interleaved, paired, paired_worker, table  # noqa: E402
from llama_compare.settings import CompareError  # noqa: E402

#: llama.cpp's converter on hf_oracle.hf_model(2) (2 layers, 8 experts, top-2, vocabulary 128), --outtype q8_0
TINY_GGUF = DATA / "tiny-deepseek2-q8_0.gguf"


def compare(*args: str, env: dict | None = None, path: str | None = None) -> subprocess.CompletedProcess:
    """The tool as a module of this interpreter (``path``: the PATH it sees)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("CXX", "MLA_DEPLOY_CACHE")}
    environ.update(PYTHONPATH=str(ROOT / "benchmarks"), OMP_NUM_THREADS="1", **(env or {}))
    if path is not None:
        environ["PATH"] = path
    return subprocess.run([sys.executable, "-m", "llama_compare", *args], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """transformers' own tiny DeepSeek-V2 checkpoint (no tokenizer files, as the random ones)."""
    from hf_oracle import hf_model

    folder = tmp_path_factory.mktemp("ckpt")
    hf_model(2).save_pretrained(folder)
    return folder


# GGUF ---------------------------------------------------------------------------------------------------------------


def test_reads_the_tensors_of_a_gguf_written_by_llama_cpps_converter():
    model = gguf.read_gguf(TINY_GGUF)
    assert model.arch == "deepseek2" and len(model.tensors) == 33
    assert model.get("expert_used_count") == 2 and model.get("expert_count") == 8 and model.get("block_count") == 2
    t = {x.name: x for x in model.tensors}
    assert t["token_embd.weight"].dims == (64, 128) and t["token_embd.weight"].type_name == "Q8_0"
    assert t["token_embd.weight"].nbytes == 128 * 2 * 34  # 128 rows of 2 blocks of 32: 32 int8 + an fp16 scale
    assert t["blk.1.ffn_gate_exps.weight"].dims == (64, 32, 8)
    assert t["blk.0.attn_norm.weight"].type_name == "F32" and t["blk.0.attn_norm.weight"].nbytes == 64 * 4
    assert sum(x.nbytes for x in model.tensors) <= TINY_GGUF.stat().st_size


def test_a_decode_step_reads_k_of_e_experts_one_embedding_row_and_the_latent_cache():
    model = gguf.read_gguf(TINY_GGUF)
    t = {x.name: x.nbytes for x in model.tensors}
    experts = sum(n for name, n in t.items() if "_exps." in name)
    whole = sum(t.values()) - experts - t["token_embd.weight"]
    empty, held = gguf.decode_bytes(model, 0), gguf.decode_bytes(model, 10)
    assert empty["expert_bytes"] == experts * 2 // 8
    assert empty["bytes"] == whole + t["token_embd.weight"] // 128 + experts * 2 // 8 and empty["cache_bytes"] == 0
    assert held["cache_bytes"] == 10 * (16 + 8) * 2 * 2  # rows x (kv_lora_rank + rope) x F16 x layers
    assert held["bytes"] == empty["bytes"] + held["cache_bytes"]


def test_a_file_that_is_no_gguf_or_a_truncated_one_is_one_error(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(CompareError, match="is not a GGUF file"):
        gguf.read_gguf(tmp_path / "x.gguf")
    (tmp_path / "cut.gguf").write_bytes(TINY_GGUF.read_bytes()[:1000])
    with pytest.raises(CompareError, match="damaged GGUF header"):
        gguf.read_gguf(tmp_path / "cut.gguf")


# llama-bench's output, the table, the bound ------------------------------------------------------------------------


def test_parses_llama_bench_json_of_a_real_run():
    tests = table.parse_llama_bench((DATA / "llama-bench-Q4_0.json").read_text())
    assert [(t["test"], t["n_depth"]) for t in tests] == [("pp512", 0), ("tg32", 0), ("pp512", 1024), ("tg32", 1024)]
    for t in tests:
        assert t["tokens_per_s"] > 0 and len(t["samples_ts"]) == 2 and t["n_threads"] == 2
        assert t["model_type"].startswith("deepseek2") and "Q4_0" in t["model_type"]


@pytest.mark.parametrize("text", ["", "{}", "[]", '[{"n_prompt": 1}]', "llama-bench: error"])
def test_output_that_is_not_llama_benchs_json_is_one_error(text):
    with pytest.raises(CompareError, match="llama-bench"):
        table.parse_llama_bench(text, "llama-bench")


def _real_run():
    report = json.loads((DATA / "bench.json").read_text())
    llama = {k: table.parse_llama_bench((DATA / f"llama-bench-{k}.json").read_text()) for k in ("F32", "Q8_0", "Q4_0")}
    read = json.loads((DATA / "llama-bytes.json").read_text())
    return report, llama, {k: {int(c): n for c, n in v.items()} for k, v in read.items()}


def test_the_table_of_a_real_run_sets_each_precision_beside_its_llama_cpp_type():
    report, llama, read = _real_run()
    rows = table.rows(report, llama, read)
    assert [(r["weights"], r["llama_type"], r["context"]) for r in rows] == [
        (w, k, c) for w, k in (("float", "F32"), ("int8", "Q8_0"), ("int4", "Q4_0")) for c in (0, 1024)]
    for r in rows:
        ours = next(x for x in report["rows"] if x["weights"] == r["weights"] and x["kind"] == "decode"
                    and x["context"] == r["context"])
        theirs = next(t for t in llama[r["llama_type"]] if t["n_gen"] and t["n_depth"] == r["context"])
        assert r["ours_tokens_per_s"] == ours["tokens_per_s_per_sequence"]
        assert r["llama_tokens_per_s"] == theirs["tokens_per_s"]
        assert r["ratio"] == pytest.approx(r["ours_tokens_per_s"] / r["llama_tokens_per_s"])
        assert r["llama_gbps"] == pytest.approx(read[r["llama_type"]][r["context"]] * theirs["tokens_per_s"] / 1e9)
        assert (r["ours_prefill_tokens_per_s"] is not None) == (r["context"] == 0)
    bound = table.bound([report], [], rows)
    names = {f"ours {r['weights']} decode @ {r['context']}" for r in rows} | {
        f"llama.cpp {r['llama_type']} decode @ {r['context']}" for r in rows}
    assert bound["check"]["fastest"] in names  # each engine named by its own precision (ours: int4, not Q4_0)
    text = table.text(rows, bound, "title")
    assert "ours / its" in text and "int4 / Q4_0" in text and "bandwidth bound:" in text
    assert all(r["engine"] == "llama.cpp" for r in rows) and "   0  llama.cpp  " in text


def test_rounds_give_the_median_of_each_figure_and_of_the_ratios_taken_within_each_round():
    """Three rounds of the real run, the machine's bandwidth halved for llama.cpp in one and for ours in another:
    each figure is the median over the rounds, the ratio the median of the rounds' own ratios (not the ratio of
    the medians), with its range; the bound is checked against every round's rows."""
    report, llama, read = _real_run()

    def scaled(factor_ours: float, factor_llama: float) -> list[dict]:
        def row(r: dict) -> dict:
            r = dict(r, **{k: r[k] * factor_ours for k in ("tokens_per_s_per_sequence", "tokens_per_s")
                           if r.get(k) is not None})
            if r.get("bound"):
                r["bound"] = dict(r["bound"], achieved_gbps=r["bound"]["achieved_gbps"] * factor_ours)
            return r

        ours = dict(report, rows=[row(r) for r in report["rows"]])
        theirs = {k: [dict(e, tokens_per_s=e["tokens_per_s"] * factor_llama) for e in v] for k, v in llama.items()}
        return table.rows(ours, theirs, read)

    rounds = [scaled(1.0, 1.0), scaled(1.0, 0.5), scaled(0.5, 1.0)]
    combined = table.combine(rounds)
    base = rounds[0]
    for row, one in zip(combined, base):
        assert row["ours_tokens_per_s"] == pytest.approx(one["ours_tokens_per_s"])  # median of 1, 1, 0.5
        assert row["llama_tokens_per_s"] == pytest.approx(one["llama_tokens_per_s"])
        assert row["ratios"] == pytest.approx([one["ratio"], 2 * one["ratio"], one["ratio"] / 2])
        assert row["ratio"] == pytest.approx(one["ratio"])
        if row["context"] == 0:
            assert row["prefill_ratio"] == pytest.approx(one["ours_prefill_tokens_per_s"]
                                                         / one["llama_prefill_tokens_per_s"])
    text = table.text(combined, table.bound([report], [], [r for each in rounds for r in each]), "title")
    first = combined[0]
    assert f"{first['ratio'] / 2:.2f}-{2 * first['ratio']:.2f}x" in text
    assert "rounds' ratios" in text and "prefill ratio" in text


def test_an_engine_faster_than_the_measured_bandwidth_is_said_plainly():
    """The bound is checked against both engines: a llama.cpp row streaming more than the best probe makes the
    output say the bound did not hold, never a quiet ratio."""
    report, llama, read = _real_run()
    rows = table.rows(report, llama, read)
    best = max(max(r["ours_gbps"], r["llama_gbps"]) for r in rows)
    held = table.bound([report], [{"read_gbps": best * 1.01, "read_kernel": "torch.mv"}], rows)
    assert held["check"]["holds"] and "bound check:" in "\n".join(table.bound_lines(held))
    low = dict(report, machine=dict(report["machine"], read_gbps=dict(report["machine"]["read_gbps"], max=best / 2)))
    broken = table.bound([low], [{"read_gbps": best / 2, "read_kernel": "torch.sum"}], rows)
    assert not broken["check"]["holds"] and broken["check"]["beaten_by"]
    assert "THE BOUND DID NOT HOLD" in table.text(rows, broken, "title")


# paired decode ------------------------------------------------------------------------------------------------------


def _pair(probes, ours, llama, ours_bytes=2.0e9, llama_bytes=2.1e9):
    return {"probes": probes, "ours_tokens_per_s": ours, "llama_tokens_per_s": llama, "ours_bytes": ours_bytes,
            "llama_bytes": llama_bytes}


def test_paired_decode_keeps_the_pairs_whose_probes_agree():
    """A pair whose bandwidth moved between its probes (36 -> 64 GB/s) compares two states and is left out of the
    medians; the steady ones give the ratio (taken within each pair) and each engine's step against the bandwidth
    probed beside it."""
    pairs = [_pair([36.0, 37.0, 36.5], 15.0, 16.0),   # slow state: 0.9375x
             _pair([64.0, 36.0, 36.0], 24.0, 15.0),   # moved: 1.6x, not counted
             _pair([63.0, 64.0, 65.0], 24.0, 22.0),   # fast state: 1.0909x
             _pair([35.0, 36.0, 35.5], 16.0, 15.0)]   # slow state: 1.0667x
    got = paired.summarize(pairs)
    assert (got["pairs"], got["steady"]) == (4, 3)
    assert got["ratios"] == pytest.approx([15 / 16, 24 / 22, 16 / 15])
    assert got["ratio"] == pytest.approx(16 / 15)  # the median of the three, not of the medians
    assert got["ours_tokens_per_s"] == 16.0 and got["llama_tokens_per_s"] == 16.0
    assert got["probe_gbps"] == pytest.approx([35.5, 64.0])
    # probed GB/s over streamed GB/s, per pair: ours 36.5/30, 64/48, 35.5/32 -> median 36.5/30
    assert got["ours_of_probe"] == pytest.approx(36.5 / 30.0)
    assert got["llama_of_probe"] == pytest.approx(35.5 / 31.5)
    assert paired.steady([36.0, 41.0, 38.0]) and not paired.steady([36.0, 42.0, 38.0])
    none = paired.summarize([pairs[1]])
    assert none["steady"] == 0 and none["ratio"] is None and none["probe_gbps"] is None
    text = paired.text([dict(got, weights="float", llama_type="F32", context=0),
                        dict(none, weights="float", llama_type="F32", context=1024)])
    assert "3 of 4" in text and "1.07x" in text and "0.94-1.09x" in text and "0 of 1" in text
    one = paired.summarize([pairs[0]])  # one steady pair: its ratio and probe once, not as a range
    row = paired.cells([dict(one, weights="float", llama_type="F32", context=0)])[0]
    assert row[6:8] == ("0.94x", "36.5")
    assert "| float / F32 | 0 | 3 of 4 |" in paired.markdown([dict(got, weights="float", llama_type="F32", context=0)])


def test_paired_worker_times_our_decode_on_a_real_engine(tmp_path):
    """Our side of a pair is a worker process of its own: a timed decode after an untimed prompt, with a cache past
    the export's capacity; a window past that cache, or an artifact it cannot open, is one error."""
    from artifacts import tiny_artifact

    from llama_compare.settings import CompareError

    art = tiny_artifact()  # exported with 64 rows
    assert paired.ours_window(art, 1, 100, 0, 4, 0) > 0 and paired.ours_window(art, 1, 100, 90, 8, 1) > 0
    # at context 0 the prompt is one token: the window fills -n + 1 rows, and the cache the run sizes holds them
    assert paired_worker.rows_for(0, 8) == 9 and paired_worker.rows_for(90, 8) == 98
    assert paired.ours_window(art, 1, paired_worker.rows_for(0, 8), 0, 8, 2) > 0
    with pytest.raises(CompareError, match="CacheCapacityError: 8 cached \\+ 1 new tokens exceed .*capacity 8"):
        paired.ours_window(art, 1, 8, 0, 8, 0)  # -n rows, as the run sized it before
    with pytest.raises(CompareError, match="the paired worker on .*: CacheCapacityError: .*capacity 100"):
        paired.ours_window(art, 1, 100, 95, 8, 0)
    with pytest.raises(CompareError, match=f"the paired worker on {tmp_path} \\(exit 1\\)"):
        paired.ours_window(tmp_path, 1, 16, 0, 2, 0)


def test_paired_llama_bench_is_one_repetition_of_the_decode_after_each_context(tmp_path):
    from llama_compare.settings import CompareError, Settings

    s = Settings(checkpoint=tmp_path, out=tmp_path / "out", cache=tmp_path / "cache", generate=32, threads=2)
    argv = paired.llama_argv(s, tmp_path / "model-F32.gguf", 1024)
    assert argv[1:] == ("-m", str(tmp_path / "model-F32.gguf"), "-t", "2", "-r", "1", "-p", "0", "-n", "32", "-d",
                        "1024", "-lm", "none", "-o", "json")
    with pytest.raises(CompareError, match="paired llama-bench: cannot run .*llama-bench"):
        paired.llama_window(s, tmp_path / "model-F32.gguf", 0)  # not built


# interleaved decode -------------------------------------------------------------------------------------------------


def test_interleaved_decode_takes_each_ratio_between_neighbouring_bursts():
    """The ratio is the median of the neighbours' ratios (not the ratio of the medians), with their quartiles, range
    and how many of them put ours ahead; each engine's GB/s is its median speed times the bytes its step reads."""
    bursts = [{"ours_tokens_per_s": o, "llama_tokens_per_s": l} for o, l in
              ((50.0, 40.0), (30.0, 40.0), (52.0, 50.0), (60.0, 30.0), (45.0, 50.0))]
    got = interleaved.summarize(bursts, ours_bytes=0.5e9, llama_bytes=0.6e9)
    assert got["ratios"] == pytest.approx([1.25, 0.75, 1.04, 2.0, 0.9])
    assert got["ratio"] == pytest.approx(1.04) and got["ahead"] == 3 and got["bursts"] == 5
    assert got["quartiles"] == pytest.approx([0.825, 1.625]) and got["ratio_range"] == pytest.approx([0.75, 2.0])
    assert got["ours_tokens_per_s"] == 50.0 and got["llama_tokens_per_s"] == 40.0
    assert got["ours_gbps"] == pytest.approx(25.0) and got["llama_gbps"] == pytest.approx(24.0)
    one = interleaved.summarize(bursts[:1])
    assert one["quartiles"] == pytest.approx([1.25, 1.25]) and one["ours_gbps"] is None
    entry = dict(got, weights="int8", llama_type="Q8_0", context=1024, probes=[36.1, 35.2])
    assert interleaved.cells([entry])[0] == ("int8 / Q8_0", "1024", "5", "50.0", "40.0", "1.04x", "0.82-1.62x",
                                              "0.75-2.00x", "3 of 5", "25.0", "24.0", "36.1, 35.2")
    assert "| int8 / Q8_0 | 1024 | 5 |" in interleaved.markdown([entry])
    assert interleaved.text([entry]).startswith(interleaved.TITLE)


def test_our_burst_worker_starts_each_burst_from_the_kept_context(tmp_path):
    """In one process, bursts at one depth start again from its context (the cache's lengths set back), so any
    number of them fit a cache of one burst's rows; a new depth is prefilled afresh; a burst past the cache, a bad
    request and an artifact that cannot be opened are each one error."""
    from artifacts import tiny_artifact

    from mla_deploy.ort.engine import OrtEngine

    art = tiny_artifact()  # exported with 64 rows
    bursts = burst_worker.Bursts(OrtEngine(art, threads=1, capacity=40))
    for _ in range(3):
        assert bursts.burst(30, 8)["n_gen"] == 8
        assert bursts.state.lengths.tolist() == [38] and bursts.lengths.tolist() == [30]
    assert bursts.burst(0, 4)["depth"] == 0 and bursts.state.lengths.tolist() == [5]  # one prompt token
    with pytest.raises(ValueError, match="a burst of 8 after 35 tokens needs 43 cache rows; the engine holds 40"):
        bursts.burst(35, 8)

    log = tmp_path / "ours.log"
    argv = [sys.executable, "-m", "llama_compare.burst_worker", str(art), "1", "40"]
    env = paired.worker_environment()  # what ours_worker gives the process
    worker = interleaved.Worker("ours", argv, log, env)
    try:
        speeds = [worker.burst(30, 8) for _ in range(4)] + [worker.burst(0, 8)]
        assert all(speed > 0 for speed in speeds)
        worker.proc.stdin.write("thirty 8\n")
        worker.proc.stdin.flush()
        assert "bad request (DEPTH N)" in json.loads(worker.proc.stdout.readline())["error"]
        with pytest.raises(CompareError, match="ours: ValueError: a burst of 8 after 35 tokens needs 43 cache rows"):
            worker.burst(35, 8)
    finally:
        worker.close()
    with pytest.raises(CompareError, match=f"^gone: .*; log: {tmp_path}"):
        interleaved.Worker("gone", [sys.executable, "-m", "llama_compare.burst_worker", str(tmp_path), "1", "16"],
                           tmp_path / "gone.log", env)


def _cached_llama():
    """Settings on the llama.cpp cache a run of the tool leaves (``$MLA_DEPLOY_CACHE`` or the default)."""
    from llama_compare.settings import Settings, default_cache

    return Settings(checkpoint=Path("."), out=Path("."), cache=default_cache())


def _llama_build():
    s = _cached_llama()
    return s if (s.build / "src" / "libllama.a").is_file() and s.vendored.is_dir() else None


@pytest.mark.skipif(_llama_build() is None, reason="needs a llama.cpp build in the cache (a run of "
                    "benchmarks/compare_llama_cpp.sh makes it); CI has none")
def test_llama_stepper_compiles_against_the_build_and_times_bursts_after_a_kept_context(tmp_path):
    """The stepper step compiles stepper.cpp against the build's static libraries; the process holds a GGUF written
    by llama.cpp's converter, times bursts at depths 0 and 16 (again and again at one depth: its tokens removed
    after each) and refuses a request past its context in one line."""
    from llama_compare import steps

    s = replace(_llama_build(), out=tmp_path)
    step = steps.stepper(s)
    if not step.done:
        steps.run(step, tmp_path / "logs", lambda line: None)
    assert interleaved.stepper_path(s).is_file() and not steps.partial(interleaved.stepper_path(s)).exists()
    worker = interleaved.llama_worker(s, TINY_GGUF, 32)
    try:
        speeds = [worker.burst(0, 8), worker.burst(16, 8), worker.burst(16, 8), worker.burst(16, 16), worker.burst(0, 4)]
        assert all(speed > 0 for speed in speeds)
        with pytest.raises(CompareError, match=r"bad request \(DEPTH N_GEN within 32 tokens\)"):
            worker.burst(20, 16)
    finally:
        worker.close()


def _llama_source():
    s = _cached_llama()
    return s if (s.vendored / "convert_hf_to_gguf.py").is_file() else None


@pytest.mark.skipif(_llama_source() is None, reason="needs llama.cpp's source in the cache (a run of "
                    "benchmarks/compare_llama_cpp.sh extracts it); CI has none")
def test_experts_written_one_at_a_time_make_the_file_the_converter_made_stacking_them(tmp_path):
    """convert_entry writes each layer's routed experts one expert at a time (the converter's LazyChunkedTensor), not
    as the float32 stack the converter makes, which a V3 layer does not fit beside in 24 GiB: the Q8_0 file is the
    one, byte for byte, that llama.cpp's converter wrote before, stacking them (TINY_GGUF: the same checkpoint)."""
    from hf_oracle import hf_model
    from llama_compare import steps

    checkpoint = tmp_path / "tiny-ckpt"  # the converter names the model after its folder: "Tiny Ckpt" as TINY_GGUF
    hf_model(2).save_pretrained(checkpoint)
    s = replace(_llama_source(), checkpoint=checkpoint, out=tmp_path)
    step = steps.convert(s, "key", "Q8_0")
    argv = step.argv[:4] + ("--outfile", str(tmp_path / "chunked.gguf")) + step.argv[6:]  # not into the cache
    proc = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, **step.env), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    experts = [t for t in gguf.read_gguf(tmp_path / "chunked.gguf").tensors if "_exps" in t.name]
    assert [t.name for t in experts] == [f"blk.1.ffn_{p}_exps.weight" for p in ("down", "gate", "up")]  # 1 MoE layer
    assert all(t.dims[-1] == 8 and t.type_name == "Q8_0" for t in experts)
    assert (tmp_path / "chunked.gguf").read_bytes() == TINY_GGUF.read_bytes()


def test_a_transformers_written_config_gets_the_keys_the_converter_reads():
    """GLM-4.7-Flash's and DeepSeek-V3.2's configs as transformers 5 writes them name no first_k_dense_replace and no
    scoring_func: llama.cpp's converter would write no dense layer (the file does not load) and softmax routing."""
    from llama_compare.convert_entry import _transformers_keys

    glm = {"mlp_layer_types": ["dense", "sparse", "sparse"], "n_routed_experts": 64}
    _transformers_keys(glm, "Glm4MoeLiteForCausalLM")
    assert glm["first_k_dense_replace"] == 1 and glm["scoring_func"] == "sigmoid"
    named = {"mlp_layer_types": ["dense", "sparse"], "first_k_dense_replace": 1, "scoring_func": "softmax",
             "n_routed_experts": 8}
    _transformers_keys(named, "DeepseekV3ForCausalLM")  # what a config names is kept
    assert named["first_k_dense_replace"] == 1 and named["scoring_func"] == "softmax"
    lite = {"first_k_dense_replace": 1, "n_routed_experts": 64}
    _transformers_keys(lite, "DeepseekV2ForCausalLM")  # V2 routes by softmax: nothing added
    assert "scoring_func" not in lite
    with pytest.raises(ValueError, match="dense layers only before the MoE ones"):
        _transformers_keys({"mlp_layer_types": ["dense", "sparse", "dense"]}, "Glm4MoeLiteForCausalLM")


def test_dry_run_with_interleave_compiles_the_stepper_and_plans_the_bursts(checkpoint, tmp_path):
    cache = tmp_path / "cache"
    proc = compare(str(checkpoint), "--dry-run", "--cache", str(cache), "--weights", "int4", "-n", "16", "--rounds",
                   "1", "--interleave", "12")
    assert proc.returncode == 0, proc.stderr
    names = [line.split(":", 1)[0] for line in proc.stdout.splitlines()]
    assert names.index("stepper") == names.index("quantize-Q4_0") + 1  # after the build, before the measurements
    stepper = next(line for line in proc.stdout.splitlines() if line.startswith("stepper:"))
    assert "benchmarks/llama_compare/stepper.cpp" in stepper and "/build/src/libllama.a" in stepper
    assert "/build/bin/llama-stepper-" in stepper and stepper.endswith(".partial")
    assert "interleaved: 12 neighbouring bursts of 16 decode steps per precision and context" in proc.stdout
    assert "stepper" not in compare(str(checkpoint), "--dry-run", "--cache", str(cache)).stdout
    bad = compare(str(checkpoint), "--dry-run", "--interleave", "-1")
    assert bad.returncode == 2 and "--interleave: expected integers >= 0" in bad.stderr
    assert not cache.exists()


# the plan and the refusals --------------------------------------------------------------------------------------


def test_dry_run_prints_every_command_and_makes_nothing(checkpoint, tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    proc = compare(str(checkpoint), "--dry-run", "--cache", str(cache), "--out", str(out), "--context", "0,1024",
                   "-r", "2", "-n", "32", "--rounds", "2")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split(":", 1)[0]: line for line in proc.stdout.splitlines() if ":" in line}
    assert "--no-binary llama-cpp-python --no-deps llama-cpp-python==0.3.36" in lines["download"]
    assert "-DCMAKE_BUILD_TYPE=Release" in lines["configure"] and "-DGGML_NATIVE=ON" in lines["configure"]
    assert "--target llama-bench llama-quantize llama-server" in lines["build"]
    assert "-DLLAMA_BUILD_SERVER=ON" in lines["configure"] and "-DLLAMA_USE_PREBUILT_UI=OFF" in lines["configure"]
    assert "model-F32.gguf.partial --outtype f32" in lines["convert-F32"]  # renamed once it succeeded
    assert "model-Q8_0.gguf.partial --outtype q8_0" in lines["convert-Q8_0"]
    assert "/model-F32.gguf " in lines["quantize-Q4_0"]
    assert lines["quantize-Q4_0"].endswith("/model-Q4_0.gguf.partial Q4_0 2")
    for kind in ("F32", "Q8_0", "Q4_0"):
        for round_ in (1, 2):
            assert (f"model-{kind}.gguf -t 2 -r 2 -p 512 -n 32 -d 0,1024 -lm none -o json > "
                    f"{out}/rounds/llama-bench-{kind}-{round_}.json") in lines[f"llama-bench-{kind}-{round_}"]
    for weights, blocks in (("float", ""), ("int8", " --block-size 32"), ("int4", " --block-size 32")):
        for round_ in (1, 2):
            assert (f"bench model --hf {checkpoint} --weights {weights}{blocks} --context 0,1024 --batch 1 "
                    f"--threads 2") in lines[f"mla-deploy-bench-{weights}-{round_}"]
    # rounds alternate which engine goes first, per precision
    measured = [line.split(":", 1)[0] for line in proc.stdout.splitlines() if "bench-" in line.split(":", 1)[0]]
    assert measured == ["mla-deploy-bench-float-1", "llama-bench-F32-1", "mla-deploy-bench-int8-1",
                        "llama-bench-Q8_0-1", "mla-deploy-bench-int4-1", "llama-bench-Q4_0-1",
                        "llama-bench-F32-2", "mla-deploy-bench-float-2", "llama-bench-Q8_0-2",
                        "mla-deploy-bench-int8-2", "llama-bench-Q4_0-2", "mla-deploy-bench-int4-2"]
    assert not cache.exists() and not out.exists()


def test_dry_run_of_one_precision_with_llama_cpp_built(checkpoint, tmp_path):
    """int4 alone: F32 converted, Q4_0 quantized from it; a recorded build is not built again, unless it was
    recorded without a tool the comparisons now need (llama-server)."""
    cache = tmp_path / "cache"
    (cache / "llama.cpp-0.3.36").mkdir(parents=True)
    record = cache / "llama.cpp-0.3.36" / "build.json"
    record.write_text(json.dumps({"targets": ["llama-bench", "llama-quantize"]}))
    older = compare(str(checkpoint), "--dry-run", "--cache", str(cache), "--weights", "int4")
    assert older.returncode == 0 and "\nbuild: cmake --build" in older.stdout, older.stderr
    record.write_text(json.dumps({"targets": ["llama-bench", "llama-quantize", "llama-server"]}))
    proc = compare(str(checkpoint), "--dry-run", "--cache", str(cache), "--weights", "int4")
    assert proc.returncode == 0, proc.stderr
    names = [line.split(":", 1)[0] for line in proc.stdout.splitlines()]
    for cached in ("[cached] download", "[cached] extract", "[cached] configure", "[cached] build"):
        assert cached in names
    assert [n for n in names if not n.startswith("[cached]") and n != "converter-deps"] == [
        "convert-F32", "quantize-Q4_0", "mla-deploy-bench-int4-1", "llama-bench-Q4_0-1", "llama-bench-Q4_0-2",
        "mla-deploy-bench-int4-2", "mla-deploy-bench-int4-3", "llama-bench-Q4_0-3"]


def test_dry_run_with_pairs_plans_each_precision_and_context_after_the_rounds(checkpoint, tmp_path):
    out = tmp_path / "out"
    proc = compare(str(checkpoint), "--dry-run", "--cache", str(tmp_path / "cache"), "--out", str(out), "--weights",
                   "float,int4", "--context", "0,512", "-n", "16", "--rounds", "1", "--pairs", "4")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "paired: 4 pairs per precision and context" in proc.stdout
    planned = [line.split(":", 1)[0] for line in lines if line.startswith("paired-")]
    assert planned == ["paired-float-0", "paired-float-512", "paired-int4-0", "paired-int4-512"]
    int4 = next(line for line in lines if line.startswith("paired-int4-512"))
    assert f"{out}/mla-deploy/artifact-int4 beside " in int4 and "model-Q4_0.gguf -t 2 -r 1 -p 0 -n 16 -d 512" in int4
    assert lines.index(next(line for line in lines if line.startswith("llama-bench-Q4_0-1"))) < lines.index(
        next(line for line in lines if line.startswith("paired:")))
    bad = compare(str(checkpoint), "--dry-run", "--pairs", "-1")
    assert bad.returncode == 2 and "--pairs: expected integers >= 0" in bad.stderr
    assert "paired" not in compare(str(checkpoint), "--dry-run", "--cache", str(tmp_path / "cache")).stdout


@pytest.mark.parametrize("weights, blocks", [("float", False), ("float,int4", True), ("int8", True)])
def test_blocks_of_32_are_asked_for_only_where_weights_are_quantized(checkpoint, tmp_path, weights, blocks):
    """The bench refuses --block-size without quantized weights: a float-only comparison must not pass it (it
    failed that way on 2026-11-26), a quantized one passes 32 (Q8_0's and Q4_0's blocks)."""
    proc = compare(str(checkpoint), "--dry-run", "--cache", str(tmp_path / "cache"), "--weights", weights)
    assert proc.returncode == 0, proc.stderr
    benches = [line for line in proc.stdout.splitlines() if line.startswith("mla-deploy-bench-")]
    assert len(benches) == 3 * len(weights.split(","))
    for bench in benches:
        quantized = not bench.startswith("mla-deploy-bench-float-")
        assert ("--block-size 32" in bench) == quantized, bench
    assert any(not b.startswith("mla-deploy-bench-float-") for b in benches) == blocks


@pytest.mark.parametrize("weights, dropped", [("int4", True), ("int8,int4", False)])
def test_q4_0_from_a_q8_0_file_is_requantized_and_the_file_dropped_unless_requested(checkpoint, tmp_path, weights,
                                                                                       dropped):
    """--quantize-from q8_0 (a full-size checkpoint whose F32 or BF16 file does not fit the disk): Q8_0 converted
    once, Q4_0 made from it with --allow-requantize, and Q8_0 removed afterwards only when int8 was not asked for."""
    from llama_compare import steps
    from llama_compare.settings import Settings

    s = Settings(checkpoint=checkpoint, out=tmp_path / "out", cache=tmp_path / "cache",
                 precisions=tuple(weights.split(",")), quantize_from="Q8_0")
    planned = {step.name: step for step in steps.plan(s, "key", ["pip"])}
    assert [n for n in planned if n.startswith(("convert", "quantize"))] == ["convert-Q8_0", "quantize-Q4_0"]
    quantize = planned["quantize-Q4_0"]
    assert quantize.argv[1:3] == ("--allow-requantize", str(s.gguf("key", "Q8_0")))
    assert quantize.drops == (s.gguf("key", "Q8_0") if dropped else None)
    proc = compare(str(checkpoint), "--dry-run", "--cache", str(tmp_path / "cache"), "--weights", weights,
                   "--quantize-from", "q8_0")
    assert proc.returncode == 0 and "--allow-requantize" in proc.stdout, proc.stderr


def test_pure_q4_0_is_a_file_of_its_own_that_llama_quantize_makes_pure(checkpoint, tmp_path):
    """--pure: llama-quantize gets --pure (every matrix Q4_0, output.weight too) and writes model-Q4_0-pure.gguf, so a
    cached default Q4_0 file is neither reused for it nor replaced; the converter's files are the same either way."""
    from llama_compare import steps
    from llama_compare.settings import Settings

    plain, pure = (Settings(checkpoint=checkpoint, out=tmp_path / "out", cache=tmp_path / "cache",
                            precisions=("int8", "int4"), pure=flag) for flag in (False, True))
    assert pure.gguf("key", "Q4_0").name == "model-Q4_0-pure.gguf" != plain.gguf("key", "Q4_0").name
    assert pure.gguf("key", "Q8_0") == plain.gguf("key", "Q8_0") and pure.gguf("key", "F32") == plain.gguf("key", "F32")
    plain.gguf("key", "Q4_0").parent.mkdir(parents=True)
    plain.gguf("key", "Q4_0").write_bytes(b"gguf")  # a default Q4_0 in the cache
    for settings, flagged in ((plain, False), (pure, True)):
        step = next(p for p in steps.plan(settings, "key", ["pip"]) if p.name == "quantize-Q4_0")
        assert ("--pure" in step.argv) == flagged and step.makes == settings.gguf("key", "Q4_0")
        assert step.done == (not flagged)
    proc = compare(str(checkpoint), "--dry-run", "--cache", str(tmp_path / "cache2"), "--weights", "int4", "--pure")
    assert proc.returncode == 0 and "--pure" in proc.stdout and "model-Q4_0-pure.gguf" in proc.stdout, proc.stderr
    assert "--pure" not in compare(str(checkpoint), "--dry-run", "--cache", str(tmp_path / "cache2"),
                                   "--weights", "int4").stdout


def test_the_title_names_the_matrices_a_file_holds_in_another_type():
    """llama.cpp's converter keeps the tiny model's matrices whose rows are no whole blocks of 32 in F16 in its Q8_0
    file, and llama-quantize keeps output.weight in Q6_K in a Q4_0 file made without --pure: the table's title says
    so, where the bytes of a step differ from ours for that reason."""
    model = gguf.read_gguf(TINY_GGUF)
    assert set(gguf.other_types(model, "Q8_0")) == {f"blk.{i}.{n}.weight" for i in (0, 1)
                                                     for n in ("attn_k_b", "attn_v_b", "attn_output")}
    assert gguf.held_apart({"Q8_0": model}) == "; the Q8_0 file holds 6 matrices in F16"
    q4 = gguf.GGUF(Path("model-Q4_0.gguf"), {}, (
        gguf.Tensor("output.weight", (2048, 102400), 14, 172_032_000),
        gguf.Tensor("blk.0.ffn_gate_inp.weight", (2048, 64), 0, 524_288),  # the router: F32 at every type
        gguf.Tensor("blk.0.attn_norm.weight", (2048,), 0, 8192),
        gguf.Tensor("blk.0.ffn_down_exps.weight", (1408, 2048, 64), 2, 103_809_024)))
    assert gguf.other_types(q4, "Q4_0") == {"output.weight": "Q6_K"}
    assert gguf.held_apart({"Q4_0": q4}) == "; the Q4_0 file holds output.weight in Q6_K"
    pure = gguf.GGUF(q4.path, {}, (gguf.Tensor("output.weight", (2048, 102400), 2, 117_964_800),))
    assert gguf.held_apart({"Q4_0": pure, "Q8_0": model}) == "; the Q8_0 file holds 6 matrices in F16"


def test_a_dropped_intermediate_is_removed_after_success_and_its_convert_step_cached(checkpoint, tmp_path):
    """The quantize step removes its transient source once it succeeded; a later run, with Q4_0 cached, does not
    convert the source again."""
    from llama_compare import steps
    from llama_compare.settings import Settings

    s = Settings(checkpoint=checkpoint, out=tmp_path / "out", cache=tmp_path / "cache", precisions=("int4",),
                 quantize_from="BF16")
    source, made = s.gguf("key", "BF16"), s.gguf("key", "Q4_0")
    source.parent.mkdir(parents=True)
    source.write_bytes(b"gguf")
    step = steps.Step("quantize-Q4_0", (sys.executable, "-c", f"open({str(steps.partial(made))!r}, 'w')"),
                      makes=made, drops=source)
    steps.run(step, tmp_path / "logs", lambda line: None)
    assert made.is_file() and not source.exists()
    planned = {p.name: p for p in steps.plan(s, "key", ["pip"])}
    assert planned["convert-BF16"].done and planned["quantize-Q4_0"].done
    assert planned["quantize-Q4_0"].argv[1] == str(source)  # bf16 -> Q4_0 needs no --allow-requantize


def test_a_step_killed_half_way_says_by_what_and_leaves_no_partial_file(tmp_path):
    """A converter killed by the kernel (llama.cpp's, out of memory on DeepSeek-V3's 256 stacked experts, exit -9)
    is named as such in the one line, and the GBs it wrote under the temporary name are removed."""
    from llama_compare import steps

    made = tmp_path / "cache" / "model-Q8_0.gguf"
    made.parent.mkdir()
    code = (f"import os, signal; open({str(steps.partial(made))!r}, 'w').write('half'); print('Writing: 19%');"
            " os.kill(os.getpid(), signal.SIGKILL)")
    step = steps.Step("convert-Q8_0", (sys.executable, "-c", code), makes=made)
    with pytest.raises(CompareError) as caught:
        steps.run(step, tmp_path / "logs", lambda line: None)
    message = str(caught.value)
    assert message.startswith("convert-Q8_0 was killed by SIGKILL (the kernel's out-of-memory killer"), message
    assert "Writing: 19%" in message and "; log: " in message and "\n" not in message
    assert not steps.partial(made).exists() and not made.exists()
    failed = steps.Step("quantize-Q4_0", (sys.executable, "-c", "import sys; print('bad file'); sys.exit(3)"))
    with pytest.raises(CompareError, match=r"^quantize-Q4_0 failed \(exit 3\): bad file; log: "):
        steps.run(failed, tmp_path / "logs", lambda line: None)


def _one_line_error(proc: subprocess.CompletedProcess, text: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and text in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_checkpoint_or_not_a_deepseek_one_is_one_line(tmp_path):
    _one_line_error(compare(str(tmp_path / "missing")), "no checkpoint folder at")
    _one_line_error(compare(str(tmp_path)), "has no config.json")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    _one_line_error(compare(str(tmp_path)), "is not a checkpoint both engines take: its architectures are ['LlamaForCausalLM']")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV2ForCausalLM"]}))
    _one_line_error(compare(str(tmp_path)), "has no *.safetensors weights")


def test_no_cmake_nor_compiler_is_one_line_before_anything_is_made(checkpoint, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = compare(str(checkpoint), "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), path=str(empty))
    _one_line_error(proc, "cannot build llama.cpp here: missing cmake, a C++ compiler")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


@pytest.mark.skipif(not shutil.which("cmake") or not (shutil.which("ninja") or shutil.which("make")),
                    reason="needs cmake to get past the build-tools check")
def test_no_network_is_one_line(checkpoint, tmp_path):
    """pip cannot reach the package index: one line saying so, and where its log is."""
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "",
           "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_CONSTRAINT": ""}
    proc = compare(str(checkpoint), "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), env=env)
    _one_line_error(proc, "could not download llama-cpp-python==0.3.36 from the package index (the package index "
                          "cannot be reached")
    assert "; log: " in proc.stderr


def test_the_bandwidth_series_prints_each_probe_and_a_summary(tmp_path):
    """benchmarks/bandwidth_states.py on a small buffer: one line per probe, the summary, the JSON series; a bad
    setting is argparse's one-line usage error."""
    script = ROOT / "benchmarks" / "bandwidth_states.py"
    out = tmp_path / "series.json"
    proc = subprocess.run([sys.executable, str(script), "--probes", "2", "--every", "0", "--mib", "16", "--threads",
                           "1", "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("probe   1:") and lines[1].startswith("probe   2:") and "GB/s" in lines[0]
    assert lines[2].startswith("2 probes, 1 threads, 16 MiB: median ") and "nearer the highest" in lines[2]
    series = json.loads(out.read_text())["series"]
    assert len(series) == 2 and all(s["read_gbps"] > 0 for s in series)
    bad = subprocess.run([sys.executable, str(script), "--probes", "0"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert bad.returncode == 2 and "expected a number >= 1" in bad.stderr and "Traceback" not in bad.stderr


# ik_llama.cpp ---------------------------------------------------------------------------------------------------


#: the lines of ik_llama.cpp's source (commit 8337e4cd3) that decide V2-Lite's layout by the layer count
IK_LINES = {
    "src/llama-hparams.cpp": "                bool is_lite = (hparams.n_layer == 27 || hparams.n_layer == 26) || "
                             "(hparams.n_layer == 48 && hparams.n_vocab == 128256);\n",
    "src/llama-load-tensors.cpp": "    const bool is_lite = (hparams.n_layer == 27 || hparams.n_layer == 26);\n",
    "src/graphs/build_deepseek2.cpp": "    bool is_lite = (hparams.n_layer == 27 || hparams.n_layer == 26);\n",
}


def ik_source(folder: Path) -> Path:
    """A folder laid out as an ik_llama.cpp source, holding the lines :mod:`llama_compare.ik` widens."""
    (folder / "ggml" / "src" / "iqk").mkdir(parents=True)
    (folder / "examples" / "llama-bench").mkdir(parents=True)
    (folder / "examples" / "llama-bench" / "llama-bench.cpp").write_text("int main() { return 0; }\n")
    for name, line in IK_LINES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("// before\n" + line + "// after\n")
    return folder


def test_ik_llama_is_a_source_folder_argument(tmp_path):
    from llama_compare.__main__ import parser, settings

    args = parser().parse_args([str(tmp_path), "--ik-llama", str(tmp_path / "ik" / ".." / "ik")])
    assert settings(args).ik_source == tmp_path / "ik" and settings(args).ik_key == ""
    assert settings(parser().parse_args([str(tmp_path)])).ik_source is None
    bad = compare(str(tmp_path), "--ik-llama")
    assert bad.returncode == 2 and "--ik-llama: expected one argument" in bad.stderr


def test_dry_run_with_ik_llama_builds_its_llama_bench_and_runs_both_variants_each_round(checkpoint, tmp_path):
    """ik_llama.cpp's copy, configure and build of llama-bench after mainline's build, keyed by its source; in
    each round its llama-bench with its defaults and with -rtr 1 on mainline's GGUF file, the decode after a context
    as -gp (it takes no -d), next to ours and mainline's, the order reversed in even rounds; nothing made."""
    from llama_compare import ik

    source, cache, out = ik_source(tmp_path / "ik"), tmp_path / "cache", tmp_path / "out"
    proc = compare(str(checkpoint), "--dry-run", "--cache", str(cache), "--out", str(out), "--weights", "int4",
                   "-n", "32", "--rounds", "2", "--ik-llama", str(source))
    assert proc.returncode == 0, proc.stderr
    lines = {line.split(":", 1)[0]: line for line in proc.stdout.splitlines() if ":" in line}
    names = list(lines)
    assert names.index("build") < names.index("ik-copy") < names.index("ik-configure") < names.index("ik-build")
    assert names.index("ik-build") < names.index("convert-F32")
    folder = cache / f"ik_llama.cpp-{ik.source_key(source)}-patch1"
    assert ik.source_key(source).startswith("files-") and len(ik.source_key(source)) == len("files-") + 12
    assert lines["ik-copy"].endswith(f"-m llama_compare.ik {source} {folder}/src")
    assert f"-S {folder}/src -B {folder}/build" in lines["ik-configure"]
    assert "-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON" in lines["ik-configure"]
    assert f"--build {folder}/build --target llama-bench -j" in lines["ik-build"]
    gguf_file = lines["llama-bench-Q4_0-1"].split(" -m ")[1].split()[0]
    for round_ in (1, 2):
        for variant, flags in (("ik", "-mla 3 -fa 1 -fmoe 1"), ("ik-rtr", "-mla 3 -fa 1 -fmoe 1 -rtr 1")):
            assert lines[f"{variant}-llama-bench-Q4_0-{round_}"].endswith(
                f"{folder}/build/bin/llama-bench -m {gguf_file} -t 2 -r 3 -p 512 -n 32 -gp 1024,32 {flags} -mmp 0 "
                f"-o json > {out}/rounds/{variant}-llama-bench-Q4_0-{round_}.json")
    measured = [n for n in names if "bench-" in n]
    assert measured == ["mla-deploy-bench-int4-1", "llama-bench-Q4_0-1", "ik-llama-bench-Q4_0-1",
                        "ik-rtr-llama-bench-Q4_0-1", "ik-rtr-llama-bench-Q4_0-2", "ik-llama-bench-Q4_0-2",
                        "llama-bench-Q4_0-2", "mla-deploy-bench-int4-2"]
    assert not cache.exists() and not out.exists() and sorted(p.name for p in source.iterdir()) == [
        "examples", "ggml", "src"]
    after = compare(str(checkpoint), "--dry-run", "--cache", str(cache), "--weights", "int8", "--context", "1024",
                    "-n", "16", "--rounds", "1", "--ik-llama", str(source)).stdout
    assert " -n 0 -gp 1024,16 -mla 3 -fa 1 -fmoe 1 -rtr 1 -mmp 0 " in after  # no decode at context 0 asked for
    assert "ik-" not in compare(str(checkpoint), "--dry-run", "--cache", str(cache)).stdout


def test_ik_build_is_keyed_by_the_sources_commit_else_by_its_files(tmp_path):
    """A clean git checkout: its HEAD; an exported tree or a checkout with changes: a hash of the files (their
    paths and bytes, the git folder and builds left out), which moves with any of them."""
    from llama_compare import ik

    source = ik_source(tmp_path / "ik")
    exported = ik.source_key(source)
    (source / "build").mkdir()
    (source / "build" / "x.o").write_bytes(b"object")
    assert ik.source_key(source) == exported
    git = ["git", "-C", str(source), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "examples", "ggml", "src"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "ik"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert ik.source_key(source) == head[:12]
    (source / "src" / "llama-load-tensors.cpp").write_text("// changed\n")
    changed = ik.source_key(source)
    assert changed.startswith("files-") and changed != exported


def test_the_copy_widens_ik_llamas_v2_lite_condition_and_leaves_the_source_alone(checkpoint, tmp_path):
    """The copy takes V2-Lite's layout also where the model has no query compression (q_lora_rank read where the
    file holds it, 0 as llama_compare's converter writes it for V2-Lite); a copied, patched source is not copied again
    (an interrupted build resumes); a source whose lines changed is one error naming the file."""
    from llama_compare import ik

    source, copy = ik_source(tmp_path / "ik"), tmp_path / "copy"
    (source / ".git").mkdir()
    before = {name: (source / name).read_text() for name in IK_LINES}
    ik.copy_and_patch(source, copy)
    assert {name: (source / name).read_text() for name in IK_LINES} == before
    assert not (copy / ".git").exists() and (copy / ik.COPIED).read_text() == f"{source}\n"
    wide = "(hparams.n_layer == 27 || hparams.n_layer == 26 || hparams.n_lora_q == 0)"
    hparams = (copy / "src" / "llama-hparams.cpp").read_text()
    assert hparams == ("// before\n                ml.get_key(LLM_KV_ATTENTION_Q_LORA_RANK, hparams.n_lora_q, false);\n"
                       f"                bool is_lite = {wide} || (hparams.n_layer == 48 && hparams.n_vocab == "
                       "128256);\n// after\n")
    for name in ("src/llama-load-tensors.cpp", "src/graphs/build_deepseek2.cpp"):
        assert (copy / name).read_text() == before[name].replace(
            "(hparams.n_layer == 27 || hparams.n_layer == 26)", wide)
    cache = tmp_path / "cache"
    from llama_compare.settings import Settings

    copied = Settings(checkpoint=checkpoint, out=tmp_path / "out", cache=cache, ik_source=source,
                      ik_key=ik.source_key(source)).ik_dir / "src"
    ik.copy_and_patch(source, copied)
    proc = compare(str(checkpoint), "--dry-run", "--cache", str(cache), "--ik-llama", str(source))
    assert "\n[cached] ik-copy: " in proc.stdout and "\nik-configure: " in proc.stdout, proc.stderr
    (source / "src" / "graphs" / "build_deepseek2.cpp").write_text("bool is_lite = hparams.n_lora_q == 0;\n")
    with pytest.raises(CompareError, match="cannot widen ik_llama.cpp's V2-Lite condition: "
                                           "src/graphs/build_deepseek2.cpp of .* has 0 times"):
        ik.copy_and_patch(source, tmp_path / "copy2")
    failed = subprocess.run([sys.executable, "-m", "llama_compare.ik", str(source), str(tmp_path / "copy3")],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
    assert failed.returncode == 1 and failed.stderr.startswith("error: cannot widen") and failed.stderr.count("\n") == 1


def test_no_ik_llama_folder_or_not_an_ik_llama_source_is_one_line_before_anything_is_made(checkpoint, tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    for args in ((), ("--dry-run",)):
        proc = compare(str(checkpoint), "--cache", str(cache), "--out", str(out), "--ik-llama",
                       str(tmp_path / "missing"), *args)
        _one_line_error(proc, f"no ik_llama.cpp source folder at {tmp_path / 'missing'}")
    mainline = tmp_path / "llama.cpp"
    (mainline / "examples" / "llama-bench").mkdir(parents=True)
    (mainline / "examples" / "llama-bench" / "llama-bench.cpp").write_text("")
    _one_line_error(compare(str(checkpoint), "--cache", str(cache), "--out", str(out), "--ik-llama", str(mainline)),
                    f"{mainline} is not an ik_llama.cpp source folder: it has no ggml/src/iqk")
    assert not cache.exists() and not out.exists()


def test_ik_llamas_decode_after_a_context_is_a_row_of_the_table_beside_ours():
    """ik_llama.cpp's llama-bench JSON of a real run (v2l4, Q4_0, -p 512 -n 32 -gp 1024,32 -rtr 1): its
    ``tg32@pp1024`` test (no n_depth field; tokens/s of the decode only) is the decode at context 1024, and the
    rows it makes beside ours carry its engine's name into the table and the bound check."""
    tests = table.parse_llama_bench((DATA / "ik-llama-bench-rtr-Q4_0.json").read_text())
    assert [(t["test"], t["n_prompt"], t["n_gen"], t["n_depth"]) for t in tests] == [
        ("pp512", 512, 0, 0), ("tg32", 0, 32, 0), ("tg32", 1024, 32, 1024)]
    raw = json.loads((DATA / "ik-llama-bench-rtr-Q4_0.json").read_text())
    assert [t["tokens_per_s"] for t in tests] == [e["avg_ts"] for e in raw]
    assert all(e["repack"] and e["mla_attn"] == 3 and e["fused_moe"] and e["flash_attn"] for e in raw)
    report, llama, read = _real_run()
    mainline = table.rows(report, llama, read)
    ik_rows = table.rows(report, {"Q4_0": tests}, read, engine="ik_llama.cpp -rtr")
    assert [(r["weights"], r["context"], r["engine"]) for r in ik_rows] == [
        ("int4", 0, "ik_llama.cpp -rtr"), ("int4", 1024, "ik_llama.cpp -rtr")]
    for row, test in zip(ik_rows, tests[1:]):
        assert row["llama_tokens_per_s"] == test["tokens_per_s"]
        assert row["ratio"] == pytest.approx(row["ours_tokens_per_s"] / test["tokens_per_s"])
        assert row["llama_gbps"] == pytest.approx(read["Q4_0"][row["context"]] * test["tokens_per_s"] / 1e9)
    assert ik_rows[0]["llama_prefill_tokens_per_s"] == tests[0]["tokens_per_s"]
    rows = table.combine([mainline + ik_rows])
    low = dict(report, machine=dict(report["machine"], read_gbps=dict(report["machine"]["read_gbps"], max=1e-3)))
    beaten = table.bound([low], [{"read_gbps": 1e-3, "read_kernel": "torch.sum"}], rows)["check"]["beaten_by"]
    assert {"ik_llama.cpp -rtr Q4_0 decode @ 0", "llama.cpp Q4_0 decode @ 1024"} <= {b["label"] for b in beaten}
    bound = table.bound([report], [], rows)
    text = table.text(rows, bound, "title").splitlines()
    assert any(line.startswith("int4 / Q4_0     1024  ik_llama.cpp -rtr ") for line in text), text
    assert "| int4 / Q4_0 | 0 | ik_llama.cpp -rtr |" in table.markdown(rows, bound, "title", [])

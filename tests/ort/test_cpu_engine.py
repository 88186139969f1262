"""The pre-built ONNX Runtime CPU engine (``mla-deploy build ART --target cpu``): built once per artifact kind in this
module (tiny int4 MatMulNBits weights, whose saved pre-packed weights ONNX Runtime 1.31.1 cannot read back, and tiny
fp32, whose MatMul pre-packed weights it does); the same tokens and logits as the source graphs; opened with graph
optimisation disabled; every kind of stale or foreign engine refused in one line; a failed build leaves nothing;
bad inputs refused in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from artifacts import tiny_artifact, tiny_recipe
from cli_run import cli, ok
from mla_deploy.artifact import load_manifest
from mla_deploy.ort.engine import OrtEngine
from mla_deploy.errors import ArtifactError

PROMPT = "3,14,15,92,65"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """``{"int4": artifact, "fp32": artifact}``, each with its CPU engine built by the CLI (copies: the shared tiny
    artifacts stay without one)."""
    from mla_deploy.exporter import export_recipe

    root = tmp_path_factory.mktemp("cpu-engine")
    export_recipe(tiny_recipe("static", weights="int4"), root / "int4")
    shutil.copytree(tiny_artifact("static"), root / "fp32")
    for kind in ("int4", "fp32"):
        out = ok(cli("build", root / kind, "--target", "cpu"))
        assert f"{root / kind / 'cpu'}" in out and "ONNX Runtime 1.31.1" in out, out
    return {"int4": root / "int4", "fp32": root / "fp32"}


def copy(art: Path, tmp_path: Path) -> Path:
    """A copy of a built artifact to spoil."""
    return Path(shutil.copytree(art, tmp_path / art.name))


def tokens(*args) -> tuple[list[int], str]:
    """``run ... --json``'s tokens and which graphs ran."""
    record = json.loads(ok(cli("run", *args, "--prompt-ids", PROMPT, "--max-new-tokens", "12", "--json")))
    return record["sequences"][0]["tokens"], record["graphs"]


@pytest.mark.parametrize("kind", ["int4", "fp32"])
def test_engine_gives_the_source_graphs_tokens_and_logits(built, kind):
    """run with the engine and with --no-engine: the same 12 tokens. The engine's products are mla-deploy's own
    operators where a C compiler and one of their fast paths (AVX-512 VNNI, AVX-VNNI, AVX2) are there (int4: the
    quantized products; fp32: the float weights' MatMul nodes, FloatMatMul; the same arithmetic, float sums in
    another order), so its prefill and decode logits
    equal the source graphs' to float32 rounding, and bit for bit where it kept ONNX Runtime's kernels (the engine
    is then the graph ONNX Runtime would have optimised itself)."""
    art = built[kind]
    (with_engine, graphs), (without, source) = tokens(art), tokens(art, "--no-engine")
    assert with_engine == without and graphs == f"engine {art / 'cpu'}" and source == "source graphs"
    engines = [OrtEngine(art, threads=1), OrtEngine(art, threads=1, use_engine=False)]
    states = [e.new_state(1) for e in engines]
    ids = np.array([[3, 14, 15, 92, 65]], dtype=np.int64)
    outs = [np.array(e.step("prefill", ids, np.arange(5)[None], s)) for e, s in zip(engines, states)]
    outs += [np.array(e.step("decode", ids[:, :1], np.array([[5]]), s)) for e, s in zip(engines, states)]
    own = json.loads((art / "cpu" / "engine.json").read_text())["operators"]
    assert (own["linear"] > 0) == (kind == "int4" and own["why_not"] is None)
    if kind == "fp32":  # an int4 engine's float MatMuls are the routers' few
        assert (own.get("float_linear", 0) > 0) == (own["why_not"] is None)
    for engine_out, source_out in ((outs[0], outs[1]), (outs[2], outs[3])):
        if own["linear"] or own.get("float_linear"):
            assert np.abs(engine_out - source_out).max() <= 1e-5 * np.abs(source_out).max()
            assert not np.array_equal(engine_out, source_out)  # the own operators did run
        else:
            assert np.array_equal(engine_out, source_out)
    assert np.isfinite(outs[0]).all()


def test_engine_prefills_in_chunks(built):
    """`run --prefill-chunk 2` on the built int4 engine (its own attention over the rows earlier chunks cached, with
    the prompt's 5 tokens cut 1 + 2 + 2): the same 12 tokens as one prefill call."""
    assert tokens(built["int4"], "--prefill-chunk", "2") == tokens(built["int4"])


def test_engine_opens_without_graph_optimisation(built):
    """What ONNX Runtime reports of the sessions: the engine's with ORT_DISABLE_ALL, the source graphs' (--no-engine,
    and the exact fp32 compute validation uses, which the engine does not bake) with ORT's default ORT_ENABLE_ALL."""
    art = built["int4"]
    levels = {name: {s.get_session_options().graph_optimization_level for s in engine.sessions.values()}
              for name, engine in (("engine", OrtEngine(art, threads=1)),
                                   ("source", OrtEngine(art, threads=1, use_engine=False)),
                                   ("exact", OrtEngine(art, threads=1, quantized_compute="fp32")))}
    assert levels == {"engine": {ort.GraphOptimizationLevel.ORT_DISABLE_ALL},
                      "source": {ort.GraphOptimizationLevel.ORT_ENABLE_ALL},
                      "exact": {ort.GraphOptimizationLevel.ORT_ENABLE_ALL}}
    assert not any(s.get_session_options().enable_mem_reuse for s in OrtEngine(art, threads=1).sessions.values())
    record = json.loads((art / "cpu" / "engine.json").read_text())
    assert record["onnxruntime"] == ort.__version__ and record["session"]["opened_with"] == "ORT_DISABLE_ALL"
    assert {g["source"] for g in record["graphs"]} == {"prefill.onnx", "decode.onnx"}


def test_prepacked_weights_kept_for_float_kernels_only(built):
    """The fp32 engine may store MatMul's pre-packed weights (the token test above then reads them back), but where
    our operators compile its float weights' MatMul nodes are FloatMatMul, which packs nothing: none of its graph's
    float weights then has a packed copy; the int4 engine stores none (ONNX Runtime 1.31.1 reads MatMulNBits's back
    as NaN), and says so in its record."""
    import onnx

    def kernels(art: Path) -> set[str]:
        model = onnx.load(str(art / "cpu" / "decode.onnx"), load_external_data=False)
        return {e.value.split("+", 1)[0] for t in model.graph.initializer for e in t.external_data
                if e.key.startswith("prepacked")}

    records = {kind: json.loads((built[kind] / "cpu" / "engine.json").read_text()) for kind in built}
    assert records["fp32"]["prepacked"] == ["MatMul", "Gemm"]
    assert ("MatMul" in kernels(built["fp32"])) == (records["fp32"]["operators"].get("float_linear", 0) == 0)
    assert records["int4"]["prepacked"] == [] and kernels(built["int4"]) == set()


def _record(field: str, value):
    def spoil(art: Path) -> None:
        path = art / "cpu" / "engine.json"
        record = json.loads(path.read_text())
        record[field] = value(record[field])
        path.write_text(json.dumps(record))
    return spoil


def _graph(field: str, value):
    def spoil(art: Path) -> None:
        path = art / "cpu" / "engine.json"
        record = json.loads(path.read_text())
        record["graphs"][-1][field] = value
        path.write_text(json.dumps(record))
    return spoil


def _new_source_digest(art: Path) -> None:
    manifest = load_manifest(art)
    graphs = dict(manifest.graphs, decode=dataclasses.replace(manifest.graphs["decode"], sha256="0" * 64))
    dataclasses.replace(manifest, graphs=graphs).save(art)


STALE = {
    "onnxruntime": (_record("onnxruntime", lambda v: "1.30.0"), "built with ONNX Runtime 1.30.0, this is ONNX Runtime"),
    "cpu features": (_record("cpu_features", lambda v: sorted(v + ["amx_tile"])), "this CPU lacks amx_tile"),
    "machine": (_record("machine", lambda v: "riscv64"), "it was built on riscv64"),
    "session": (_record("session", lambda v: dict(v, accuracy_level=1)), "session settings (accuracy_level=1)"),
    "model": (_record("fingerprint", lambda v: "another"), "built for another model"),
    "source digest": (_new_source_digest, "the source graph decode.onnx changed"),
    "source recorded": (_graph("source_sha256", "1" * 64), "the source graph decode.onnx changed"),
    "engine edited": (lambda art: (art / "cpu" / "decode.onnx").open("ab").write(b"\0"), "decode.onnx was modified"),
    "data missing": (lambda art: (art / "cpu" / "decode.data").unlink(), "decode.data are missing"),
    "data truncated": (lambda art: (art / "cpu" / "decode.data").open("r+b").truncate(100), "truncated or replaced"),
    "data rewritten": (lambda art: (art / "cpu" / "decode.data").write_bytes(
        bytes(255 - b for b in (art / "cpu" / "decode.data").read_bytes())), "decode.data were modified"),
    "data unrecorded": (_graph("data", None), "names no weights file"),
    "no data sample": (_graph("data_sample", ""), "holds no sample digest"),
    "no record": (lambda art: (art / "cpu" / "engine.json").unlink(), "holds no engine.json"),
    "other format": (_record("format_version", lambda v: 99), "written by another mla-deploy"),
    "features not a list": (_record("cpu_features", lambda v: "avx"), "cpu_features must be a list"),
}


@pytest.mark.parametrize("reason", list(STALE))
def test_stale_or_foreign_engine_is_refused(built, tmp_path, reason):
    """Each difference refused when the engine opens: one line naming it and how to rebuild; --no-engine (use_engine
    False) still runs the source graphs."""
    art = copy(built["int4"], tmp_path)
    spoil, words = STALE[reason]
    spoil(art)
    with pytest.raises(ArtifactError) as refused:
        OrtEngine(art, threads=1)
    message = str(refused.value)
    assert words in message and f"`mla-deploy build {art} --target cpu` rebuilds it" in message, message
    assert "\n" not in message
    assert OrtEngine(art, threads=1, use_engine=False).info()["graphs"] == "source graphs"


def test_stale_engine_refused_by_run_and_rebuilt(built, tmp_path):
    """The CLI: run refuses the stale engine in one line with exit 1; build replaces it; run uses it again."""
    art = copy(built["int4"], tmp_path)
    STALE["onnxruntime"][0](art)
    result = cli("run", art, "--prompt-ids", PROMPT, "--max-new-tokens", "2")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "--target cpu` rebuilds it" in result.stderr
    out = tmp_path / "bench"  # bench model opens the engine as run does: refused before it measures anything
    result = cli("bench", "model", "--artifact", art, "--context", "0", "--batch", "1", "--prompt-length", "4",
                 "--repeat", "1", "--warmup", "0", "--no-transformers", "--threads", "1", "--out", out)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "is stale" in result.stderr and not out.exists()
    ok(cli("build", art, "--target", "cpu"))
    assert tokens(art)[1] == f"engine {art / 'cpu'}"


def _failing_decode(art: Path) -> None:
    """Make ONNX Runtime fail to load ``decode.onnx`` (one node of an unknown operator: the one writing the logits,
    which no swap of the build can take or drop) while the artifact stays consistent (the manifest's sha256 and size
    follow), so the build gets past its checks and fails on the second graph, after the first was written."""
    import onnx

    from mla_deploy.artifact import sha256_file

    manifest = load_manifest(art)
    model = onnx.load(str(art / "decode.onnx"))
    node = next(n for n in model.graph.node if model.graph.output[0].name in n.output)
    node.op_type, node.domain = "NoSuchOp", "com.example"
    model.opset_import.add(domain="com.example", version=1)
    onnx.save(model, str(art / "decode.onnx"))
    path = art / "decode.onnx"
    decode = dataclasses.replace(manifest.graphs["decode"], sha256=sha256_file(path), bytes=path.stat().st_size)
    dataclasses.replace(manifest, graphs=dict(manifest.graphs, decode=decode)).save(art)


def test_failed_build_leaves_the_previous_engine_or_none(built, tmp_path):
    """A build that fails on its second graph: one line, exit 1; no temporary folder; the previous engine is kept
    untouched; without one, no cpu/ folder appears."""
    art = copy(built["int4"], tmp_path)
    before = {p.name: p.read_bytes() for p in (art / "cpu").iterdir()}
    _failing_decode(art)
    result = cli("build", art, "--target", "cpu")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "ONNX Runtime could not optimise decode.onnx" in result.stderr
    assert {p.name: p.read_bytes() for p in (art / "cpu").iterdir()} == before
    shutil.rmtree(art / "cpu")
    assert cli("build", art, "--target", "cpu").returncode == 1
    assert sorted(p.name for p in art.iterdir()) == ["decode.onnx", "manifest.json", "prefill.onnx"]


def test_rebuild_keeps_a_users_file_that_an_edited_record_names(built, tmp_path):
    """engine.json edited to name a user's file (any name but an engine file's) or a folder: the build trusts the
    record only for names it could have written itself, refuses in one line and keeps both."""
    art = copy(built["int4"], tmp_path)
    record = json.loads((art / "cpu" / "engine.json").read_text())
    record["graphs"][0]["data"], record["graphs"][-1]["engine"] = "notes.txt", "mine.onnx"
    (art / "cpu" / "engine.json").write_text(json.dumps(record))
    (art / "cpu" / "notes.txt").write_text("the user's own file\n")
    (art / "cpu" / "mine.onnx").mkdir()
    (art / "cpu" / "mine.onnx" / "inside").write_text("kept\n")
    result = cli("build", art, "--target", "cpu")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "is not a file of a CPU engine" in result.stderr, result.stderr
    assert (art / "cpu" / "notes.txt").read_text() == "the user's own file\n"
    assert (art / "cpu" / "mine.onnx" / "inside").read_text() == "kept\n"


@pytest.mark.parametrize("name", ["extra.onnx", "extra.data", "link.data"])
def test_rebuild_keeps_a_users_file_named_like_an_engine_file(built, tmp_path, name):
    """A file in cpu/ that neither the build writes nor the engine's record names, whatever its suffix (a user's
    graph, or a link to another engine's weights), is refused in one line and kept; the engine stays as it was."""
    art = copy(built["int4"], tmp_path)
    user = art / "cpu" / name
    if name.startswith("link"):
        user.symlink_to(art / "cpu" / "decode.data")
    else:
        user.write_text("the user's own file\n")
    before = {p.name: p.read_bytes() for p in (art / "cpu").iterdir() if not p.is_symlink()}
    result = cli("build", art, "--target", "cpu")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert f"{name} is not a file of a CPU engine" in result.stderr
    assert {p.name: p.read_bytes() for p in (art / "cpu").iterdir() if not p.is_symlink()} == before
    assert user.is_symlink() or user.read_text() == "the user's own file\n"


def test_bad_inputs_are_one_line_errors(built, tmp_path):
    """Not an artifact, a bf16 artifact, TensorRT options with --target cpu, a user's file where cpu/ goes, a disk
    that fills up: one line each, exit 1, nothing left behind."""
    art = copy(built["fp32"], tmp_path)
    shutil.rmtree(art / "cpu")
    (tmp_path / "empty").mkdir()
    (art / "cpu").write_text("my notes\n")
    cases = [(["build", tmp_path / "empty", "--target", "cpu"], "holds no manifest.json"),
             (["build", tiny_artifact("static", "bf16"), "--target", "cpu"], "bf16 artifacts need TensorRT"),
             (["build", art, "--target", "cpu", "--opt-level", "3"], "--opt-level: options of --target tensorrt"),
             (["build", art, "--target", "cpu"], "is not a CPU engine folder; move it away first")]
    for args, words in cases:
        result = cli(*args)
        assert result.returncode == 1 and result.stderr.splitlines() == [result.stderr.strip()], result.stderr
        assert words in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert (art / "cpu").read_text() == "my notes\n" and not list(tiny_artifact("static", "bf16").glob("*cpu*"))
    (art / "cpu").unlink()
    full = subprocess.run([sys.executable, "-c", "import resource, signal, sys; from mla_deploy.cli import main; "
                           "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                           "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); "
                           "sys.argv = ['mla-deploy', *sys.argv[1:]]; main()", "build", str(art), "--target", "cpu"],
                          capture_output=True, text=True,  # no .pyc: one larger than the limit would be truncated
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
    assert full.returncode == 1 and len(full.stderr.splitlines()) == 1, full.stderr
    assert "ONNX Runtime could not optimise prefill.onnx: writing prefill.data reached this process's file size " \
           "limit (65536 bytes, `ulimit -f`)" in full.stderr, full.stderr  # the cause, not ONNX Runtime's words
    assert sorted(p.name for p in art.iterdir()) == ["decode.onnx", "manifest.json", "prefill.onnx"], full.stderr

"""The CLI's error contract (docs/errors.md), tried as a user meets it: real `python -m mla_deploy` processes.

For every bad input: the exit status (1 for a user error, 2 for a malformed command line), exactly one non-empty
line on stderr, ``mla-deploy: error: ...``, naming the problem, no traceback, nothing left behind (no ``.tmp-`` or
``.old-`` temporaries) and no user file lost or changed: the whole workspace is snapshotted before and compared
after each case.

A full disk without privileges: a small tmpfs in a private user and mount namespace (``unshare -r -m``) gives a
real ``ENOSPC`` where the kernel allows it; ``RLIMIT_FSIZE`` works everywhere (set in the child before exec, with
SIGXFSZ ignored so that a write past the limit fails with ``EFBIG``, "File too large", instead of killing the
process): the same failure path in mla-deploy, an ``OSError`` from ``write``.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artifacts import tiny_artifact

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TEMPORARY = (".tmp-", ".old-")


#: a child under a file-size limit writes no bytecode: Python ignores a short write of a .pyc, and a module whose
#: bytecode is larger than the limit would be left truncated for every later import to fail on
NO_BYTECODE = {**ENV, "PYTHONDONTWRITEBYTECODE": "1"}


def cli(*args: str, cwd: Path, preexec_fn=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mla_deploy", *args], capture_output=True, text=True, cwd=cwd,
                          env=ENV if preexec_fn is None else NO_BYTECODE, timeout=timeout, preexec_fn=preexec_fn)


def error_line(proc: subprocess.CompletedProcess, status: int, *words: str) -> str:
    """The single error line of ``proc``, after checking the contract."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mla-deploy: error: "), proc.stderr
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` with its content hash ("dir" for folders)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def temporaries(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if any(t in p.name for t in TEMPORARY)]


def full_disk(limit_bytes: int):
    """A ``preexec_fn``: files written by the child may not grow past ``limit_bytes`` (see the module docstring)."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return apply


def dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A workspace of user files and artifacts (copies of the tiny preset's export) that bad inputs meet."""
    root = tmp_path_factory.mktemp("cli-errors")
    art = root / "art"
    shutil.copytree(tiny_artifact("static"), art)
    (root / "afile.txt").write_text("a user's file\n")
    (root / "nonempty").mkdir()
    (root / "nonempty" / "notes.txt").write_text("keep me\n")
    (root / "gelu").mkdir()
    (root / "gelu" / "config.json").write_text('{"model_type": "deepseek_v3", "hidden_act": "gelu"}')
    (root / "unknown.toml").write_text('[model]\nname = "x"\nno_such_field = 1\n')
    (root / "garbage.toml").write_text("this is [ not toml\n")
    (root / "garbage.json").write_text("{ not json\n")
    shutil.copytree(art, root / "vocab")  # a manifest edited after the export: the graph's vocabulary is 128
    manifest = json.loads((root / "vocab" / "manifest.json").read_text())
    manifest["model"]["vocab_size"] = 1000
    (root / "vocab" / "manifest.json").write_text(json.dumps(manifest))
    shutil.copytree(art, root / "truncated")
    graph = root / "truncated" / "decode.onnx"
    graph.write_bytes(graph.read_bytes()[:1000])
    shutil.copytree(art, root / "badjson")
    (root / "badjson" / "manifest.json").write_text("{ nope")
    shutil.copytree(art, root / "clash")  # a user's model.onnx beside a two-graph artifact: an export would replace it
    (root / "clash" / "model.onnx").write_text("the user's own graph\n")
    for name, key, value in (("model_list", "model", [1, 2]), ("weights_text", "weights", "x"),
                             ("versions_int", "versions", 5), ("recipe_text", "recipe", "x")):
        shutil.copytree(art, root / name)  # a manifest field edited into another type
        manifest = json.loads((root / name / "manifest.json").read_text())
        manifest[key] = value
        (root / name / "manifest.json").write_text(json.dumps(manifest))
    shutil.copytree(art, root / "no_capacity")  # a static cache's capacity edited away
    manifest = json.loads((root / "no_capacity" / "manifest.json").read_text())
    manifest["max_cache_length"] = None
    (root / "no_capacity" / "manifest.json").write_text(json.dumps(manifest))
    shutil.copytree(art, root / "data_int")
    manifest = json.loads((root / "data_int" / "manifest.json").read_text())
    manifest["graphs"]["decode"]["external_data"] = 5
    (root / "data_int" / "manifest.json").write_text(json.dumps(manifest))
    for name, edit in (("dtype_edited", lambda m: m.__setitem__("dtype", "float16")),
                       ("width_edited", lambda m: m["cache"].__setitem__("width", 100)),
                       ("channels_edited", lambda m: m["cache"]["channels"].__setitem__("c_kv", [0, 400])),
                       ("form_edited", lambda m: m["graphs"]["decode"].__setitem__("form", "CC")),
                       ("attention_edited", lambda m: m["graphs"]["decode"].__setitem__("attention", "plugin")),
                       ("attention_unknown", lambda m: m["graphs"]["prefill"].__setitem__("attention", "flash"))):
        shutil.copytree(art, root / name)  # what the manifest says of its dtype, cache or graphs contradicted
        manifest = json.loads((root / name / "manifest.json").read_text())
        edit(manifest)
        (root / name / "manifest.json").write_text(json.dumps(manifest))
    shutil.copytree(art, root / "nested")
    (root / "nested" / "manifest.json").write_text("[" * 100000 + "]" * 100000)  # past Python's recursion limit
    (root / "latin1.toml").write_bytes(b"\xff\xfe[model]\n")
    (root / "list.json").write_text("[]")
    (root / "rope.toml").write_text((Path(__file__).parents[2] / "export" / "tiny.toml").read_text().replace(
        "factor = ", 'factor = "x" # '))
    (root / "genai").mkdir()  # what `export --target genai` writes (no manifest.json): no artifact
    (root / "genai" / "genai_config.json").write_text('{"model": {"type": "deepseek_v3"}}')
    (root / "genai" / "model.onnx").write_bytes(b"\x00graph")
    return root


LONG = ",".join(["1"] * 1000)
#: b"caf\xe9" (latin-1, not UTF-8) as Python receives it in argv on Linux (``surrogateescape``); subprocess passes
#: the original bytes
NOT_UTF8 = "caf\udce9"

#: (id, argv with {art} for the artifact, exit status, words the line must hold)
CASES = [
    # malformed command lines: click's usage errors, one line, exit 2
    ("no_such_command", ["nosuch"], 2, ["No such command 'nosuch'"]),
    ("no_such_option", ["inspect", "--bogus"], 2, ["No such option", "--bogus"]),
    ("bad_precision", ["export", "--preset", "tiny", "--precision", "fp8", "--out", "x"], 2, ["--precision", "fp8"]),
    ("bad_cache_mode", ["export", "--preset", "tiny", "--cache-mode", "ring", "--out", "x"], 2, ["--cache-mode"]),
    ("out_is_a_file", ["export", "--preset", "tiny", "--out", "afile.txt"], 2, ["afile.txt", "is a file"]),
    ("run_no_artifact", ["run"], 2, ["Missing argument 'ARTIFACT'"]),
    ("run_no_prompt", ["run", "art"], 2, ["--prompt-ids"]),
    ("run_bad_provider", ["run", "art", "--prompt-ids", "1", "--provider", "tpu"], 2, ["--provider", "tpu"]),
    ("validate_bad_provider", ["validate", "art", "--provider", "tpu"], 2, ["--provider"]),
    # inspect
    ("unknown_preset", ["inspect", "--preset", "nope"], 1, ["unknown preset 'nope'"]),
    ("no_source", ["inspect"], 1, ["exactly one of --preset, --recipe, --hf"]),
    ("two_sources", ["inspect", "--preset", "tiny", "--recipe", "unknown.toml"], 1, ["exactly one"]),
    ("hf_missing", ["inspect", "--hf", "no-such-checkpoint"], 1, ["no-such-checkpoint"]),
    ("hf_gelu", ["inspect", "--hf", "gelu"], 1, ["hidden_act"]),
    ("recipe_unknown_field", ["inspect", "--recipe", "unknown.toml"], 1, ["no_such_field"]),
    ("recipe_not_toml", ["inspect", "--recipe", "garbage.toml"], 1, ["garbage.toml"]),
    ("recipe_missing", ["inspect", "--recipe", "missing.toml"], 1, ["missing.toml"]),
    # export
    ("export_no_out", ["export", "--preset", "tiny"], 1, ["--out"]),
    ("layers_past_model", ["export", "--preset", "tiny", "--layers", "999", "--out", "x"], 1,
     ["layers must be an integer in 1..2", "999"]),
    ("layers_zero", ["export", "--preset", "tiny", "--layers", "0", "--out", "x"], 1, ["--layers must be >= 1"]),
    ("layers_not_int", ["export", "--preset", "tiny", "--layers", "two", "--out", "x"], 1,
     ["--layers takes an integer"]),
    ("capacity_zero", ["export", "--preset", "tiny", "--max-cache-length", "0", "--out", "x"], 1,
     ["--max-cache-length must be >= 2"]),
    ("capacity_one", ["export", "--preset", "tiny", "--max-cache-length", "1", "--out", "x"], 1,
     ["--max-cache-length must be >= 2, got 1"]),  # the recipe's bound, not a second one
    ("out_in_proc", ["export", "--preset", "tiny", "--out", "/proc/x"], 1, ["cannot write /proc/x"]),
    ("out_under_a_file", ["export", "--preset", "tiny", "--out", "afile.txt/sub"], 1,
     ["cannot write afile.txt/sub", "Not a directory"]),
    ("out_not_an_artifact", ["export", "--preset", "tiny", "--out", "nonempty"], 1,
     ["nonempty is not empty and holds no mla-deploy artifact"]),
    ("out_other_model", ["export", "--preset", "tiny", "--layers", "1", "--out", "art"], 1,
     ["already holds a different model", "--overwrite"]),
    ("out_user_file_in_the_way", ["export", "--preset", "tiny", "--out", "clash"], 1,
     ["model.onnx is not a file of the artifact"]),
    ("hf_and_preset", ["export", "--preset", "tiny", "--hf", "gelu", "--out", "x"], 1, ["exactly one"]),
    ("hf_layers", ["export", "--hf", "gelu", "--layers", "1", "--out", "x"], 1, ["hidden_act"]),
    ("hf_missing_export", ["export", "--hf", "no-such-checkpoint", "--out", "x"], 1, ["no-such-checkpoint"]),
    # run
    ("run_missing_artifact", ["run", "missing", "--prompt-ids", "1"], 1, ["no artifact directory at missing"]),
    ("run_not_an_artifact", ["run", "nonempty", "--prompt-ids", "1"], 1, ["holds no manifest.json"]),
    ("run_manifest_not_json", ["run", "badjson", "--prompt-ids", "1"], 1, ["not readable JSON"]),
    ("run_truncated_graph", ["run", "truncated", "--prompt-ids", "1"], 1, ["decode.onnx"]),
    ("run_edited_manifest", ["run", "vocab", "--prompt-ids", "1,2,500"], 1,  # refused before anything runs
     ["manifest.json prefill outputs", "1000"]),
    ("manifest_model_not_a_table", ["run", "model_list", "--prompt-ids", "1"], 1, ["[model]", "table", "list"]),
    ("manifest_weights_not_a_table", ["run", "weights_text", "--prompt-ids", "1"], 1, ["[weights] is not a table"]),
    ("manifest_versions_not_a_table", ["run", "versions_int", "--prompt-ids", "1"], 1, ["[versions] is not a table"]),
    ("manifest_recipe_not_a_table", ["run", "recipe_text", "--prompt-ids", "1"], 1, ["[recipe] is not a table"]),
    ("manifest_static_without_capacity", ["run", "no_capacity", "--prompt-ids", "1"], 1,
     ["a static cache needs its max_cache_length"]),
    ("manifest_data_not_a_name", ["run", "data_int", "--prompt-ids", "1"], 1, ["decode graph entry", "got 5"]),
    ("manifest_dtype_edited", ["run", "dtype_edited", "--prompt-ids", "1"], 1,
     ["dtype 'float16' is not 'float32'", "precision fp32"]),
    ("manifest_cache_width_edited", ["validate", "width_edited"], 1, ["cache width is 100", "give 24"]),
    ("manifest_cache_channels_edited", ["build", "channels_edited", "--target", "cpu"], 1, ["cache channels"]),
    ("manifest_form_edited", ["run", "form_edited", "--prompt-ids", "1"], 1,
     ["decode graph's form is 'CC'", "'A_CC' of its recorded recipe"]),
    ("manifest_attention_edited", ["run", "attention_edited", "--prompt-ids", "1"], 1,
     ["says its decode graph's attention is 'plugin'", "holds 0 MlaDecode plugin nodes"]),
    ("manifest_attention_edited_build", ["build", "attention_edited", "--target", "cpu"], 1,
     ["says its decode graph's attention is 'plugin'", "holds 0 MlaDecode plugin nodes"]),
    ("manifest_attention_unknown", ["validate", "attention_unknown"], 1, ["prefill graph's attention is 'flash'"]),
    ("manifest_nested_too_deep", ["build", "nested", "--target", "cpu"], 1, ["not readable JSON", "RecursionError"]),
    ("id_past_int64", ["run", "art", "--prompt-ids", "9223372036854775808"], 1,
     ["token id 9223372036854775808", "vocabulary"]),
    ("recipe_not_utf8", ["inspect", "--recipe", "latin1.toml"], 1, ["latin1.toml", "not a readable TOML"]),
    ("recipe_rope_not_a_number", ["inspect", "--recipe", "rope.toml"], 1, ["rope_scaling values must be numbers"]),
    ("hf_config_a_list", ["inspect", "--hf", "list.json"], 1, ["list.json", "not a Hugging Face config"]),
    ("ids_not_ints", ["run", "art", "--prompt-ids", "1,x"], 1, ["comma-separated integers", "'1,x'"]),
    ("id_past_vocab", ["run", "art", "--prompt-ids", "1,2,999"], 1, ["token id 999", "vocabulary"]),
    ("id_negative", ["run", "art", "--prompt-ids=-5"], 1, ["token id -5"]),
    ("empty_prompt", ["run", "art", "--prompt-ids", ""], 1, ["at least one token id"]),
    ("new_tokens_zero", ["run", "art", "--prompt-ids", "1", "--max-new-tokens", "0"], 1,
     ["--max-new-tokens must be >= 1"]),
    ("prefill_chunk_zero", ["run", "art", "--prompt-ids", "1", "--prefill-chunk", "0"], 1,
     ["--prefill-chunk must be >= 1"]),
    ("past_capacity", ["run", "art", "--prompt-ids", "1,2,3", "--max-new-tokens", "200"], 1, ["capacity"]),
    ("past_capacity_allowed_long", ["run", "art", "--prompt-ids", "1,2,3", "--max-new-tokens", "2000", "--allow-long"],
     1, ["capacity"]),  # only the error: no warning line before it
    ("past_positions", ["run", "art", "--prompt-ids", LONG, "--max-new-tokens", "100"], 1,
     ["1100 positions", "max_position_embeddings 1024", "--allow-long"]),
    ("run_threads_zero", ["run", "art", "--prompt-ids", "1", "--threads", "0"], 1, ["--threads must be >= 1"]),
    ("run_threads_negative", ["run", "art", "--prompt-ids", "1", "--threads", "-1"], 1, ["--threads must be >= 1"]),
    ("run_threads_past_cpus", ["run", "art", "--prompt-ids", "1", "--threads", "100000"], 1,
     ["--threads must be <= ", "the CPUs this process may use", "got 100000"]),
    ("ids_empty_item", ["run", "art", "--prompt-ids", "1,,2"], 1, ["comma-separated integers", "'1,,2'"]),
    ("ids_trailing_comma", ["run", "art", "--prompt-ids", "1,2,"], 1, ["comma-separated integers", "'1,2,'"]),
    ("seed_negative", ["run", "art", "--prompt-ids", "1", "--seed", "-1"], 1, ["--seed must be >= 0"]),
    ("run_genai_folder", ["run", "genai", "--prompt-ids", "1"], 1,
     ["genai is an onnxruntime-genai folder", "onnxruntime_genai.Model('genai')"]),
    # bytes that are not UTF-8, in text and in paths: a malformed command line, whichever the command
    ("prompt_not_utf8", ["run", "art", "--prompt", NOT_UTF8], 2,
     ["the value of --prompt is not UTF-8", r"b'caf\xe9'", "mla-deploy run --help"]),
    ("prompt_equals_not_utf8", ["run", "art", f"--prompt={NOT_UTF8}"], 2, ["the value of --prompt is not UTF-8"]),
    ("system_not_utf8", ["run", "art", "--prompt", "hi", "--chat", "--system", NOT_UTF8], 2, ["--system"]),
    ("stop_not_utf8", ["run", "art", "--prompt-ids", "1", "--stop", NOT_UTF8], 2, ["the value of --stop"]),
    ("artifact_not_utf8", ["run", NOT_UTF8, "--prompt-ids", "1"], 2, ["argument 2 is not UTF-8"]),
    ("export_out_not_utf8", ["export", "--preset", "tiny", "--out", NOT_UTF8], 2, ["the value of --out"]),
    ("inspect_recipe_not_utf8", ["inspect", "--recipe", NOT_UTF8], 2, ["the value of --recipe"]),
    ("validate_out_not_utf8", ["validate", "art", "--out", NOT_UTF8], 2, ["the value of --out"]),
    ("bench_out_not_utf8", ["bench", "attention", "--preset", "tiny", "--out", NOT_UTF8], 2,
     ["the value of --out", "mla-deploy bench --help"]),
    # validate
    ("validate_missing", ["validate", "missing"], 1, ["no artifact directory at missing"]),
    ("validate_out_under_a_file", ["validate", "art", "--out", "afile.txt/v"], 1,
     ["afile.txt is not a directory"]),
    ("validate_threads_zero", ["validate", "art", "--threads", "0"], 1, ["--threads must be >= 1"]),
    ("validate_threads_past_cpus", ["validate", "art", "--threads", "100000"], 1,
     ["--threads must be <= ", "the CPUs this process may use"]),
    ("validate_genai_folder", ["validate", "genai"], 1, ["genai is an onnxruntime-genai folder"]),
    ("validate_steps_negative", ["validate", "art", "--steps", "-1"], 1, ["--steps must be >= 0"]),
    ("validate_results_missing", ["validate", "art", "--load-results", "missing.json"], 1, ["missing.json"]),
    ("validate_results_garbage", ["validate", "art", "--load-results", "garbage.json"], 1, ["garbage.json"]),
    # bench (options are parsed before anything runs)
    ("bench_no_source", ["bench", "attention"], 1, ["exactly one of --preset, --recipe"]),
    ("bench_model_no_source", ["bench", "model"], 1, ["exactly one of --artifact, --hf, --preset, --recipe"]),
    ("bench_context_not_ints", ["bench", "attention", "--preset", "tiny", "--context", "1k"], 1, ["--context"]),
    ("bench_threads_zero", ["bench", "attention", "--preset", "tiny", "--threads", "0"], 1,
     ["--threads must be >= 1"]),
    ("bench_threads_past_cpus", ["bench", "attention", "--preset", "tiny", "--threads", "100000"], 1,
     ["--threads must be <= ", "the CPUs this process may use"]),
    ("bench_model_threads_past_cpus", ["bench", "model", "--artifact", "art", "--threads", "100000"], 1,
     ["--threads must be <= ", "the CPUs this process may use"]),
    ("bench_seed_negative", ["bench", "attention", "--preset", "tiny", "--seed", "-1"], 1, ["--seed must be >= 0"]),
    ("bench_model_seed_negative", ["bench", "model", "--artifact", "art", "--seed", "-1"], 1,
     ["--seed must be >= 0"]),
    ("bench_unknown_path", ["bench", "attention", "--preset", "tiny", "--paths", "warp-drive"], 1, ["warp-drive"]),
    ("bench_unknown_bench", ["bench", "warp-drive"], 2, ["No such command 'warp-drive'"]),
    ("bench_misplaced_option", ["bench", "model", "--preset", "tiny", "--passes", "2"], 2,
     ["--passes is an option of `bench attention`, not of `bench model`"]),
    # the spelling from before the subcommands: routed to them
    ("bench_old_spelling_misplaced", ["bench", "--whole-model", "--preset", "tiny", "--passes", "2"], 2,
     ["--passes is an option of `bench attention`, not of `bench model`"]),
    ("bench_hf_without_whole_model", ["bench", "--preset", "tiny", "--hf", "gelu"], 2,
     ["--hf is an option of `bench model`, not of `bench attention`"]),
]


@pytest.fixture(scope="module")
def outcomes(ws) -> dict[str, tuple[subprocess.CompletedProcess, dict, dict]]:
    """Every case of :data:`CASES` run once, two at a time (each is a short process); the workspace's snapshot
    before and after all of them."""
    from concurrent.futures import ThreadPoolExecutor

    before = snapshot(ws)
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = dict(zip([c[0] for c in CASES], pool.map(lambda case: cli(*case[1], cwd=ws), CASES)))
    after = snapshot(ws)
    return {name: (proc, before, after) for name, proc in procs.items()}


@pytest.mark.parametrize("name, status, words", [pytest.param(i, s, w, id=i) for i, a, s, w in CASES])
def test_bad_input_is_one_line(ws, outcomes, name, status, words):
    """Each bad input: its exit status, one line naming the problem, nothing written, nothing lost."""
    proc, before, after = outcomes[name]
    error_line(proc, status, *words)
    assert proc.stdout == ""
    assert after == before  # no case wrote, changed or removed a file (no temporaries either)
    assert not temporaries(ws)


def test_validate_unavailable_provider_is_one_line(ws):
    """A provider that does not load: one line, and no "Exception ignored ... is_active" after it."""
    proc = cli("validate", "art", "--provider", "cuda", cwd=ws)
    if proc.returncode == 0:
        pytest.skip("CUDA works on this machine")
    error_line(proc, 1, "CUDAExecutionProvider")
    assert "Exception ignored" not in proc.stderr


def test_build_without_tensorrt_is_one_line(ws):
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed: the build would run")
    error_line(cli("build", "art", cwd=ws), 1, "TensorRT")


def test_dump_recipe_needs_no_out(tmp_path):
    proc = cli("export", "--preset", "tiny", "--dump-recipe", cwd=tmp_path)
    assert proc.returncode == 0 and json.loads(proc.stdout)["model"]["name"] == "tiny"
    assert not any(tmp_path.iterdir())


def test_bare_command_prints_help(tmp_path):
    proc = cli(cwd=tmp_path)
    assert proc.returncode == 0 and "Commands:" in proc.stdout and proc.stderr == ""


def test_reexport_keeps_what_it_did_not_write(tmp_path):
    """Re-exporting the same model into its directory (here as one graph instead of prefill + decode) replaces the
    artifact's files, the old graphs included, and keeps validation/, trt/ and the user's own files; temporaries
    left by a killed export (a dead pid) are removed and reported."""
    out = tmp_path / "tiny"
    shutil.copytree(tiny_artifact("static"), out)
    (out / "validation").mkdir()
    (out / "validation" / "report.md").write_text("an earlier report\n")
    (out / "trt").mkdir()
    (out / "trt" / "decode.engine").write_bytes(b"\x00engine")
    (out / "notes.txt").write_text("my notes\n")
    stale = tmp_path / f".tiny.tmp-{dead_pid()}"
    stale.mkdir()
    (stale / "weights.data").write_bytes(b"\x00" * 1000)
    recipe = (Path(__file__).parents[2] / "export" / "tiny.toml").read_text()
    (tmp_path / "one-graph.toml").write_text(recipe.replace('prefill_form = "CC"', 'prefill_form = "A_CC"'))
    kept = {k: v for k, v in snapshot(out).items() if k.split("/")[0] in ("validation", "trt", "notes.txt")}
    proc = cli("export", "--recipe", "one-graph.toml", "--out", "tiny", "--progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert {k: v for k, v in snapshot(out).items() if k in kept} == kept
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.onnx", "notes.txt", "trt", "validation"]
    assert not stale.exists() and not temporaries(tmp_path)
    assert f"removed {stale.name}, left by an export that was killed" in proc.stderr
    for step in ("tracing model.onnx", "traced model.onnx", "writing", "saved model.onnx"):
        assert step in proc.stderr, proc.stderr
    total = next(line for line in proc.stdout.splitlines() if line.strip().startswith("total"))
    assert "MB" in total


def test_sigterm_during_export_removes_the_temporary_dir(tmp_path):
    """SIGTERM once the export's temporary folder exists: the folder is removed, one line, exit 128 + 15 (SIGHUP
    takes the same path)."""
    signum = signal.SIGTERM
    proc = subprocess.Popen([sys.executable, "-m", "mla_deploy", "export", "--preset", "deepseek-v2-lite",
                             "--layers", "1", "--out", "v2"], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not temporaries(tmp_path):
            assert proc.poll() is None and time.monotonic() < deadline, "no temporary folder appeared"
            time.sleep(0.05)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    error_line(done, 128 + signum, f"interrupted ({signal.Signals(signum).name})")
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


#: a command under the contract's group that takes SIGTERM inside a weakref callback, where Python drops any
#: exception raised ("Exception ignored in ..."), as the import system's module-lock callback does
SWALLOWED = """
import os, signal, sys, tempfile, time, weakref, click
from mla_deploy.cli.contract import MainGroup

@click.group(cls=MainGroup)
def main():
    pass

class Thing:
    pass

@main.command()
def work():
    with tempfile.TemporaryDirectory(dir=".", prefix=".tmp-") as tmp:
        def callback(ref):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs in here, and its exception is dropped
        thing = Thing()
        ref = weakref.ref(thing, callback)
        del thing
        time.sleep(5)
        print("ran on after the signal")

main()
"""


def test_sigterm_inside_a_callback_that_drops_exceptions_still_stops_the_command(tmp_path):
    """A stop signal whose exception Python drops (it landed in a weakref callback, a ``__del__``) is delivered
    again until it propagates: one line, exit 128 + 15, the temporary folder removed, the command does not run on."""
    done = subprocess.run([sys.executable, "-c", SWALLOWED, "work"], cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=60)
    assert "ran on" not in done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr
    error_line(done, 128 + signal.SIGTERM, "interrupted (SIGTERM)")
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


INTERRUPTED = "mla-deploy: error: interrupted (SIGINT); temporary files were removed"


def start(*args: str, cwd: Path, **popen) -> subprocess.Popen:
    """``mla-deploy ARGS`` started in the background, its output in pipes."""
    return subprocess.Popen([sys.executable, "-m", "mla_deploy", *args], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def read_stderr_until(proc: subprocess.Popen, words: str) -> str:
    """The stderr lines of ``proc`` up to the first holding ``words`` (the process must still run then)."""
    seen = ""
    while True:
        line = proc.stderr.readline()
        assert line, f"the command ended before printing {words!r}: {seen}"
        seen += line
        if words in line:
            break
    assert proc.poll() is None
    return seen


def interrupt(proc: subprocess.Popen, seen: str = "", group: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    """SIGINT to ``proc`` alone (``kill -INT PID``) or to its process group (Ctrl-C in a terminal: ``group``, for a
    process started with ``start_new_session``); its outcome (stderr after ``seen``) and the seconds it took."""
    began = time.monotonic()
    try:
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, seen + stderr), time.monotonic() - began


def assert_interrupted(done: subprocess.CompletedProcess) -> None:
    """Exit 130; the interrupt's line last and the only error; no blank line (click's Abort printed one) and no
    traceback (the lines before are the command's progress lines and warnings)."""
    lines = done.stderr.splitlines()
    assert done.returncode == 128 + signal.SIGINT, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "" not in lines, done.stderr
    assert lines[-1] == INTERRUPTED, done.stderr
    assert [line for line in lines if line.startswith("mla-deploy: error")] == [INTERRUPTED], done.stderr


def running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> list[int]:
    """The running descendants of ``pid`` (Linux ``/proc``)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    children = [c for c in children if running(c)]
    return children + [g for c in children for g in descendants(c)]


def test_sigint_during_generation_stops_run(tmp_path):
    """Ctrl-C inside run's decode loop (a million steps, the warning line is printed just before it): exit 130
    within seconds, the interrupt's line, nothing written."""
    proc = start("run", str(tiny_artifact("concat")), "--prompt-ids", "1,2", "--max-new-tokens", str(10**6),
                 "--allow-long", cwd=tmp_path)
    seen = read_stderr_until(proc, "mla-deploy: warning:")
    time.sleep(0.5)
    done, seconds = interrupt(proc, seen)
    assert_interrupted(done)
    assert seconds < 20
    assert not any(tmp_path.iterdir())


def test_sigint_while_validate_loads_the_reference(ws, tmp_path):
    """Ctrl-C while validate loads the PyTorch reference: exit 130 with the interrupt's line; the report folder
    keeps the earlier report as it was and gets nothing new."""
    out = tmp_path / "reports"
    out.mkdir()
    (out / "report.md").write_text("an earlier report\n")
    before = snapshot(out)
    proc = start("validate", str(ws / "art"), "--out", str(out), "--progress", cwd=tmp_path)
    seen = read_stderr_until(proc, "loading the PyTorch reference")
    done, seconds = interrupt(proc, seen)
    assert_interrupted(done)
    assert seconds < 20
    assert snapshot(out) == before and not temporaries(tmp_path)


@pytest.mark.parametrize("group", [False, True], ids=["sigint_to_the_command", "ctrl_c_to_the_process_group"])
def test_sigint_during_the_bench_stops_its_workers(tmp_path, group):
    """Ctrl-C while the attention bench exports its graph in a child process (which runs on, writing nothing to
    the command, for many seconds when nothing stops it): exit 130 with the interrupt's line and no child left
    running, whether the signal reached the command alone or (a terminal's Ctrl-C) its children too."""
    proc = start("bench", "attention", "--preset", "tiny", "--context", "16", "--batch", "1", "--paths", "ort-static",
                 "--passes", "1", "--threads", "1", "--out", "b", cwd=tmp_path, start_new_session=group)
    deadline, seen = time.monotonic() + 300, {}
    while True:  # until a child has run for 2 s
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        now, children = time.monotonic(), descendants(proc.pid)
        seen = {pid: seen.get(pid, now) for pid in children}
        if any(now - first >= 2.0 for first in seen.values()):
            break
        time.sleep(0.05)
    done, seconds = interrupt(proc, group=group)
    assert_interrupted(done)
    assert seconds < 20
    time.sleep(1.0)  # a child that ignored the signal would still run now (the command waited 3 s, then killed it)
    assert not any(running(pid) for pid in children), "a bench child still runs after the interrupt"
    assert not temporaries(tmp_path) and not list(tmp_path.glob("b/.bench-work-*"))


def _tmpfs_works() -> bool:
    """Whether an unprivileged user and mount namespace with a tmpfs can be made here (``unshare -r -m``)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-r", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /tmp"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def test_full_disk_during_export(tmp_path):
    """The weights stream hits a full disk: one line naming --out and the reason, nothing left behind. A real
    ENOSPC on a 256 KiB tmpfs in a private mount namespace where one can be made (the listing of the tmpfs after
    the export is printed from inside it), else RLIMIT_FSIZE (see the module docstring)."""
    recipe = (Path(__file__).parents[2] / "export" / "tiny.toml").read_text()
    recipe = (recipe.replace("num_hidden_layers = 2", "num_hidden_layers = 1")  # one graph of one layer: fast
              .replace('prefill_form = "CC"', 'prefill_form = "A_CC"')
              .replace("opset = 24", "opset = 24\nexternal_data_threshold = 0"))  # weights.data (1 MB), streamed
    (tmp_path / "small.toml").write_text(recipe)
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "user.txt").write_text("mine\n")
    if _tmpfs_works():
        script = ('mount -t tmpfs -o size=256k tmpfs "$1" && echo mine > "$1/user.txt" && cd "$1" && '
                  '"$2" -m mla_deploy export --recipe ../small.toml --out deep/art; rc=$?; '
                  'cat user.txt; ls -A "$1"; exit $rc')
        proc = subprocess.run(["unshare", "-r", "-m", "sh", "-c", script, "sh", str(disk), sys.executable],
                              capture_output=True, text=True, env=ENV, timeout=300)
        error_line(proc, 1, "cannot write deep/art", "No space left on device")
        assert proc.stdout.splitlines() == ["mine", "user.txt"]  # deep/ (made for the export) is gone too
    else:
        before = snapshot(disk)
        proc = cli("export", "--recipe", "../small.toml", "--out", "deep/art", cwd=disk,
                   preexec_fn=full_disk(64 * 1024))
        error_line(proc, 1, "cannot write deep/art", "File too large")
        assert snapshot(disk) == before  # deep/ (made for the export) is gone too


def test_full_disk_during_validate(ws, tmp_path):
    """validate --out on a full disk: one line naming the folder; no .run_results.json.tmp-PID, no empty folder."""
    proc = cli("validate", str(ws / "art"), "--steps", "1", "--out", str(tmp_path / "reports"), cwd=ws,
               preexec_fn=full_disk(4 * 1024))
    error_line(proc, 1, "cannot write the validation reports to", "File too large")
    assert not any(tmp_path.iterdir()) and not temporaries(ws)


def test_nan_weights_are_refused_naming_the_tensor(tmp_path):
    """A checkpoint holding a NaN: the export stops at that tensor, names it, and leaves nothing."""
    import dataclasses

    import torch
    from safetensors.torch import load_file, save_file

    from mla_deploy import load_recipe
    from mla_deploy.random_checkpoint import write_random_checkpoint

    config = load_recipe("tiny").model.first_layers(1)
    ckpt = tmp_path / "ckpt"
    write_random_checkpoint(dataclasses.replace(config, name="nan"), ckpt, dtype="fp32")
    shard = next(ckpt.glob("*.safetensors"))
    tensors = load_file(shard)
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    tensors[key][3, 5] = torch.nan
    save_file(tensors, shard, metadata={"format": "pt"})
    before = snapshot(tmp_path)
    proc = cli("export", "--hf", "ckpt", "--out", "art", cwd=tmp_path)
    error_line(proc, 1, f"weight {key} holds NaN (1 of")
    assert snapshot(tmp_path) == before
    inspected = cli("inspect", "--hf", "ckpt", cwd=tmp_path)  # a checkpoint is called one, not a preset
    assert inspected.returncode == 0 and inspected.stdout.startswith("checkpoint ckpt ")


def test_long_request_runs_with_allow_long_and_a_warning(tmp_path):
    """Past max_position_embeddings with --allow-long: a warning line, then the tokens; tokens/s are labelled."""
    proc = cli("run", str(tiny_artifact("concat")), "--prompt-ids", LONG, "--prompt-ids", "1,2", "--max-new-tokens",
               "30", "--allow-long", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "mla-deploy: warning: the longest prompt (1000 tokens) plus 30 new tokens is 1030 positions, past the "
        "model's max_position_embeddings 1024"]
    lines = proc.stdout.splitlines()
    assert len(lines[0].split(": ")[1].split(",")) == 30
    assert "tokens/s per sequence" in lines[2] and "tokens/s for the batch" in lines[2]


def test_seed_zero_is_a_seed_for_run_and_bench(ws):
    """--seed 0 (the usual default seed) samples repeatably in run, and run's and the benches' --help state one
    bound."""
    argv = ["run", "art", "--prompt-ids", "1,2", "--temperature", "1", "--seed", "0", "--max-new-tokens", "8"]
    first, again = cli(*argv, cwd=ws), cli(*argv, cwd=ws)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[0] == again.stdout.splitlines()[0]
    for command in (["run"], ["bench", "attention"], ["bench", "model"]):
        text = " ".join(cli(*command, "--help", cwd=ws).stdout.split())
        assert "--seed N" in text and "An integer >= 0." in text, text


def test_internal_error_is_one_line_with_the_traceback_in_a_file():
    """A bug (an exception that is no user error): one line naming it and the file holding the full traceback."""
    import click
    from click.testing import CliRunner

    from mla_deploy.cli import EXIT_BUG, MainGroup

    @click.group(cls=MainGroup)
    def group():
        pass

    @group.command()
    def boom():
        raise ZeroDivisionError("a bug")

    result = CliRunner().invoke(group, ["boom"])
    assert result.exit_code == EXIT_BUG
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: internal error"), result.stderr
    assert "ZeroDivisionError: a bug" in lines[0]
    path = Path(lines[0].split("full traceback in ")[1])
    try:
        assert 'raise ZeroDivisionError("a bug")' in path.read_text()
    finally:
        path.unlink()

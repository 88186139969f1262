"""A manifest that no longer describes its graphs is refused by `run` and `validate`, through the real command, in
one line naming the manifest, before anything runs or is written: a quantization record edited (scheme, block size,
format), deleted, added to a float artifact or malformed, and a static cache's capacity edited; and a graph
entry's experts form round-trips.

Without these checks `validate` blamed an edited record on the numbers (a 5.3 max abs error against a reference
quantized the wrong way, and a made-up cost) and `run` exited 0 computing with weights the manifest misnamed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from artifacts import tiny_artifact
from cli_run import cli


def _record(manifest: dict) -> dict:
    return manifest["quantization"]


#: (id, the artifact it starts from, the edit of its manifest.json, words the line must hold)
EDITS = [
    ("scheme_edited", "int8", lambda m: _record(m).update(weights="int4"),
     ["15 x int4 weights in blocks of 32 (matmulnbits)", "15 x int8 weights in blocks of 32 (matmulnbits)"]),
    ("block_size_edited", "int8", lambda m: _record(m).update(block_size=64),
     ["int8 weights in blocks of 64", "the graphs hold 15 x int8 weights in blocks of 32"]),
    ("format_edited", "int8", lambda m: _record(m).update(format="qdq"),
     ["in blocks of 32 (qdq)", "the graphs hold 15 x int8 weights in blocks of 32 (matmulnbits)"]),
    ("record_deleted", "int8", lambda m: m.pop("quantization"),
     ["no quantized weights", "the graphs hold 15 x int8"]),
    ("tensors_edited", "int8", lambda m: _record(m).update(tensors=14), ["14 x int8", "the graphs hold 15 x int8"]),
    ("record_added", "float", lambda m: m.update(quantization={"weights": "int8", "block_size": 32,
                                                               "format": "matmulnbits", "tensors": 15, "bytes": 1,
                                                               "keys": ["lm_head.weight"]}),
     ["15 x int8 weights in blocks of 32 (matmulnbits)", "the graphs hold no quantized weights"]),
    ("record_malformed", "int8", lambda m: _record(m).update(format="nbits2"), ["quantization: format must be"]),
    ("capacity_edited", "float", lambda m: m.update(max_cache_length=m["max_cache_length"] + 100),
     ["max_cache_length", "is not the", "exported with"]),
]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """Copies of a float and an int8 (matmulnbits) static-cache export of the tiny preset, each edited one way."""
    root = tmp_path_factory.mktemp("manifest-contract")
    shutil.copytree(tiny_artifact("static", weights="int8"), root / "int8")
    shutil.copytree(tiny_artifact("static"), root / "float")
    for name, source, edit, _ in EDITS:
        shutil.copytree(root / source, root / name)
        path = root / name / "manifest.json"
        manifest = json.loads(path.read_text())
        edit(manifest)
        path.write_text(json.dumps(manifest, indent=2))
    return root


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


COMMANDS = {"run": ["--prompt-ids", "1,2", "--max-new-tokens", "2"], "validate": []}


@pytest.fixture(scope="module")
def outcomes(ws):
    """Every edit met by `run` and `validate`; the workspace before and after."""
    jobs = [(name, command) for name, *_ in EDITS for command in COMMANDS]
    before = _snapshot(ws)
    procs = {job: cli(job[1], ws / job[0], *COMMANDS[job[1]]) for job in jobs}
    return procs, before, _snapshot(ws)


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("name, words", [pytest.param(e[0], e[3], id=e[0]) for e in EDITS])
def test_an_edited_manifest_is_refused_in_one_line(ws, outcomes, name, words, command):
    procs, before, after = outcomes
    proc = procs[(name, command)]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("mla-deploy: error: ") and str(ws / name / "manifest.json") in lines[0], lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert proc.stdout == "" and after == before  # nothing ran, nothing was written (no validation/ folder)


def test_the_unedited_artifacts_run(ws):
    """The control: the same artifacts as exported pass the check and generate."""
    for source in ("int8", "float"):
        proc = cli("run", ws / source, *COMMANDS["run"])
        assert proc.returncode == 0, proc.stderr


def test_the_experts_form_round_trips_and_old_entries_read_as_branches():
    """Each graph entry records its experts' form; an entry written before the choice existed holds branches; an
    unknown form is refused in one line, like any malformed entry."""
    from mla_deploy.artifact.manifest import GraphEntry
    from mla_deploy.errors import ArtifactError

    for form in ("fused", "branches"):
        entry = GraphEntry(role="decode", file="model.onnx", form="A_CC", inputs=(), outputs=(), experts=form)
        assert entry.to_dict()["experts"] == form and GraphEntry.from_dict("decode", entry.to_dict()) == entry
    old = {k: v for k, v in entry.to_dict().items() if k != "experts"}
    assert GraphEntry.from_dict("decode", old).experts == "branches"
    with pytest.raises(ArtifactError, match=r"^manifest.json: the decode graph's experts must be fused or branches, "
                                            r"got 'fusd'$"):
        GraphEntry.from_dict("decode", {**old, "experts": "fusd"})

"""check_artifact: a missing or truncated graph, a modified graph, a manifest that does not describe the graphs or
its own model are one-line ArtifactErrors (also through `mla-deploy validate`)."""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from mla_deploy.artifact import check_artifact
from mla_deploy.cli import main
from mla_deploy.errors import ArtifactError
from validate_helpers import rerecord, scale_initializer


def _edit_manifest(artifact, edit):
    path = artifact / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=2))


def _truncate(artifact, role="prefill"):
    path = artifact / f"{role}.onnx"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_intact_artifact(tiny_static):
    manifest = check_artifact(tiny_static)
    assert set(manifest.graphs) == {"prefill", "decode"}


DAMAGE = {
    "missing_graph": (lambda a: (a / "decode.onnx").unlink(), r"decode graph .* is missing"),
    "truncated_graph": (_truncate, r"prefill graph .* has \d+ bytes, the manifest says \d+"),
    "truncated_rerecorded": (lambda a: (_truncate(a), rerecord(a, "prefill")), r"not a readable ONNX file"),
    "modified_graph": (lambda a: scale_initializer(a, "decode", "model.model.layers.0.self_attn.w_uk", 2.0),
                       r"does not match the sha256"),
    "renamed_tensor_in_manifest": (
        lambda a: _edit_manifest(a, lambda m: m["graphs"]["decode"]["inputs"][4].update(name="past_latent.7")),
        r"decode inputs do not match the I/O contract .*'past_latent.7' where 'past_latent.0' is expected"),
    "layer_count_in_manifest": (
        lambda a: _edit_manifest(a, lambda m: m["model"].update(num_hidden_layers=3)),
        r"cache lists 2 layers, the model has 3"),
    "missing_manifest": (lambda a: (a / "manifest.json").unlink(), r"holds no manifest.json"),
    "unknown_format_version": (lambda a: _edit_manifest(a, lambda m: m.update(format_version=99)),
                               r"format_version 99 is not supported"),
    "malformed_tokenizer_record": (lambda a: _edit_manifest(a, lambda m: m.update(tokenizer={"files": ["x"]})),
                                   r"\[tokenizer\] must list tokenizer.json"),
    "missing_tokenizer_file": (
        lambda a: _edit_manifest(a, lambda m: m.update(tokenizer={"files": [
            {"file": "tokenizer.json", "bytes": 3, "sha256": "0" * 64}]})),
        r"the tokenizer file .*tokenizer.json is missing"),
}


def test_a_manifest_without_a_tokenizer_record_loads_and_saves_without_one(tiny_static):
    """The tokenizer record is optional in format version 1: a preset export has none and writes none."""
    manifest = check_artifact(tiny_static)
    assert manifest.tokenizer is None and "tokenizer" not in manifest.to_dict()
    assert "tokenizer" not in json.loads((tiny_static / "manifest.json").read_text())


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_an_artifact_error(artifact_copy, damage):
    apply, pattern = DAMAGE[damage]
    apply(artifact_copy)
    with pytest.raises(ArtifactError, match=pattern):
        check_artifact(artifact_copy)


def test_graph_io_differs_from_manifest(artifact_copy):
    """A graph whose own input names differ from the manifest's (hash re-recorded) is refused."""
    path = artifact_copy / "decode.onnx"
    model = onnx.load(str(path))
    old = model.graph.input[0].name
    for node in model.graph.node:
        node.input[:] = ["ids" if x == old else x for x in node.input]
    model.graph.input[0].name = "ids"
    onnx.save(model, str(path))
    rerecord(artifact_copy, "decode")
    with pytest.raises(ArtifactError, match=r"decode.onnx graph inputs do not match manifest.json: 'ids' where "
                                            r"'input_ids' is expected"):
        check_artifact(artifact_copy)


@pytest.mark.parametrize("damage", ["truncated_graph", "layer_count_in_manifest", "missing_graph"])
def test_cli_one_line(artifact_copy, tmp_path, damage):
    """`mla-deploy validate` on a damaged artifact: exit 1, one `mla-deploy: error:` line, no traceback."""
    DAMAGE[damage][0](artifact_copy)
    result = CliRunner().invoke(main, ["validate", str(artifact_copy), "--out", str(tmp_path / "r")])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-deploy: error:")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("form", ["fused", "branches"])
def test_a_recorded_experts_form_its_graph_does_not_hold_is_refused(tmp_path, form):
    """A MoE artifact whose manifest says the other form of experts than its graph holds (edited): one line naming
    the graph and what it holds, through check_artifact and `mla-deploy validate`."""
    from hf_oracle import hf_model

    hf_model(2).save_pretrained(tmp_path / "ckpt")
    art = tmp_path / "art"
    result = CliRunner().invoke(main, ["export", "--hf", str(tmp_path / "ckpt"), "--out", str(art), "--experts", form])
    assert result.exit_code == 0, result.output
    check_artifact(art)
    other = {"fused": "branches", "branches": "fused"}[form]
    _edit_manifest(art, lambda m: m["graphs"]["decode"].update(experts=other))
    holds = "it holds MoE/QMoE operators where the manifest records branches" if form == "fused" else \
        "the manifest records fused experts and it holds no MoE/QMoE operator"
    with pytest.raises(ArtifactError, match=f"does not describe its decode graph .*: {holds}"):
        check_artifact(art)
    result = CliRunner().invoke(main, ["validate", str(art), "--out", str(tmp_path / "r")])
    assert result.exit_code == 1 and result.stderr.strip().count("\n") == 0 and holds in result.stderr

"""validate_artifact and `mla-deploy validate` on the tiny fp32 export: both cache modes pass with every figure in
the reports; a perturbed decode weight fails naming the worst output and step; saved run results compare again
without running anything. The fp16 export passes its recipe's measured tolerance, which still catches a 5% weight
error."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from mla_deploy.cli import main
from mla_deploy.errors import AccuracyError
from mla_deploy.recipe import Tolerance
from mla_deploy.validate import ValidateOptions, validate_artifact
from validate_helpers import rerecord, scale_initializer

OUTPUTS = ["logits", "present_latent.0", "present_latent.1"]
STEPS = 16  # the tiny recipe's [validate] decode_steps


@pytest.fixture(scope="module")
def static_run(tiny_static, tmp_path_factory):
    out = tmp_path_factory.mktemp("static-report")
    return validate_artifact(tiny_static, out_dir=out, threads=1)


def test_static_passes_with_every_figure(static_run):
    """The static-cache export is within the fp32 tolerance at every step; report.json holds every figure."""
    result = static_run
    assert result.passed, result.summary()
    report = json.loads(result.files["report.json"].read_text())
    assert report["passed"] is True
    assert report["artifact"]["precision"] == "fp32" and report["artifact"]["cache_mode"] == "static"
    assert report["comparison"]["tolerances"]["logits"] == {"atol": 1e-4, "rtol": 1e-4}
    assert report["environment"]["providers"]["onnxrt"] == "CPUExecutionProvider"
    assert "polygraphy" in report["environment"]["versions"]
    assert report["trajectory"]["prompt_lengths"] == [7, 6]  # a padded batch
    onnxrt = report["runners"]["onnxrt"]
    assert sorted(onnxrt["outputs"]) == OUTPUTS
    for name in OUTPUTS:
        steps = onnxrt["outputs"][name]["steps"]
        assert [s["step"] for s in steps] == list(range(STEPS + 1))
        assert steps[0]["role"] == "prefill" and steps[1]["role"] == "decode"
        for s in steps:
            assert s["passed"] and s["max_abs"] < 1e-4 and s["cosine"] > 0.999999
            assert set(s) >= {"max_abs", "mean_abs", "max_rel", "mean_rel", "cosine", "count", "polygraphy"}
            # over real entries only, never above Polygraphy's whole-tensor maximum
            assert s["max_abs"] <= s["polygraphy"]["max_absdiff"] + 1e-12
    # the cache grows by one row per sequence per step: 7 + 6 rows after the prefill, 24 per layer row
    assert onnxrt["outputs"]["present_latent.0"]["steps"][0]["count"] == (7 + 6) * 24
    assert onnxrt["outputs"]["present_latent.0"]["steps"][STEPS]["count"] == (7 + 6 + 2 * STEPS) * 24
    assert onnxrt["top1_rate"] == 1.0 and len(onnxrt["top1"]) == STEPS + 1
    assert report["worst"]["passed"] is True


def test_report_files(static_run):
    """report.html is self-contained with matplotlib PNGs; report.md is a short summary; no temp files remain."""
    files = static_run.files
    for name in ("report.json", "report.html", "report.md", "run_results.json", "inputs.json"):
        assert files[name].is_file() and files[name].stat().st_size > 0
    page = files["report.html"].read_text()
    assert page.count("data:image/png;base64,") == 2
    assert "<svg" not in page and "http://" not in page and "https://" not in page
    assert "PASS" in page and "Top-1 token agreement" in page and "present_latent.1" in page
    md = files["report.md"].read_text()
    assert "**PASS**" in md and "| onnxrt | `logits` |" in md and len(md.splitlines()) < 30
    assert "an element fails only if its absolute error exceeds atol **and**" in md  # the rule beside the figures
    assert not [p for p in files["report.json"].parent.iterdir() if p.name.startswith(".")]


def test_concat_passes_via_cli(tiny_concat, tmp_path):
    """`mla-deploy validate` on the concat-cache export exits 0 with a one-line verdict."""
    result = CliRunner().invoke(main, ["validate", str(tiny_concat), "--steps", "6", "--out", str(tmp_path),
                                       "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("validation passed")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["artifact"]["cache_mode"] == "concat" and report["summary"]["steps"] == 7
    assert all(o["passed"] for o in report["runners"]["onnxrt"]["outputs"].values())


def test_perturbed_decode_weight_fails(artifact_copy, tmp_path):
    """Scaling layer 0's w_uk in decode.onnx (manifest re-recorded): exit 1 naming the worst output and step."""
    scale_initializer(artifact_copy, "decode", "model.model.layers.0.self_attn.w_uk", 1.5)
    rerecord(artifact_copy, "decode")
    result = CliRunner().invoke(main, ["validate", str(artifact_copy), "--steps", "4", "--out", str(tmp_path),
                                       "--threads", "1"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: validation failed: worst output ")
    report = json.loads((tmp_path / "report.json").read_text())
    worst = report["worst"]
    assert f"worst output {worst['output']} at step {worst['step']} (decode)" in lines[0]
    assert f"{worst['max_abs']:.3e}" in lines[0]
    assert worst["output"] in ("logits", "present_latent.1") and worst["step"] >= 1 and not worst["passed"]
    outputs = report["runners"]["onnxrt"]["outputs"]
    assert outputs["logits"]["steps"][0]["passed"]  # the prefill graph is untouched
    assert outputs["present_latent.0"]["passed"]  # layer 0's cache comes before its attention
    assert outputs["logits"]["failed_steps"] == [1, 2, 3, 4]
    assert not outputs["present_latent.1"]["passed"]
    assert "FAIL" in (tmp_path / "report.md").read_text()


def test_fp16_export_passes_its_measured_tolerance(tiny_static_fp16, tmp_path):
    """`mla-deploy validate` on the tiny fp16 export exits 0 against the fp32 original at the tolerance measured in
    export/tiny.toml; the error is fp16's (far above fp32's 1e-4) and every greedy token agrees."""
    result = CliRunner().invoke(main, ["validate", str(tiny_static_fp16), "--out", str(tmp_path), "--threads", "1"])
    assert result.exit_code == 0, result.output
    compared = len(OUTPUTS) * (STEPS + 1)
    assert result.stdout.startswith(f"validation passed: {compared} output-steps within atol 2.0e-01, rtol 2.0e-01")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["artifact"]["precision"] == "fp16"
    assert report["comparison"]["tolerances"]["logits"] == {"atol": 0.2, "rtol": 0.2}
    assert 1e-3 < report["worst"]["max_abs"] < 0.2
    assert report["runners"]["onnxrt"]["top1_rate"] == 1.0


def test_fp16_tolerance_still_catches_a_small_weight_error(tiny_static_fp16, tmp_path):
    """A 5% change of layer 0's w_uk in the fp16 decode graph fails the fp16 tolerance from the first decode step."""
    copy = tmp_path / "artifact"
    shutil.copytree(tiny_static_fp16, copy, ignore=shutil.ignore_patterns("validation"))
    scale_initializer(copy, "decode", "model.model.layers.0.self_attn.w_uk", 1.05)
    rerecord(copy, "decode")
    result = validate_artifact(copy, steps=4, threads=1, options=ValidateOptions(write_reports=False))
    assert not result.passed and result.worst["output"] == "logits" and result.worst["max_abs"] > 0.4
    outputs = result.report["runners"]["onnxrt"]["outputs"]
    assert outputs["logits"]["steps"][0]["passed"] and not outputs["logits"]["passed"]  # prefill untouched


def test_saved_results_compare_again_without_running(static_run, tmp_path, monkeypatch):
    """--load-results: nothing runs, the figures are the same; a tighter tolerance re-decides the verdict."""
    from mla_deploy.validate import compat, core

    def no_run(*args, **kwargs):
        raise AssertionError("a runner was started")

    monkeypatch.setattr(core, "_run", no_run)
    monkeypatch.setattr(compat, "run_comparator", no_run)
    saved = static_run.files["run_results.json"]
    artifact = static_run.report["artifact"]["path"]
    again = validate_artifact(artifact, out_dir=tmp_path / "again", load_results=saved)
    assert again.passed
    first, second = static_run.report["runners"]["onnxrt"], again.report["runners"]["onnxrt"]
    assert first["outputs"] == second["outputs"] and first["top1"] == second["top1"]
    assert again.report["environment"]["providers"]["onnxrt"] == "CPUExecutionProvider"  # from the saved report
    assert not (tmp_path / "again" / "run_results.json").exists()

    strict = validate_artifact(artifact, out_dir=tmp_path / "strict", load_results=saved,
                               options=ValidateOptions(tolerance=Tolerance(1e-9, 1e-9)))
    assert not strict.passed
    with pytest.raises(AccuracyError, match=r"validation failed: worst output \S+ at step \d+"):
        strict.raise_for_failure()

    result = CliRunner().invoke(main, ["validate", artifact, "--load-results", str(saved),
                                       "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output


def test_load_results_errors_are_one_line(tiny_static, tmp_path):
    """A missing or non-RunResults file given to --load-results is a one-line error."""
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for path in (tmp_path / "missing.json", bad):
        result = CliRunner().invoke(main, ["validate", str(tiny_static), "--load-results", str(path),
                                           "--out", str(tmp_path / "o")])
        assert result.exit_code == 1
        assert len(result.stderr.strip().splitlines()) == 1 and "mla-deploy: error:" in result.stderr


def test_steps_beyond_static_capacity(tiny_static, tmp_path):
    """More decode steps than the static cache holds: a one-line error before anything runs."""
    result = CliRunner().invoke(main, ["validate", str(tiny_static), "--steps", "100", "--out", str(tmp_path)])
    assert result.exit_code == 1 and "capacity 64" in result.stderr


def _as_hf_export(artifact, folder):
    """Turn a preset export into one whose reference is a Hugging Face checkpoint folder (config.json +
    model.safetensors holding the same original-form weights, rebuilt from the export's seed)."""
    from safetensors.torch import save_file

    from artifacts import reference_model

    manifest = json.loads((artifact / "manifest.json").read_text())
    config = {k: v for k, v in manifest["model"].items() if k != "name"}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in reference_model(artifact).state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    manifest["weights"] = {"kind": "hf", "path": str(folder)}
    (artifact / "manifest.json").write_text(json.dumps(manifest, indent=2))


def test_hf_weights_reference(artifact_copy, tmp_path):
    """A checkpoint export's reference is loaded from manifest["weights"]["path"]; a missing one is one line."""
    pytest.importorskip("mla_deploy.checkpoint")
    _as_hf_export(artifact_copy, tmp_path / "hf")
    result = validate_artifact(artifact_copy, out_dir=tmp_path / "r", steps=2, threads=1)
    assert result.passed, result.summary()
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (tmp_path / "hf" / "config.json").unlink()
    (tmp_path / "hf").rmdir()
    cli = CliRunner().invoke(main, ["validate", str(artifact_copy), "--out", str(tmp_path / "r2")])
    assert cli.exit_code == 1 and "named by manifest.json is not there" in cli.stderr


def test_html_without_matplotlib(static_run, monkeypatch):
    """matplotlib is an optional extra: without it the page keeps every table and says why there are no plots."""
    import sys

    from mla_deploy.validate.report_html import render_html

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    page = render_html(static_run.report)
    assert "data:image/png" not in page and "matplotlib is not installed" in page and "present_latent.1" in page


def test_nan_outputs_are_reported_as_nan(static_run, tmp_path):
    """A NaN in the engine's logits fails the step whatever the statistic, shows NaN figures (never a clean number)
    and counts the position as a top-1 disagreement; the summary and report.md say NaN."""
    from mla_deploy.validate import compat

    results = compat.load_run_results(static_run.files["run_results.json"])
    compat.iteration_outputs(results, "onnxrt")[2]["logits"][0, 0, 0] = float("nan")
    compat.save_run_results(results, tmp_path / "run_results.json")
    artifact = static_run.report["artifact"]["path"]
    result = validate_artifact(artifact, out_dir=tmp_path / "nan", load_results=tmp_path / "run_results.json")
    assert not result.passed
    logits = result.report["runners"]["onnxrt"]["outputs"]["logits"]
    assert logits["failed_steps"] == [2] and logits["nonfinite"] == 1 and logits["max_abs"] != logits["max_abs"]
    top1 = result.report["runners"]["onnxrt"]["top1"][2]
    assert top1["agree"] == top1["positions"] - 1
    assert "logits holds 1 NaN/Inf values at step 2" in result.summary()
    assert "1 NaN/Inf values" in (tmp_path / "nan" / "report.md").read_text()


def test_a_reference_beyond_the_memory_is_refused_before_any_weight_is_read(tiny_static, tmp_path):
    """The full-size DeepSeek-V2-Lite's fp32 reference (59 GiB) on this machine: one line naming what it needs and
    what is available, instead of the kernel killing the process; the tiny model's passes the same check."""
    import dataclasses

    from mla_deploy import load_recipe
    from mla_deploy.artifact import load_manifest
    from mla_deploy.host import available_memory
    from mla_deploy.weight_bytes import weight_groups
    from mla_deploy.errors import InputError
    from mla_deploy.validate.reference import load_reference_model, require_memory

    big = load_recipe("deepseek-v2-lite").model
    assert weight_groups(big, 4).total_bytes > 58 * 2**30 > available_memory()  # 15.7 B parameters in fp32
    manifest = load_manifest(tiny_static)
    require_memory(manifest.config)
    with pytest.raises(InputError, match=r"needs its fp32 PyTorch reference, about 5\d\.\d GiB, and .* available"):
        load_reference_model(tiny_static, dataclasses.replace(manifest, model=big))

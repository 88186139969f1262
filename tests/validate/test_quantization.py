"""Validation of artifacts with quantized weights (mla_deploy/validate/quantization.py): (a) the graphs against a
PyTorch model carrying the same dequantized weights, at the fp32 tolerance; (b) the quantization's cost, the artifact
as deployed (int8 activations) against the unquantized original, against the recipe's thresholds.

The checkpoints are tiny transformers DeepSeek-V2/V3 MoE models trained briefly on a learnable task (a random
model's top-1 margins are too small for top-1 agreement to mean anything), written by transformers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from cli_run import cli, ok
from quantized_helpers import blocks_along_n, double_one_scale, edit_graph, scales_along_n

from mla_deploy.errors import AccuracyError, CacheCapacityError, ConfigError
from mla_deploy.recipe import DEFAULT_QUANTIZATION_THRESHOLDS, QuantizationThreshold, ValidateSettings
from mla_deploy.validate import ValidateOptions, validate_artifact
from mla_deploy.validate.quantization import DEPLOYED, EXACT, ORIGINAL, judge, quantization_figures, trajectory_steps


# --- pure parts ------------------------------------------------------------------------------------------------
def test_trajectory_steps_reach_the_minimum_and_clamp_to_a_static_cache():
    assert trajectory_steps(8, 64, 7, None) == (64, False)
    assert trajectory_steps(100, 64, 7, None) == (100, False)
    assert trajectory_steps(8, 64, 7, 71) == (64, False)
    assert trajectory_steps(8, 64, 7, 40) == (33, True)  # what the cache holds after the longest prompt
    assert trajectory_steps(50, 64, 7, 40) == (50, True)  # never below the asked steps (the trajectory refuses them)
    with pytest.raises(CacheCapacityError):
        trajectory_steps(0, 64, 41, 40)


def test_quantization_figures_over_real_tokens_only():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(2, 3, 5)).astype(np.float32)
    out = ref.copy()
    out[0, 0] = -ref[0, 0]  # a flipped row: cosine -1, its argmax changes
    out[1, 2] = 1e6  # padding: must not count
    mask = np.array([[True, True, True], [True, True, False]])
    fig = quantization_figures([{"logits": out}], [{"logits": ref}], [mask])
    assert fig["positions"] == 5 and fig["top1_agree"] == 4 and fig["top1"] == pytest.approx(0.8)
    assert fig["min_cosine"] == pytest.approx(-1.0) and fig["mean_cosine"] == pytest.approx(0.6)
    assert fig["max_abs"] == pytest.approx(2 * np.abs(ref[0, 0]).max())
    assert fig["max_abs_reference"] == pytest.approx(np.abs(ref[mask]).max())
    out[0, 1, 0] = np.nan
    fig = quantization_figures([{"logits": out}], [{"logits": ref}], [mask])
    assert fig["nonfinite"] == 1 and fig["top1_agree"] == 3 and np.isnan(fig["max_abs"])
    assert judge(fig, QuantizationThreshold(0.0, -1.0)) == ["1 positions hold NaN/Inf logits"]


def test_judge_names_each_bound_missed():
    fig = {"nonfinite": 0, "top1": 0.98, "mean_cosine": 0.9995}
    assert judge(fig, QuantizationThreshold(0.98, 0.9995)) == []
    assert judge(fig, QuantizationThreshold(0.99, 0.9999)) == ["top-1 agreement 98.0% < 99.0%",
                                                               "mean logits cosine 0.99950 < 0.9999"]


def test_recipe_thresholds_merge_over_the_defaults_and_refuse_bad_tables():
    settings = ValidateSettings(quantization={"int4": {"min_top1": 0.5}})
    assert settings.quantization["int8"] == DEFAULT_QUANTIZATION_THRESHOLDS["int8"]
    assert settings.quantization["int4"] == QuantizationThreshold(
        0.5, DEFAULT_QUANTIZATION_THRESHOLDS["int4"].min_mean_cosine)
    for bad, words in (({"fp8": {}}, "unknown weight scheme 'fp8'"), ({"int8": {"top1": 1}}, "takes min_mean_cosine"),
                       ({"int8": {"min_top1": 2}}, "in [0, 1]"), ({"int8": {"min_top1": "x"}}, "must be numbers")):
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            ValidateSettings(quantization=bad)
    with pytest.raises(ConfigError, match="quantization_steps"):
        ValidateSettings(quantization_steps=-1)


# --- whole artifacts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_checkpoint_validates_graph_and_cost_separately(quantized_validations, version, weights):
    """(a) passes at the fp32 tolerance; (b) meets the scheme's thresholds over 64 decode steps (V3's static cache
    of 64 rows: 57, reported as clamped), and its cost is real (far above the fp32 tolerance: the unquantized
    original is another model); the reports carry both."""
    _, result = quantized_validations(version, weights)
    report = result.report
    assert result.passed and result.graph_passed, result.lines()
    assert report["comparison"]["runners"] == [EXACT] and report["comparison"]["reference"] == "torch"
    assert report["worst"]["max_abs"] < 1e-4
    q = result.quantization
    threshold = DEFAULT_QUANTIZATION_THRESHOLDS[weights]
    assert (q["weights"], q["block_size"], q["runner"], q["reference"]) == (weights, 32, DEPLOYED, ORIGINAL)
    assert q["passed"] and q["failures"] == []
    steps, clamped = (57, " (clamped to the static cache)") if version == 3 else (64, "")
    assert (q["decode_steps"], q["clamped"], q["positions"]) == (steps, bool(clamped), 7 + 6 + 2 * steps)
    assert q["top1"] >= threshold.min_top1 and q["mean_cosine"] >= threshold.min_mean_cosine
    assert q["max_abs"] > 100 * 1e-4 and q["min_cosine"] <= q["mean_cosine"] < 1
    assert report["trajectory"]["decode_steps"] == steps
    lines = result.lines()
    assert len(lines) == 2 and lines[0].startswith("validation passed:") and "(onnxrt-fp32 vs torch)" in lines[0]
    assert lines[1].startswith(f"quantization ({weights} weights, blocks of 32) within its thresholds: onnxrt-int8 "
                               f"vs torch-unquantized over {q['positions']} positions (prefill + {steps} decode "
                               f"steps{clamped})")
    saved = json.loads((result.out_dir / "report.json").read_text())
    assert saved["quantization"]["top1"] == q["top1"] and saved["passed"] is True
    assert "#### Quantization: **PASS**" in (result.out_dir / "report.md").read_text()
    assert "<h2>Quantization &mdash; <span class='ok'>pass</span></h2>" in (result.out_dir / "report.html").read_text()
    from mla_deploy.validate import compat

    saved_runs = compat.load_run_results(result.out_dir / "run_results.json")
    assert compat.runner_names(saved_runs) == ["torch", EXACT, DEPLOYED, ORIGINAL]
    feeds = compat.load_feed_dicts(result.out_dir / "inputs.json")
    logits = np.concatenate([np.asarray(step["logits"])[np.asarray(feed["valid"]) != 0]
                             for step, feed in zip(compat.iteration_outputs(saved_runs, ORIGINAL), feeds)])
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 2  # trained: real margins, so top-1 agreement means something


def _copy(artifact, tmp_path):
    dst = tmp_path / "artifact"
    shutil.copytree(artifact, dst, ignore=shutil.ignore_patterns("validation"))
    return dst


def _short(artifact) -> None:
    """The artifact's recipe asks for no more than its 8 decode steps: (a)'s planted mistakes show at once."""
    path = artifact / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["recipe"].setdefault("validate", {})["quantization_steps"] = 0
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("quant_format", ["matmulnbits", "qdq"])
def test_a_wrong_block_scale_fails_the_graph_comparison(quantized_artifacts, quant_format, tmp_path):
    artifact = _copy(quantized_artifacts(2, "int8", quant_format), tmp_path)
    _short(artifact)
    edit_graph(artifact, double_one_scale("model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight.T"))
    result = validate_artifact(artifact, options=ValidateOptions(write_reports=False))
    assert not result.passed and not result.graph_passed
    assert result.quantization["passed"]  # the cost against the unquantized original cannot see it: (a) does
    worst = result.worst
    assert (worst["output"], worst["runner"]) == ("present_latent.0", EXACT) and worst["max_abs"] > 1e-2
    assert result.report["runners"][EXACT]["outputs"]["present_latent.0"]["failed_steps"][0] == 0  # from the prefill
    with pytest.raises(AccuracyError, match=r"^validation failed: worst output present_latent.0 at step \d+ \(\w+\)"
                                            r": max abs error .* exceeds atol 1.0e-04, rtol 1.0e-04 \(onnxrt-fp32 vs "
                                            r"torch;"):
        result.raise_for_failure()


@pytest.mark.parametrize("quant_format", ["matmulnbits", "qdq"])
def test_scales_along_the_wrong_axis_fail_the_graph_comparison(quantized_artifacts, quant_format, tmp_path):
    artifact = _copy(quantized_artifacts(2, "int8", quant_format), tmp_path)
    _short(artifact)
    edit_graph(artifact, blocks_along_n if quant_format == "qdq" else scales_along_n)
    result = validate_artifact(artifact, options=ValidateOptions(write_reports=False))
    assert not result.graph_passed
    # re-quantizing along N is a small change that (b) cannot see; scrambled MatMulNBits scales are a large one
    assert result.quantization["passed"] == (quant_format == "qdq")
    assert result.report["summary"]["failed"] > 0 and result.worst["runner"] == EXACT
    assert result.failures()[0] == result.summary() and result.summary().startswith("validation failed: worst output")


def test_thresholds_from_the_recipe_fail_the_quantization_alone(quantized_validations, tmp_path):
    """The recorded run compared again (``--load-results``) under thresholds no quantization meets: (a) still
    passes, (b) fails naming the bounds, and the verdict fails."""
    original, first = quantized_validations(3, "int4")
    saved = first.out_dir
    artifact = _copy(original, tmp_path)
    path = artifact / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["recipe"].setdefault("validate", {})["quantization"] = {"int4": {"min_top1": 1.0, "min_mean_cosine": 1.0}}
    path.write_text(json.dumps(manifest))
    result = validate_artifact(artifact, tmp_path / "again", load_results=saved / "run_results.json")
    assert result.graph_passed and not result.passed and not result.quantization["passed"]
    [failure] = result.failures()
    assert failure.startswith("quantization (int4 weights, blocks of 32) exceeds its thresholds: ")
    assert "mean logits cosine" in failure and "< 1.0" in failure
    assert "#### Quantization: **FAIL**" in (tmp_path / "again" / "report.md").read_text()
    with pytest.raises(AccuracyError, match="^quantization .* exceeds its thresholds"):
        result.raise_for_failure()


def test_cli_prints_one_line_for_the_graph_and_one_for_the_quantization(quantized_artifacts, tmp_path):
    """``mla-deploy validate ARTIFACT`` on an int8 checkpoint export: two lines, exit 0, the reports written."""
    artifact = quantized_artifacts(2, "int8")
    graph, cost = ok(cli("validate", artifact, "--out", tmp_path / "report")).splitlines()
    assert graph.startswith("validation passed: ") and "(onnxrt-fp32 vs torch)" in graph
    assert cost.startswith("quantization (int8 weights, blocks of 32) within its thresholds: onnxrt-int8 vs "
                           "torch-unquantized over 141 positions (prefill + 64 decode steps): top-1 agreement 100.0% "
                           "(min 99.0%), logits cosine mean 0.999")
    assert json.loads((tmp_path / "report" / "report.json").read_text())["quantization"]["passed"] is True


"""The mla-deploy command line: inspect prints the cache table, user errors are one line, --help stays light."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mla_deploy.cli import main

V3_TOKENS = ("576", "40960", "32768", "71.11", "56.89", "1.00")  # latent, CD, MHA; CD and MHA x latent
BIN = Path(sys.executable).with_name("mla-deploy")


def _cli(*args: str) -> subprocess.CompletedProcess:
    if not BIN.exists():
        pytest.skip(f"no console script at {BIN}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=60, env=env)


def test_inspect_v3_in_process():
    """`inspect --preset deepseek-v3` (CliRunner) prints latent 576, CD 40960, MHA 32768 and their ratios."""
    result = CliRunner().invoke(main, ["inspect", "--preset", "deepseek-v3"])
    assert result.exit_code == 0, result.output
    for token in V3_TOKENS:
        assert token in result.stdout


def test_inspect_v3_console_script():
    """The installed `mla-deploy` script prints the same table."""
    proc = _cli("inspect", "--preset", "deepseek-v3")
    assert proc.returncode == 0, proc.stderr
    for token in V3_TOKENS:
        assert token in proc.stdout


@pytest.mark.parametrize("args", [
    pytest.param(["inspect", "--preset", "no-such-model"], id="unknown_preset"),
    pytest.param(["inspect"], id="no_source"),
    pytest.param(["inspect", "--preset", "tiny", "--recipe", "x.toml"], id="two_sources"),
])
def test_user_error_is_one_line_in_process(args):
    """A user error exits 1 with one `mla-deploy: error: ...` line on stderr and nothing on stdout."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: ")


def test_unknown_preset_console_script():
    """Through the real script: exit 1, a single error line naming the preset, no traceback."""
    proc = _cli("inspect", "--preset", "no-such-model")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mla-deploy: error: unknown preset 'no-such-model'")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_bad_hf_config_is_one_line(tmp_path):
    """An unsupported config.json (--hf) is also a one-line error."""
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "hidden_act": "gelu"}')
    result = CliRunner().invoke(main, ["inspect", "--hf", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stderr.startswith("mla-deploy: error: ") and result.stderr.count("\n") == 1


def test_presets_lists_every_preset():
    """`presets` lists each built-in preset with its latent width."""
    result = CliRunner().invoke(main, ["presets"])
    assert result.exit_code == 0
    assert "deepseek-v3" in result.stdout and "latent=576" in result.stdout


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["inspect", "--preset", "deepseek-v3"],
                                  ["export", "--help"], ["run", "--help"], ["validate", "--help"], ["bench", "--help"]])
def test_help_and_inspect_do_not_import_torch(argv):
    """`mla-deploy --help` (and inspect, which needs only the config) never imports torch."""
    code = (
        "import sys\n"
        "from mla_deploy.cli import main\n"
        f"sys.argv = ['mla-deploy', *{argv!r}]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
        "heavy = [m for m in ('torch', 'onnx', 'onnxruntime', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout or "576" in proc.stdout


def test_an_option_group_passes_one_typed_object_and_checks_it():
    """A command decorated with option groups gets one parsed object per group (not their loose values), its
    --help lists the groups' options in order, and a group's check is the CLI's one-line error."""
    import click

    from mla_deploy.cli import MainGroup
    from mla_deploy.cli.groups import ModelSource, Progress, ProgressArgs, Runtime, RuntimeArgs, SourceArgs

    got = {}

    @click.group(cls=MainGroup)
    def group():
        pass

    @group.command()
    @SourceArgs()
    @RuntimeArgs()
    @ProgressArgs()
    def probe(source, runtime, progress):
        got.update(source=source, runtime=runtime, progress=progress)

    result = CliRunner().invoke(group, ["probe", "--preset", "tiny", "--threads", "1", "--progress"])
    assert result.exit_code == 0, result.output
    assert got == {"source": ModelSource("preset", "tiny"), "runtime": Runtime("cpu", 1), "progress": Progress(True)}
    assert got["source"].config().num_hidden_layers == 2
    help_text = CliRunner().invoke(group, ["probe", "--help"]).stdout
    flags = ["--preset", "--recipe", "--hf", "--provider", "--threads", "--quiet", "--progress"]
    assert [help_text.index(f"{flag} ") for flag in flags] == sorted(help_text.index(f"{flag} ") for flag in flags)
    result = CliRunner().invoke(group, ["probe", "--preset", "tiny", "--hf", "x"])
    assert result.exit_code == 1 and result.stderr == "mla-deploy: error: give exactly one of --preset, --recipe, --hf\n"


def test_the_choices_are_the_owners():
    """--cache-mode, --precision, --weights, --block-size, --quant-format and --experts offer what their owners
    define (the cache modes, which the CLI cannot import at startup, are a copy held equal here)."""
    from mla_deploy import quant
    from mla_deploy.cache_layout import CACHE_MODES
    from mla_deploy.cli import groups
    from mla_deploy.expert_forms import EXPERT_FORMS
    from mla_deploy.io_spec import PRECISIONS

    assert groups.CACHE_MODES == CACHE_MODES
    options = {o.name: o.attrs["type"].choices for o in groups.ExportSettingsArgs().options()
               if isinstance(o.attrs.get("type"), click.Choice)}
    assert options == {"precision": tuple(PRECISIONS), "cache_mode": CACHE_MODES, "weights": ("float", *quant.SCHEMES),
                       "block_size": tuple(map(str, quant.BLOCK_SIZES)), "quant_format": tuple(quant.FORMATS),
                       "experts": EXPERT_FORMS}

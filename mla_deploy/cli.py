"""The ``mla-deploy`` command line. Thin: options -> recipe -> a library call.

Heavy modules (torch, onnx, onnxruntime, tensorrt) are imported inside the commands, so
``mla-deploy --help`` is instant. The error contract (:class:`_Main`, stated in the README's Errors section):
every failure prints exactly one line on stderr, ``mla-deploy: error: ...``:

* a user error (:class:`~mla_deploy.errors.MLADeployError`) or a file that cannot be written or read (``OSError``:
  no space, no permission, not a folder): exit 1;
* a malformed command line (click's usage errors: unknown option, bad choice, missing argument): exit 2;
* SIGINT, SIGTERM, SIGHUP: the command stops, its temporaries are removed, exit 128 + the signal number;
* anything else is a bug: the line names it and the file where the full traceback was written, exit 70.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from . import __version__
from .bench.options import Int, IntList, PathList, Positive
from .errors import MLADeployError


#: exit status of an internal error (a bug): BSD's EX_SOFTWARE
EXIT_BUG = 70


def _fail(message: str, status: int) -> "NoReturn":
    """Print ``mla-deploy: error: <message>`` as one line on stderr and exit with ``status``."""
    click.echo(f"mla-deploy: error: {' '.join(str(message).split())}", err=True)
    sys.exit(status)


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived (SIGINT is Python's KeyboardInterrupt): unwinds like it, so every temporary
    folder and file is removed on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame):
    import signal

    for other in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # a second signal must not cut the cleanup short
        signal.signal(other, signal.SIG_IGN)
    raise Interrupted(signum)


def _os_error_line(exc: OSError) -> str:
    """``cannot write PATH: No space left on device``-style text of an OSError."""
    what = exc.strerror or str(exc)
    if exc.filename is not None:
        return f"{exc.filename}: {what}"
    return what


def _bug_line(exc: BaseException) -> str:
    """Write the traceback of an unexpected exception to a file; the one line that names it and the file."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(exc))
    try:
        fd, path = tempfile.mkstemp(prefix="mla-deploy-traceback-", suffix=".txt")
        with open(fd, "w") as f:
            f.write(f"mla-deploy {__version__}\nargv: {sys.argv}\n\n{text}")
        where = f"full traceback in {path}"
    except OSError:
        where = "the traceback could not be written to a file"
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return (f"internal error (a bug in mla-deploy, please report it): {type(exc).__name__}: {first}; {where}")


class _Main(click.Group):
    """The command group with the error contract of the module docstring."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        import signal

        if not standalone_mode:  # a caller that handles click's exceptions itself
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        handlers = {}
        for name in ("SIGTERM", "SIGHUP"):
            if hasattr(signal, name):
                try:
                    handlers[getattr(signal, name)] = signal.signal(getattr(signal, name), _on_signal)
                except ValueError:  # not the main thread: signals stay as they are
                    break
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            sys.exit(result if isinstance(result, int) else 0)  # click returns ctx.exit()'s code here
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.exceptions.NoArgsIsHelpError as exc:  # `mla-deploy` alone: its help, not an error
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else "mla-deploy"
            _fail(f"{exc.format_message().rstrip('.')} (see `{command} --help`)", 2)
        except click.ClickException as exc:  # click.FileError and the like
            _fail(exc.format_message(), 1)
        except MLADeployError as exc:
            _fail(str(exc), 1)
        except OSError as exc:
            _fail(_os_error_line(exc), 1)
        except click.Abort:  # click's form of KeyboardInterrupt (and EOF at a prompt)
            _fail("interrupted (SIGINT); temporary files were removed", 128 + signal.SIGINT)
        except Interrupted as exc:
            _fail(f"interrupted ({signal.Signals(exc.signum).name}); temporary files were removed", 128 + exc.signum)
        except Exception as exc:  # noqa: BLE001 - a bug: one line and the traceback in a file
            _fail(_bug_line(exc), EXIT_BUG)
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)


def _config_from(preset: str | None, recipe: str | None, hf: str | None):
    from .config import from_hf_config
    from .errors import ConfigError
    from .recipe import load_recipe

    given = [x for x in (preset, recipe, hf) if x]
    if len(given) != 1:
        raise ConfigError("give exactly one of --preset, --recipe, --hf")
    if hf:
        return from_hf_config(hf)
    return load_recipe(preset or recipe).model


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mla-deploy")
def main() -> None:
    """Deploy DeepSeek-style Multi-Head Latent Attention models: absorbed rewrite, ONNX export with the
    latent cache as explicit I/O, TensorRT engines, and validation against PyTorch."""


@main.command()
@click.option("--preset", metavar="NAME", help="A built-in preset (see `mla-deploy presets`).")
@click.option("--recipe", type=click.Path(dir_okay=False), help="A recipe TOML file.")
@click.option("--hf", type=click.Path(), help="A Hugging Face checkpoint folder or config.json.")
def inspect(preset, recipe, hf):
    """Print a model's dimensions and its cache size per token per layer (MHA, CD, latent)."""
    from .cache_table import format_inspect

    kind = "checkpoint" if hf else "recipe" if recipe else "preset"
    click.echo(format_inspect(_config_from(preset, recipe, hf), kind))


@main.command()
def presets():
    """List the built-in presets."""
    from .recipe import load_recipe, preset_names

    for name in preset_names():
        c = load_recipe(name).model
        click.echo(f"{name:<18} layers={c.num_hidden_layers:<3} hidden={c.hidden_size:<5} "
                   f"heads={c.num_attention_heads:<4} latent={c.latent_dim}")


def _recipe_for_export(preset, recipe, hf, precision, cache_mode, max_cache_length, layers, weights=None,
                       block_size=None, quant_format=None):
    """The recipe an export uses: a preset or recipe file, or a checkpoint's config with default settings."""
    import dataclasses
    from pathlib import Path

    from .errors import ConfigError
    from .recipe import Recipe, load_recipe

    given = [x for x in (preset, recipe, hf) if x]
    if len(given) != 1:
        raise ConfigError("give exactly one of --preset, --recipe, --hf")
    if hf:
        from .config import from_hf_config

        config = from_hf_config(hf)
        result = Recipe(name=Path(hf).resolve().name, model=config, source=str(hf))
    else:
        result = load_recipe(preset or recipe)
    changes = {k: v for k, v in (("precision", precision), ("cache_mode", cache_mode),
                                 ("max_cache_length", max_cache_length), ("weights", weights),
                                 ("block_size", block_size), ("quant_format", quant_format)) if v is not None}
    for flag, given in (("--block-size", block_size), ("--quant-format", quant_format)):
        if given is not None and (weights or result.export.weights) == "float":
            raise ConfigError(f"{flag} needs --weights int8 or int4")
    if changes:
        result = result.replace(export=dataclasses.replace(result.export, **changes))
    if layers is not None:
        if hf:
            raise ConfigError("--layers applies to presets, not to checkpoints")
        result = result.replace(model=result.model.first_layers(layers))
    return result


@main.command()
@click.option("--preset", metavar="NAME", help="A built-in preset (random weights; see `mla-deploy presets`).")
@click.option("--recipe", type=click.Path(dir_okay=False), help="A recipe TOML file.")
@click.option("--hf", type=click.Path(), help="A Hugging Face DeepSeek-V2/V3 checkpoint folder (safetensors).")
@click.option("--out", type=click.Path(file_okay=False), help="The artifact directory to write (required unless "
                                                               "--dump-recipe).")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), help="Override [export] precision.")
@click.option("--cache-mode", type=click.Choice(["concat", "static"]), help="Override [export] cache_mode.")
@click.option("--max-cache-length", type=Int(), help="Override [export] max_cache_length (static capacity).")
@click.option("--layers", type=Int(), help="Keep only the first N decoder layers (presets only).")
@click.option("--weights", type=click.Choice(["float", "int8", "int4"]),
              help="Override [export] weights: int8/int4 quantize the projections, MLPs, experts and lm_head "
                   "(weight-only, a symmetric scale per block of input features); float (default) quantizes nothing.")
@click.option("--block-size", type=click.Choice(["32", "64", "128"]),
              help="Input features per scale of --weights int8/int4 (default 32).")
@click.option("--quant-format", type=click.Choice(["matmulnbits", "qdq"]),
              help="How --weights int8/int4 are written: matmulnbits (default; ONNX Runtime's MatMulNBits, loads in "
                   "1.4x the weights' bytes) or qdq (standard DequantizeLinear -> MatMul, for TensorRT).")
@click.option("--overwrite", is_flag=True, help="Replace --out even if it holds a different model.")
@click.option("--validate", "run_validation", is_flag=True, help="Validate against PyTorch right after exporting.")
@click.option("--dump-recipe", is_flag=True, help="Print the resolved recipe as JSON and exit.")
@click.option("--block", type=click.Choice(["decoder", "mha", "latent-cross-attention"]), default="decoder",
              show_default=True, help="Export the whole decoder, or one comparison block sized like the preset: "
                                      "textbook MHA (K/V cache as I/O) or Perceiver-style latent cross-attention.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines (they are shown on a terminal only).")
@click.option("--progress", "force_progress", is_flag=True, help="Progress lines on stderr even when it is no "
                                                                 "terminal.")
@click.option("--target", type=click.Choice(["artifact", "genai"]), default="artifact", show_default=True,
              help="artifact: the mla-deploy artifact; genai: a folder onnxruntime-genai loads (needs --hf; "
                   "--max-cache-length is its context length).")
def export(preset, recipe, hf, out, precision, cache_mode, max_cache_length, layers, weights, block_size,
           quant_format, overwrite, run_validation, dump_recipe, block, quiet, force_progress, target):
    """Export the absorbed model to ONNX (prefill + decode graphs) with the latent cache as explicit I/O."""
    import json
    import time

    from .errors import ConfigError

    resolved = _recipe_for_export(preset, recipe, hf, precision, cache_mode, max_cache_length, layers, weights,
                                  None if block_size is None else int(block_size), quant_format)
    if dump_recipe:
        click.echo(json.dumps(resolved.to_dict(), indent=2))
        return
    if out is None:
        raise ConfigError("export needs --out DIR (the artifact directory to write)")
    if target == "genai":
        _export_genai(resolved, hf, out, overwrite, cache_mode, block, run_validation, quiet, force_progress)
        return
    if block == "decoder":  # before the heavy imports: a bad --out fails at once
        from .artifact.target import check_export_target, probe_writable

        check_export_target(out, overwrite=overwrite)
        probe_writable(out)
    if block != "decoder":
        from .exporter.blocks import export_block

        manifest = export_block(block, resolved.model, out, overwrite=overwrite)
        click.echo(f"exported the {block} block sized like {resolved.name} to {out}/{manifest['file']}")
        return
    from .exporter import export_recipe

    source = weights = None
    if hf:
        from .checkpoint import CheckpointTensors

        source = CheckpointTensors(hf)  # read one tensor at a time while the weights are written
        weights = source.weights_source()
    show = force_progress or (not quiet and sys.stderr.isatty())
    start = time.perf_counter()
    manifest = export_recipe(resolved, out, weights=weights, overwrite=overwrite, source=source,
                             progress=_progress_line("weights") if show else None,
                             log=_log_line(start) if show else None)
    export_s = time.perf_counter() - start
    click.echo(f"exported {manifest.name} to {out} in {export_s:.1f} s: {manifest.precision}, "
               f"{manifest.layout.mode} cache, opset {manifest.opset}, "
               f"latent {manifest.config.latent_dim} per token per layer")
    shown, total = set(), 0
    for role, graph in manifest.graphs.items():
        roles = [r for r, g in manifest.graphs.items() if g.file == graph.file]
        if graph.file not in shown:
            shown.add(graph.file)
            total += graph.bytes
            click.echo(f"  {'+'.join(roles):<14} {graph.file:<13} form {graph.form:<7} {_size(graph.bytes)}")
    if manifest.weights_data is not None:
        total += manifest.weights_data["bytes"]
        click.echo(f"  {'weights':<14} {manifest.weights_data['file']:<13} {'':<12} "
                   f"{_size(manifest.weights_data['bytes'])} (shared by the graphs)")
    else:
        click.echo(f"  {'weights':<14} {'':<13} {'':<12} inside the graph file(s)")
    if manifest.tokenizer is not None:
        total += sum(f["bytes"] for f in manifest.tokenizer.files)
        click.echo(f"  {'tokenizer':<14} {', '.join(manifest.tokenizer.names)}")
    click.echo(f"  {'total':<14} {'':<13} {'':<12} {_size(total)}")
    if run_validation:
        from .validate import validate_artifact

        _report_validation(validate_artifact(out))


def _export_genai(resolved, hf, out, overwrite, cache_mode, block, run_validation, quiet, force_progress):
    """``export --target genai``: the onnxruntime-genai folder of a checkpoint (:mod:`mla_deploy.exporter.genai`)."""
    import time

    from .errors import ConfigError

    if not hf:
        raise ConfigError("--target genai exports a checkpoint: give --hf CHECKPOINT")
    if cache_mode or block != "decoder" or run_validation:
        raise ConfigError("--target genai takes neither --cache-mode, --block nor --validate (genai holds the "
                          "cache in its own layout)")
    from .artifact.target import probe_writable
    from .checkpoint import CheckpointTensors
    from .exporter.genai import check_genai_target, export_genai

    check_genai_target(out, overwrite)  # before reading the checkpoint: a bad --out fails at once
    probe_writable(out)
    show = force_progress or (not quiet and sys.stderr.isatty())
    start = time.perf_counter()
    config = export_genai(resolved, out, CheckpointTensors(hf), hf, overwrite=overwrite,
                          progress=_progress_line("weights") if show else None, log=_log_line(start) if show else None)
    decoder = config["model"]["decoder"]
    click.echo(f"exported {resolved.name} for onnxruntime-genai to {out} in {time.perf_counter() - start:.1f} s: "
               f"{resolved.export.precision}, context length {config['model']['context_length']}, latent "
               f"{resolved.model.latent_dim} per token per layer as key/value halves of {decoder['head_size']}")
    from pathlib import Path

    from .exporter.genai import GENAI_FILES

    for name in GENAI_FILES:
        if (Path(out) / name).is_file():
            click.echo(f"  {name:<22} {_size((Path(out) / name).stat().st_size)}")


def _size(nbytes: int) -> str:
    """``0.34 MB`` / ``4.30 GB``."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def _log_line(start: float):
    """A ``log(line)`` callback printing ``[  12.3 s] line`` on stderr."""
    import time

    def log(line: str) -> None:
        click.echo(f"[{time.perf_counter() - start:7.1f} s] {line}", err=True)

    return log


def _progress_line(label: str):
    """A ``progress(done, total, seconds)`` callback: one updating line on a terminal (a line per update, at most
    one a second, elsewhere)."""
    tty = sys.stderr.isatty()
    shown = [-1.0]

    def show(done: int, total: int, seconds: float) -> None:
        last = bool(total) and done >= total
        if not last and seconds - shown[0] < (0.2 if tty else 1.0):
            return
        shown[0] = seconds
        rate = done / max(seconds, 1e-9)
        left = f", {(total - done) / rate:.0f} s left" if total and rate and not last else ""
        scale, unit = (1e9, "GB") if total >= 1e9 else (1e6, "MB")
        text = f"{label}: {done / scale:.2f} / {total / scale:.2f} {unit}, {rate / 1e6:.0f} MB/s{left}"
        if tty:
            click.echo(f"\r{text}   ", err=True, nl=last)
        else:
            click.echo(text, err=True)

    return show


def _parse_ids(values) -> list[list[int]]:
    from .errors import InputError

    prompts = []
    for value in values:
        try:
            prompts.append([int(x) for x in value.replace(" ", "").split(",") if x != ""])
        except ValueError:
            raise InputError(f"--prompt-ids takes comma-separated integers, got {value!r}") from None
    return prompts


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--prompt", "prompts", multiple=True,
              help="A text prompt (needs an artifact exported from a checkpoint with its tokenizer); repeat for a "
                   "batch.")
@click.option("--prompt-ids", "prompt_ids", multiple=True,
              help="Comma-separated token ids of one prompt; repeat for a batch.")
@click.option("--chat", is_flag=True, help="Apply the checkpoint's chat template to each --prompt (a user turn).")
@click.option("--system", help="With --chat: a system message before each prompt.")
@click.option("--stop", multiple=True, help="Stop a sequence when its text contains this string; repeatable.")
@click.option("--max-new-tokens", default=32, show_default=True, type=Int())
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy; > 0 samples.")
@click.option("--top-k", type=Int(), help="Sample from the k most likely tokens (needs --temperature > 0).")
@click.option("--top-p", default=1.0, show_default=True, type=float,
              help="Sample from the most likely tokens up to this probability, in (0, 1] (needs --temperature > 0).")
@click.option("--seed", type=Int(), help="Seed of the sampling (the same seed repeats the same text).")
@click.option("--json", "as_json", is_flag=True, help="Print the tokens, the text and the timings as JSON.")
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="ONNX Runtime execution provider.")
@click.option("--threads", type=Int(), help="ONNX Runtime intra-op threads.")
@click.option("--allow-long", is_flag=True, help="Run past the model's max_position_embeddings (with a warning).")
def run(artifact, prompts, prompt_ids, chat, system, stop, max_new_tokens, temperature, top_k, top_p, seed, as_json,
        provider, threads, allow_long):
    """Generate from an exported artifact with ONNX Runtime: text in and text out (--prompt, streamed as it is
    generated), or token ids (--prompt-ids). Stops at the checkpoint's end-of-sequence ids and --stop strings;
    greedy unless --temperature > 0."""
    import json

    from .engines.base import check_positions
    from .engines.ort_engine import OrtEngine
    from .errors import InputError
    from .sampling import SamplingConfig
    from .tokenizer import load_tokenizer

    if bool(prompts) == bool(prompt_ids):  # a malformed command line: click's usage error (exit 2)
        raise click.UsageError("give --prompt (text) or --prompt-ids (token ids), not both" if prompts else
                               "give a prompt: --prompt TEXT or --prompt-ids 1,2,3")
    if (chat or system is not None) and not prompts:
        raise InputError("--chat and --system apply to --prompt")
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    tokenizer = load_tokenizer(artifact)
    if tokenizer is None and (prompts or stop):
        raise InputError(f"{artifact} has no tokenizer (only an export of a checkpoint with tokenizer.json carries "
                         f"one), so {'--prompt' if prompts else '--stop'} cannot be used; give --prompt-ids")
    ids = _parse_ids(prompt_ids) if prompt_ids else None
    if prompts:
        from .text import encode_prompts

        ids = encode_prompts(tokenizer, prompts, chat, system)
    engine = OrtEngine(artifact, provider=provider, threads=threads)
    warning = check_positions(engine.config, max((len(p) for p in ids), default=0), max_new_tokens, allow_long)
    if warning:
        click.echo(f"mla-deploy: warning: {warning}", err=True)
    if tokenizer is None:
        result, texts = engine.generate(ids, max_new_tokens, sampling), None
    else:
        from .text import stream_text

        stream = stream_text(engine, tokenizer, ids, max_new_tokens, sampling, stop)
        live = bool(prompts) and len(ids) == 1 and not as_json
        for piece in stream:
            if live:
                click.echo(piece.text, nl=False)
                sys.stdout.flush()
        done = stream.result()
        result, texts = done.generation, done.texts
        if live:
            click.echo("")
    info = engine.info()
    if as_json:
        click.echo(json.dumps(_run_record(result, info, ids, texts, sampling), indent=2, ensure_ascii=False))
        return
    if prompts and len(ids) > 1:
        for i, (text, tokens) in enumerate(zip(texts, result.tokens)):
            click.echo(f"--- sequence {i} ({len(tokens)} tokens, {result.finish_reasons[i]}) ---")
            click.echo(text)
    elif not prompts:
        for i, tokens in enumerate(result.tokens):
            click.echo(f"sequence {i}: {','.join(map(str, tokens))}")
    per_sequence = ", ".join(f"{t:.1f}" for t in result.sequence_tokens_per_second)
    click.echo(f"provider {result.provider}; {info['precision']}, {info['cache_mode']} cache; batch "
               f"{len(result.tokens)}; time to first token {result.prefill_seconds * 1e3:.1f} ms; decode "
               f"{result.tokens_per_second:.1f} tokens/s for the batch, {per_sequence} tokens/s per sequence "
               f"({result.decode_steps} steps)", err=bool(prompts))


def _run_record(result, info: dict, prompts: list[list[int]], texts, sampling) -> dict:
    """What ``run --json`` prints: per sequence its prompt ids, new tokens, text, finish reason and decode rate;
    the batch's timings, labelled."""
    import dataclasses

    sequences = []
    for i, tokens in enumerate(result.tokens):
        record = {"prompt_ids": prompts[i], "tokens": tokens, "finish_reason": result.finish_reasons[i],
                  "decode_tokens_per_second": _number(result.sequence_tokens_per_second[i])}
        if texts is not None:
            record["text"] = texts[i]
        sequences.append(record)
    return {"provider": result.provider, "precision": info["precision"], "cache_mode": info["cache_mode"],
            "sampling": dataclasses.asdict(sampling), "sequences": sequences,
            "timings": {"time_to_first_token_s": result.prefill_seconds, "decode_s": result.decode_seconds,
                        "decode_steps": result.decode_steps,
                        "decode_tokens_per_second_batch": _number(result.tokens_per_second)}}


def _number(value: float) -> float | None:
    """JSON has no NaN: a rate without decode steps is null."""
    return None if value != value else value


@main.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--steps", type=Int(minimum=0), help="Decode steps after the prefill (default: the recipe's).")
@click.option("--out", type=click.Path(file_okay=False), help="Report folder (default: ARTIFACT_DIR/validation).")
@click.option("--load-results", type=click.Path(dir_okay=False),
              help="Compare a saved run_results.json again instead of running.")
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="ONNX Runtime execution provider.")
@click.option("--threads", type=Int(), help="ONNX Runtime intra-op threads.")
@click.option("--trt", "with_trt", is_flag=True, help="Also validate a TensorRT engine (needs mla_deploy.trt).")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines (they are shown on a terminal only).")
@click.option("--progress", "force_progress", is_flag=True, help="Progress lines on stderr even when it is no "
                                                                 "terminal.")
def validate(artifact_dir, steps, out, load_results, provider, threads, with_trt, quiet, force_progress):
    """Validate an exported artifact against its PyTorch original with Polygraphy; write report.{json,html,md}.

    Quantized weights: the graphs against a PyTorch model with the same dequantized weights, and the quantization's
    cost (the artifact as deployed against the unquantized original), one line each.

    Exit status 0 when every output is within the recipe's tolerance at every step (and the quantization within
    its thresholds), 1 otherwise."""
    import time

    from .validate import validate_artifact

    runtimes = ("onnxrt", "tensorrt") if with_trt else ("onnxrt",)
    show = force_progress or (not quiet and sys.stderr.isatty())
    result = validate_artifact(artifact_dir, out_dir=out, steps=steps, load_results=load_results,
                               runtimes=runtimes, provider=provider, threads=threads,
                               log=_log_line(time.perf_counter()) if show else None)
    _report_validation(result)


def _report_validation(result) -> None:
    """One line per verdict of a validation (the graphs; a quantized artifact's quantization): the passing ones on
    stdout, the failing ones as the error (exit 1)."""
    failing = result.failures()
    for line in result.lines():
        if line not in failing:
            click.echo(line)
    result.raise_for_failure()


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option("--no-providers", is_flag=True, help="Do not try ONNX Runtime's providers with real sessions.")
def doctor(as_json, no_providers):
    """Report torch and CUDA, the ONNX Runtime providers that really load, TensorRT, Polygraphy, the GPU,
    and which commands work on this machine."""
    import json

    from .doctor import collect, format_report

    info = collect(providers=not no_providers)
    click.echo(json.dumps(info, indent=2) if as_json else format_report(info))


@main.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--workspace-mib", type=click.IntRange(min=1),
              help="Builder workspace limit (default: the recipe's [build] workspace_mib).")
@click.option("--strongly-typed/--weakly-typed", default=None,
              help="TensorRT 10: strongly typed, or weakly typed with the FP16/BF16 flag of the export's precision "
                   "(default). TensorRT 11 is always strongly typed.")
@click.option("--no-timing-cache", is_flag=True, help="Neither read nor write ARTIFACT_DIR/trt/timing.cache.")
@click.option("--opt-level", type=click.IntRange(0, 5), help="TensorRT builder optimisation level.")
def build(artifact_dir, workspace_mib, strongly_typed, no_timing_cache, opt_level):
    """Build TensorRT engines for an exported artifact: one engine per graph (ARTIFACT_DIR/trt/model.engine with a
    prefill and a decode profile, or prefill.engine and decode.engine), timing.cache and build.json, with
    optimisation profiles from the recipe's [build] ranges."""
    import dataclasses

    from .trt.build import build_engines, require_tensorrt

    from pathlib import Path

    from .artifact import load_manifest
    from .errors import ArtifactError
    from .trt.build import check_buildable

    try:
        manifest = load_manifest(artifact_dir)
    except ArtifactError:
        manifest = None  # reported after the runtime, as before
    if manifest is not None:
        check_buildable(manifest, Path(artifact_dir))  # an artifact TensorRT could never parse: said first
    require_tensorrt()  # before anything else: one line naming what is missing
    settings = None
    if workspace_mib:
        from .artifact import load_manifest

        settings = dataclasses.replace(load_manifest(artifact_dir).build_settings(), workspace_mib=workspace_mib)
    record = build_engines(artifact_dir, settings, strongly_typed=strongly_typed, timing_cache=not no_timing_cache,
                           optimization_level=opt_level)
    for engine in record["engines"].values():
        roles = " + ".join(f"{role} (profile {record['roles'][role]['profile']})" for role in engine["roles"])
        click.echo(f"{artifact_dir}/trt/{engine['file']}  {engine['bytes'] / 2**20:.1f} MiB  "
                   f"built in {engine['build_seconds']:.1f} s: {roles}")
    typing = "strongly typed" if record["strongly_typed"] else "weakly typed " + "+".join(record["precision_flags"])
    click.echo(f"TensorRT {record['tensorrt']} on {record['gpu']}; {record['precision']}, {typing}")


def _command_line(ctx: click.Context) -> str:
    """The command as run, rebuilt from its parsed options (for the report)."""
    import shlex

    parts = ["mla-deploy", ctx.info_name or "bench"]
    for name, value in ctx.params.items():
        if value is None or value is False:
            continue
        parts.append("--" + name.replace("_", "-"))
        if value is not True:
            parts.append(shlex.quote(",".join(map(str, value)) if isinstance(value, tuple) else str(value)))
    return " ".join(parts)


@main.command()
@click.option("--whole-model", is_flag=True,
              help="Bench the whole model instead of the attention stack: decode ms/token and tokens/s after a context, "
                   "prefill tokens/s, peak memory, ONNX Runtime beside transformers' own model, each against the "
                   "bound measured in the same run.")
@click.option("--preset", metavar="NAME", help="A built-in preset (see `mla-deploy presets`).")
@click.option("--recipe", type=click.Path(dir_okay=False), help="A recipe TOML file.")
@click.option("--artifact", type=click.Path(file_okay=False), help="--whole-model: an exported artifact, benched as is.")
@click.option("--hf", type=click.Path(file_okay=False),
              help="--whole-model: a Hugging Face DeepSeek checkpoint folder, exported into OUT/artifact first.")
@click.option("--layers", type=Int(),
              help="Attention layers in the benched unit [default: 2]; --whole-model: keep only the first N decoder "
                   "layers of the preset or recipe [default: all].")
@click.option("--context", type=IntList(minimum=0),
              help="Cached tokens T, comma list [default: 1024,4096,16384; --whole-model: 0,4096].")
@click.option("--batch", type=IntList(), default="1,8", show_default=True, help="Batch sizes B, comma list.")
@click.option("--prompt-length", type=Int(), help="--whole-model: tokens per sequence of the timed prefill [default: 512].")
@click.option("--threads", type=Int(), default=2, show_default=True, help="torch and ONNX Runtime intra-op threads.")
@click.option("--repeat", type=Int(),
              help="Timed calls per point and pass, at most [default: 20]; --whole-model: timed decode steps per "
                   "point and timed prefills per batch size [default: 10].")
@click.option("--warmup", type=Int(minimum=0), default=3, show_default=True, help="Untimed calls before them.")
@click.option("--passes", type=Int(),
              help="Passes; each runs every variant in its own process, odd passes in reverse order [default: 2].")
@click.option("--paths", type=PathList(),
              help="Comma subset of hf-eager, hf-sdpa, torch-cd, torch-absorbed, ort-concat, ort-static, trt "
                   "[default: all].")
@click.option("--max-seconds", type=Positive(),
              help="Time budget of one point in one pass (at least 3 timed calls are kept) [default: 20].")
@click.option("--seed", type=Int(minimum=0), default=0, show_default=True,
              help="Seed of the weights and inputs (--whole-model: of the prompts and of a preset's checkpoint).")
@click.option("--no-transformers", is_flag=True, help="--whole-model: do not time transformers' model.")
@click.option("--weights", "weights", metavar="LIST",
              help="--whole-model (--hf, --preset, --recipe): comma list of float, int8, int4; each is exported "
                   "(OUT/artifact, OUT/artifact-int8, ...) and timed, quantized rows beside the float one "
                   "[default: float].")
@click.option("--block-size", type=click.Choice(["32", "64", "128"]),
              help="--whole-model: input features per scale of the int8/int4 exports [default: 32].")
@click.option("--probe-mib", type=Int(), default=512, show_default=True, hidden=True, help="Read-bandwidth probe buffer.")
@click.option("--out", default="bench-results", show_default=True, type=click.Path(file_okay=False),
              help="Folder for bench.json, bench.md and bench.png; --whole-model from --hf or --preset also keeps the "
                   "exported artifact (and the random checkpoint) there, reused by a later run on the same model.")
def bench(whole_model, preset, recipe, artifact, hf, layers, context, batch, prompt_length, threads, repeat, warmup,
          passes, paths, max_seconds, seed, no_transformers, weights, block_size, probe_mib, out):
    """Decode-step latency, tokens/s, cache and peak memory of MLA attention: transformers' own attention
    (naive), this project's PyTorch model (CD and absorbed), the exported graph in ONNX Runtime (concat and
    static in place) and TensorRT where available; each against the machine's measured roofline.

    With --whole-model: the whole model (--artifact, --hf or --preset/--recipe [--layers N]) in ONNX Runtime
    beside transformers' AutoModelForCausalLM.generate on the same checkpoint: decode ms/token and tokens/s after
    each --context, prefill tokens/s of a --prompt-length prompt, peak RSS, and each step's time over its bound
    (the weights it must read, routed experts counted per step, plus the latent cache, over the measured
    bandwidth; or its FLOPs over the measured GEMM rate)."""
    from .errors import ConfigError

    command = _command_line(click.get_current_context())
    echo = lambda line: click.echo(line, err=True)  # noqa: E731
    sources = {"artifact": artifact, "hf": hf, "preset": preset, "recipe": recipe}
    given = [name for name, value in sources.items() if value]
    if whole_model:
        misplaced = [n for n, v in (("--passes", passes), ("--paths", paths), ("--max-seconds", max_seconds)) if v]
        if misplaced:
            raise ConfigError(f"{misplaced[0]} applies to the attention bench, not to --whole-model")
        if len(given) != 1:
            raise ConfigError("--whole-model takes exactly one of --artifact, --hf, --preset, --recipe")
        from .bench.whole_model.driver import run_whole_model
        from .bench.whole_model.report import format_table as whole_model_table
        from .bench.whole_model.spec import WholeModelSpec

        chosen = {"contexts": context, "prompt_length": prompt_length, "repeat": repeat, "weights": weights,
                  "block_size": None if block_size is None else int(block_size)}
        spec = WholeModelSpec(source=given[0], location=sources[given[0]], layers=layers, batches=batch,
                              threads=threads, warmup=warmup, seed=seed, transformers=not no_transformers,
                              probe_mib=probe_mib, **{k: v for k, v in chosen.items() if v is not None})
        report = run_whole_model(spec, out, echo=echo, command=command)
        click.echo(whole_model_table(report))
        click.echo(f"wrote {out}/bench.json, {out}/bench.md")
        return
    misplaced = [n for n, v in (("--artifact", artifact), ("--hf", hf), ("--prompt-length", prompt_length),
                                ("--no-transformers", no_transformers), ("--weights", weights),
                                ("--block-size", block_size)) if v]
    if misplaced:
        raise ConfigError(f"{misplaced[0]} applies to --whole-model only")
    from .bench.attention.driver import run_bench
    from .bench.attention.output import format_table
    from .bench.attention.spec import BenchSpec
    from .recipe import load_recipe

    if bool(preset) == bool(recipe):
        raise ConfigError("give exactly one of --preset, --recipe")
    config = load_recipe(preset or recipe).model
    chosen = {"layers": layers, "contexts": context, "repeat": repeat, "passes": passes, "paths": paths,
              "max_seconds": max_seconds}
    spec = BenchSpec(config=config, batches=batch, threads=threads, warmup=warmup, seed=seed, probe_mib=probe_mib,
                     source=preset or recipe, **{k: v for k, v in chosen.items() if v is not None})
    report = run_bench(spec, out, echo=echo, command=command)
    click.echo(format_table(report))
    click.echo(f"wrote {out}/bench.json, {out}/bench.md, {out}/bench.png")


if __name__ == "__main__":  # pragma: no cover
    main()

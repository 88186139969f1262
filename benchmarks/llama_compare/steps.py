"""The command lines of a comparison, in the order they run, each skipped when the cache already holds what it
makes: download the ``llama-cpp-python`` sdist, build its vendored llama.cpp (``llama-bench``, ``llama-quantize``
and ``llama-server`` only, without the server's web UI, Release, native CPU), convert the checkpoint to F32 and Q8_0 with llama.cpp's converter
and quantize Q4_0, then ``mla-deploy bench model`` and ``llama-bench`` per type, in rounds (:func:`measurements`);
with ``--ik-llama``, ik_llama.cpp's build and its ``llama-bench`` too (:mod:`.ik`)."""

from __future__ import annotations

import os
import shlex
import signal
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .checks import compilers
from .settings import CONVERTER_TYPES, PRECISIONS, TARGETS, CompareError, Settings

HERE = Path(__file__).resolve().parent
#: the converter's modules (import name -> package) besides torch and numpy, which mla-deploy brings
CONVERTER_MODULES = {"yaml": "pyyaml", "tqdm": "tqdm"}
#: what pip says when it cannot reach the package index
NETWORK_SIGNS = ("NewConnectionError", "Failed to establish", "Temporary failure in name resolution",
                 "Network is unreachable", "Connection refused", "Could not fetch URL", "timed out", "ProxyError")


@dataclass(frozen=True)
class Step:
    """One command. Attributes: name (also its log file's name); argv; done: what it makes is cached (the step is
    skipped); stdout: the file its standard output goes to (None: the log); env: variables added; makes: the file
    it writes under a temporary name (:func:`partial`), renamed to this one once the command succeeded, so an
    interrupted step leaves nothing a later run would take as cached (and removed where the command failed); drops:
    a file removed once it succeeded (an intermediate GGUF no requested type is); moves: ``(written, kept)``, the file the command writes under a fixed
    name (the bench's bench.json) renamed to ``kept`` once it succeeded, so the next round's does not replace it."""

    name: str
    argv: tuple[str, ...]
    done: bool = False
    stdout: Path | None = None
    env: dict = field(default_factory=dict)
    makes: Path | None = None
    drops: Path | None = None
    moves: tuple[Path, Path] | None = None

    def line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        text = (env + " " if env else "") + shlex.join(self.argv) + (f" > {self.stdout}" if self.stdout else "")
        return f"{'[cached] ' if self.done else ''}{self.name}: {text}"


def partial(path: Path) -> Path:
    """Where a step writes ``path`` until it has succeeded."""
    return path.with_name(path.name + ".partial")


def download(s: Settings, pip: list[str]) -> Step:
    """The sdist from the package index (only llama-cpp-python itself from source: ``--no-binary :all:`` would
    also build its build dependencies, cmake included, from source)."""
    argv = (*pip, "download", "--no-binary", "llama-cpp-python", "--no-deps", f"llama-cpp-python=={s.version}",
            "--dest", str(s.llama_dir / "sdist"))
    archive = s.llama_dir / "sdist" / f"llama_cpp_python-{s.version}.tar.gz"
    return Step("download", argv, done=s.built or archive.is_file())


def extract(s: Settings) -> Step:
    """The sdist unpacked (Python's own tarfile command line) into ``s.source``."""
    archive = s.llama_dir / "sdist" / f"llama_cpp_python-{s.version}.tar.gz"
    argv = (sys.executable, "-m", "tarfile", "-e", str(archive), str(s.source))
    return Step("extract", argv, done=s.built or s.vendored.is_dir())


def configure(s: Settings) -> Step:
    generator = ("-G", "Ninja") if shutil.which("ninja") else ()
    compiler = (f"-DCMAKE_CXX_COMPILER={compilers()[0]}",) if os.environ.get("CXX") and compilers() else ()
    flags = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF")
    argv = ("cmake", "-S", str(s.vendored), "-B", str(s.build), *generator, *compiler, *flags)
    return Step("configure", argv, done=s.built)


def build(s: Settings) -> Step:
    argv = ("cmake", "--build", str(s.build), "--target", *TARGETS, "-j", str(os.cpu_count() or 1))
    return Step("build", argv, done=s.built)


def stepper(s: Settings) -> Step:
    """``llama-stepper`` (``stepper.cpp``: llama.cpp's side of ``--interleave``), compiled with the C++ compiler
    against the build's own static libraries and headers (OpenMP as the build has it)."""
    from .interleaved import STEPPER_SOURCE, stepper_path

    libs = [s.build / "src" / "libllama.a"] + [s.build / "ggml" / "src" / f"libggml{part}.a"
                                               for part in ("", "-cpu", "-base")]
    try:
        cache = (s.build / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        cache = ""  # not configured yet: ggml enables OpenMP where the compiler has it
    openmp = () if "GGML_OPENMP_ENABLED:INTERNAL=OFF" in cache else ("-fopenmp",)
    out = stepper_path(s)
    argv = ((compilers() or ["c++"])[0], "-O2", "-std=c++17", f"-I{s.vendored / 'include'}",
            f"-I{s.vendored / 'ggml' / 'include'}", str(STEPPER_SOURCE), *map(str, libs), *openmp, "-lpthread", "-ldl",
            "-lm", "-o", str(partial(out)))
    return Step("stepper", argv, done=out.is_file(), makes=out)


def missing_converter_modules() -> list[str]:
    """The converter's packages the running interpreter lacks."""
    import importlib.util

    return [package for module, package in CONVERTER_MODULES.items() if importlib.util.find_spec(module) is None]


def converter_deps(s: Settings, pip: list[str]) -> Step | None:
    """Install what the converter needs and this interpreter lacks into the cache (never into the user's
    environment); None when nothing is missing."""
    missing = missing_converter_modules()
    if not missing:
        return None
    argv = (*pip, "install", "--no-deps", "--target", str(s.converter_deps), *missing)
    return Step("converter-deps", argv, done=all((s.converter_deps / m).exists() for m in CONVERTER_MODULES))


def convert(s: Settings, key: str, kind: str, done: bool = False) -> Step:
    """F32, BF16 or Q8_0 straight from the checkpoint with llama.cpp's converter (:mod:`.convert_entry`);
    ``done``: cached whatever the cache holds (a dropped intermediate whose products are all there)."""
    out = s.gguf(key, kind)
    argv = (sys.executable, str(HERE / "convert_entry.py"), str(s.vendored), str(s.checkpoint), "--outfile",
            str(partial(out)), "--outtype", CONVERTER_TYPES[kind])
    path = os.pathsep.join([str(s.vendored / "gguf-py"), str(s.converter_deps)])
    return Step(f"convert-{kind}", argv, done=done or out.is_file(), env={"PYTHONPATH": path, "NO_LOCAL_GGUF": "1"},
                makes=out)


def quantize(s: Settings, key: str, kind: str, drop: bool = False) -> Step:
    """Other types from the ``s.quantize_from`` file with ``llama-quantize`` (``--allow-requantize`` from Q8_0,
    ``--pure`` where :attr:`Settings.pure`); ``drop``: that file is removed once this step succeeded."""
    out, source = s.gguf(key, kind), s.gguf(key, s.quantize_from)
    flags = ("--allow-requantize",) if s.quantize_from not in ("F32", "BF16") else ()
    flags += ("--pure",) if s.pure else ()
    argv = (str(s.tool("llama-quantize")), *flags, str(source), str(partial(out)), kind, str(s.threads))
    return Step(f"quantize-{kind}", argv, done=out.is_file(), makes=out, drops=source if drop else None)


def mla_bench(s: Settings, weights: str, round_: int) -> Step:
    """``mla-deploy bench model`` at batch 1 on the same checkpoint, one precision (its own export, made by the
    first round and reused by the others), its bench.json kept per round (:meth:`Settings.ours_json`)."""
    # blocks of 32 as Q8_0/Q4_0's; the bench refuses --block-size where no weights are quantized (float)
    blocks = ("--block-size", "32") if weights != "float" else ()
    argv = (sys.executable, "-m", "mla_deploy", "bench", "model", "--hf", str(s.checkpoint), "--weights", weights,
            *blocks, "--context", ",".join(map(str, s.contexts)), "--batch", "1", "--threads", str(s.threads),
            "--prompt-length", str(s.prompt), "--repeat", str(s.our_repeat), "--no-transformers", "--out",
            str(s.bench_out))
    return Step(f"mla-deploy-bench-{weights}-{round_}", argv,
                moves=(s.bench_out / "bench.json", s.ours_json(weights, round_)))


def llama_bench(s: Settings, key: str, kind: str, round_: int) -> Step:
    """``llama-bench`` on one GGUF file: the prompt at depth 0 and ``generate`` tokens after each context; the
    weights read into memory (``-lm none``, as ours are), JSON on standard output."""
    argv = (str(s.tool("llama-bench")), "-m", str(s.gguf(key, kind)), "-t", str(s.threads), "-r", str(s.repetitions),
            "-p", str(s.prompt), "-n", str(s.generate), "-d", ",".join(map(str, s.contexts)), "-lm", "none",
            "-o", "json")
    return Step(f"llama-bench-{kind}-{round_}", argv, stdout=s.llama_json(kind, round_))


def measurements(s: Settings, key: str) -> list[Step]:
    """Both engines (and ik_llama.cpp's variants where asked for), ``s.rounds`` times: per precision ours, then
    llama.cpp's (then ik_llama.cpp's) in odd rounds, the other way round in even ones, so none always runs first
    after an export or another engine."""
    from . import ik

    out = []
    for round_ in range(1, s.rounds + 1):
        for weights in s.precisions:
            kind = PRECISIONS[weights]
            group = [mla_bench(s, weights, round_), llama_bench(s, key, kind, round_)]
            if s.ik_source is not None:
                group += [ik.bench(s, key, kind, variant, round_) for variant in ik.VARIANTS]
            out += group if round_ % 2 else group[::-1]
    return out


def plan(s: Settings, key: str, pip: list[str]) -> list[Step]:
    """Every step of a run, in order (``key``: the checkpoint's fingerprint)."""
    kinds = [PRECISIONS[p] for p in s.precisions]
    quantized = [k for k in kinds if k not in CONVERTER_TYPES]
    transient = bool(quantized) and s.quantize_from not in kinds  # made only to be quantized, then removed
    steps = [download(s, pip), extract(s), configure(s), build(s)]
    if s.ik_source is not None:
        from . import ik

        steps += ik.build_steps(s)
    steps.append(converter_deps(s, pip))
    steps += [convert(s, key, k) for k in kinds if k in CONVERTER_TYPES]
    if transient:
        steps.append(convert(s, key, s.quantize_from, done=all(s.gguf(key, k).is_file() for k in quantized)))
    steps += [quantize(s, key, k, drop=transient and k == quantized[-1]) for k in quantized]
    if s.interleave:
        steps.append(stepper(s))
    steps += measurements(s, key)
    return [step for step in steps if step is not None]


def run(step: Step, logs: Path, echo) -> None:
    """Run ``step`` with its output in ``logs/NAME.log`` (standard output to ``step.stdout`` when set);
    :class:`CompareError` naming the log when it fails."""
    logs.mkdir(parents=True, exist_ok=True)
    for made in (step.stdout, step.moves[1] if step.moves else None):
        if made is not None:
            made.parent.mkdir(parents=True, exist_ok=True)
    log = logs / f"{step.name}.log"
    echo(f"[compare] {step.name}: {shlex.join(step.argv)}")
    env = {**os.environ, **step.env}
    with open(log, "w") as err:
        out = open(step.stdout, "w") if step.stdout else err
        try:
            code = subprocess.run(step.argv, stdout=out, stderr=err, env=env).returncode
        except OSError as exc:
            raise CompareError(f"{step.name}: cannot run {step.argv[0]}: {exc.strerror}") from None
        finally:
            if step.stdout:
                out.close()
    if code != 0:
        if step.makes is not None:  # a step killed half-way leaves GBs under the temporary name: not kept
            partial(step.makes).unlink(missing_ok=True)
        raise CompareError(failure(step, code, log.read_text(errors="replace")) + f"; log: {log}")
    if step.makes is not None:
        partial(step.makes).replace(step.makes)
    if step.drops is not None:
        step.drops.unlink(missing_ok=True)
    if step.moves is not None:
        written, kept = step.moves
        if not written.is_file():
            raise CompareError(f"{step.name} succeeded but wrote no {written}; log: {log}")
        written.replace(kept)


def failure(step: Step, code: int, log: str) -> str:
    """One line saying why ``step`` failed, from its log (a download without network said so)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    last = lines[-1] if lines else "no output"
    if step.name == "download":
        if any(sign in log for sign in NETWORK_SIGNS):
            reason = "the package index cannot be reached"
        elif "(from versions: none)" in log:  # what pip says when no index answered
            reason = "the package index cannot be reached, or it has no such release"
        else:
            reason = last
        return f"could not download {step.argv[-3]} from the package index ({reason})"
    if code < 0:  # subprocess's way of saying a signal ended it
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        oom = -code == signal.SIGKILL
        why = " (the kernel's out-of-memory killer sends it when the memory runs out)" if oom else ""
        return f"{step.name} was killed by {name}{why}: {last}"
    return f"{step.name} failed (exit {code}): {last}"

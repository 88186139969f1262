"""mla-deploy's own ONNX Runtime CPU operators (``mla_deploy/ort/csrc/cpu_ops.c``) and the graph swaps that put them in a
CPU engine in place of ONNX Runtime's ``QMoE`` and ``MatMulNBits``.

``mla_deploy.BlockwiseMatMul`` takes ``MatMulNBits``'s inputs as they are (``A [..., K]``, ``B uint8 [N, K/32,
32*bits/8]``, ``N*K/32`` scales) and computes what it computes at ``accuracy_level`` 4: the rows of ``A`` quantized
to int8 per block of 32, integer dot products, one scale product per block. ``mla_deploy.RoutedExperts`` takes
``QMoE``'s weights as they are (int4/int8 blocks of 32, zero point
``2^(bits-1)``, float32 scales or the float16 copies the engine build stores, gate and up rows interleaved) and computes what ``QMoE`` computes at ``accuracy_level``
4 (each token's vector quantized to int8 per block, integer dot products): the same inputs, attributes and
routing (top ``k`` of ``router_probs``, softmax over the chosen), or, where the swap finds the export's routing
round trip, the chosen experts and their weights as given (``normalize_routing_weights`` 0). They exist because these
products
are most of a quantized decode step and a kernel written for them streams faster than ONNX Runtime 1.31's at decode
(one token: the kernels' fixed costs, not the bytes, bound ONNX Runtime's on a layer's matrices), as fast at a
512-token prefill, and reads the weights where ONNX Runtime maps them: nothing is packed at open, so an engine opens
in seconds at the size of its weights. Figures: docs/cpu-engine.md and benchmarks/results/.

``mla_deploy.LatentAttention`` computes one layer's absorbed attention core over its latent cache (what
:class:`~mla_deploy.model.mla.AbsorbedMLAttention` computes between its projections; its per-head products as
``HeadwiseMatMul`` computes them, or in float32 for float32 weights): one node where ONNX Runtime ran about 40 small
ones per layer.

A float artifact's experts become ``mla_deploy.FloatExperts`` (with the layer's shared experts as more experts
where the graph adds them) and its ``MatMul`` nodes of a float32 weight
``mla_deploy.FloatMatMul`` of the weight transposed, ``[N, K]`` (the build stores it so): a decode step's few rows (up
to 8) computed by the operator, each output a dot product over one of its rows, streamed where ONNX Runtime maps
it; more rows (a prefill) handed to ONNX Runtime's own ``FusedMatMul`` kernel (``transB``) through the C API's
``CreateOp``/``InvokeOp``.

The CPU engine build (:mod:`~mla_deploy.ort.cpu_build`) compiles the source for the best instruction set the CPU
it runs on has (:func:`compile_library`, :data:`FAST_PATHS`: AVX-512 VNNI, else AVX-VNNI, else AVX2 with FMA and F16C;
``cc -O3`` with that set's explicit flags, into the engine folder), swaps every eligible node
(:func:`mla_deploy.ort.swaps.swap_experts`, :func:`~mla_deploy.ort.swaps.swap_linear`: which nodes they
compute exactly is the quantization's to say) and records the library and its instruction set in the engine's
record; a session opening the engine registers it (:func:`register`). Where there is no C compiler, no source (an
installed wheel: the plugin sources ship with the source checkout), or the CPU has none of the fast paths (the
portable C path is slower than ONNX Runtime's kernels), the engine keeps ONNX Runtime's operators and its record says
why.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

LIBRARY = "cpu_ops.so"
#: how long the compiler may take (it takes about 2 s)
COMPILE_SECONDS = 300


def source_path() -> Path:
    """The operators' C source, package data of :mod:`mla_deploy.ort` (``csrc/cpu_ops.c``): it ships in the wheel,
    so an installed mla-deploy compiles the operators as a source checkout does."""
    return Path(__file__).resolve().parent / "csrc" / "cpu_ops.c"


@dataclass(frozen=True)
class Isa:
    """An instruction set the operators' integer products are compiled for.

    Attributes:
        name: as the compiled library names it (``mla_deploy_cpu_ops_isa()`` in ``csrc/cpu_ops.c``).
        needs: the CPU features (as :func:`mla_deploy.ort.record.host_cpu` names them) it runs on.
        flags: the compiler flags that select it.
    """

    name: str
    needs: tuple[str, ...]
    flags: tuple[str, ...]


_AVX2 = ("avx2", "fma", "f16c")
#: the operators' fast paths, best first: a build takes the first one the CPU has. All three compute the same lanes
#: in the same order (bit-equal outputs); AVX-VNNI and AVX2 take two 256-bit registers where AVX-512 takes one.
FAST_PATHS = (
    Isa("avx512-vnni", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni") + _AVX2,
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c")),
    Isa("avx-vnni", ("avxvnni",) + _AVX2, ("-mavx2", "-mfma", "-mf16c", "-mavxvnni")),
    Isa("avx2", _AVX2, ("-mavx2", "-mfma", "-mf16c")),
)
#: the operators in plain C, on any CPU: slower than ONNX Runtime's kernels, so a build never takes it for an engine;
#: the tests compile it to check the vector paths against it
PORTABLE = Isa("portable", (), ())
NO_FAST_PATH = ("this CPU has none of the operators' fast paths (AVX-512 VNNI, AVX-VNNI, AVX2 with FMA and F16C); "
                "ONNX Runtime's kernels are faster than their portable C")


def fast_path(features: tuple[str, ...]) -> Isa | None:
    """The best of :data:`FAST_PATHS` a CPU with ``features`` (:func:`~mla_deploy.ort.record.host_cpu`'s) runs, or
    None."""
    return next((isa for isa in FAST_PATHS if all(f in features for f in isa.needs)), None)


def isa_named(name: str) -> Isa:
    """The :data:`FAST_PATHS` entry or :data:`PORTABLE` called ``name``.

    Raises: ValueError: no such instruction set."""
    for isa in (*FAST_PATHS, PORTABLE):
        if isa.name == name:
            return isa
    raise ValueError(f"no operator instruction set {name!r} (one of "
                     f"{', '.join(i.name for i in (*FAST_PATHS, PORTABLE))})")


@dataclass(frozen=True)
class Library:
    """A compiled operator library, or why there is none.

    Attributes:
        path: the shared library (None: not built, see ``why_not``).
        isa: the instruction set its integer products use (:attr:`Isa.name`, as the library says it;
            None when not built).
        why_not: why the engine keeps ``QMoE`` (None when ``path`` is usable).
    """

    path: Path | None
    isa: str | None = None
    why_not: str | None = None

    @property
    def vnni(self) -> bool:
        """It computes with AVX-512 VNNI."""
        return self.isa == "avx512-vnni"


def compiler() -> str | None:
    """The C compiler used (``$CC``, else ``cc``, ``gcc``, ``clang`` on ``PATH``), or None."""
    return os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def _missing() -> str | None:
    """Why the operators cannot be compiled here at all (no source, no compiler), or None."""
    cc = compiler()
    if not source_path().is_file():
        return f"the operator source {source_path()} is missing (a damaged installation)"
    if cc is None or shutil.which(cc) is None:
        return f"no C compiler ({'$CC=' + cc if cc else 'cc, gcc, clang or $CC'} not found)"
    return None


_ISA_MARKER = re.compile(rb"mla_deploy_cpu_ops_isa=([a-z0-9-]+);")


def library_isa(path: Path) -> str | None:
    """The instruction set the compiled library at ``path`` says it uses (what its ``mla_deploy_cpu_ops_isa()``
    returns, read from the marker beside it in the file: loading the library would give, for a path this process
    loaded before, the library it loaded then); None where the file holds no marker."""
    found = _ISA_MARKER.search(Path(path).read_bytes())
    return found.group(1).decode() if found else None


def compile_library(into: Path, isa: Isa | None = None, source: Path | None = None,
                    features: tuple[str, ...] | None = None) -> Library:
    """Compile :func:`source_path` (or ``source``, a copy of it) into ``into/cpu_ops.so`` for ``isa``, by default the
    best fast path (:func:`fast_path`) of a CPU with ``features`` (by default this one's), then check it against the
    ONNX Runtime installed (:func:`check_library`). A library for an ``isa`` that a CPU with ``features`` cannot run
    is compiled (so that its code is known to build) but neither checked nor kept.
    Never raises for a missing compiler or source, a CPU without a fast path, or a library that fails its check: the
    :class:`Library` says why there is none."""
    missing = _missing()
    if missing:
        return Library(None, why_not=missing)
    if features is None:
        from ..host import cpu_flags

        features = tuple(sorted(cpu_flags()))
    if isa is None:
        isa = fast_path(features)
        if isa is None:
            return Library(None, why_not=NO_FAST_PATH)
    lacks = [f for f in isa.needs if f not in features]
    source, cc, out = Path(source or source_path()), compiler(), Path(into) / LIBRARY
    # explicit flags, not -march=native: the library is for the instruction set chosen, whatever else the CPU has
    # (an AVX2 library built on an AVX-512 machine uses no AVX-512); -mtune only schedules
    flags = ["-O3", "-fPIC", "-shared", "-std=gnu11", *isa.flags] + (["-mtune=native"] if isa.flags else [])
    try:
        # the compiler's own temporaries (assembly, object) go into `into` too: a build that is interrupted
        # removes them with it, where /tmp would keep them
        done = subprocess.run([cc, *flags, "-o", str(out), str(source), "-lm"], capture_output=True, text=True,
                              timeout=COMPILE_SECONDS, env={**os.environ, "TMPDIR": str(Path(into).resolve())})
    except (subprocess.TimeoutExpired, OSError) as exc:
        return Library(None, why_not=f"{cc} could not compile {source.name}: {type(exc).__name__}")
    if done.returncode != 0 or not out.is_file():
        first = (done.stderr.strip().splitlines() or ["no message"])[0]
        return Library(None, why_not=f"{cc} could not compile {source.name}: {first[:200]}")
    built = library_isa(out)
    if built != isa.name:  # a compiler that ignored a flag: the source chose another path
        out.unlink()
        return Library(None, why_not=f"{cc} compiled {source.name} for {built}, not {isa.name}")
    if lacks:  # running it would stop at its first instruction this CPU does not have
        out.unlink()
        return Library(None, why_not=f"compiled for {isa.name}, which this CPU cannot run (it lacks {', '.join(lacks)})")
    failed = check_library(out)
    if failed:
        out.unlink()
        return Library(None, why_not=failed)
    return Library(out, built)


#: how long the check of a compiled library may take (an import of onnxruntime and four small sessions: about 1 s)
CHECK_SECONDS = 120


def check_library(library: Path) -> str | None:
    """Run each operator kind of ``library`` once in a child process against its reference (:mod:`.probe`), so that
    a C API position that does not match the installed ONNX Runtime is found without crashing this process; None
    when it works, else one line saying why it does not."""
    import signal
    import sys

    try:
        done = subprocess.run([sys.executable, "-m", "mla_deploy.ort.probe", str(library)], capture_output=True,
                              text=True, timeout=CHECK_SECONDS)
    except (subprocess.TimeoutExpired, OSError) as exc:
        return f"the operator library could not be checked against ONNX Runtime: {type(exc).__name__}"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        try:
            how = f"crashed ({signal.Signals(-done.returncode).name})"
        except ValueError:
            how = f"was killed by signal {-done.returncode}"
    else:
        how = "failed: " + ((done.stdout.strip().splitlines() or ["no message"])[-1])
    return (f"the operator library does not work with this ONNX Runtime: it {how} when run once in a child process "
            f"(its C API table positions in {source_path().name} do not match)")


def api_version(onnxruntime_version: str) -> int:
    """The ``OrtApi`` version of an ONNX Runtime release (``ORT_API_VERSION`` is its minor version: 1.31.1 -> 31)."""
    parts = onnxruntime_version.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def why_not_here(features: tuple[str, ...]) -> str | None:
    """Why ``build --target cpu`` would keep ONNX Runtime's kernels on a machine whose CPU has ``features`` (its
    :func:`~mla_deploy.ort.record.host_cpu` features: no source, no C compiler, none of :data:`FAST_PATHS`), or None
    when it compiles the operators (for :func:`fast_path`'s instruction set); without compiling (``mla-deploy
    doctor``)."""
    return _missing() or (None if fast_path(features) else NO_FAST_PATH)


def register(options, library: Path) -> None:
    """Register the operator library at ``library`` with the ONNX Runtime ``SessionOptions`` ``options``.

    Raises:
        ArtifactError: the library does not load (a missing or foreign file)."""
    import onnxruntime

    from ..errors import ArtifactError

    try:
        wanted = ctypes.CDLL(str(library)).mla_deploy_cpu_ops_api_version()
    except (OSError, AttributeError) as exc:
        raise ArtifactError(f"{library} is not an mla-deploy operator library: {exc}") from exc
    running = api_version(onnxruntime.__version__)
    if running < wanted:
        raise ArtifactError(f"the operator library {library} needs ONNX Runtime's C API version {wanted} or newer; "
                            f"ONNX Runtime {onnxruntime.__version__} has {running}")
    try:
        options.register_custom_ops_library(str(library))
    except Exception as exc:  # onnxruntime raises its own types
        raise ArtifactError(f"ONNX Runtime cannot load the operator library {library}: "
                            f"{(str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]}") from exc

"""ik_llama.cpp beside mainline (``--ik-llama SRC``): its ``llama-bench`` built from a source folder the user gives,
run on mainline's GGUF files, two rows per precision and context: its defaults spelled out (``-mla 3 -fa 1 -fmoe
1``) and the same with ``-rtr 1`` (the weights repacked for its kernels at load).

ik_llama.cpp takes a DeepSeek-V2 model for the layout without a query compression (V2-Lite's) only at 26 or 27
layers (it does not read ``attention.q_lora_rank``, which :mod:`.convert_entry` writes as 0 for such a
checkpoint), so a checkpoint cut to its first layers would not load. The build therefore compiles a copy of the
source under the cache (never the user's folder) with that condition widened to "or no query compression" and the
key read where present (:data:`PATCH`); nothing else changes. The build is keyed by the source's commit (its git
HEAD, else a hash of its files) and the patch's revision, so another commit builds beside it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .checks import compilers
from .settings import CompareError, Settings
from .steps import HERE, Step

#: what marks a folder as an ik_llama.cpp source (mainline has neither)
MARKERS = ("ggml/src/iqk", "examples/llama-bench/llama-bench.cpp")
#: top-level folders of a source left out of its hash and its copy (a build made inside it, git's own)
SKIPPED = (".git", "build")
_LITE = "(hparams.n_layer == 27 || hparams.n_layer == 26)"
_WIDE = "(hparams.n_layer == 27 || hparams.n_layer == 26 || hparams.n_lora_q == 0)"
#: file -> (text, replacement, how many times): the "lite" layout also when the model has no query compression;
#: llama-hparams.cpp reads q_lora_rank where the file holds it (a model without the key keeps 0, as before)
PATCH = {
    "src/llama-hparams.cpp": ((f"bool is_lite = {_LITE}",
                               f"ml.get_key(LLM_KV_ATTENTION_Q_LORA_RANK, hparams.n_lora_q, false);\n"
                               f"                bool is_lite = {_WIDE}"), 1),
    "src/llama-load-tensors.cpp": ((f"const bool is_lite = {_LITE}", f"const bool is_lite = {_WIDE}"), 1),
    "src/graphs/build_deepseek2.cpp": ((f"bool is_lite = {_LITE}", f"bool is_lite = {_WIDE}"), 1),
}
#: written into the copy once it is complete and patched
COPIED = ".mla-deploy-copied"
#: the title's note of what the build changed
PATCH_NOTE = "built with its V2-Lite layout taken also where a model has no query compression"
#: ik_llama.cpp's llama-bench: its defaults for DeepSeek spelled out, and with the weights repacked at load
VARIANTS = {"ik": ("-mla", "3", "-fa", "1", "-fmoe", "1"), "ik-rtr": ("-mla", "3", "-fa", "1", "-fmoe", "1",
                                                                   "-rtr", "1")}
#: the table's name of each variant
LABELS = {"ik": "ik_llama.cpp", "ik-rtr": "ik_llama.cpp -rtr"}
#: ik_llama.cpp's cmake options besides the build type and the native CPU: one static llama-bench; its
#: FlashAttention kernels for the quantized caches left out (the comparison runs its default F16 cache) to halve
#: the build
CMAKE_OPTIONS = ("-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF",
                 "-DGGML_IQK_FA_ALL_QUANTS=OFF")


def check_source(folder: Path) -> Path:
    """``folder`` resolved; :class:`CompareError` when it is no ik_llama.cpp source folder."""
    if not folder.is_dir():
        raise CompareError(f"no ik_llama.cpp source folder at {folder}")
    missing = [m for m in MARKERS if not (folder / m).exists()]
    if missing:
        raise CompareError(f"{folder} is not an ik_llama.cpp source folder: it has no {' nor '.join(missing)}")
    return folder.resolve()


def _files(folder: Path):
    for root, dirs, files in os.walk(folder):
        if Path(root) == folder:
            dirs[:] = [d for d in dirs if not d.startswith(SKIPPED)]
        dirs.sort()
        for name in sorted(files):
            yield Path(root) / name


def source_key(folder: Path) -> str:
    """The source's commit (12 hex digits of its git HEAD) where it is a git checkout, else ``files-`` and 12 hex
    digits of a hash of its files' paths and bytes (an exported tree, which has no git)."""
    try:
        proc = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        top, head = proc.stdout.split()
        if proc.returncode == 0 and Path(top).resolve() == folder.resolve():
            dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=60).stdout.strip()
            if not dirty:
                return head[:12]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    digest = hashlib.sha256()
    for path in _files(folder):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        if not path.is_symlink():
            digest.update(path.read_bytes())
    return "files-" + digest.hexdigest()[:12]


def copy_and_patch(source: Path, copy: Path) -> None:
    """Copy ``source`` (without its git folder or builds) to ``copy`` and apply :data:`PATCH`; a file whose text
    is not there any more (ik_llama.cpp changed it) is one error naming it (:data:`.settings.IK_PATCH_REVISION`
    changes with the patch). The copy is marked complete (:data:`COPIED`) last, so an interrupted build resumes
    from it rather than copying again (which would make every object stale)."""
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(source, copy, symlinks=True,
                    ignore=lambda d, names: [n for n in names if Path(d) == source and n.startswith(SKIPPED)])
    for name, ((old, new), times) in PATCH.items():
        path = copy / name
        text = path.read_text() if path.is_file() else ""
        if text.count(old) != times:
            raise CompareError(f"cannot widen ik_llama.cpp's V2-Lite condition: {name} of {source} has "
                               f"{text.count(old)} times {old!r}, expected {times}")
        path.write_text(text.replace(old, new))
    (copy / COPIED).write_text(f"{source}\n")


def build_steps(s: Settings) -> list[Step]:
    """Copy and patch the source (:func:`copy_and_patch`), configure and build ``llama-bench``; each cached once
    the build is recorded (:attr:`Settings.ik_built`)."""
    copy = s.ik_dir / "src"
    generator = ("-G", "Ninja") if shutil.which("ninja") else ()
    compiler = (f"-DCMAKE_CXX_COMPILER={compilers()[0]}",) if os.environ.get("CXX") and compilers() else ()
    return [Step("ik-copy", (sys.executable, "-m", "llama_compare.ik", str(s.ik_source), str(copy)),
                 done=s.ik_built or (copy / COPIED).is_file(), env={"PYTHONPATH": str(HERE.parent)}),
            Step("ik-configure", ("cmake", "-S", str(copy), "-B", str(s.ik_build), *generator, *compiler,
                                  "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", *CMAKE_OPTIONS), done=s.ik_built),
            Step("ik-build", ("cmake", "--build", str(s.ik_build), "--target", "llama-bench", "-j",
                              str(os.cpu_count() or 1)), done=s.ik_built)]


def bench_argv(s: Settings, gguf: Path, variant: str) -> tuple[str, ...]:
    """ik_llama.cpp's llama-bench on one GGUF file: the prompt, the decode at context 0 (``-n``) and after each
    other context (``-gp CONTEXT,N``: it takes no ``-d``; the tokens/s of a ``-gp`` test count the decode only),
    the weights read into memory (``-mmp 0``), JSON on standard output."""
    after = [("-gp", f"{c},{s.generate}") for c in s.contexts if c]
    return (str(s.ik_tool), "-m", str(gguf), "-t", str(s.threads), "-r", str(s.repetitions), "-p", str(s.prompt),
            "-n", str(s.generate if 0 in s.contexts else 0), *(a for pair in after for a in pair), *VARIANTS[variant],
            "-mmp", "0", "-o", "json")


def bench(s: Settings, key: str, kind: str, variant: str, round_: int) -> Step:
    return Step(f"{variant}-llama-bench-{kind}-{round_}", bench_argv(s, s.gguf(key, kind), variant),
                stdout=s.ik_json(variant, kind, round_))


def main(argv: list[str]) -> None:
    """``python -m llama_compare.ik SOURCE COPY``: the build's copy step (:func:`copy_and_patch`)."""
    source, copy = map(Path, argv)
    try:
        copy_and_patch(source, copy)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])

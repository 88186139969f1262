"""The refusals a run makes before it starts anything, each one line: no checkpoint, not a DeepSeek one, no
cmake or compiler; and the checkpoint's fingerprint, which keys its GGUF files in the cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .settings import ARCHITECTURES, CompareError

#: bytes of each weight file's end that go into the fingerprint beside its safetensors header
SAMPLE_BYTES = 1 << 20
#: changes with what :mod:`.convert_entry` writes, so GGUF files of an older revision are not reused
CONVERTER_REVISION = "3"
#: files whose presence means the checkpoint has a tokenizer llama.cpp's converter can read
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def check_checkpoint(folder: Path) -> dict:
    """The checkpoint's ``config.json``; :class:`CompareError` when ``folder`` is no DeepSeek checkpoint with
    safetensors weights."""
    if not folder.is_dir():
        raise CompareError(f"no checkpoint folder at {folder}")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CompareError(f"{folder} is not a Hugging Face checkpoint: it has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise CompareError(f"{config_file} does not read as JSON: {exc}") from None
    architectures = config.get("architectures") or []
    if not set(architectures) & set(ARCHITECTURES):
        raise CompareError(f"{folder} is not a checkpoint both engines take: its architectures are "
                           f"{architectures or 'none'}, the comparison takes {', '.join(ARCHITECTURES)}")
    if not weight_files(folder):
        raise CompareError(f"{folder} has no *.safetensors weights")
    return config


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def fingerprint(folder: Path, version: str) -> str:
    """16 hex digits naming the checkpoint's GGUF files: its config, each weight file's name, size, safetensors
    header and last :data:`SAMPLE_BYTES` (two random checkpoints of one shape differ there), the tokenizer files,
    the llama.cpp version converting them and :data:`CONVERTER_REVISION`."""
    digest = hashlib.sha256(f"{version} {CONVERTER_REVISION}".encode())
    for name in ("config.json",) + TOKENIZER_FILES:
        if (folder / name).is_file():
            digest.update(name.encode() + (folder / name).read_bytes())
    for path in weight_files(folder):
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f"{path.name}:{size}".encode() + f.read(min(header, size - 8)))
            f.seek(max(0, size - SAMPLE_BYTES))
            digest.update(f.read())
    return digest.hexdigest()[:16]


def compilers() -> list[str]:
    """The C++ compilers found: ``$CXX`` when set, else c++, g++, clang++ on the PATH."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return [name for name in names if shutil.which(name)]


def missing_build_tools() -> list[str]:
    """What building llama.cpp needs and this machine lacks (empty: all there)."""
    missing = [] if shutil.which("cmake") else ["cmake"]
    if not compilers():
        missing.append("a C++ compiler (c++, g++ or clang++, or $CXX)")
    if not (shutil.which("ninja") or shutil.which("make")):
        missing.append("ninja or make")
    return missing


def require_build_tools() -> None:
    missing = missing_build_tools()
    if missing:
        raise CompareError(f"cannot build llama.cpp here: missing {', '.join(missing)}")


def pip_command() -> list[str]:
    """pip as the running interpreter's module, else ``pip3``/``pip`` on the PATH."""
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "pip"]
    found = shutil.which("pip3") or shutil.which("pip")
    if not found:
        raise CompareError("cannot download llama-cpp-python: pip is not installed")
    return [found]

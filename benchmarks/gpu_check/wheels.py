"""The wheels the GPU machine lacks: downloaded here, packed into parts a call can carry, joined and installed there.

The GPU machine's image (Python 3.12, torch 2.11+cu130) has everything the project needs except ``polygraphy`` and
``onnxruntime-gpu`` (it has the CPU ``onnxruntime``). onnxruntime-gpu 1.31.1's PyPI wheel is built for CUDA 13.0
(``capi/build_and_package_info.py``: ``cuda_version = '13.0'``; its CUDA provider needs ``libcublas.so.13``,
``libcublasLt.so.13``, ``libcudart.so.13``, ``libcurand.so.10``), the CUDA major of torch's cu130 libraries there.

The wheel is 244 MiB, over one call's 64 MiB. Its payload is deflated, which xz cannot shrink further, so it is
rewritten uncompressed (the same files, so the same RECORD), compressed with xz (about a fifth smaller than the
deflated wheel) and split into equal parts of at most :data:`~layout.PART_LIMIT`. Each part folder carries the
same ``manifest.json`` (sizes and sha256 of every part, of the wheel as PyPI serves it and of the rewritten one).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .layout import DOWNLOADS, MANIFEST, PACK, PART_LIMIT, Work, part_dir

#: (name, version) of every wheel carried; the first is packed into parts, the others ride in part 0
WHEELS = (("onnxruntime-gpu", "1.31.1"), ("polygraphy", "0.53.6"))
TARGET_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
CHUNK = 1 << 20


class PackError(Exception):
    """A part missing, damaged or of another pack; a download or an install that failed."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(name: str, version: str, dest: Path = DOWNLOADS) -> Path:
    """The wheel of ``name==version`` for CPython 3.12 manylinux x86_64 in ``dest``, downloaded once."""
    prefix = f"{name.replace('-', '_')}-{version}-"
    found = sorted(dest.glob(prefix + "*.whl"))
    if not found:
        dest.mkdir(parents=True, exist_ok=True)
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               TARGET_PYTHON, "--implementation", "cp", *platforms, "-d", str(dest), f"{name}=={version}"]
        print("$", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            raise PackError(f"pip could not download {name}=={version}")
        found = sorted(dest.glob(prefix + "*.whl"))
    if len(found) != 1:
        raise PackError(f"expected one wheel {prefix}*.whl in {dest}, found {[p.name for p in found]}")
    return found[0]


def _stored_copy(wheel: Path, dest: Path) -> None:
    """``wheel`` rewritten with every member uncompressed (zip STORED): the same names, bytes and RECORD."""
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            member = zipfile.ZipInfo(info.filename, info.date_time)
            member.external_attr = info.external_attr
            with src.open(info) as reader, out.open(member, "w", force_zip64=True) as writer:
                shutil.copyfileobj(reader, writer, CHUNK)


def _write_parts(packed: Path, name: str, count: int, pack: Path) -> list[dict]:
    """Split ``packed`` into ``count`` parts of equal size (the last one shorter) under ``pack/part-K/``."""
    size = math.ceil(packed.stat().st_size / count)
    parts = []
    with open(packed, "rb") as src:
        for index in range(count):
            folder = part_dir(index, pack)
            folder.mkdir(parents=True, exist_ok=True)
            target, digest, written = folder / f"{name}.{index:02d}", hashlib.sha256(), 0
            with open(target, "wb") as out:
                while written < size and (chunk := src.read(min(CHUNK, size - written))):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
            parts.append({"file": f"{folder.name}/{target.name}", "bytes": written, "sha256": digest.hexdigest()})
    return parts


def pack_wheel(wheel: Path, pack: Path = PACK, limit: int = PART_LIMIT, preset: int = 6) -> dict:
    """Rewrite ``wheel`` uncompressed, xz it and split it into parts of at most ``limit`` bytes; its manifest entry."""
    pack.mkdir(parents=True, exist_ok=True)
    stored, packed = pack / (wheel.name + ".stored"), pack / (wheel.name + ".xz")
    try:
        print(f"rewriting {wheel.name} uncompressed and compressing it with xz (several minutes, once)", flush=True)
        _stored_copy(wheel, stored)
        with open(stored, "rb") as src, lzma.open(packed, "wb", preset=preset) as out:
            shutil.copyfileobj(src, out, CHUNK)
        count = max(1, math.ceil(packed.stat().st_size / limit))
        return {"wheel": wheel.name, "sha256_download": sha256_file(wheel), "sha256_stored": sha256_file(stored),
                "stored_bytes": stored.stat().st_size, "xz_bytes": packed.stat().st_size,
                "parts": _write_parts(packed, wheel.name + ".xz", count, pack)}
    finally:
        stored.unlink(missing_ok=True)
        packed.unlink(missing_ok=True)


def read_manifest(pack: Path = PACK) -> dict | None:
    """The manifest of the parts under ``pack`` (every part folder holds the same one); None if none is there."""
    found = sorted(pack.glob(f"part-*/{MANIFEST}"))
    if not found:
        return None
    manifests = [json.loads(p.read_text()) for p in found]
    if any(m["id"] != manifests[0]["id"] for m in manifests):
        raise PackError(f"the part folders under {pack} come from different prepares: prepare again and carry them all")
    return manifests[0]


def _pack_is_current(manifest: dict | None, wheel: Path, pack: Path) -> bool:
    if manifest is None or manifest["packed"]["wheel"] != wheel.name:
        return False
    if manifest["packed"]["sha256_download"] != sha256_file(wheel):
        return False
    return all((pack / p["file"]).is_file() and sha256_file(pack / p["file"]) == p["sha256"]
               for p in manifest["packed"]["parts"])


def prepare(pack: Path = PACK, downloads: Path = DOWNLOADS, limit: int = PART_LIMIT) -> dict:
    """Download every wheel of :data:`WHEELS` (once), pack the large one (once) and write the manifest."""
    wheels = [download(name, version, downloads) for name, version in WHEELS]
    current = read_manifest(pack) if pack.is_dir() else None
    if _pack_is_current(current, wheels[0], pack):
        packed = current["packed"]
        print(f"{wheels[0].name}: the parts under {pack} are current", flush=True)
    else:
        shutil.rmtree(pack, ignore_errors=True)
        packed = pack_wheel(wheels[0], pack, limit)
    extra = []
    for wheel in wheels[1:]:
        shutil.copy2(wheel, part_dir(0, pack) / wheel.name)
        extra.append({"file": f"{part_dir(0, pack).name}/{wheel.name}", "bytes": wheel.stat().st_size,
                      "sha256": sha256_file(wheel)})
    body = {"python": TARGET_PYTHON, "versions": dict(WHEELS), "packed": packed, "wheels": extra}
    manifest = {"id": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16], **body}
    for index in range(len(packed["parts"])):
        (part_dir(index, pack) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def missing_parts(manifest: dict, pack: Path = PACK) -> list[str]:
    """The part files of ``manifest`` not (or not wholly) under ``pack``."""
    files = manifest["packed"]["parts"] + manifest["wheels"]
    return [p["file"] for p in files if not (pack / p["file"]).is_file() or (pack / p["file"]).stat().st_size != p["bytes"]]


def join_parts(manifest: dict, pack: Path, dest: Path) -> Path:
    """Check every part's sha256, decompress the joined parts into ``dest/WHEEL`` and check the wheel's sha256."""
    dest.mkdir(parents=True, exist_ok=True)
    packed = manifest["packed"]
    wheel, whole, decompressor = dest / packed["wheel"], hashlib.sha256(), lzma.LZMADecompressor()
    with open(wheel, "wb") as out:
        for part in packed["parts"]:
            digest = hashlib.sha256()
            with open(pack / part["file"], "rb") as src:
                for chunk in iter(lambda: src.read(CHUNK), b""):
                    digest.update(chunk)
                    data = decompressor.decompress(chunk)
                    out.write(data)
                    whole.update(data)
            if digest.hexdigest() != part["sha256"]:
                raise PackError(f"{part['file']} is damaged (sha256 differs from the manifest): carry it again")
    if not decompressor.eof or whole.hexdigest() != packed["sha256_stored"]:
        raise PackError(f"the joined parts do not give {packed['wheel']} (sha256 differs): prepare and carry again")
    return wheel


def copy_wheels(manifest: dict, pack: Path, dest: Path) -> list[Path]:
    """The small wheels of part 0, checked and copied into ``dest``."""
    out = []
    for entry in manifest["wheels"]:
        if sha256_file(pack / entry["file"]) != entry["sha256"]:
            raise PackError(f"{entry['file']} is damaged (sha256 differs from the manifest): carry it again")
        out.append(Path(shutil.copy2(pack / entry["file"], dest / Path(entry["file"]).name)))
    return out


IMPORT_CHECK = """
import json, onnxruntime, polygraphy
from onnxruntime.capi import build_and_package_info as info
print(json.dumps({"onnxruntime": onnxruntime.__version__, "package": info.package_name,
                  "cuda_version": getattr(info, "cuda_version", None), "onnxruntime_file": onnxruntime.__file__,
                  "providers": onnxruntime.get_available_providers(), "polygraphy": polygraphy.__version__}))
"""


def pip_install(wheels: list[Path], site: Path) -> dict:
    """``pip install --no-index --no-deps --target site`` of ``wheels``; then what imports from ``site``."""
    shutil.rmtree(site, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site), *map(str, wheels)]
    print("$", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise PackError("pip install of the carried wheels failed (its output is above)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    check = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, env=env)
    if check.returncode != 0:
        raise PackError(f"the installed packages do not import: {check.stderr.strip().splitlines()[-1:]}")
    return json.loads(check.stdout)


def install(work: Work, pack: Path = PACK) -> int:
    """Join the parts and install the wheels into ``work.site``: 0 installed (or already), 3 parts missing, 1 error."""
    manifest = read_manifest(pack) if pack.is_dir() else None
    if manifest is None:
        print(f"install: no part folder under {pack} (carry .whl/gpu-check/part-0, ...)", flush=True)
        return 3
    missing = missing_parts(manifest, pack)
    if missing:
        print(f"install: waiting for {', '.join(missing)} (carry their folders in the next calls)", flush=True)
        return 3
    done = json.loads(work.install_file.read_text()) if work.install_file.is_file() else {}
    if done.get("id") == manifest["id"] and work.site.is_dir():
        print(f"install: already installed into {work.site} ({done['imports']['onnxruntime']})", flush=True)
        return 0
    try:
        wheels = [join_parts(manifest, pack, work.wheels), *copy_wheels(manifest, pack, work.wheels)]
        imports = pip_install(wheels, work.site)
    except PackError as exc:
        print(f"install: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(work.wheels, ignore_errors=True)
    work.root.mkdir(parents=True, exist_ok=True)
    work.install_file.write_text(json.dumps({"id": manifest["id"], "imports": imports}, indent=2) + "\n")
    print(f"install: {imports['package']} {imports['onnxruntime']} (CUDA {imports['cuda_version']}) and polygraphy "
          f"{imports['polygraphy']} installed into {work.site}; providers {imports['providers']}", flush=True)
    return 0

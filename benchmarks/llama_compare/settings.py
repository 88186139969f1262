"""What a comparison run measures and where it keeps its files (one owner for every path)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

#: our ``--weights`` name -> llama.cpp's type of the same precision (both: blocks of 32 with one scale each)
PRECISIONS = {"float": "F32", "int8": "Q8_0", "int4": "Q4_0"}
#: the llama-cpp-python release whose vendored llama.cpp the issue's figures came from
DEFAULT_VERSION = "0.3.36"
#: the converter's ``--outtype`` for the types it writes itself; the others come from llama-quantize
CONVERTER_TYPES = {"F32": "f32", "BF16": "bf16", "Q8_0": "q8_0"}
#: what llama-quantize may read (``--quantize-from``): F32 as the issue's figures; BF16 gives the same Q4_0 from a
#: bf16 checkpoint at half the disk; Q8_0 (requantized, not the same Q4_0) where even that does not fit
QUANTIZE_SOURCES = ("F32", "BF16", "Q8_0")
#: Hugging Face architectures both llama.cpp's converter and mla-deploy take (GLM-4.7-Flash's is DeepSeek-V3's
#: attention, llama.cpp's ``deepseek2``; DeepSeek-V3.2's is its ``deepseek32``, the indexer included)
ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "DeepseekV32ForCausalLM")
#: the llama.cpp tools the comparisons need (llama-server: benchmarks/serve_bench.py --llama-server)
TARGETS = ("llama-bench", "llama-quantize", "llama-server")
#: changes with what :mod:`.ik` changes in ik_llama.cpp's source, so a build of an older change is not reused
IK_PATCH_REVISION = "1"


class CompareError(Exception):
    """A user error: printed as one line, exit status 1."""


def default_cache() -> Path:
    """``$MLA_DEPLOY_CACHE``, else ``$XDG_CACHE_HOME/mla-deploy``, else ``~/.cache/mla-deploy``."""
    if os.environ.get("MLA_DEPLOY_CACHE"):
        return Path(os.environ["MLA_DEPLOY_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mla-deploy"


@dataclass(frozen=True)
class Settings:
    """One comparison.

    Attributes:
        checkpoint: the Hugging Face DeepSeek checkpoint folder both engines read.
        out: where the table (compare.json, compare.md), llama-bench's outputs, bench.json and the logs go (our
            exported artifacts too, reused by a later run).
        cache: the llama.cpp build and the GGUF files, reused by later runs.
        version: the llama-cpp-python release whose vendored llama.cpp is built.
        precisions: our ``--weights`` names (keys of :data:`PRECISIONS`).
        contexts: cached tokens before the decode steps (llama-bench ``-d``, ours ``--context``).
        threads: threads of both engines.
        repetitions: llama-bench ``-r``.
        prompt: prompt tokens of the prefill (llama-bench ``-p``, ours ``--prompt-length``).
        generate: tokens llama-bench generates per repetition (``-n``).
        our_repeat: our timed decode steps per point and timed prefills (``--repeat``).
        rounds: how many times both engines are measured, alternating per precision (ours then llama.cpp in odd
            rounds, llama.cpp then ours in even ones): this machine's read bandwidth moves between states for
            minutes at a time (docs/benchmarks.md), so a ratio is taken within one round and the table gives their median.
        pairs: how many paired decode measurements follow the rounds per precision and context (0: none;
            :mod:`.paired`).
        interleave: how many neighbouring bursts of both engines, held open side by side, follow per precision
            and context (0: none; :mod:`.interleaved`).
        quantize_from: the GGUF type (:data:`QUANTIZE_SOURCES`) llama-quantize makes Q4_0 from; removed once used
            when no requested precision is that type (a 27-layer V2-Lite F32 file is 63 GB).
        pure: llama-quantize ``--pure``: every matrix it quantizes in the one type asked for. Without it (its
            default, what a llama.cpp user gets) a Q4_0 file keeps ``output.weight`` in Q6_K, more bytes a step than
            our int4 ``lm_head`` reads; with it both engines read the same weights at the same precision. Kept as a
            file of its own (:meth:`gguf`).
        ik_source: an ik_llama.cpp source folder (``--ik-llama``) whose ``llama-bench`` runs beside mainline's on the
            same GGUF files in every round (:mod:`.ik`); None: mainline only.
        ik_key: that source's commit, or a hash of its files (:func:`.ik.source_key`), which keys its build.
    """

    checkpoint: Path
    out: Path
    cache: Path
    version: str = DEFAULT_VERSION
    precisions: tuple[str, ...] = tuple(PRECISIONS)
    contexts: tuple[int, ...] = (0, 1024)
    threads: int = 2
    repetitions: int = 3
    prompt: int = 512
    generate: int = 128
    our_repeat: int = 10
    quantize_from: str = "F32"
    rounds: int = 3
    pairs: int = 0
    interleave: int = 0
    pure: bool = False
    ik_source: Path | None = None
    ik_key: str = ""

    @property
    def llama_dir(self) -> Path:
        """The sdist, its extracted source and the build of this version."""
        return self.cache / f"llama.cpp-{self.version}"

    @property
    def source(self) -> Path:
        return self.llama_dir / "src"

    @property
    def vendored(self) -> Path:
        """llama.cpp inside the sdist."""
        return self.source / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build(self) -> Path:
        return self.llama_dir / "build"

    @property
    def build_record(self) -> Path:
        """Written after a successful build: a later run reuses the build."""
        return self.llama_dir / "build.json"

    @property
    def built(self) -> bool:
        """The build is recorded with every tool of :data:`TARGETS` (one recorded before a tool was added is built
        again)."""
        try:
            targets = json.loads(self.build_record.read_text()).get("targets", ())
        except (OSError, ValueError, AttributeError):
            return False
        return set(TARGETS) <= set(targets)

    def tool(self, name: str) -> Path:
        return self.build / "bin" / name

    @property
    def converter_deps(self) -> Path:
        """``pip install --target`` folder of the converter's modules the running interpreter lacks."""
        return self.cache / "convert-deps"

    def gguf_dir(self, key: str) -> Path:
        """The GGUF files of the checkpoint whose fingerprint is ``key``."""
        return self.cache / "gguf" / key

    def gguf(self, key: str, kind: str) -> Path:
        """The file of ``kind``; llama-quantize's files made ``--pure`` (:attr:`pure`) are ``model-KIND-pure.gguf``."""
        pure = "-pure" if self.pure and kind not in CONVERTER_TYPES else ""
        return self.gguf_dir(key) / f"model-{kind}{pure}.gguf"

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    @property
    def bench_out(self) -> Path:
        """``mla-deploy bench model --out`` of every round (the exported artifacts there are reused)."""
        return self.out / "mla-deploy"

    def ours_artifact(self, weights: str) -> Path:
        """The export ``mla-deploy bench model`` made of ``weights`` under :attr:`bench_out` (its ``artifact`` or
        ``artifact-int8`` ... folder)."""
        from mla_deploy import quant

        return self.bench_out / quant.plan(weights, 32 if weights != "float" else None).variant("artifact")

    def ours_json(self, weights: str, round_: int) -> Path:
        """The bench.json of one precision in one round (1-based), moved here once that bench succeeded."""
        return self.out / "rounds" / f"mla-deploy-{weights}-{round_}.json"

    def llama_json(self, kind: str, round_: int) -> Path:
        return self.out / "rounds" / f"llama-bench-{kind}-{round_}.json"

    @property
    def ik_dir(self) -> Path:
        """ik_llama.cpp's patched copy (``src``), its build and its build record, per source commit and patch."""
        return self.cache / f"ik_llama.cpp-{self.ik_key}-patch{IK_PATCH_REVISION}"

    @property
    def ik_build(self) -> Path:
        return self.ik_dir / "build"

    @property
    def ik_record(self) -> Path:
        """Written after a successful build of ik_llama.cpp's llama-bench: a later run reuses the build."""
        return self.ik_dir / "build.json"

    @property
    def ik_built(self) -> bool:
        return self.ik_record.is_file() and self.ik_tool.is_file()

    @property
    def ik_tool(self) -> Path:
        """ik_llama.cpp's llama-bench."""
        return self.ik_build / "bin" / "llama-bench"

    def ik_json(self, variant: str, kind: str, round_: int) -> Path:
        """ik_llama.cpp's llama-bench JSON of one variant (:data:`.ik.VARIANTS`), type and round."""
        return self.out / "rounds" / f"{variant}-llama-bench-{kind}-{round_}.json"

"""The artifact: one owner for its manifest, its integrity checks and the atomic file helpers.

* :class:`Manifest` (frozen) with :func:`load_manifest` and :meth:`Manifest.save`: ``manifest.json``.
* :func:`check_artifact`: hashes, the I/O contract and the ONNX files' own I/O against the manifest.
* :class:`TokenizerFiles`, :func:`copy_tokenizer_files`: the checkpoint's tokenizer files an artifact carries.
* :mod:`.files`: :func:`atomic_dir`, :func:`atomic_write_text`, :func:`atomic_file`, :func:`sha256_file`.
* :mod:`.target`: what an export may do to an existing output folder (:func:`check_export_target`).

Importing this package imports neither torch nor onnx (the ONNX checks import onnx when they run).
"""

from .check import check_artifact
from .files import (atomic_dir, atomic_file, atomic_write_bytes, atomic_write_text, replace_dir, sampled_sha256,
                    sha256_file)
from .manifest import (FORMAT, FORMAT_VERSION, MANIFEST, REFERENCE_WEIGHTS, SUPPORTED_FORMAT_VERSIONS, GraphEntry,
                       Manifest, WeightsSource, load_manifest, now, read_fingerprint)
from .tokenizer_files import TOKENIZER_FILES, TokenizerFiles, copy_tokenizer_files

__all__ = ["check_artifact", "atomic_dir", "atomic_file", "atomic_write_bytes", "atomic_write_text", "replace_dir",
           "sha256_file", "sampled_sha256", "FORMAT", "FORMAT_VERSION", "MANIFEST", "REFERENCE_WEIGHTS", "SUPPORTED_FORMAT_VERSIONS",
           "GraphEntry", "Manifest", "WeightsSource", "load_manifest", "now", "read_fingerprint",
           "TOKENIZER_FILES", "TokenizerFiles", "copy_tokenizer_files"]

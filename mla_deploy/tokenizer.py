"""Deprecated import path, kept for one release (0.2 removes it): the names are :mod:`mla_deploy.generate.tokenizer`'s, also importable from
:mod:`mla_deploy.generate`."""

import warnings

warnings.warn("mla_deploy.tokenizer is deprecated and will be removed in 0.2: import from mla_deploy.generate",
              DeprecationWarning, stacklevel=2)

from .generate.tokenizer import ArtifactTokenizer, IncrementalDetokenizer, load_tokenizer  # noqa: E402
__all__ = ["ArtifactTokenizer", "IncrementalDetokenizer", "load_tokenizer"]

"""Deprecated import path, kept for one release (0.2 removes it): the names are :mod:`mla_deploy.generate.text`'s, also importable from
:mod:`mla_deploy.generate`."""

import warnings

warnings.warn("mla_deploy.text is deprecated and will be removed in 0.2: import from mla_deploy.generate",
              DeprecationWarning, stacklevel=2)

from .generate.text import TextGeneration, TextPiece, TextStream, encode_prompts, generate_text, stream_text  # noqa: E402
__all__ = ["TextGeneration", "TextPiece", "TextStream", "encode_prompts", "generate_text", "stream_text"]

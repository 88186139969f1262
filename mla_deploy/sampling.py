"""Deprecated import path, kept for one release (0.2 removes it): the names are :mod:`mla_deploy.generate.sampling`'s, also importable from
:mod:`mla_deploy.generate`."""

import warnings

warnings.warn("mla_deploy.sampling is deprecated and will be removed in 0.2: import from mla_deploy.generate",
              DeprecationWarning, stacklevel=2)

from .generate.sampling import SamplingConfig, next_tokens, token_probabilities  # noqa: E402
__all__ = ["SamplingConfig", "next_tokens", "token_probabilities"]

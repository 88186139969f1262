"""The documented import path ``mla_deploy.sampling``: the names are :mod:`mla_deploy.generate.sampling`'s,
their owner."""

from .generate.sampling import SamplingConfig, next_tokens, token_probabilities

__all__ = ["SamplingConfig", "next_tokens", "token_probabilities"]

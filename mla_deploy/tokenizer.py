"""The documented import path ``mla_deploy.tokenizer``: the names are :mod:`mla_deploy.generate.tokenizer`'s,
their owner."""

from .generate.tokenizer import ArtifactTokenizer, IncrementalDetokenizer, load_tokenizer

__all__ = ["ArtifactTokenizer", "IncrementalDetokenizer", "load_tokenizer"]

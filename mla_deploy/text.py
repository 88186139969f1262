"""The documented import path ``mla_deploy.text``: the names are :mod:`mla_deploy.generate.text`'s, their owner."""

from .generate.text import TextGeneration, TextPiece, TextStream, encode_prompts, generate_text, stream_text

__all__ = ["TextGeneration", "TextPiece", "TextStream", "encode_prompts", "generate_text", "stream_text"]

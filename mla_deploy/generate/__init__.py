"""Generation, in one place: from prompts to new ids and text, over any engine that runs an artifact.

* :mod:`~mla_deploy.generate.engine`: :class:`GenerationEngine`, the engine interface the loop drives
  (``prefill``, ``decode``, ``argmax``, ...); every engine of :mod:`mla_deploy.engines` implements it.
* :mod:`~mla_deploy.generate.loop`: the loop (:func:`stream_tokens`, :func:`generate_tokens`), and its steps
  (:func:`prefill_step`, :func:`decode_step`: one decode step over a batch of cache rows).
* :mod:`~mla_deploy.generate.batching`: continuous batching (:class:`ContinuousBatcher`): requests join and leave
  one running batch between decode steps, each in its own row of an in-place cache (what ``mla-deploy serve`` runs),
  with ``n`` choices sharing a prefill, chunked prefill and a prefix cache (:mod:`~mla_deploy.generate.prefix_cache`).
* :mod:`~mla_deploy.generate.logprobs`: log probabilities of chosen tokens, as OpenAI's ``logprobs`` report them.
* :mod:`~mla_deploy.generate.request`: a request's checks and its right-padded batch.
* :mod:`~mla_deploy.generate.sampling`: greedy, temperature, top-k, top-p; seeded.
* :mod:`~mla_deploy.generate.tokenizer` and :mod:`~mla_deploy.generate.chat_template`: an artifact's tokenizer
  and chat template, as transformers applies them.
* :mod:`~mla_deploy.generate.text`: text in, text out, streamed, with stop strings.

Names are imported lazily (``from mla_deploy.generate import stream_text``), so importing the package loads
neither numpy nor the tokenizers library.
"""

from __future__ import annotations

from ..lazy import lazy_getattr

_LAZY = {
    "BatchingEngine": ".engine",
    "GenerationEngine": ".engine",
    "BATCH_FINISH_REASONS": ".batching",
    "ContinuousBatcher": ".batching",
    "SequenceEvent": ".batching",
    "Ticket": ".batching",
    "PrefixCache": ".prefix_cache",
    "TokenLogprob": ".logprobs",
    "FINISH_REASONS": ".loop",
    "Generation": ".loop",
    "GenerationStream": ".loop",
    "StepTokens": ".loop",
    "choose_tokens": ".loop",
    "decode_step": ".loop",
    "generate_tokens": ".loop",
    "prefill_step": ".loop",
    "stream_tokens": ".loop",
    "check_ids": ".request",
    "check_positions": ".request",
    "pad_prompts": ".request",
    "Sampler": ".sampling",
    "SamplingConfig": ".sampling",
    "next_tokens": ".sampling",
    "token_probabilities": ".sampling",
    "ArtifactTokenizer": ".tokenizer",
    "IncrementalDetokenizer": ".tokenizer",
    "load_tokenizer": ".tokenizer",
    "render_chat": ".chat_template",
    "StopText": ".text",
    "TextGeneration": ".text",
    "TextPiece": ".text",
    "TextStream": ".text",
    "encode_prompts": ".text",
    "generate_text": ".text",
    "stream_text": ".text",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)

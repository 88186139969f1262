"""``mla-deploy run``: generate from an exported artifact with ONNX Runtime."""

from __future__ import annotations

import click

from ..errors import InputError
from .groups import PromptArgs, Prompts, Runtime, RuntimeArgs, SamplingArgs
from .live import generate_and_show
from .options import Int


@click.command()
@click.argument("artifact", type=click.Path())
@PromptArgs()
@click.option("--max-new-tokens", default=32, show_default=True, type=Int())
@SamplingArgs()
@click.option("--json", "as_json", is_flag=True, help="Print the tokens, the text and the timings as JSON.")
@RuntimeArgs()
@click.option("--prefill-chunk", type=Int(), default=None,
              help="Prefill at most N prompt tokens per sequence in one call, the rest in further calls over the "
                   "cache. Default: as many as keep one layer's attention scores within 1 GiB (a short prompt "
                   "in one call; a batch of 32 prompts of 4096 tokens of DeepSeek-V2-Lite in chunks of 128).")
@click.option("--allow-long", is_flag=True, help="Run past the model's max_position_embeddings (with a warning).")
def run(artifact, prompts: Prompts, max_new_tokens, sampling, as_json, runtime: Runtime, prefill_chunk, allow_long):
    """Generate from an exported artifact with ONNX Runtime: text in and text out (--prompt, streamed as it is
    generated), or token ids (--prompt-ids). Stops at the checkpoint's end-of-sequence ids and --stop strings;
    greedy unless --temperature > 0."""
    from ..ort.engine import OrtEngine
    from ..generate.request import check_positions
    from ..generate.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(artifact)
    ids = _prompt_ids(prompts, tokenizer, artifact)
    engine = OrtEngine(artifact, provider=runtime.provider, threads=runtime.threads, use_engine=runtime.use_engine,
                       prefill_chunk=prefill_chunk, cuda=runtime.cuda)
    longest = max((len(p) for p in ids), default=0)
    warning = check_positions(engine.config, longest, max_new_tokens, allow_long)
    engine.check_request(longest, max_new_tokens)  # a request the cache cannot hold fails before any warning
    if warning:
        click.echo(f"mla-deploy: warning: {warning}", err=True)
    result, texts = generate_and_show(engine, tokenizer, ids, max_new_tokens, sampling, prompts.stop,
                                      bool(prompts.texts), as_json)
    info = engine.info()
    if as_json:
        import json

        click.echo(json.dumps(_run_record(result, info, ids, texts, sampling), indent=2, ensure_ascii=False))
    else:
        _print_timings(result, info, bool(prompts.texts))


def _prompt_ids(prompts: Prompts, tokenizer, artifact) -> list[list[int]]:
    """The token ids of each prompt: ``--prompt-ids`` as given, or the encoded ``--prompt`` texts."""
    if tokenizer is None and (prompts.texts or prompts.stop):
        raise InputError(f"{artifact} has no tokenizer (only an export of a checkpoint with tokenizer.json carries "
                         f"one), so {'--prompt' if prompts.texts else '--stop'} cannot be used; give --prompt-ids")
    if not prompts.texts:
        return list(prompts.ids)
    from ..generate.text import encode_prompts

    return encode_prompts(tokenizer, list(prompts.texts), prompts.chat, prompts.system)


def _print_timings(result, info: dict, from_text: bool) -> None:
    """The timings line (on stderr after text; the sequences were printed by :func:`.live.generate_and_show`)."""
    per_sequence = ", ".join(f"{t:.1f}" for t in result.sequence_tokens_per_second)
    click.echo(f"provider {result.provider} ({info['graphs']}); {info['precision']}, {info['cache_mode']} cache; "
               f"batch {len(result.tokens)}; time to first token {result.prefill_seconds * 1e3:.1f} ms; decode "
               f"{result.tokens_per_second:.1f} tokens/s for the batch, {per_sequence} tokens/s per sequence "
               f"({result.decode_steps} steps){_cuda_note(info)}", err=from_text)


def _cuda_note(info: dict) -> str:
    """On the CUDA provider: whether decode replays CUDA graphs (or why not) and where tokens are chosen."""
    if "cuda_graph" not in info:
        return ""
    return f"; CUDA graphs {info['cuda_graph']}; tokens chosen on the {info['token_choice']}"


def _run_record(result, info: dict, prompts: list[list[int]], texts, sampling) -> dict:
    """What ``run --json`` prints: per sequence its prompt ids, new tokens, text, finish reason and decode rate;
    the batch's timings, labelled."""
    import dataclasses

    sequences = []
    for i, tokens in enumerate(result.tokens):
        record = {"prompt_ids": prompts[i], "tokens": tokens, "finish_reason": result.finish_reasons[i],
                  "decode_tokens_per_second": _number(result.sequence_tokens_per_second[i])}
        if texts is not None:
            record["text"] = texts[i]
        sequences.append(record)
    return {"provider": result.provider, "graphs": info["graphs"], "huge_pages": info.get("huge_pages"),
            "mapped_weights": info.get("mapped_weights"), "precision": info["precision"],
            "cache_mode": info["cache_mode"], "cuda": info.get("cuda"), "cuda_graph": info.get("cuda_graph"),
            "token_choice": info.get("token_choice"),
            "sampling": dataclasses.asdict(sampling), "sequences": sequences,
            "timings": {"time_to_first_token_s": result.prefill_seconds, "decode_s": result.decode_seconds,
                        "decode_steps": result.decode_steps,
                        "decode_tokens_per_second_batch": _number(result.tokens_per_second)}}


def _number(value: float) -> float | None:
    """JSON has no NaN: a rate without decode steps is null."""
    return None if value != value else value

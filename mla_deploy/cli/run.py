"""``mla-deploy run``: generate from an exported artifact with ONNX Runtime."""

from __future__ import annotations


import click

from ..bench.options import Int
from .live import generate_and_show


def _parse_ids(values) -> list[list[int]]:
    from ..errors import InputError

    prompts = []
    for value in values:
        try:
            prompts.append([int(x) for x in value.replace(" ", "").split(",") if x != ""])
        except ValueError:
            raise InputError(f"--prompt-ids takes comma-separated integers, got {value!r}") from None
    return prompts


@click.command()
@click.argument("artifact", type=click.Path())
@click.option("--prompt", "prompts", multiple=True,
              help="A text prompt (needs an artifact exported from a checkpoint with its tokenizer); repeat for a "
                   "batch.")
@click.option("--prompt-ids", "prompt_ids", multiple=True,
              help="Comma-separated token ids of one prompt; repeat for a batch.")
@click.option("--chat", is_flag=True, help="Apply the checkpoint's chat template to each --prompt (a user turn).")
@click.option("--system", help="With --chat: a system message before each prompt.")
@click.option("--stop", multiple=True, help="Stop a sequence when its text contains this string; repeatable.")
@click.option("--max-new-tokens", default=32, show_default=True, type=Int())
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy; > 0 samples.")
@click.option("--top-k", type=Int(), help="Sample from the k most likely tokens (needs --temperature > 0).")
@click.option("--top-p", default=1.0, show_default=True, type=float,
              help="Sample from the most likely tokens up to this probability, in (0, 1] (needs --temperature > 0).")
@click.option("--seed", type=Int(), help="Seed of the sampling (the same seed repeats the same text).")
@click.option("--json", "as_json", is_flag=True, help="Print the tokens, the text and the timings as JSON.")
@click.option("--provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="ONNX Runtime execution provider.")
@click.option("--threads", type=Int(), help="ONNX Runtime intra-op threads.")
@click.option("--allow-long", is_flag=True, help="Run past the model's max_position_embeddings (with a warning).")
def run(artifact, prompts, prompt_ids, chat, system, stop, max_new_tokens, temperature, top_k, top_p, seed, as_json,
        provider, threads, allow_long):
    """Generate from an exported artifact with ONNX Runtime: text in and text out (--prompt, streamed as it is
    generated), or token ids (--prompt-ids). Stops at the checkpoint's end-of-sequence ids and --stop strings;
    greedy unless --temperature > 0."""
    import json

    from ..engines.ort_engine import OrtEngine
    from ..errors import InputError
    from ..generate.request import check_positions
    from ..generate.sampling import SamplingConfig
    from ..generate.tokenizer import load_tokenizer

    if bool(prompts) == bool(prompt_ids):  # a malformed command line: click's usage error (exit 2)
        raise click.UsageError("give --prompt (text) or --prompt-ids (token ids), not both" if prompts else
                               "give a prompt: --prompt TEXT or --prompt-ids 1,2,3")
    if (chat or system is not None) and not prompts:
        raise InputError("--chat and --system apply to --prompt")
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    tokenizer = load_tokenizer(artifact)
    if tokenizer is None and (prompts or stop):
        raise InputError(f"{artifact} has no tokenizer (only an export of a checkpoint with tokenizer.json carries "
                         f"one), so {'--prompt' if prompts else '--stop'} cannot be used; give --prompt-ids")
    ids = _parse_ids(prompt_ids) if prompt_ids else None
    if prompts:
        from ..generate.text import encode_prompts

        ids = encode_prompts(tokenizer, prompts, chat, system)
    engine = OrtEngine(artifact, provider=provider, threads=threads)
    warning = check_positions(engine.config, max((len(p) for p in ids), default=0), max_new_tokens, allow_long)
    if warning:
        click.echo(f"mla-deploy: warning: {warning}", err=True)
    result, texts = generate_and_show(engine, tokenizer, ids, max_new_tokens, sampling, stop, bool(prompts), as_json)
    info = engine.info()
    if as_json:
        click.echo(json.dumps(_run_record(result, info, ids, texts, sampling), indent=2, ensure_ascii=False))
        return
    per_sequence = ", ".join(f"{t:.1f}" for t in result.sequence_tokens_per_second)
    click.echo(f"provider {result.provider}; {info['precision']}, {info['cache_mode']} cache; batch "
               f"{len(result.tokens)}; time to first token {result.prefill_seconds * 1e3:.1f} ms; decode "
               f"{result.tokens_per_second:.1f} tokens/s for the batch, {per_sequence} tokens/s per sequence "
               f"({result.decode_steps} steps)", err=bool(prompts))


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
    return {"provider": result.provider, "precision": info["precision"], "cache_mode": info["cache_mode"],
            "sampling": dataclasses.asdict(sampling), "sequences": sequences,
            "timings": {"time_to_first_token_s": result.prefill_seconds, "decode_s": result.decode_seconds,
                        "decode_steps": result.decode_steps,
                        "decode_tokens_per_second_batch": _number(result.tokens_per_second)}}


def _number(value: float) -> float | None:
    """JSON has no NaN: a rate without decode steps is null."""
    return None if value != value else value

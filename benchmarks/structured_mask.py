"""The per-token cost of a JSON-schema token mask with llguidance and with xgrammar, on a tokenizer of DeepSeek's
vocabulary size, to choose the library `mla-deploy serve` constrains its outputs with:

    python benchmarks/structured_mask.py [--tokenizer trained|padded] [--vocab 102400] [--repeat 20]

The tokenizer has DeepSeek-V2's vocabulary size (102,400 ids; V3: 129,280): ``trained`` (the default), a byte-level
BPE trained to ``--vocab`` ids on this Python's standard library sources (40 MB of code and English prose, a few
seconds), a realistic spread of token lengths; ``padded``, the tests' byte-level BPE (tests/hf_oracle.py) with added
tokens ``[t300]``... up to ``--vocab`` ids, as benchmarks/bench_tokenizer.py gives a V2-Lite-sized checkpoint. One JSON
document valid under a schema of nested objects, enums, bounded strings, numbers and an array is tokenized; both
libraries walk it token by token in lockstep (the order alternating each token, so that a busy machine slows both
alike), timing each mask computation (the library filling a bitmask of the whole vocabulary for the next token) and
each token's advance. Reported: median and 90th percentile per token of each, the ratio of the medians, the
one-time costs (the tokenizer's preparation, the schema's compilation), and what the server pays per constrained row
and step with the chosen library (mask, applied to the row's logits, and advance: mla_deploy.generate.constrain).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "scores", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace, the quick brown fox", "age": 36, "email": "ada@example.com", "role": "editor",
            "scores": [1.5, 2.25, -3, 1e3], "address": {"street": "12 St James's Square", "city": "London 你好",
                                                      "zip": "12345"}, "active": True}


def tokenizer(kind: str, vocab: int):
    """A transformers fast tokenizer of ``vocab`` ids (the module docstring)."""
    import sysconfig

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "padded":
        from hf_oracle import hf_tokenizer

        tok = hf_tokenizer("post_processor")
        tok.add_tokens([f"[t{i}]" for i in range(len(tok), vocab)])
        return tok
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        size += len(texts[-1])
        if size > 40e6:
            break
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


def walk(kind: str, vocab: int, repeat: int) -> dict:
    import llguidance
    import llguidance.numpy
    import numpy as np
    import xgrammar

    tok = tokenizer(kind, vocab)
    vocab = len(tok)
    text = json.dumps(DOCUMENT, separators=(",", ":"), ensure_ascii=False)
    ids = tok(text, add_special_tokens=False).input_ids
    times = {}

    start = time.perf_counter()
    ll_tok = llguidance.LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=vocab, eos_token=tok.eos_token_id)
    times["llguidance tokenizer (s)"] = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={"whitespace_flexible": False})
    ll_matcher = llguidance.LLMatcher(ll_tok, grammar)
    times["llguidance compile (s)"] = time.perf_counter() - start
    assert not ll_matcher.is_error(), ll_matcher.get_error()

    start = time.perf_counter()
    xg_info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(xg_info, max_threads=1)
    times["xgrammar tokenizer (s)"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(SCHEMA, any_whitespace=False, separators=(",", ":"))
    times["xgrammar compile (s)"] = time.perf_counter() - start

    ll_mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
    xg_mask = xgrammar.allocate_token_bitmask(1, vocab)
    mask = {"llguidance": [], "xgrammar": []}
    advance = {"llguidance": [], "xgrammar": []}
    allowed = {"llguidance": [], "xgrammar": []}
    for turn in range(repeat):
        ll = llguidance.LLMatcher(ll_tok, grammar)
        xg = xgrammar.GrammarMatcher(compiled)

        def ll_step(token):
            t0 = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(ll, ll_mask)
            t1 = time.perf_counter()
            ok = ll.consume_token(token)
            t2 = time.perf_counter()
            assert ok, (token, ll.get_error())
            return t1 - t0, t2 - t1, ll_mask

        def xg_step(token):
            t0 = time.perf_counter()
            xg.fill_next_token_bitmask(xg_mask)
            t1 = time.perf_counter()
            ok = xg.accept_token(token)
            t2 = time.perf_counter()
            assert ok, token
            return t1 - t0, t2 - t1, xg_mask.numpy()

        steps = [("llguidance", ll_step), ("xgrammar", xg_step)]
        for i, token in enumerate(ids + [tok.eos_token_id]):
            for name, step in (steps if (i + turn) % 2 == 0 else steps[::-1]):
                m, a, bits = step(token)
                mask[name].append(m)
                advance[name].append(a)
                if turn == 0:
                    allowed[name].append(int(np.unpackbits(bits.view(np.uint8)).sum()))
    assert ll.is_stopped() or ll.is_accepting(), "llguidance did not end with the document"
    assert xg.is_terminated(), "xgrammar did not end with the document"
    out = {"tokenizer": kind, "vocab": vocab, "document_tokens": len(ids) + 1, "repeat": repeat, **times}
    for name in mask:
        out[f"{name} mask median (us)"] = 1e6 * statistics.median(mask[name])
        out[f"{name} mask p90 (us)"] = 1e6 * sorted(mask[name])[int(0.9 * len(mask[name]))]
        out[f"{name} mask mean (us)"] = 1e6 * statistics.fmean(mask[name])
        out[f"{name} advance median (us)"] = 1e6 * statistics.median(advance[name])
        out[f"{name} allowed tokens (mean per step)"] = statistics.fmean(allowed[name])
    out["xgrammar / llguidance mask median"] = out["xgrammar mask median (us)"] / out["llguidance mask median (us)"]
    out.update(served_row(tok, vocab, ids, repeat))
    return out


def served_row(tok, vocab: int, ids: list[int], repeat: int) -> dict:
    """What `mla-deploy serve` pays per constrained row and step (mla_deploy.generate.constrain, xgrammar): the
    mask, its application to the row's float32 logits, and the advance, along the same document."""
    import tempfile

    import numpy as np

    from mla_deploy.generate.constrain import Grammars
    from mla_deploy.generate.tokenizer import ArtifactTokenizer

    with tempfile.TemporaryDirectory() as folder:
        tok.backend_tokenizer.save(str(Path(folder) / "tokenizer.json"))
        grammar = Grammars(ArtifactTokenizer(folder), vocab, [tok.eos_token_id]).compile(SCHEMA)
    logits = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    row = []
    for _ in range(repeat):
        constraint = grammar.start()
        for token in ids:
            start = time.perf_counter()
            constraint.mask(logits)
            constraint.advance(token)
            row.append(time.perf_counter() - start)
        assert constraint.complete
    return {"served row: mask + apply + advance median (us)": 1e6 * statistics.median(row),
            "served row: mask + apply + advance mean (us)": 1e6 * statistics.fmean(row)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", choices=("trained", "padded"), default="trained")
    parser.add_argument("--vocab", type=int, default=102400)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    for key, value in walk(args.tokenizer, args.vocab, args.repeat).items():
        print(f"{key:48s} {value:.4g}" if isinstance(value, float) else f"{key:48s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

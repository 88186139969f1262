"""Constrained decoding (mla_deploy/generate/constrain.py, xgrammar) inside continuous batching, over the real ONNX
Runtime engine of the transformers-written tiny checkpoint and its tokenizer: a constrained row and free rows share
decode steps; the free rows get exactly their solo tokens; the constrained one ends (``stop``) when its JSON is
complete, and that JSON validates against the schema, greedy or sampled; a bad schema is an InputError."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from artifacts import text_artifact  # noqa: E402
from mla_deploy.errors import InputError  # noqa: E402
from mla_deploy.generate import ContinuousBatcher, SamplingConfig, generate_tokens, load_tokenizer  # noqa: E402
from mla_deploy.generate.constrain import Grammars  # noqa: E402
from mla_deploy.ort.engine import OrtEngine  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 999},
                                           "s": {"type": "string", "maxLength": 4},
                                           "e": {"enum": ["x", "yy", None]}},
          "required": ["n", "s", "e"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served():
    artifact = text_artifact("static")
    engine, tokenizer = OrtEngine(artifact, threads=1), load_tokenizer(artifact)
    return engine, tokenizer, Grammars(tokenizer, engine.vocab_size, tokenizer.eos_ids)


def test_constrained_and_free_rows_share_steps_and_the_free_ones_keep_their_solo_tokens(served):
    engine, tokenizer, grammars = served
    grammar = grammars.compile(SCHEMA)
    free_prompts = [tokenizer.encode("Hello world"), tokenizer.encode("The quick brown fox")]
    solo = [generate_tokens(engine, [p], 30).tokens[0] for p in free_prompts]
    batcher = ContinuousBatcher(engine, max_batch=4)
    prompt = tokenizer.encode("json:")
    constrained = [batcher.submit(prompt, 200, sampling, tokenizer.eos_ids, constraint=grammar.start())
                   for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=7))]
    free = [batcher.submit(p, 30) for p in free_prompts]
    while not batcher.idle:
        batcher.step()
    assert [t.tokens for t in free] == solo
    for ticket in constrained:
        text = tokenizer.decode(ticket.tokens)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert ticket.constraint.complete and ticket.tokens[-1] not in tokenizer.eos_ids  # ended at the JSON's end
    assert batcher.stats.finished["stop"] == 2
    assert batcher.stats.decode_rows > batcher.stats.decode_steps  # rows were decoded together


def test_the_mask_allows_what_the_grammar_allows(served):
    engine, tokenizer, grammars = served
    constraint = grammars.compile({"enum": ["yes", "no"]}).start()
    logits = np.zeros(engine.vocab_size, dtype=np.float32)
    allowed = np.flatnonzero(np.isfinite(constraint.mask(logits)))
    texts = {tokenizer.decode([int(i)]) for i in allowed}
    assert texts and all('"yes"'.startswith(t) or '"no"'.startswith(t) for t in texts), texts
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    constraint.advance(quote)
    for token in tokenizer.encode('no"', add_special_tokens=False):
        assert not constraint.complete
        assert np.isfinite(constraint.mask(logits)[token])
        constraint.advance(token)
    assert constraint.complete


def test_any_json_object_and_bad_schemas(served):
    engine, tokenizer, grammars = served
    batcher = ContinuousBatcher(engine, max_batch=4)
    tickets = [batcher.submit(tokenizer.encode("obj"), 250, SamplingConfig(temperature=t, seed=s),
                              tokenizer.eos_ids, constraint=grammars.compile(None).start())
               for s in range(2) for t in (0.7, 1.0)]
    while not batcher.idle:
        batcher.step()
    for ticket in tickets:
        text = tokenizer.decode(ticket.tokens)
        if len(ticket.tokens) < 250:  # an object may outgrow the tokens given; one that ended is whole
            assert isinstance(json.loads(text), dict)
            assert "\ufffd" not in text  # UTF-8 throughout (no encoded surrogate)
        else:
            assert text.startswith("{")
    # refused: not a schema xgrammar takes; no value satisfies it; a keyword decoding would not enforce; not finite
    for bad in ({"type": "nonsense"}, {"type": "string", "pattern": "("}, {"$ref": "#/nowhere"}, {"anyOf": []},
                {"properties": {"a": {"not": {"type": "null"}}}}, {"allOf": [{"type": "string"}, {"maxLength": 2}]},
                {"type": "array", "uniqueItems": True}, {"type": "number", "maximum": float("inf")}):
        with pytest.raises(InputError, match="the JSON schema") as error:
            grammars.compile(bad)
        assert "\n" not in str(error.value)
    grammars.compile({"type": "object", "properties": {"not": {"enum": ["if"]}}})  # names and data are not keywords


def byte_level(byte: int) -> str:
    """The character GPT-2's byte-level alphabet (the tests' tokenizer's) spells ``byte`` with."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    return chr(byte) if byte in kept else chr(256 + [b for b in range(256) if b not in kept].index(byte))


def test_no_encoded_surrogate_gets_into_a_string(served):
    # xgrammar 0.2.9 alone would take ED A0 80 (a surrogate encoded, not UTF-8) into a JSON string
    engine, tokenizer, grammars = served
    constraint = grammars.compile({"type": "string"}).start()
    constraint.advance(tokenizer.encode('"', add_special_tokens=False)[0])
    constraint.advance(tokenizer.backend.token_to_id(byte_level(0xED)))
    allowed = {tokenizer.backend.id_to_token(int(i)) for i in np.flatnonzero(constraint.allowed())}
    assert allowed == {byte_level(b) for b in range(0x80, 0xA0)}, allowed

"""The artifact's tokenizer (mla_deploy.generate.tokenizer, mla_deploy.generate.chat_template) against transformers' own, on a
byte-level BPE tokenizer trained offline on text with Chinese and emoji and saved by transformers: the ids of
``tokenizer(text)`` (BOS from the post-processor, or none), the chat template's text and ids, the
end-of-sequence ids, and the incremental detokenizer on multi-byte characters split across tokens."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from hf_oracle import CORPUS, hf_tokenizer  # noqa: E402
from mla_deploy.generate.chat_template import render_chat  # noqa: E402
from mla_deploy.errors import ArtifactError, InputError  # noqa: E402
from mla_deploy.generate.tokenizer import ArtifactTokenizer  # noqa: E402

TEXTS = CORPUS + ["", "  leading spaces", "mixed 中文 and emoji 🎉🙂 end", "<s> literal specials </s>",
                  "unseen 字符 ☃ and 🦀", "line\nbreaks\ttabs"]
MULTI_BYTE = ["你好，世界！", "emoji 🙂🚀🎉 are fun 👍🏽", "深度求索 🦀 ☃ 字符"]
CONVERSATIONS = [
    [{"role": "user", "content": "你好 🙂"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hello"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": None},
     {"role": "user", "content": "再见"}],
]


@pytest.fixture(scope="module", params=["post_processor", "template"])
def saved(request, tmp_path_factory):
    """``(transformers tokenizer reloaded from disk, our tokenizer on the same folder, folder)``."""
    folder = tmp_path_factory.mktemp(f"tok-{request.param}")
    hf_tokenizer(request.param).save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder), ArtifactTokenizer(folder), folder


def test_encode_equals_transformers(saved):
    hf, ours, _ = saved
    for text in TEXTS:
        assert ours.encode(text) == hf(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids
    bos = hf.bos_token_id
    assert (ours.encode("Hello")[0] == bos) == (hf.backend_tokenizer.post_processor is not None and
                                                 hf("Hello").input_ids[0] == bos)


def test_decode_equals_transformers(saved):
    hf, ours, _ = saved
    rng = np.random.default_rng(0)
    for ids in [hf(t).input_ids + [hf.eos_token_id] for t in TEXTS] + [rng.integers(0, len(hf), 20).tolist()]:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_equals_apply_chat_template(saved, generation_prompt):
    hf, ours, _ = saved
    for messages in CONVERSATIONS:
        text = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        assert ours.render_chat(messages, generation_prompt) == text
        ids = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt)["input_ids"]
        assert ours.chat_ids(messages, generation_prompt) == ids


TEMPLATE = """{%- set ns = namespace(count=0) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'bad' %}{{ raise_exception('no bad roles: ' + m['content']) }}{% endif -%}
  {%- if loop.index > 3 %}{% break %}{% endif -%}
  {%- set ns.count = ns.count + 1 %}
  {{ m['role'] | upper }} {{ m | tojson }} {{ m | tojson(indent=2) }}
  {% generation %}[{{ m['content'] }}]{% endgeneration %}
{% endfor %}
{{ dict(a=1, b='é<>') | tojson }} {{ ns.count }} {{ bos_token }}{{ eos_token }}{{ pad_token }}
{%- if add_generation_prompt %}ASSISTANT:{% endif %}"""


def test_template_environment_equals_transformers(saved):
    """namespace, raise_exception, loop controls, {% generation %}, tojson (no HTML escaping, non-ASCII kept,
    indent), dict, trim_blocks / lstrip_blocks, the special tokens as variables."""
    hf, ours, _ = saved
    messages = [{"role": "user", "content": "<b>你好</b>"}, {"role": "assistant", "content": "🙂"},
                {"role": "user", "content": "x"}, {"role": "user", "content": "cut by break"}]
    want = hf.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert render_chat(TEMPLATE, messages, ours.special_tokens, add_generation_prompt=True) == want
    bad = [{"role": "bad", "content": "oops"}]
    with pytest.raises(Exception, match="no bad roles: oops"):
        hf.apply_chat_template(bad, chat_template=TEMPLATE, tokenize=False)
    with pytest.raises(InputError, match="the chat template refused the conversation: no bad roles: oops"):
        render_chat(TEMPLATE, bad, ours.special_tokens)
    with pytest.raises(InputError, match="not valid Jinja"):
        render_chat("{% for %}", bad, {})


def test_eos_ids_from_generation_config_or_the_tokenizer(saved, tmp_path):
    hf, _, folder = saved
    copy = tmp_path / "tok"
    shutil.copytree(folder, copy)
    assert ArtifactTokenizer(copy).eos_ids == (hf.eos_token_id,)  # no generation_config.json: the eos_token
    for value, want in ((5, (5,)), ([1, 7], (1, 7))):
        (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        assert ArtifactTokenizer(copy).eos_ids == want
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ArtifactError, match="eos_token_id 'x'"):
        ArtifactTokenizer(copy)
    (copy / "tokenizer.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not a readable tokenizer"):
        ArtifactTokenizer(copy)


def test_no_chat_template_is_an_input_error(saved, tmp_path):
    _, _, folder = saved
    copy = tmp_path / "tok"
    shutil.copytree(folder, copy)
    (copy / "chat_template.jinja").unlink()
    with pytest.raises(InputError, match="no chat template"):
        ArtifactTokenizer(copy).chat_ids([{"role": "user", "content": "x"}])
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D{{ messages[0]['content'] }}"},
                               {"name": "tool_use", "template": "T"}]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert ArtifactTokenizer(copy).render_chat([{"role": "user", "content": "x"}]) == "Dx"


def stream(ours, ids) -> list[str]:
    detok = ours.detokenizer()
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_detokenizer_never_splits_a_multi_byte_character(saved):
    _, ours, _ = saved
    split = 0
    for text in MULTI_BYTE:
        ids = ours.encode(text, add_special_tokens=False)
        split += sum("\ufffd" in ours.decode([i]) for i in ids)  # tokens holding part of a character
        pieces = stream(ours, [ours.backend.token_to_id("<s>")] + ids + [ours.backend.token_to_id("</s>")])
        assert "".join(pieces) == text == ours.decode(ids)
        assert not any("\ufffd" in p for p in pieces), pieces
        assert sum(bool(p) for p in pieces) > 1  # streamed in several pieces, not all at the end
    assert split >= 5, "the test texts must split characters across tokens"


def test_detokenizer_joins_to_decode_on_any_ids(saved):
    """Random ids (byte tokens that may never form a character, specials, words): the pieces joined equal decode."""
    _, ours, _ = saved
    rng = np.random.default_rng(0)
    size = ours.backend.get_vocab_size()
    for _ in range(50):
        ids = rng.integers(0, size, rng.integers(1, 30)).tolist()
        assert "".join(stream(ours, ids)) == ours.decode(ids)

"""Text generation over the engine's loop (mla_deploy.generate.text): a scripted engine emits known ids, the real test
tokenizer decodes them; streamed pieces, stop strings held back and cut, end-of-sequence ids, chat prompts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("transformers")

from hf_oracle import hf_tokenizer  # noqa: E402
from mla_deploy.cache_layout import CONCAT  # noqa: E402
from mla_deploy.engines.base import Engine  # noqa: E402
from mla_deploy.errors import InputError  # noqa: E402
from mla_deploy.generate.text import encode_prompts, generate_text, stream_text  # noqa: E402
from mla_deploy.generate.tokenizer import ArtifactTokenizer  # noqa: E402


class ScriptedEngine(Engine):
    """Emits ``scripts[b][k]`` as sequence b's k-th new token, whatever the input (then its last one again)."""

    provider = "scripted"

    def __init__(self, scripts, vocab):
        config = SimpleNamespace(latent_dim=1, num_hidden_layers=1, num_attention_heads=1, vocab_size=vocab,
                                 is_sparse=False)
        super().__init__("scripted", SimpleNamespace(config=config, layout=CONCAT, precision="fp32", capacity=None))
        self.scripts, self.calls = scripts, 0

    def _allocate(self, shape):
        return np.zeros(shape, np.float32)

    def _run(self, role, ids, positions, logits_index, control, state):
        logits = np.zeros((*logits_index.shape, self.config.vocab_size), np.float32)
        for b, script in enumerate(self.scripts):
            logits[b, :, script[min(self.calls, len(script) - 1)]] = 1
        self.calls += 1
        return logits, [np.concatenate((c, np.zeros((*ids.shape, 1), np.float32)), 1) for c in state.caches]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    hf_tokenizer().save_pretrained(folder)
    return ArtifactTokenizer(folder)


def run(tokenizer, texts, max_new_tokens=40, **kwargs):
    scripts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    engine = ScriptedEngine(scripts, tokenizer.backend.get_vocab_size())
    stream = stream_text(engine, tokenizer, [[0]] * len(texts), max_new_tokens, **kwargs)
    pieces = list(stream)
    return pieces, stream.result(), scripts


def test_pieces_join_to_the_decoded_text(tokenizer):
    texts = ["你好，世界！ emoji 🙂🚀.", "The quick brown fox."]
    pieces, result, scripts = run(tokenizer, texts, max_new_tokens=50, eos_ids=[])
    for b, text in enumerate(texts):
        mine = [p.text for p in pieces if p.sequence == b]
        assert "".join(mine) == result.texts[b] == tokenizer.decode(result.generation.tokens[b])
        assert result.texts[b].startswith(text) and len(mine) > 3 and not any("\ufffd" in p for p in mine)
    assert pieces[-1].finished == "length"


def test_a_stop_string_cuts_the_text_and_stops_the_sequence(tokenizer):
    text = "Hello world, 你好，世界！ and more"
    pieces, result, scripts = run(tokenizer, [text, text], stop=["世界", "unused stop"], eos_ids=[])
    for b in range(2):
        assert result.texts[b] == "Hello world, 你好，"
        assert result.generation.finish_reasons[b] == "stop"
        tokens = result.generation.tokens[b]
        assert tokens == scripts[b][: len(tokens)] and "世界" in tokenizer.decode(tokens)  # kept its last token
        assert "世界" not in tokenizer.decode(tokens[:-1])
    streamed = "".join(p.text for p in pieces if p.sequence == 0)
    assert streamed == result.texts[0]


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    """A stop string ``"fox!"``: ``"fo"`` is held until ``"fox."`` shows it is not one, then released."""
    pieces, result, _ = run(tokenizer, ["the fox. the fox!"], stop=["fox!"], eos_ids=[])
    assert result.texts[0] == "the fox. the "
    shown = ""
    for p in pieces:
        shown += p.text
        assert not shown.endswith(("f", "fo", "fox")) or p.finished, shown  # never a possible stop's start


def test_eos_ends_a_sequence(tokenizer):
    eos = tokenizer.eos_ids[0]
    scripts_text = "Hello world"
    ids = tokenizer.encode(scripts_text, add_special_tokens=False)
    engine = ScriptedEngine([ids[:2] + [eos] + ids[2:], ids], tokenizer.backend.get_vocab_size())
    result = generate_text(engine, tokenizer, [[0], [0, 1]], 30)
    assert result.generation.tokens[0] == ids[:2] + [eos] and result.generation.finish_reasons[0] == "eos"
    assert result.texts[0] == tokenizer.decode(ids[:2])  # the special EOS is not shown


def test_encode_prompts(tokenizer):
    assert encode_prompts(tokenizer, ["hi", "你好"]) == [tokenizer.encode("hi"), tokenizer.encode("你好")]
    chat = encode_prompts(tokenizer, ["hi"], chat=True, system="sys")
    assert chat == [tokenizer.chat_ids([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}])]
    with pytest.raises(InputError, match="needs the chat template"):
        encode_prompts(tokenizer, ["hi"], system="sys")
    with pytest.raises(InputError, match="stop string cannot be empty"):
        run(tokenizer, ["x"], stop=[""])


# what `mla-deploy run` prints when it is interrupted (mla_deploy.cli.live) -----------------------------------
class Interrupting(ScriptedEngine):
    """Raises KeyboardInterrupt (as Ctrl-C does) in its ``after``-th graph run."""

    def __init__(self, scripts, vocab, after):
        super().__init__(scripts, vocab)
        self.after = after

    def _run(self, role, ids, positions, logits_index, control, state):
        if self.calls == self.after:
            raise KeyboardInterrupt
        return super()._run(role, ids, positions, logits_index, control, state)


@pytest.fixture
def signal_handlers():
    """The process's signal handlers, restored after the test (the interruption ignores later signals)."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("mode", ["one text", "texts", "one ids", "ids", "json"])
def test_an_interrupted_run_prints_what_was_generated(tokenizer, capsys, signal_handlers, mode):
    """Ctrl-C after 4 tokens: the streamed line is ended as it stands, a batch is printed with what each sequence
    has, --json prints nothing; then the signal goes on to the error contract (one line, exit 130)."""
    import signal

    from mla_deploy.cli.contract import Interrupted
    from mla_deploy.cli.live import generate_and_show

    batch = 1 if mode.startswith("one") or mode == "json" else 2
    script = tokenizer.encode("Hello world, hello again and again", add_special_tokens=False)
    engine = Interrupting([script] * batch, tokenizer.backend.get_vocab_size(), after=4)
    with_text = "text" in mode or mode == "json"
    with pytest.raises(Interrupted) as interrupted:
        generate_and_show(engine, tokenizer if with_text else None, [[0]] * batch, 40, None, (), with_text,
                          mode == "json")
    assert interrupted.value.signum == signal.SIGINT
    ids, text = script[:4], tokenizer.decode(script[:4])
    want = {"one text": f"{text}\n", "one ids": f"sequence 0: {','.join(map(str, ids))}\n", "json": "",
            "texts": "".join(f"--- sequence {i} (4 tokens, interrupted) ---\n{text}\n" for i in range(2)),
            "ids": "".join(f"sequence {i}: {','.join(map(str, ids))}\n" for i in range(2))}
    assert capsys.readouterr().out == want[mode] and text.startswith("Hello")

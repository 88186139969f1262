"""Text in, text out, as a user runs it: transformers-written tiny DeepSeek-V2 and V3 checkpoints saved with a
tokenizer (byte-level BPE trained offline on text with Chinese and emoji, a chat template, an EOS in
generation_config.json), exported with `mla-deploy export --hf`, then `mla-deploy run --prompt` (the real command group, run in the test's
process: tests/test_cli_export_run.py runs export and run as separate processes) against transformers' own
tokenizer and `generate`."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cli_run import cli, ok  # noqa: E402
from hf_oracle import TEXT_PROMPTS, text_checkpoint  # noqa: E402
from artifacts import tiny_artifact  # noqa: E402
from mla_deploy.artifact import check_artifact, load_manifest  # noqa: E402
from mla_deploy.errors import ArtifactError  # noqa: E402

NEW = 12


def one_line_error(result, status=1):
    assert result.returncode == status, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: ") and "Traceback" not in result.stderr
    return lines[0]


_EXPORTED = {}


def export_text_checkpoint(version: int, tmp_path_factory):
    """``(transformers model, its tokenizer, artifact)``, made once per version: V2 with the BOS from
    tokenizer.json's post-processor and the static cache, V3 with the BOS only from the chat template and the
    concat cache."""
    if version not in _EXPORTED:
        folder = tmp_path_factory.mktemp(f"text-v{version}")
        hf, tok = text_checkpoint(folder / "ckpt", version, "post_processor" if version == 2 else "template")
        out = folder / "artifact"
        printed = ok(cli("export", "--hf", folder / "ckpt", "--out", out, "--cache-mode",
                         "static" if version == 2 else "concat"))
        assert "tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json" in printed
        _EXPORTED[version] = hf, tok, out
    return _EXPORTED[version]


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def exported(request, tmp_path_factory):
    return export_text_checkpoint(request.param, tmp_path_factory)


@torch.no_grad()
def transformers_text(hf, tok, prompts: list[list[int]]) -> tuple[list[str], list[list[int]]]:
    """transformers' greedy ``generate`` of a left-padded batch with its attention mask: the decoded new text
    (``skip_special_tokens=True``) and the new ids up to and including the first EOS."""
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)[:, width:]
    texts = [tok.decode(row, skip_special_tokens=True) for row in out]
    tokens = []
    for row in out.tolist():
        tokens.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return texts, tokens


@pytest.mark.slow
def test_run_prompt_prints_what_transformers_generates(exported):
    hf, tok, out = exported
    manifest = load_manifest(out)
    assert manifest.tokenizer is not None and {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                               "generation_config.json"} <= set(manifest.tokenizer.names)
    texts, tokens = transformers_text(hf, tok, [tok(p).input_ids for p in TEXT_PROMPTS])
    assert len(tokens[0]) < NEW and tokens[0][-1] == tok.eos_token_id  # the first prompt ends at EOS
    assert len(tokens[1]) == NEW and tok.eos_token_id not in tokens[1]  # while the second goes on
    # one prompt: the text streamed to stdout, then a newline; the timings on stderr
    single = cli("run", out, "--prompt", TEXT_PROMPTS[0], "--max-new-tokens", NEW)
    assert ok(single) == texts[0] + "\n"
    assert "time to first token" in single.stderr and "tokens/s for the batch" in single.stderr
    # a batch of two prompts of different lengths
    printed = ok(cli("run", out, "--prompt", TEXT_PROMPTS[0], "--prompt", TEXT_PROMPTS[1], "--max-new-tokens", NEW))
    assert printed == (f"--- sequence 0 ({len(tokens[0])} tokens, eos) ---\n{texts[0]}\n"
                       f"--- sequence 1 ({NEW} tokens, length) ---\n{texts[1]}\n")
    record = json.loads(ok(cli("run", out, "--prompt", TEXT_PROMPTS[0], "--prompt", TEXT_PROMPTS[1],
                               "--max-new-tokens", NEW, "--json")))
    assert [s["tokens"] for s in record["sequences"]] == tokens
    assert [s["text"] for s in record["sequences"]] == texts
    assert [s["finish_reason"] for s in record["sequences"]] == ["eos", "length"]
    assert [s["prompt_ids"] for s in record["sequences"]] == [tok(p).input_ids for p in TEXT_PROMPTS]
    timings = record["timings"]
    assert timings["time_to_first_token_s"] > 0 and timings["decode_tokens_per_second_batch"] > 0
    assert all(s["decode_tokens_per_second"] > 0 for s in record["sequences"])


@pytest.mark.slow
def test_run_chat_uses_the_chat_template_as_transformers_does(exported):
    hf, tok, out = exported
    record = json.loads(ok(cli("run", out, "--prompt", "你好 🙂", "--chat", "--system", "Be brief.",
                               "--max-new-tokens", NEW, "--json")))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 🙂"}]
    want = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    sequence = record["sequences"][0]
    assert sequence["prompt_ids"] == want
    texts, tokens = transformers_text(hf, tok, [want])
    assert sequence["tokens"] == tokens[0] and sequence["text"] == texts[0]


@pytest.mark.slow
def test_run_sampling_and_stop_strings(exported):
    hf, tok, out = exported
    prompt = ["--prompt", TEXT_PROMPTS[1], "--max-new-tokens", NEW, "--json"]

    def tokens(*options):
        sequence = json.loads(ok(cli("run", out, *prompt, *options)))["sequences"][0]
        return {k: sequence[k] for k in ("tokens", "text", "finish_reason")}

    greedy = tokens()
    assert tokens("--temperature", "0.8", "--top-k", "1", "--seed", "3")["tokens"] == greedy["tokens"]
    sampled = tokens("--temperature", "1.5", "--top-p", "0.95", "--seed", "7")
    assert tokens("--temperature", "1.5", "--top-p", "0.95", "--seed", "7") == sampled  # a seed repeats
    assert sampled["tokens"] != greedy["tokens"]
    assert tokens("--temperature", "1.5", "--top-p", "0.95", "--seed", "8")["tokens"] != sampled["tokens"]
    # a stop string: the text ends before it, the sequence stops at the token that completed it
    text = greedy["text"]
    stop = next(c for c in text[1:] if c != "\ufffd")
    stopped = tokens("--stop", stop)
    assert stopped["text"] == text[: text.index(stop)] and stopped["finish_reason"] == "stop"
    assert stopped["tokens"] == greedy["tokens"][: len(stopped["tokens"])] and len(stopped["tokens"]) < NEW


def test_tokenizer_files_are_checked(tmp_path_factory, tmp_path):
    _, _, out = export_text_checkpoint(2, tmp_path_factory)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    assert check_artifact(copy).tokenizer.names[0] == "tokenizer.json"
    config = copy / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<pad>", "<pa_>"))  # same size, other bytes
    load_manifest(copy)  # sizes only
    with pytest.raises(ArtifactError, match="tokenizer_config.json does not match the sha256"):
        check_artifact(copy)
    (copy / "chat_template.jinja").unlink()
    with pytest.raises(ArtifactError, match="chat_template.jinja is missing"):
        load_manifest(copy)


def test_run_text_errors_are_one_line(tmp_path_factory):
    _, _, out = export_text_checkpoint(2, tmp_path_factory)
    tiny = tiny_artifact("static")
    assert "has no tokenizer" in one_line_error(cli("run", tiny, "--prompt", "hello"))
    assert "has no tokenizer" in one_line_error(cli("run", tiny, "--prompt-ids", "1,2", "--stop", "x"))
    assert "top_p must be in (0, 1]" in one_line_error(cli("run", out, "--prompt", "x", "--temperature", "1",
                                                           "--top-p", "1.5"))
    assert "top_p must be in (0, 1]" in one_line_error(cli("run", out, "--prompt", "x", "--temperature", "1",
                                                           "--top-p", "0"))
    assert "temperature must be" in one_line_error(cli("run", out, "--prompt", "x", "--temperature", "-1"))
    assert "give a temperature > 0" in one_line_error(cli("run", out, "--prompt", "x", "--top-k", "5"))
    assert "not both" in one_line_error(cli("run", out, "--prompt", "x", "--prompt-ids", "1"), 2)  # usage errors
    assert "give a prompt" in one_line_error(cli("run", out), 2)
    assert "apply to --prompt" in one_line_error(cli("run", out, "--prompt-ids", "1", "--chat"))
    assert "needs the chat template" in one_line_error(cli("run", out, "--prompt", "x", "--system", "s"))
    assert "stop string cannot be empty" in one_line_error(cli("run", out, "--prompt", "x", "--stop", ""))

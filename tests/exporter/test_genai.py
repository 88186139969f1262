"""The onnxruntime-genai target (:mod:`mla_deploy.exporter.genai`), as a user meets it: transformers-written tiny
DeepSeek-V2 and V3 checkpoints with a tokenizer, `mla-deploy export --target genai` (the real command group, in the test's process), then
onnxruntime-genai's own Model/Generator greedy search against `mla-deploy run` and transformers' `generate`,
and the cache written in place (genai's shared past/present buffer; an ONNX Runtime IOBinding of one buffer as
past and present)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (the [genai] extra: "
                                                     "pip install -e '.[genai]', which make test does)")
transformers = pytest.importorskip("transformers")

from cli_run import cli, ok  # noqa: E402
from hf_oracle import TEXT_PROMPTS, text_checkpoint  # noqa: E402

NEW = 12
CONTEXT = 64


_EXPORTED = {}


def export_checkpoint(version: int, tmp_path_factory):
    """``(transformers model, tokenizer, genai folder, mla-deploy artifact or None)`` of one checkpoint version,
    made once: V2 also exported as the normal artifact for `mla-deploy run` (whose equality with transformers on
    both versions is tests/test_text_cli.py's), to keep the file fast."""
    if version not in _EXPORTED:
        folder = tmp_path_factory.mktemp(f"genai-v{version}")
        hf, tok = text_checkpoint(folder / "ckpt", version, "post_processor" if version == 2 else "template")
        printed = ok(cli("export", "--hf", folder / "ckpt", "--out", folder / "genai", "--target", "genai",
                         "--max-cache-length", CONTEXT))
        assert "for onnxruntime-genai" in printed and "key/value halves of 12" in printed
        artifact = None
        if version == 2:
            artifact = folder / "artifact"
            ok(cli("export", "--hf", folder / "ckpt", "--out", artifact))
        _EXPORTED[version] = hf, tok, folder / "genai", artifact
    return _EXPORTED[version]


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def exported(request, tmp_path_factory):
    return export_checkpoint(request.param, tmp_path_factory)


def until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def genai_greedy(folder, prompts: list[list[int]], pad: int) -> list[list[int]]:
    """onnxruntime-genai's greedy search over ``prompts`` (right-padded, genai's batch convention: it masks a
    row's trailing pad ids and reads its logits at its last real token): the new ids of each row."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=CONTEXT, batch_size=len(prompts), do_sample=False)
    generator = og.Generator(model, params)
    width = max(map(len, prompts))
    generator.append_tokens(np.array([p + [pad] * (width - len(p)) for p in prompts], dtype=np.int32))
    new = [[] for _ in prompts]
    for _ in range(NEW):
        if generator.is_done():
            break
        generator.generate_next_token()
        for row, token in zip(new, generator.get_next_tokens()):
            row.append(int(token))
    return new


@torch.no_grad()
def transformers_greedy(hf, prompts: list[list[int]], pad: int) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)[:, width:].tolist()


def test_genai_folder_holds_the_latent_cache_as_two_halves(exported):
    import onnx

    hf, tok, folder, _ = exported
    names = {p.name for p in folder.iterdir()}
    assert {"genai_config.json", "model.onnx", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((folder / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    latent = hf.config.kv_lora_rank + hf.config.qk_rope_head_dim
    assert decoder["head_size"] * 2 == latent and decoder["num_key_value_heads"] == 1
    assert config["search"]["past_present_share_buffer"] is True and config["model"]["context_length"] == CONTEXT
    assert (config["model"]["eos_token_id"], config["model"]["pad_token_id"]) == (tok.eos_token_id, tok.pad_token_id)
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    assert list(dims)[:2] == ["input_ids", "attention_mask"]
    assert dims["past_key_values.1.value"] == ["batch_size", 1, "max_cache_length", latent // 2]
    assert "TensorScatter" in {n.op_type for n in graph.node}
    assert {(n.domain, n.op_type) for n in graph.node} >= {("com.microsoft", "MoE")}  # the experts fused (auto)
    # the cache halves are scored and weighted one by one: no Concat (nor Slice) of cache-sized tensors
    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(folder / "model.onnx"), load_external_data=False))
    shapes = {v.name: [d.dim_param for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
    copies = [n.output[0] for n in inferred.graph.node if n.op_type in ("Concat", "Slice")
              and "max_cache_length" in shapes.get(n.output[0], [])]
    assert not copies
    # genai's tokenizer reads the carried files; it does not apply tokenizer.json's post-processor (the V2
    # checkpoint's BOS), so ids are compared with the text's ids without special tokens
    tokenizer = og.Tokenizer(og.Model(str(folder)))
    for text in TEXT_PROMPTS:
        ids = [int(i) for i in tokenizer.encode(text)]
        assert ids == tok(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(np.array(ids, dtype=np.int32)) == text
    # a chat rendered by transformers encodes to transformers' ids (special tokens in the text included); genai's
    # own renderer reads the carried template but keeps the newline after a block tag (no trim_blocks)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 🙂"}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert [int(i) for i in tokenizer.encode(chat)] == tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                                 return_dict=False)
    assert tokenizer.apply_chat_template(json.dumps(messages), add_generation_prompt=True).startswith("<s><|system|>")


@pytest.mark.slow
def test_genai_greedy_equals_mla_deploy_run_and_transformers(exported):
    hf, tok, folder, artifact = exported
    prompts = [tok(p).input_ids for p in TEXT_PROMPTS]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    want = [until_eos(row, eos) for row in transformers_greedy(hf, prompts, pad)]
    assert len(want[0]) < NEW and len(want[1]) == NEW  # the first stops at EOS, the second goes on
    if artifact is not None:
        record = json.loads(ok(cli("run", artifact, "--prompt-ids", ",".join(map(str, prompts[0])), "--prompt-ids",
                                   ",".join(map(str, prompts[1])), "--max-new-tokens", NEW, "--json")))
        assert [s["tokens"] for s in record["sequences"]] == want
    for i, prompt in enumerate(prompts):  # one prompt at a time
        assert [until_eos(r, eos) for r in genai_greedy(folder, [prompt], pad)] == [want[i]]
    # a batch of two prompts of different lengths, in both orders (the shorter row padded)
    assert [until_eos(r, eos) for r in genai_greedy(folder, prompts, pad)] == want
    assert [until_eos(r, eos) for r in genai_greedy(folder, prompts[::-1], pad)] == want[::-1]


def test_genai_keeps_the_cache_buffer_in_place(exported):
    """genai's shared buffer: every present is the whole ``[B, 1, max_length, C/2]`` buffer, the step's past
    input holds what the previous step wrote, and a decode step changes only its own row."""
    _, tok, folder, _ = exported
    prompt = tok(TEXT_PROMPTS[1]).input_ids
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=CONTEXT, batch_size=1, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    before = {n: generator.get_output(n).copy() for n in ("present.0.key", "present.1.value")}
    for name, value in before.items():
        assert value.shape == (1, 1, CONTEXT, 12)
        assert np.abs(value[0, 0, : len(prompt)]).max(axis=1).min() > 0  # every prompt row written
    for step in range(3):  # token `step` is sampled from the last logits; the next call writes row len + step
        generator.generate_next_token()
        if step == 0:
            continue
        row = len(prompt) + step - 1
        for name, old in before.items():
            new = generator.get_output(name).copy()
            past = generator.get_input(name.replace("present", "past_key_values"))
            np.testing.assert_array_equal(past, new)  # one buffer: the past input is the present output
            changed = np.flatnonzero(np.abs(new - old).reshape(CONTEXT, -1).max(axis=1))
            assert changed.tolist() == [row], (name, changed)
            before[name] = new


def test_ort_binds_one_buffer_as_past_and_present(exported, capfd):
    """The graph itself: past and present bound to the same OrtValue, ONNX Runtime writes the present into it
    (same address after the step, no "in-place optimization not activated" warning) and only rows
    ``[len, len + 1)`` change."""
    import onnxruntime as ort

    _, tok, folder, _ = exported
    options = ort.SessionOptions()
    options.log_severity_level = 1  # warnings: ONNX Runtime logs one when TensorScatter copies the cache
    session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    prompt = tok(TEXT_PROMPTS[0]).input_ids
    layers = sum(1 for i in session.get_inputs() if i.name.endswith(".key"))
    caches = [ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, CONTEXT, 12), np.float32)) for _ in range(2 * layers)]
    names = [(f"past_key_values.{i}.{h}", f"present.{i}.{h}") for i in range(layers) for h in ("key", "value")]

    def step(ids: list[int], total: int):
        binding = session.io_binding()
        binding.bind_output("logits")  # outputs come back in binding order: logits first
        binding.bind_cpu_input("input_ids", np.array([ids], dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, total), dtype=np.int64))
        for (past, present), value in zip(names, caches):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        session.run_with_iobinding(binding)
        return binding.get_outputs()

    capfd.readouterr()
    outputs = step(prompt, len(prompt))
    assert [o.data_ptr() for o in outputs[1:]] == [c.data_ptr() for c in caches]
    held = [c.numpy().copy() for c in caches]
    assert all(np.abs(h[0, 0, : len(prompt)]).max() > 0 and not h[0, 0, len(prompt):].any() for h in held)
    token = int(outputs[0].numpy()[0, -1].argmax())
    outputs = step([token], len(prompt) + 1)
    assert [o.data_ptr() for o in outputs[1:]] == [c.data_ptr() for c in caches]
    for old, value in zip(held, caches):
        changed = np.flatnonzero(np.abs(value.numpy() - old).reshape(CONTEXT, -1).max(axis=1))
        assert changed.tolist() == [len(prompt)]
    log = capfd.readouterr()
    assert "in-place optimization not activated" not in log.out + log.err


def test_genai_export_errors_are_one_line(tmp_path_factory, tmp_path):
    _, _, folder, artifact = export_checkpoint(2, tmp_path_factory)
    ckpt = folder.parent / "ckpt"

    def error(*args):
        result = cli("export", "--target", "genai", *args)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mla-deploy: error: "), result.stderr
        return lines[0]

    assert "give --hf CHECKPOINT" in error("--preset", "tiny", "--out", tmp_path / "x")
    assert "already holds an onnxruntime-genai export" in error("--hf", ckpt, "--out", folder)
    assert "holds no onnxruntime-genai export" in error("--hf", ckpt, "--out", artifact)
    assert "takes neither --cache-mode" in error("--hf", ckpt, "--out", tmp_path / "y", "--cache-mode", "static")
    assert "cannot write" in error("--hf", ckpt, "--out", "/proc/genai")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_genai_overwrite_keeps_the_users_files(tmp_path):
    from mla_deploy.errors import ExportError
    from mla_deploy.exporter.genai import check_genai_target

    assert check_genai_target(tmp_path / "new", overwrite=False) == []
    for name in ("genai_config.json", "model.onnx", "tokenizer.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    with pytest.raises(ExportError, match="pass --overwrite"):
        check_genai_target(tmp_path, overwrite=False)
    assert check_genai_target(tmp_path, overwrite=True) == ["notes.txt"]  # kept; the export's own are replaced


def test_genai_quantized_export_runs_like_the_artifact(tmp_path_factory, tmp_path):
    """``--weights int8`` reaches the genai graph too: its MatMulNBits and QMoE nodes are the artifact's, and genai's
    greedy tokens equal `mla-deploy run` on the artifact quantized the same way (V2's checkpoint)."""
    import onnx

    hf, tok, folder, _ = export_checkpoint(2, tmp_path_factory)
    checkpoint = folder.parent / "ckpt"
    ok(cli("export", "--hf", checkpoint, "--out", tmp_path / "genai", "--target", "genai", "--max-cache-length",
           CONTEXT, "--weights", "int8"))
    ok(cli("export", "--hf", checkpoint, "--out", tmp_path / "artifact", "--weights", "int8"))
    graphs = [onnx.load(str(tmp_path / d / "model.onnx"), load_external_data=False).graph for d in ("genai", "artifact")]
    counts = [sum(n.op_type in ("MatMulNBits", "QMoE") for n in g.node) for g in graphs]  # the default format
    assert counts[0] == counts[1] > 0 and all(any(n.op_type == "QMoE" for n in g.node) for g in graphs)
    prompts = [tok(p).input_ids for p in TEXT_PROMPTS]
    record = json.loads(ok(cli("run", tmp_path / "artifact", "--prompt-ids", ",".join(map(str, prompts[1])),
                               "--max-new-tokens", NEW, "--json")))
    assert genai_greedy(tmp_path / "genai", [prompts[1]], tok.pad_token_id) == [record["sequences"][0]["tokens"]]


@pytest.mark.slow
def test_genai_longcat_holds_a_latent_per_sublayer(tmp_path):
    """LongCat-Flash (tests/family_checkpoints.py's tiny `longcat_flash`, with a tokenizer): genai holds its four
    latent caches (two MLA sub-layers in each of two layers) as four key/value pairs, and its greedy tokens are
    transformers', one prompt at a time and as a padded batch."""
    import family_checkpoints
    from hf_oracle import hf_tokenizer

    tok = hf_tokenizer()
    hf = family_checkpoints.write("longcat_flash", tmp_path / "ckpt", vocab_size=len(tok))
    tok.save_pretrained(tmp_path / "ckpt")
    ok(cli("export", "--hf", tmp_path / "ckpt", "--out", tmp_path / "genai", "--target", "genai",
           "--max-cache-length", CONTEXT))
    config = json.loads((tmp_path / "genai" / "genai_config.json").read_text())
    assert config["model"]["decoder"]["num_hidden_layers"] == 4
    prompts = [tok(p).input_ids for p in TEXT_PROMPTS]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    want = [until_eos(row, eos) for row in transformers_greedy(hf, prompts, pad)]
    for i, prompt in enumerate(prompts):
        assert [until_eos(r, eos) for r in genai_greedy(tmp_path / "genai", [prompt], pad)] == [want[i]]
    assert [until_eos(r, eos) for r in genai_greedy(tmp_path / "genai", prompts, pad)] == want

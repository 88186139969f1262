"""load_checkpoint imports checkpoints that transformers itself wrote (save_pretrained, safetensors).

Tiny DeepSeek-V2/V3 models (``hf_oracle.hf_model``, weights N(0, 0.3), float32) are saved one file or
sharded (``max_shard_size="50KB"``, which writes ``model.safetensors.index.json``), loaded back with
:func:`load_checkpoint`, and compared with the HF model: every parameter bit for bit, logits within
``1e-5`` of ``max|ref|``, and 32 greedy tokens equal to ``generate``. Corrupted copies (a tensor
dropped, reshaped or added) must fail naming the tensor; a synthetic float8 checkpoint (DeepSeek-V3's
block-scaled format) must dequantise.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

import hf_oracle  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from mla_deploy.checkpoint import dequantize_fp8, load_checkpoint  # noqa: E402
from mla_deploy.errors import CheckpointError  # noqa: E402

TOL = 1e-5
# id -> (version, hf_model keyword arguments)
CASES = {
    "V2-moe-q_lora": (2, dict(q_lora_rank=32)),
    "V2-moe-q_proj-yarn": (2, dict(q_lora_rank=None, yarn=True)),
    "V2-dense-q_proj": (2, dict(q_lora_rank=None, moe=False)),
    "V3-moe-q_lora-yarn": (3, dict(q_lora_rank=32, yarn=True)),
    "V3-moe-q_proj": (3, dict(q_lora_rank=None)),
    "V3-dense-q_lora": (3, dict(q_lora_rank=32, moe=False)),
}
_HF: dict[str, torch.nn.Module] = {}


def hf(case: str) -> torch.nn.Module:
    if case not in _HF:
        version, kw = CASES[case]
        _HF[case] = hf_oracle.hf_model(version, **kw)
    return _HF[case]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|``."""
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(case, sharded=False)``: the folder transformers' save_pretrained wrote for that case (cached)."""
    folders: dict[tuple[str, bool], object] = {}

    def get(case: str, sharded: bool = False):
        if (case, sharded) not in folders:
            folder = tmp_path_factory.mktemp(f"{case}-{'sharded' if sharded else 'single'}")
            hf(case).save_pretrained(folder, **({"max_shard_size": "50KB"} if sharded else {}))
            folders[case, sharded] = folder
        return folders[case, sharded]

    return get


def _copy_with(src, dst, change) -> None:
    """Copy checkpoint ``src`` to ``dst`` with its single safetensors file rewritten: ``change(tensors)``."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def _ids(batch: int, length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    batch, n = ids.shape
    out, _ = model(ids, torch.arange(n).expand(batch, n), model.empty_cache(batch))
    return out


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_hf(saved, case, sharded):
    """Every HF tensor arrives bit for bit (experts stacked), and CC and A_CC logits match HF's."""
    folder = saved(case, sharded)
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    reference = hf(case)
    model = load_checkpoint(folder, form="CC")
    ours, theirs = model.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    assert model.load_report.skipped == {} and len(model.load_report.files) == (1 if not sharded else
                                                                                len(list(folder.glob("*.safetensors"))))
    ids = _ids(2, 9)
    with torch.no_grad():
        ref = reference(ids).logits
    assert rel_err(_logits(model, ids), ref) <= TOL
    absorbed = load_checkpoint(folder, form="A_CC")
    assert absorbed.form == "A_CC"
    assert rel_err(_logits(absorbed, ids), ref) <= TOL


@torch.no_grad()
def _greedy(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` greedy tokens after ``prompt [1, P]``: one prefill, then one token per call through the concat cache."""
    length = prompt.shape[1]
    logits, past = model(prompt, torch.arange(length).unsqueeze(0), model.empty_cache(1))
    tokens = [logits[:, -1].argmax(-1, keepdim=True)]
    for t in range(steps - 1):
        logits, past = model(tokens[-1], torch.tensor([[length + t]]), past)
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)


@pytest.mark.parametrize("case", ["V2-moe-q_lora", "V3-moe-q_lora-yarn"])
def test_greedy_decode_matches_hf_generate(saved, case):
    """The imported model in absorbed form, decoding 32 tokens through its cache, picks HF generate's tokens."""
    model = load_checkpoint(saved(case), form="A_CC")
    for length, seed in ((4, 11), (7, 12), (12, 13)):
        prompt = _ids(1, length, seed)
        ref = hf(case).generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                max_new_tokens=32, eos_token_id=None, pad_token_id=0)[:, length:]
        assert ref.shape == (1, 32)
        assert torch.equal(_greedy(model, prompt, 32), ref), (length, seed)


def test_bf16_checkpoint_keeps_its_dtype(tmp_path):
    """A bf16 save loads as bf16 by default (the V3 routing bias stays float32, as in transformers)."""
    reference = hf_oracle.hf_model(3).to(torch.bfloat16)
    reference.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    as_fp32 = load_checkpoint(tmp_path, dtype="float32")
    assert as_fp32.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32


def test_tied_embeddings(tmp_path):
    """With tie_word_embeddings, lm_head is the embedding (whether or not the file repeats it)."""
    import transformers

    config = hf_oracle.hf_config(3)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    reference = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0.0 if p.dim() > 1 else 1.0, 0.3 if p.dim() > 1 else 0.1)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    reference.save_pretrained(tmp_path / "hf")
    ids = _ids(2, 6)
    with torch.no_grad():
        ref = reference(ids).logits
    model = load_checkpoint(tmp_path / "hf", form="A_CC")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert rel_err(_logits(model, ids), ref) <= TOL

    def repeat(tensors):  # a file that stores both names
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    _copy_with(tmp_path / "hf", tmp_path / "both", repeat)
    model = load_checkpoint(tmp_path / "both")
    assert model.load_report.skipped == {"tied lm_head (same as model.embed_tokens.weight)": ["lm_head.weight"]}
    assert rel_err(_logits(model, ids), ref) <= TOL


# corrupted checkpoints ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, shape", [
    ("model.layers.1.self_attn.kv_b_proj.weight", (16, 80)),
    ("model.layers.1.mlp.experts.3.up_proj.weight", (32, 60)),
])
def test_wrong_shape_names_tensor_and_both_shapes(saved, tmp_path, name, shape):
    def reshape(tensors):
        tensors[name] = torch.zeros(shape)

    _copy_with(saved("V3-moe-q_proj"), tmp_path / "bad", reshape)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "bad")
    expected = tuple(load_file(saved("V3-moe-q_proj") / "model.safetensors")[name].shape)
    assert name in str(err.value) and str(shape) in str(err.value) and str(expected) in str(err.value)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.kv_a_layernorm.weight",
                                  "model.layers.1.mlp.experts.5.down_proj.weight",
                                  "lm_head.weight"])
def test_missing_tensor_is_named(saved, tmp_path, name):
    _copy_with(saved("V2-moe-q_lora"), tmp_path / "bad", lambda tensors: tensors.pop(name))
    with pytest.raises(CheckpointError, match="lacks 1 tensor") as err:
        load_checkpoint(tmp_path / "bad")
    assert name in str(err.value)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_bias", "model.layers.1.mlp.experts.8.up_proj.weight",
                                  "model.layers.2.input_layernorm.weight", "model.layers.1.self_attn.o_proj.weight_scale_inv"])
def test_unknown_tensor_is_an_error(saved, tmp_path, name):
    _copy_with(saved("V3-moe-q_lora-yarn"), tmp_path / "bad", lambda t: t.update({name: torch.zeros(3)}))
    with pytest.raises(CheckpointError, match="does not use") as err:
        load_checkpoint(tmp_path / "bad")
    assert name in str(err.value)


def test_mtp_layers_and_rope_buffers_are_skipped_and_reported(saved, tmp_path):
    """DeepSeek-V3's MTP layer ``model.layers.{num_hidden_layers}`` is skipped (listed), the rest loads."""
    extra = {"model.layers.2.eh_proj.weight": torch.zeros(64, 128), "model.layers.2.enorm.weight": torch.ones(64),
             "model.layers.2.self_attn.kv_b_proj.weight": torch.zeros(80, 16),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    _copy_with(saved("V3-moe-q_lora-yarn"), tmp_path / "mtp", lambda t: t.update(extra))
    config = json.loads((tmp_path / "mtp" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "mtp" / "config.json").write_text(json.dumps(config))
    model = load_checkpoint(tmp_path / "mtp", form="A_CC")
    skipped = model.load_report.skipped
    assert sorted(sum(skipped.values(), [])) == sorted(extra)
    assert "3 MTP layer tensors" in model.load_report.summary()
    ids = _ids(2, 7)
    with torch.no_grad():
        assert rel_err(_logits(model, ids), hf("V3-moe-q_lora-yarn")(ids).logits) <= TOL


def test_pickles_only_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*safetensors only"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "absent")


def test_corrupt_file_is_a_checkpoint_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_oracle.hf_config(2).to_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(tmp_path)


def test_index_naming_an_absent_shard(saved, tmp_path):
    shutil.copytree(saved("V2-moe-q_lora", sharded=True), tmp_path / "ck")
    shard = sorted((tmp_path / "ck").glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_checkpoint(tmp_path / "ck")


# float8 (DeepSeek-V3's own release format) -----------------------------------------------------------

def _quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise e4m3 quantisation as DeepSeek-V3 ships it: returns ``w_fp8 [O, I]`` and ``scale_inv [ceil(O/b), ceil(I/b)]``."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = w
    blocks = padded.view(br, block, bc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0  # [br, bc]
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(br * block, bc * block)[:rows, :cols]
    return q.contiguous(), scale


def test_dequantize_fp8_edge_blocks():
    """128x128 blocks over a 300x200 weight (partial blocks at both edges) against a per-block loop."""
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, scale = _quantize(w, 128)
    assert scale.shape == (3, 2)
    out = dequantize_fp8(q, scale, (128, 128), torch.float32)
    for i in range(3):
        for j in range(2):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            assert torch.equal(out[rows, cols], q[rows, cols].float() * scale[i, j])
    assert ((out - w).abs() <= w.abs() / 16 + scale.max() * 2 ** -9).all()


_QUANTIZED = ("_proj.weight", "kv_a_proj_with_mqa.weight")  # DeepSeek-V3 keeps embeddings, norms, lm_head, router


@pytest.mark.parametrize("block", [128, 16])
def test_fp8_checkpoint_dequantizes(saved, tmp_path, block):
    """Quantise every projection blockwise, store ``_scale_inv``; load: within fp8 error of the original,
    exactly the dequantised values, bf16 by default, and logits equal HF's with those weights."""
    folder = saved("V3-moe-q_lora-yarn")
    original = load_file(folder / "model.safetensors")
    quantized = {}

    def quantize(tensors):
        for name, w in list(tensors.items()):
            if name.endswith(_QUANTIZED) and name != "lm_head.weight":
                tensors[name], tensors[name + "_scale_inv"] = _quantize(w, block)
                quantized[name] = tensors[name], tensors[name + "_scale_inv"]

    _copy_with(folder, tmp_path / "fp8", quantize)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))

    model = load_checkpoint(tmp_path / "fp8", dtype=torch.float32)
    assert model.load_report.dequantized == len(quantized) == 40  # 2 x 5 attention, 3 dense, 8 x 3 + 3 MoE
    state = model.state_dict()
    for name, (q, scale) in quantized.items():
        expert = name.split(".mlp.experts.")
        if len(expert) == 2:  # model.layers.1.mlp.experts.{e}.{proj}.weight -> a slice of the fused tensor
            e, proj = expert[1].split(".")[:2]
            fused = state[f"{expert[0]}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][int(e)]
            got = fused if proj == "down_proj" else fused.chunk(2)[proj == "up_proj"]
        else:
            got = state[name]
        s = scale.repeat_interleave(block, 0)[: q.shape[0]].repeat_interleave(block, 1)[:, : q.shape[1]]
        assert torch.equal(got, q.float() * s), name
        assert ((got - original[name]).abs() <= original[name].abs() / 16 + s * 2 ** -9).all(), name

    reference = hf_oracle.hf_model(3, q_lora_rank=32, yarn=True)
    reference.load_state_dict(state, strict=True)  # HF with the dequantised weights
    ids = _ids(2, 8)
    with torch.no_grad():
        assert rel_err(_logits(model, ids), reference(ids).logits) <= TOL

    default = load_checkpoint(tmp_path / "fp8", form="A_CC")
    assert default.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert torch.isfinite(_logits(default, ids)).all()

    def drop_scale(tensors):
        quantize(tensors)
        del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]

    _copy_with(folder, tmp_path / "no_scale", drop_scale)
    shutil.copy(tmp_path / "fp8" / "config.json", tmp_path / "no_scale" / "config.json")
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.o_proj.weight is float8"):
        load_checkpoint(tmp_path / "no_scale")

"""The decode attention as one custom node, ``mla_deploy::MlaDecode``, for the TensorRT plugin of ``plugins/mla_decode``.

With ``[export] decode_attention = "plugin"`` every decode layer's attention core (scores over the latent
cache, masked softmax, weighted sum of ``c_kv``) is the custom op :func:`mla_decode`. Its eager
implementation is the same standard-op subgraph as :class:`~mla_deploy.model.mla.AbsorbedMLAttention`
(``A_CC``), so PyTorch pins its semantics; at export it becomes one ONNX node:

``MlaDecode(q [B, H, S, C], cache [B, 1, T, C], lengths [B] int64) -> [B, H, S, r]``, domain ``mla_deploy``,
attributes ``softmax_scale`` (float), ``kv_lora_rank`` (int) and ``plugin_namespace = "mla_deploy"`` (what
TensorRT's ONNX parser reads to find the plugin creator ``mla_deploy::MlaDecode``).

``C = kv_lora_rank + qk_rope_head_dim``; channels ``[0, r)`` of the cache are the values. ``lengths[b]`` is the
number of valid rows of sequence ``b`` after this step's ``S`` rows were written: new token ``s`` sees slots
``t < lengths[b] - S + 1 + s`` (the static cache's mask with ``lengths = write_indices + S``).
"""

from __future__ import annotations

import torch

from ..artifact.manifest import PLUGIN_DOMAIN, PLUGIN_OP
from ..errors import CacheCapacityError, ConfigError
from ..model.cache import StaticCache
from ..model.mla import AbsorbedMLAttention, masked_softmax

DOMAIN, OP_TYPE = PLUGIN_DOMAIN, PLUGIN_OP


@torch.library.custom_op("mla_deploy::mla_decode", mutates_args=())
def mla_decode(q: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, softmax_scale: float,
               kv_lora_rank: int) -> torch.Tensor:
    """Absorbed MLA attention over the latent cache (standard ops; the plugin's reference semantics).

    Args:
        q: ``[B, H, S, C]``: ``[q_nope . W_UK | rope(q_pe)]`` per head.
        cache: ``[B, 1, T, C]`` latent rows (the static cache after this step's write).
        lengths: ``[B]`` int64 valid rows per sequence, this step's ``S`` rows included (``S <= lengths <= T``).
        softmax_scale: multiplies the scores (in float32) before the softmax.
        kv_lora_rank: ``r``: the values are channels ``[0, r)`` of the cache.
    Returns:
        ``[B, H, S, r]`` in ``q``'s dtype.
    """
    steps, slots = q.shape[-2], cache.shape[-2]
    if bool((lengths < steps).any()) or bool((lengths > slots).any()):
        raise CacheCapacityError(f"mla_decode: lengths {lengths.tolist()} must lie in [{steps}, {slots}]")
    scores = q @ cache.transpose(-1, -2)  # [B, H, S, T]
    # slot t is visible to new token s iff t <= lengths - S + s: the static cache's own mask
    mask = StaticCache(lengths - steps).mask(steps, cache)  # [B, 1, S, T]
    probs = masked_softmax(scores.float() * softmax_scale, mask)
    return probs.to(cache.dtype) @ cache[..., :kv_lora_rank]


@mla_decode.register_fake
def _mla_decode_fake(q, cache, lengths, softmax_scale, kv_lora_rank):
    return q.new_empty((*q.shape[:-1], kv_lora_rank))


def op_schema():
    """The ``onnx.defs.OpSchema`` of ``mla_deploy::MlaDecode`` (version 1); not registered with onnx globally."""
    from onnx.defs import OpSchema

    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    return OpSchema(
        OP_TYPE, DOMAIN, 1, "Absorbed MLA decode attention over the latent cache (TensorRT plugin).",
        inputs=[OpSchema.FormalParameter("q", "T", "[B, H, S, C]"),
                OpSchema.FormalParameter("cache", "T", "[B, 1, T, C]"),
                OpSchema.FormalParameter("lengths", "tensor(int64)", "[B] valid rows after this step")],
        outputs=[OpSchema.FormalParameter("output", "T", "[B, H, S, kv_lora_rank]")],
        type_constraints=[("T", floats, "q, cache and output share one float type")],
        attributes=[OpSchema.Attribute("softmax_scale", OpSchema.AttrType.FLOAT, "score multiplier"),
                    OpSchema.Attribute("kv_lora_rank", OpSchema.AttrType.INT, "value channels [0, r)"),
                    OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace")])


def mla_decode_onnx(q, cache, lengths, softmax_scale: float, kv_lora_rank: int):
    """onnxscript translation of :func:`mla_decode`: one ``mla_deploy::MlaDecode`` node."""
    from onnxscript import values

    op = values.Op(values.Opset(DOMAIN, 1), OP_TYPE, op_schema())
    return op(q, cache, lengths, softmax_scale=float(softmax_scale), kv_lora_rank=int(kv_lora_rank),
              plugin_namespace=DOMAIN)


def translation_table() -> dict:
    """``custom_translation_table`` entries of this module, for ``torch.onnx.export``."""
    return {torch.ops.mla_deploy.mla_decode.default: mla_decode_onnx}


class PluginDecodeAttention(AbsorbedMLAttention):
    """:class:`AbsorbedMLAttention` whose attention core is :func:`mla_decode` (static cache only).

    Parameters and their names are those of the absorbed module it replaces.
    """

    def attend(self, q_lat, q_pe, new, mask, past, cache):
        """As :meth:`AbsorbedMLAttention.attend`, the core being :func:`mla_decode`; ``mask`` is unused
        (``lengths`` replaces it)."""
        lengths = cache.lengths_after(q_lat.shape[2])  # [B]; the concat cache refuses (ConfigError)
        present, _ = cache.write_latent(past, new)  # [B, 1, T_max, C]
        o_lat = mla_decode(torch.cat((q_lat, q_pe), dim=-1), present, lengths, float(self.softmax_scale),
                           self.config.kv_lora_rank)  # [B, H, S, r]
        return o_lat, present


def use_decode_plugin(model: torch.nn.Module) -> torch.nn.Module:
    """Replace, in place, every :class:`AbsorbedMLAttention` of ``model`` by a :class:`PluginDecodeAttention`.

    Returns: ``model``. Raises: ConfigError: ``model`` has no absorbed attention (an original form), or sparse
    attention (the plugin attends to every slot).
    """
    config = getattr(model, "config", None)
    if config is not None and config.is_sparse:
        raise ConfigError(f"{config.name}: the MlaDecode plugin attends to every cached token; DeepSeek Sparse "
                          "Attention (index_topk) needs decode_attention = \"standard\"")
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, AbsorbedMLAttention) and not isinstance(child, PluginDecodeAttention):
                with torch.device("meta"):  # the child's own tensors are assigned (a meta model stays meta)
                    new = PluginDecodeAttention(child.config, child.form)
                new.load_state_dict(child.state_dict(), assign=True)
                new.train(child.training)
                setattr(module, name, new)
                replaced += 1
    if not replaced:
        raise ConfigError("decode_attention = \"plugin\" needs an absorbed decode_form (A_CC or A_CC_ME)")
    return model

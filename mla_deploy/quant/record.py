"""What an export does to its weights, and the manifest's record of what it did: one object either way.

:data:`FLOAT` (nothing quantized) and a :class:`Quantized` scheme in a format answer the same questions, so no
caller asks "quantized or not?":

* the export (:meth:`~Quantization.quantize_graphs`): float changes nothing; a scheme puts the weights in its
  format's nodes;
* the manifest (:meth:`~Quantization.to_manifest`, :func:`from_manifest`): float has no ``quantization`` record;
* a tensor's bytes as stored (:meth:`~Quantization.stored_nbytes`, the bench's bound): ``numel * itemsize``, or
  integers plus scales in the format's layout;
* the PyTorch reference (:meth:`~Quantization.dequantize_state`): unchanged, or the keys quantized-then-dequantized;
* an ONNX Runtime session (:meth:`~Quantization.session`): the graph file, or what the format needs for the asked
  compute;
* TensorRT (:meth:`~Quantization.require_tensorrt`): builds float, asks the format otherwise;
* the graph files (:meth:`~Quantization.disagreement`): hold no quantized weight, or the record's scheme and format.

The manifest's record (``manifest.json`` ``quantization``; older artifacts load): ``{"weights", "block_size",
"symmetric": true, "axis": "input features", "format", "ops", "tensors", "bytes", "keys"}``, ``keys`` the checkpoint
tensors quantized along their last axis, and ``per_head`` where any ``kv_b_proj`` is held as its absorbed halves,
each in blocks of its own product's input features (:data:`~.formats.HEADWISE`; an mla-deploy older than that
field refuses the record rather than misread it). The first quantized release wrote no ``ops`` and the ops as
``format``, and a record may lack ``format``: both mean ``qdq``, then the only format. A float artifact has no
record.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from ..errors import ArtifactError, ConfigError
from ..expert_forms import CPU_LAYOUT
from .formats import (DEFAULT_FORMAT, EXACT_COMPUTE, FAST_COMPUTE, FORMATS, HEADWISE, QDQ, QMOE_LAYOUTS, WeightFormat,
                      accuracy_level)
from .formats import session as format_session
from .graph import GraphQuantization, QuantizedKeys, WeightPart, quantize_graph_weights
from .scheme import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, SCHEMES, WeightQuantization, fake_quantize

if TYPE_CHECKING:
    import torch

FLOAT_WEIGHTS = "float"
#: ``--weights`` / ``[export] weights``: float, then the schemes
WEIGHTS = (FLOAT_WEIGHTS, *SCHEMES)
#: a record's ``format``: a format's name, or (the first quantized release, when ``qdq`` was the only format and
#: there was no ``ops``) its ops
_FORMAT_OF_RECORD = {**{f.ops: f for f in FORMATS.values()}, **FORMATS}
#: the fields of a record; ``format`` may be absent (records written before there were two formats)
_RECORD_FIELDS = {"weights", "block_size", "symmetric", "axis", "format", "ops", "tensors", "bytes", "keys",
                  "per_head"}
#: the absorbed attention's names of ``kv_b_proj``'s halves (the bench's meta model holds them, not ``kv_b_proj``)
_KV_B, _HALVES = "kv_b_proj.weight", ("w_uk", "w_uv")


class Quantization:
    """What an export does to its weights: :data:`FLOAT`, nothing (this class); or a :class:`Quantized` scheme.

    In an artifact's manifest it also records what the export did (:attr:`keys`, :attr:`tensors`, :attr:`bytes`).

    Attributes:
        quantized: any weight is quantized.
        weights: ``float``, ``int8`` or ``int4``.
        block_size: input features per scale (None: float).
        keys: the checkpoint tensors held quantized along their last axis, sorted (an artifact's record; empty
            otherwise).
        per_head: the ``kv_b_proj`` tensors held quantized as their absorbed halves (:data:`~.formats.HEADWISE`).
        tensors: the quantized weights in the graphs (each expert of a stacked tensor counts in the branch form; a
            fused ``QMoE``'s stacked weight counts once).
        bytes: their bytes as stored (integers and scales).
    """

    quantized = False
    weights = FLOAT_WEIGHTS
    block_size: int | None = None
    keys: tuple[str, ...] = ()
    per_head: tuple[str, ...] = ()
    tensors = 0
    bytes = 0

    def __repr__(self) -> str:
        return "<Quantization float>"

    def describe(self) -> str:
        """``no quantization (float weights)``, ``int4 weights in blocks of 32 (matmulnbits)``."""
        return "no quantization (float weights)"

    def settings(self) -> dict[str, Any]:
        """The ``[export]`` fields that make this quantization (``weights``, ``block_size``, and ``quant_format``
        where it matters)."""
        return {"weights": FLOAT_WEIGHTS, "block_size": DEFAULT_BLOCK_SIZE}

    def fingerprint(self) -> dict[str, Any]:
        """What it adds to an artifact's identity (float: nothing, so float artifacts keep theirs)."""
        return {}

    def variant(self, name: str) -> str:
        """``name`` for float weights, ``name-int8`` ...: the name of a thing made with these weights."""
        return name

    def stored_type(self, precision: str) -> str:
        """The weights' type as stored: ``precision`` for float weights, else the scheme."""
        return precision

    def kept_float(self) -> str:
        """What the export keeps in the float type: ``every weight``, or ``the embedding, norms, routers and
        kv_b_proj`` (``kv_b_proj`` named where it is not quantized per head)."""
        return "every weight"

    def run_info(self) -> dict[str, Any]:
        """What a run reports of the weights: ``{"weights", "quantized_compute"}`` (an engine's default compute)."""
        return {"weights": FLOAT_WEIGHTS, "quantized_compute": None}

    @property
    def arithmetic(self) -> str:
        """The arithmetic of the weights' products under an engine's default compute: ``fp32`` for float weights,
        ``int8`` (activations quantized per block) for quantized ones; what bounds a step's FLOPs in a bench."""
        return EXACT_COMPUTE

    @property
    def tensorrt_format(self) -> bool:
        """The weights are quantized in a format written for TensorRT (``qdq``); float weights are not."""
        return False

    def qmoe_misfit(self, widths: Mapping[str, int], layout: str = CPU_LAYOUT) -> str | None:
        """Why ONNX Runtime's ``QMoE`` in the fused form's ``layout`` cannot hold experts of these input widths
        (``{"hidden_size": 2048, ...}``: its blocks must divide each; on CUDA, 64 too:
        :meth:`~mla_deploy.quant.formats._QMoE.misfit`), e.g. ``moe_intermediate_size 32 is not a multiple of 64``;
        None when it can (float weights: always)."""
        return None

    # the export -----------------------------------------------------------------------------------------------------
    def quantize_graphs(self, graphs: list[tuple[Any, dict, dict]], log: Callable[[str], None],
                        per_head: bool = True, fused_layout: str = CPU_LAYOUT) -> QuantizedKeys:
        """Quantize the traced ``graphs`` in place (:func:`~mla_deploy.quant.graph.quantize_graph_weights`;
        ``per_head``: the absorbed halves of ``kv_b_proj`` too, where the format takes them; ``fused_layout``: the
        fused experts' layout, :data:`~mla_deploy.expert_forms.FUSED_LAYOUTS`); returns the checkpoint keys quantized
        (none for float)."""
        return QuantizedKeys()

    def recorded(self, keys: QuantizedKeys, parts: Iterable[tuple[WeightPart, int]]) -> "Quantization":
        """The record of an export that quantized ``keys``, its initializers being ``parts`` (``(WeightPart,
        bytes)`` of every initializer)."""
        return self

    def to_manifest(self) -> dict[str, Any]:
        """The manifest's entry: ``{"quantization": record}``, nothing for float weights."""
        return {}

    # reading an artifact ---------------------------------------------------------------------------------------------
    def stored_nbytes(self, key: str, shape: Sequence[int], itemsize: int) -> int:
        """Bytes the tensor ``key`` takes in the artifact: ``numel * itemsize`` for a float one, integers plus
        scales for a quantized one: a checkpoint tensor ``[..., out, in]`` (per expert of a stacked tensor), or an
        absorbed half of a per-head ``kv_b_proj`` (``...self_attn.w_uk [H, dn, r]``, ``w_uv [H, dv, r]``)."""
        return math.prod(shape) * itemsize

    def with_scale_bytes(self, scale_bytes: int) -> "Quantization":
        """This record with its quantized tensors' scales counted at ``scale_bytes`` each (float weights: itself)."""
        return self

    def quantized_nbytes(self, shapes: Mapping[str, Sequence[int]], itemsize: int) -> int:
        """Bytes of the quantized tensors among ``shapes`` (``{key: shape}``, a model's state dict in any form),
        as stored."""
        return sum(self.stored_nbytes(key, shape, itemsize) for key, shape in shapes.items()
                   if key in self.keys or _per_head_key(key) in self.per_head)

    @property
    def key_count(self) -> int:
        """How many checkpoint tensors are held quantized (:attr:`keys` and :attr:`per_head`)."""
        return len(self.keys) + len(self.per_head)

    def unknown_keys(self, available: Iterable[str]) -> list[str]:
        """The recorded keys that are not among ``available`` (a model's state-dict keys, in any form: a per-head
        ``kv_b_proj`` may be there as its absorbed halves), sorted."""
        names = set(available)
        halves = {_per_head_key(k) for k in names}
        return sorted((set(self.keys) - names) | {k for k in self.per_head if k not in names and k not in halves})

    def dequantize_state(self, state: Mapping[str, "torch.Tensor"], config: Any = None) -> None:
        """Replace, in place, each quantized tensor of ``state`` (a ``CC``-form state dict of the model ``config``,
        an :class:`~mla_deploy.config.MLAConfig`) by its quantized-then-dequantized value: the weights the graphs
        compute with."""

    def session(self, path: str | Path, compute: str) -> tuple[str | bytes, dict[str, str]]:
        """What ONNX Runtime is given to run the graph at ``path`` with quantized products in ``compute`` (``int8``
        or ``fp32``): the model (its path or bytes) and session config entries.

        Raises:
            InputError: an unknown ``compute``.
        """
        accuracy_level(compute)
        return str(path), {}

    def require_tensorrt(self, where: str) -> None:
        """Refuse, naming ``where``, weights TensorRT cannot build. Raises: ArtifactError."""

    def expected_graphs(self) -> GraphQuantization:
        """What the graphs of an artifact with this record hold (:func:`~mla_deploy.quant.observe_graphs`)."""
        return GraphQuantization({})

    def disagreement(self, graphs: GraphQuantization) -> str | None:
        """Why this record does not describe what the ``graphs`` hold, or None when it does."""
        expected = self.expected_graphs()
        if graphs == expected:
            return None
        return f"its quantization record says {expected.describe()}, the graphs hold {graphs.describe()}"


@dataclass(frozen=True, repr=False)
class Quantized(Quantization):
    """Weight-only quantization: a scheme (int8/int4, block size) written in a format.

    Attributes:
        scheme: the :class:`~mla_deploy.quant.WeightQuantization`.
        format: the :class:`~mla_deploy.quant.formats.WeightFormat`.
        keys, tensors, bytes: see :class:`Quantization` (an artifact's record).
    """

    scheme: WeightQuantization
    format: WeightFormat = DEFAULT_FORMAT
    keys: tuple[str, ...] = ()
    tensors: int = 0
    bytes: int = 0
    per_head: tuple[str, ...] = ()
    #: bytes per scale of the tensors in :attr:`keys` as a runtime holds them (0: the graph's float type; 2: float16,
    #: as the CPU engine's operators read them, :meth:`with_scale_bytes`)
    scale_bytes: int = 0
    quantized = True

    def __repr__(self) -> str:
        return f"<Quantization {self.describe()}>"

    @property
    def weights(self) -> str:  # type: ignore[override]
        return self.scheme.weights

    @property
    def block_size(self) -> int:  # type: ignore[override]
        return self.scheme.block_size

    def describe(self) -> str:
        return f"{self.weights} weights in blocks of {self.block_size} ({self.format.name})"

    def settings(self) -> dict[str, Any]:
        return {"weights": self.weights, "block_size": self.block_size, "quant_format": self.format.name}

    def fingerprint(self) -> dict[str, Any]:
        return {"quantization": self.scheme.to_dict()}

    def variant(self, name: str) -> str:
        return f"{name}-{self.weights}"

    def stored_type(self, precision: str) -> str:
        return self.weights

    def kept_float(self) -> str:
        return "the embedding, norms and routers" if self.per_head else "the embedding, norms, routers and kv_b_proj"

    def run_info(self) -> dict[str, Any]:
        return {"weights": self.scheme.to_dict(), "quantized_compute": f"{FAST_COMPUTE} (the engine's default)"}

    @property
    def arithmetic(self) -> str:
        return FAST_COMPUTE

    @property
    def tensorrt_format(self) -> bool:
        return self.format.tensorrt

    def qmoe_misfit(self, widths, layout=CPU_LAYOUT):
        return QMOE_LAYOUTS[layout].misfit(widths, self.scheme)

    def quantize_graphs(self, graphs, log, per_head=True, fused_layout=CPU_LAYOUT):
        keys = quantize_graph_weights(graphs, self.scheme, self.format, per_head, QMOE_LAYOUTS[fused_layout])
        per_head = f" ({len(keys.per_head)} per head)" if keys.per_head else ""
        log(f"{self.weights} weights in blocks of {self.block_size}: {len(keys)} checkpoint tensors{per_head}")
        return keys

    def recorded(self, keys, parts):
        stored = [(part, n) for part, n in parts if part.quantized]
        return Quantized(self.scheme, self.format, tuple(sorted(keys.keys)), sum(1 for p, _ in stored if p.index == 0),
                         sum(n for _, n in stored), tuple(sorted(keys.per_head)))

    def to_manifest(self) -> dict[str, Any]:
        per_head = {"per_head": list(self.per_head)} if self.per_head else {}
        return {"quantization": {**self.scheme.to_dict(), "symmetric": True, "axis": "input features",
                                 "format": self.format.name, "ops": self.format.ops, "tensors": self.tensors,
                                 "bytes": self.bytes, "keys": list(self.keys), **per_head}}

    def with_scale_bytes(self, scale_bytes: int) -> "Quantized":
        """This record with the scales of :attr:`keys` counted at ``scale_bytes`` each (the per-head weights' keep
        the graph's float type): what a CPU engine storing them as float16 reads."""
        return dataclasses.replace(self, scale_bytes=scale_bytes)

    def stored_nbytes(self, key, shape, itemsize):
        if _per_head_key(key) in self.per_head:
            heads, rows, rank = shape  # w_uk [H, dn, r] multiplies as [K=dn, N=r]; w_uv [H, dv, r] as [K=r, N=dv]
            k, n = (rows, rank) if key.endswith(_HALVES[0]) else (rank, rows)
            return heads * HEADWISE.nbytes(k, n, self.scheme, itemsize)
        if key not in self.keys:
            return math.prod(shape) * itemsize
        *lead, n, k = shape  # [..., out, in]: quantized per output row in blocks of input features
        return math.prod(lead) * self.format.nbytes(k, n, self.scheme, self.scale_bytes or itemsize)

    def dequantize_state(self, state, config=None):
        import torch

        with torch.no_grad():
            for key in self.keys:
                state[key].copy_(fake_quantize(state[key], self.scheme))
            if self.per_head and config is None:
                raise ValueError("a per-head quantization needs the model's config to split kv_b_proj")
            for key in self.per_head:
                state[key].copy_(fake_quantize_heads(state[key], self.scheme, config))

    def session(self, path, compute):
        return format_session(self.format, Path(path), compute)

    def disagreement(self, graphs):
        return super().disagreement(graphs.counted_as(self.format.name))

    def require_tensorrt(self, where):
        self.format.require_tensorrt(where)

    def expected_graphs(self):
        return GraphQuantization({(self.format.name, self.scheme.bits, self.block_size): self.tensors})


def _per_head_key(name: str) -> str | None:
    """The ``kv_b_proj`` key whose absorbed half ``name`` is (``...self_attn.w_uk`` ->
    ``...self_attn.kv_b_proj.weight``), or None."""
    for half in _HALVES:
        if name.endswith("." + half):
            return name[: -len(half)] + _KV_B
    return None


def fake_quantize_heads(weight: "torch.Tensor", scheme: WeightQuantization, config: Any) -> "torch.Tensor":
    """What the graphs compute with for a per-head ``kv_b_proj.weight [H*(dn+dv), r]``, in its layout: each head's
    ``w_uk [dn, r]`` quantized in blocks of ``dn`` (its product ``q_nope . w_uk`` sums over ``dn``) and ``w_uv
    [dv, r]`` in blocks of ``r`` (``o_lat . w_uv^T`` sums over ``r``), then dequantized. Returns float32."""
    import torch

    from ..model.absorb import split_kv_b

    w_uk, w_uv = split_kv_b(weight, config)  # [H, dn, r], [H, dv, r]
    w_uk = fake_quantize(w_uk.transpose(1, 2), scheme).transpose(1, 2)
    return torch.cat((w_uk, fake_quantize(w_uv, scheme)), dim=1).reshape(weight.shape)


#: nothing quantized: the weights in the artifact's precision
FLOAT = Quantization()


def plan(weights: str | None = None, block_size: int | None = None, quant_format: str | None = None) -> Quantization:
    """``--weights`` / ``[export] weights`` (None: float), ``block_size`` (None: 32) and ``quant_format`` (None: the
    default) as a :class:`Quantization`.

    Raises:
        ConfigError: an unknown scheme or format, a block size not in :data:`BLOCK_SIZES`, or a block size other
            than the default for float weights.
    """
    fmt = FORMATS.get(DEFAULT_FORMAT.name if quant_format is None else quant_format)
    if fmt is None:
        raise ConfigError(f"quant_format must be {' or '.join(FORMATS)}, got {quant_format!r}")
    if weights in (None, FLOAT_WEIGHTS):
        if block_size not in (None, DEFAULT_BLOCK_SIZE):
            raise ConfigError(f"a block size needs quantized weights (weights = {' or '.join(SCHEMES)})")
        return FLOAT
    return Quantized(WeightQuantization(weights, DEFAULT_BLOCK_SIZE if block_size is None else block_size), fmt)


def plans(weights: Sequence[str], block_size: int | None = None, quant_format: str | None = None
          ) -> list[Quantization]:
    """:func:`plan` of each of ``weights`` (e.g. the bench's ``--weights float,int4``), ``block_size`` applying to the
    quantized ones."""
    return [plan(w, None if w == FLOAT_WEIGHTS else block_size, quant_format) for w in weights]


def from_manifest(record: Any, source: str) -> Quantization:
    """The manifest's ``quantization`` record (None: float weights) as a :class:`Quantization`.

    Raises:
        ArtifactError: a record that is no table, lacks its keys, has an unknown field, scheme, block size or
            format, or counts that are no integers; one line naming ``source``.
    """
    if record is None:
        return FLOAT
    if not isinstance(record, dict) or not isinstance(record.get("keys"), list):
        raise ArtifactError(f"{source}: quantization must be a table with the quantized keys")
    unknown = sorted(set(record) - _RECORD_FIELDS)
    counts = [record.get(k, 0) for k in ("tensors", "bytes")]
    if unknown or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise ArtifactError(f"{source}: quantization: " + (f"unknown field(s) {', '.join(unknown)}" if unknown else
                                                            f"tensors and bytes must be counts, got {counts}"))
    try:
        scheme = WeightQuantization(str(record.get("weights")), int(record.get("block_size", DEFAULT_BLOCK_SIZE)))
        fmt = _FORMAT_OF_RECORD.get(record.get("format", QDQ.name))
        if fmt is None:
            raise ConfigError(f"format must be {' or '.join(FORMATS)}, got {record.get('format')!r}")
    except (ConfigError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{source}: quantization: {exc}") from None
    per_head = record.get("per_head", [])
    if not isinstance(per_head, list):
        raise ArtifactError(f"{source}: quantization: per_head must be a list of keys")
    if per_head and not fmt.headwise:
        raise ArtifactError(f"{source}: quantization: the {fmt.name} format holds no per-head weights")
    return Quantized(scheme, fmt, tuple(str(k) for k in record["keys"]), *counts, tuple(str(k) for k in per_head))


def require_quantized(weights: str | None, flags: Mapping[str, Any]) -> None:
    """Refuse a flag among ``flags`` (``{"--block-size": value or None, ...}``) given for float ``weights``.

    Raises:
        ConfigError: ``--block-size needs --weights int8 or int4``.
    """
    given = [flag for flag, value in flags.items() if value is not None]
    if given and weights in (None, FLOAT_WEIGHTS):
        raise ConfigError(f"{given[0]} needs --weights {' or '.join(SCHEMES)}")


def parse_block_size(value: str | int | None) -> int | None:
    """A ``--block-size`` choice as an integer (None: not given)."""
    return None if value is None else int(value)


def weights_list(value: str | Sequence[str], block_size: str | int | None) -> tuple[tuple[str, ...], int | None]:
    """The bench's ``--weights LIST`` (a comma list of :data:`WEIGHTS`, duplicates dropped) and its
    ``--block-size``.

    Raises:
        ConfigError: an unknown entry, an empty list, a block size without a quantized entry or not in
            :data:`BLOCK_SIZES`.
    """
    given = value.split(",") if isinstance(value, str) else list(value)
    chosen = tuple(dict.fromkeys(w.strip() for w in given))
    if not chosen or any(w not in WEIGHTS for w in chosen):
        raise ConfigError(f"--weights takes a comma list of {', '.join(WEIGHTS)}; got {','.join(given)!r}")
    if block_size is None:
        return chosen, None
    try:
        size = int(str(block_size).strip())
    except ValueError:
        raise ConfigError(f"--block-size takes an integer, got {block_size!r}") from None
    require_quantized(next((w for w in chosen if w != FLOAT_WEIGHTS), None), {"--block-size": size})
    if size not in BLOCK_SIZES:
        raise ConfigError(f"--block-size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {size}")
    return chosen, size

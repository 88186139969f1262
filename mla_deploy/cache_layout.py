"""The latent cache layouts: the one place that knows what ``concat``, ``static`` and genai's cache mean.

A :class:`CacheLayout` answers, for its mode, every question the rest of the package asks about the cache:

================================ ================================================ ============================================
question                         :data:`CONCAT`                                   :data:`STATIC`
================================ ================================================ ============================================
graph I/O (:meth:`~CacheLayout.io`)  ``attention_mask [B, P+S]``;                   ``write_indices [B]``;
                                 past ``[B, P, C]``, present ``[B, P+S, C]``       past = present ``[B, 1, capacity, C]``
tracing (:meth:`~CacheLayout.dynamic_shapes`, :meth:`~CacheLayout.example_state`)  past axis dynamic from 0  capacity axis dynamic
PyTorch (:meth:`~CacheLayout.policy`)  :class:`~mla_deploy.model.cache.ConcatCache`  :class:`~mla_deploy.model.cache.StaticCache`
TensorRT (:meth:`~CacheLayout.axis_ranges`)  past and total from ``[build]``       capacity fixed at ``max_cache_length``
host state (:meth:`~CacheLayout.new_state`, ...)  grows; key-valid mask kept      fixed buffers written in place
================================ ================================================ ============================================

A third layout, :data:`GENAI`, is the cache as onnxruntime-genai holds it (``export --target genai``): the latent
row cut into two equal column halves, genai's "key" and "value" ``[B, 1, capacity, C/2]`` per layer, written in place
at the slot ``total - S`` of an ``attention_mask [B, total]`` whose zeros mark left padding
(:class:`~mla_deploy.model.cache.MaskedBlockCache`), under genai's names (``past_key_values.{i}.key``, ...). It is
no artifact cache mode (not in :data:`CACHE_MODES`): genai runs it, so it answers the graph and tracing
questions and refuses the host-side ones.

A model with DeepSeek Sparse Attention has a second cache per layer, its indexer's keys (``index_head_dim`` per
token): :func:`cache_tensors` lists every cache tensor of a model (names, width), in graph order, and the layouts
lay each out alike; engines carry ``CacheState.caches`` in that order without knowing what each holds. A LongCat-Flash
layer holds two MLA sub-layers, each with its own latent cache: its caches are one per MLA sub-layer
(``config.num_hidden_layers`` of them, transformers' own cache index ``2 * layer + sub-layer``), so every count
below (``layer_rows``, the manifest, the memory a batch takes) is per MLA sub-layer.

Everything else asks the layout (``get_layout(mode)``, or :data:`GENAI`) instead of comparing mode strings. The tensor names and
axis names themselves are in :mod:`mla_deploy.io_spec`.

Host-side state is array-agnostic: an engine passes its own ``allocate(shape)`` (NumPy, an ``OrtValue``, a
CUDA tensor) and the layout decides the shapes, the control input and how the state advances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .config import MLAConfig
from .errors import CacheCapacityError, ConfigError, InputError, ShapeError
from .io_spec import (BATCH, CAPACITY, LOGITS, PAST, PRECISIONS, SEQ, TOTAL, TensorSpec, index_past_name,
                      index_present_name, past_name, present_name)

CACHE_MODES = ("concat", "static")


@dataclass(frozen=True)
class CacheTensor:
    """One cache of the graph: its input and output names, its channels and what it holds (``latent`` or
    ``index``) of which MLA layer (for LongCat-Flash, sub-layer ``layer % 2`` of decoder layer ``layer // 2``)."""

    past: str
    present: str
    width: int
    kind: str
    layer: int


def cache_tensors(config: MLAConfig, layers: int | None = None) -> list[CacheTensor]:
    """Every cache tensor of ``config``'s graph, in graph order: ``past_latent.{i}`` of each layer, then with
    DeepSeek Sparse Attention ``past_index.{i}`` (``index_head_dim`` wide) of each layer. ``layers``: how many
    layers (default ``num_hidden_layers``)."""
    layers = config.num_hidden_layers if layers is None else layers
    out = [CacheTensor(past_name(i), present_name(i), config.latent_dim, "latent", i) for i in range(layers)]
    if config.is_sparse:
        out += [CacheTensor(index_past_name(i), index_present_name(i), config.index_head_dim, "index", i)
                for i in range(layers)]
    return out


def cache_elements_per_token(config: MLAConfig) -> int:
    """Cached numbers per token per layer: the latent row, plus the index keys with sparse attention."""
    return config.latent_dim + (config.index_head_dim if config.is_sparse else 0)


def layer_rows(config: MLAConfig, per_tensor: Sequence[np.ndarray]) -> np.ndarray:
    """Rows read from each cache tensor (:func:`cache_tensors`' order, each ``[T, width]``) as one array per layer,
    ``[layers, T, W]`` with ``W`` = :func:`cache_elements_per_token`: a layer's latent row, then its index keys. What
    a prefix cache keeps of a prompt."""
    tensors = cache_tensors(config)
    if len(per_tensor) != len(tensors):
        raise ShapeError(f"{len(per_tensor)} cache tensors' rows, the model has {len(tensors)}")
    layers: list[list[np.ndarray]] = [[] for _ in range(config.num_hidden_layers)]
    for tensor, rows in zip(tensors, per_tensor):
        layers[tensor.layer].append(np.asarray(rows))
    return np.stack([np.concatenate(parts, axis=-1) for parts in layers])


def tensor_rows(config: MLAConfig, rows: np.ndarray) -> list[np.ndarray]:
    """The inverse of :func:`layer_rows`: ``rows [layers, T, W]`` as each cache tensor's ``[T, width]`` (views).

    Raises: ShapeError: ``rows`` not ``[num_hidden_layers, T, cache_elements_per_token]``."""
    rows, width = np.asarray(rows), cache_elements_per_token(config)
    if rows.ndim != 3 or rows.shape[0] != config.num_hidden_layers or rows.shape[2] != width:
        raise ShapeError(f"cache rows {list(rows.shape)} must be [{config.num_hidden_layers}, T, {width}]")
    out, start = [], [0] * config.num_hidden_layers
    for tensor in cache_tensors(config):
        at = start[tensor.layer]
        out.append(rows[tensor.layer, :, at: at + tensor.width])
        start[tensor.layer] = at + tensor.width
    return out

def _sublayer(config: MLAConfig, index: int) -> dict[str, int]:
    """Which decoder layer and MLA sub-layer the latent cache ``index`` belongs to, where a layer has several
    (LongCat-Flash); empty otherwise."""
    per = config.attention_per_layer
    return {} if per == 1 else {"layer": index // per, "sublayer": index % per}


Range = tuple[int, int, int]


@dataclass
class CacheState:
    """The cache of one batch of sequences, as an engine holds it.

    Attributes:
        lengths: ``[B]`` int64 rows held per sequence (= the position of its next token).
        caches: per layer, the engine's arrays in the layout's shape (:meth:`CacheLayout.cache_shape`).
        key_valid: concat only: ``[B, P]`` int64, 1 for a real token's slot, 0 for a padding slot.
        extra: engine-specific buffers (e.g. TensorRT's scratch present buffers).
        capacity: fixed-capacity layouts: the slots per sequence this state's caches have (None: growing).
    """

    lengths: np.ndarray
    caches: list
    key_valid: np.ndarray | None = None
    extra: dict = field(default_factory=dict)
    capacity: int | None = None


class CacheLayout:
    """What one cache mode means everywhere. Use the instances :data:`CONCAT` and :data:`STATIC`.

    Attributes:
        mode: ``concat`` or ``static`` (the name in recipes, manifests and the CLI).
        control: the graph input that tells the step where it is (``attention_mask`` or ``write_indices``).
        in_place: the present cache is the past buffer (bind one buffer as both).
        has_capacity: the cache has a fixed number of slots per sequence (``max_cache_length``).
        min_opset: the oldest ONNX opset its graphs export to (the static cache's in-place write is
            ``TensorScatter``, opset 24).
        supports_plugin: the decode graph can use the ``mla_deploy::MlaDecode`` TensorRT plugin (it reads the
            per-sequence valid lengths from the control input and the cache as ``[B, 1, T, C]``).
    """

    mode: str = ""
    control: str = ""
    in_place: bool = False
    has_capacity: bool = False
    min_opset: int = 18
    supports_plugin: bool = False

    def __repr__(self) -> str:
        return f"<CacheLayout {self.mode}>"

    # graph I/O ------------------------------------------------------------------------------------
    def control_spec(self) -> TensorSpec:
        """The control input's spec."""
        raise NotImplementedError

    def cache_shapes(self, width: int) -> tuple[tuple, tuple]:
        """Symbolic ``(past shape, present shape)`` of one layer's cache of ``width`` channels."""
        raise NotImplementedError

    def io(self, config: MLAConfig, precision: str, head_inputs: Sequence[TensorSpec] | None = None,
           head_outputs: Sequence[TensorSpec] | None = None, layers: int | None = None
           ) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """Inputs and outputs of a graph that steps the latent cache, in graph order.

        Args:
            config: the model (latent width, vocabulary, layer count).
            precision: ``fp32``, ``fp16`` or ``bf16``: the dtype of the caches (and of the default logits).
            head_inputs: the inputs before the control input (default, the decoder's: ``input_ids``,
                ``position_ids`` int64 ``[batch_size, sequence_length]``, ``logits_index`` int64
                ``[batch_size, logits_length]``).
            head_outputs: the outputs before the caches (default: ``logits [batch_size, logits_length, V]``).
            layers: caches (default: ``config.num_hidden_layers``).
        Returns:
            ``(head_inputs + [control] + past caches, head_outputs + present caches)``, the caches in
            :func:`cache_tensors`' order.
        """
        if precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        dtype = PRECISIONS[precision]
        layers = config.num_hidden_layers if layers is None else layers
        if head_inputs is None:
            head_inputs = [TensorSpec("input_ids", "int64", (BATCH, SEQ)), TensorSpec("position_ids", "int64", (BATCH, SEQ)),
                           TensorSpec("logits_index", "int64", (BATCH, LOGITS))]
        if head_outputs is None:
            head_outputs = [TensorSpec("logits", dtype, (BATCH, LOGITS, config.vocab_size))]
        tensors = cache_tensors(config, layers)
        inputs = [*head_inputs, self.control_spec(),
                  *(TensorSpec(t.past, dtype, self.cache_shapes(t.width)[0]) for t in tensors)]
        outputs = [*head_outputs, *(TensorSpec(t.present, dtype, self.cache_shapes(t.width)[1]) for t in tensors)]
        return inputs, outputs

    def describe(self, config: MLAConfig) -> dict[str, Any]:
        """The manifest's ``cache`` entry: mode, width, channel split, per-layer tensor names, aliasing."""
        r, c = config.kv_lora_rank, config.latent_dim
        index = {}
        if config.is_sparse:
            index = {"index": {
                "width": config.index_head_dim, "index_topk": config.index_topk,
                "holds": "each layer's lightning-indexer keys, LayerNorm(wk x) with the first qk_rope_head_dim channels "
                         "rotated (interleaved pairs); each query attends to the index_topk tokens they score highest",
                "layers": [{"past": index_past_name(i), "present": index_present_name(i)}
                           for i in range(config.num_hidden_layers)]}}
        return {
            "mode": self.mode,
            "width": c,
            "channels": {"c_kv": [0, r], "k_pe": [r, c]},
            "c_kv": "kv_a_layernorm(c_kv), the compressed key/value latent",
            "k_pe": "rope(k_pe) shared by all heads, adjacent pairs (2i, 2i+1) interleaved as in DeepSeek's weights",
            "sequence_axis": -2,
            "layers": [{"past": past_name(i), "present": present_name(i), **_sublayer(config, i)}
                       for i in range(config.num_hidden_layers)],
            "aliased": self.in_place,
            **index,
        }

    def manifest_capacity(self, max_cache_length: int | None) -> int | None:
        """The capacity an artifact records: ``max_cache_length`` for a fixed-capacity layout, else None."""
        return int(max_cache_length) if self.has_capacity and max_cache_length else None

    # tracing and PyTorch ----------------------------------------------------------------------------
    def dynamic_shapes(self, layers: int, batch, steps: int | None = None) -> tuple[dict, tuple[dict, ...]]:
        """``torch.export`` dynamic shapes of the control input and the ``layers`` caches.

        Args:
            layers: number of caches.
            batch: the ``torch.export.Dim`` of the batch axis (shared with the head inputs).
            steps: the new rows per step when the graph's sequence axis is fixed (e.g. 1 for a decode-only
                graph); None when it is dynamic (``sequence_length``).
        Returns:
            ``(control dims, (cache dims, ...))``.
        """
        raise NotImplementedError

    def example_state(self, batch: int, past: int, steps: int, width: int, layers: int, capacity: int, dtype):
        """Tracing inputs: ``(control, [cache] * layers)`` for ``batch`` sequences holding ``past`` rows that add
        ``steps`` rows (every dynamic axis must be traced at >= 2: an axis traced at 1 is frozen)."""
        raise NotImplementedError

    def example_caches(self, config: MLAConfig, batch: int, past: int, steps: int, capacity: int, dtype,
                       layers: int | None = None):
        """:meth:`example_state` for every cache of ``config`` (:func:`cache_tensors`): ``(control, caches)``."""
        control, caches = None, []
        for tensor in cache_tensors(config, layers):
            control, (cache,) = self.example_state(batch, past, steps, tensor.width, 1, capacity, dtype)
            caches.append(cache)
        return control, caches

    def policy(self, control):
        """The PyTorch cache policy for one step, given the control tensor (mask or write indices)."""
        raise NotImplementedError

    def layer_caches(self, flat: Sequence) -> list:
        """The graph's cache inputs (:meth:`io`'s order) as one entry per layer, as the model takes them."""
        return list(flat)

    def flat_caches(self, presents: Sequence) -> list:
        """The model's present caches (one entry per layer) as the graph's cache outputs, in :meth:`io`'s order."""
        return list(presents)

    def empty(self, batch: int, length: int, width: int, layers: int, dtype=None, device=None) -> list:
        """Zero torch caches: ``layers`` tensors of :meth:`cache_shape` ``(batch, length, width)``."""
        import torch

        return [torch.zeros(self.cache_shape(batch, length, width), dtype=dtype, device=device) for _ in range(layers)]

    # TensorRT ---------------------------------------------------------------------------------------
    def axis_ranges(self, role: str, build, capacity: int | None) -> dict[str, Range]:
        """``(min, opt, max)`` of every symbolic axis of ``role``'s graph (``prefill`` or ``decode``).

        Args:
            build: a :class:`~mla_deploy.recipe.BuildSettings` (``batch``, ``prompt_length``, ``past_length``).
            capacity: the artifact's capacity (fixed-capacity layouts).
        Raises:
            ConfigError: an unknown role, a missing capacity, or a prompt range beyond it.
        """
        if role not in ("prefill", "decode"):
            raise ConfigError(f"unknown graph role {role!r}; expected prefill or decode")
        seq: Range = tuple(build.prompt_length) if role == "prefill" else (1, 1, 1)
        # a generation step asks for one row of logits; validation asks for every position of the prompt
        logits: Range = (1, 1, seq[2])
        return {BATCH: tuple(build.batch), SEQ: seq, LOGITS: logits, **self._cache_ranges(role, build, capacity, seq)}

    def _cache_ranges(self, role: str, build, capacity: int | None, seq: Range) -> dict[str, Range]:
        raise NotImplementedError

    # host-side state ----------------------------------------------------------------------------------
    def cache_shape(self, batch: int, length: int, width: int) -> tuple[int, ...]:
        """Concrete shape of one layer's cache: concat ``[B, length, C]``, static ``[B, 1, length, C]``."""
        raise NotImplementedError

    def new_state(self, batch: int, widths: Sequence[int], capacity: int | None,
                  allocate: Callable[[tuple[int, ...]], Any]) -> CacheState:
        """An empty cache for ``batch`` sequences: one array per entry of ``widths`` (the channels of each cache
        tensor, :func:`cache_tensors`' order); ``allocate(shape)`` makes one zeroed array of the engine's kind."""
        raise NotImplementedError

    def room(self, prompt_length: int, capacity: int | None) -> int | None:
        """The most new tokens a sequence of ``prompt_length`` can get in ``capacity`` rows (its last token is not
        cached): at most 0 when the prompt alone does not fit; None where the cache grows."""
        return None

    def check_request(self, prompt_length: int, new_tokens: int, capacity: int | None) -> None:
        """Refuse a generation whose prompt plus new tokens cannot fit (fixed-capacity layouts)."""

    def check_step(self, state: CacheState, steps: int, capacity: int | None) -> None:
        """Refuse a step of ``steps`` new rows per sequence that cannot fit."""

    def control_input(self, state: CacheState, valid: np.ndarray) -> np.ndarray:
        """The control input of a step over ``valid [B, S]`` (1 real token, 0 right padding): int64."""
        raise NotImplementedError

    def advance(self, state: CacheState, valid: np.ndarray, control: np.ndarray, presents: Sequence) -> None:
        """Update ``state`` after a step that ran with ``control`` and returned ``presents`` (one per layer).
        ``lengths`` is updated in place: a view of some rows of a larger state (:meth:`rows`) advances them there."""
        state.lengths += np.asarray(valid).sum(axis=1).astype(np.int64)
        state.caches = list(presents)

    def held(self, cache, state: CacheState):
        """One layer's rows held after a step, ``[B, T, C]`` (a view where the array kind allows): concat every
        slot (padding slots included); static slots ``0 .. max(lengths)``."""
        raise NotImplementedError

    def slot_valid(self, state: CacheState, slots: int) -> np.ndarray:
        """``[B, slots]`` bool: which of the rows :meth:`held` returns belong to a real token."""
        raise NotImplementedError

    def rows(self, state: CacheState, start: int, stop: int, view: Callable[[Any, int, int], Any]) -> CacheState:
        """The sequences ``start .. stop - 1`` of ``state`` as a state of their own that shares its memory: a step
        on it writes their cache rows and advances their ``lengths`` in ``state``. ``view(cache, start, stop)`` is
        the engine's view of rows of one of its arrays. Only an in-place layout has one: its buffers stay put.

        Raises: CacheCapacityError: a growing layout (each step replaces its arrays). InputError: rows outside
            ``[0, B)`` or none.
        """
        if not self.in_place:
            raise CacheCapacityError(f"the {self.mode} cache has no view of some of its sequences (each step "
                                     f"replaces its arrays); export with --cache-mode static")
        if not 0 <= start < stop <= len(state.lengths):
            raise InputError(f"rows {start}..{stop - 1} are not rows of a batch of {len(state.lengths)}")
        return CacheState(state.lengths[start:stop], [view(cache, start, stop) for cache in state.caches],
                          capacity=state.capacity)

    def clear(self, state: CacheState, row: int, keep: int = 0) -> None:
        """Empty sequence ``row`` of an in-place ``state`` for a new sequence (``keep`` 0), or cut it back to its first
        ``keep`` rows: what its slots still hold past them is never attended (a query sees only the slots below its
        write index plus its own step's), and the next step writes over it."""
        if not self.in_place:
            raise CacheCapacityError(f"the {self.mode} cache cannot empty one of its sequences; export with "
                                     f"--cache-mode static")
        assert 0 <= keep <= state.lengths[row], (keep, state.lengths[row])
        state.lengths[row] = keep

    def slots(self, array, row: int, start: int, stop: int):
        """Slots ``start .. stop - 1`` of sequence ``row`` of one layer's cache ``array`` (a host NumPy array or a
        view of the engine's buffer) as ``[stop - start, C]``, the same memory: what copying cache rows between
        sequences, or to and from the host, reads and writes. Only an in-place layout's slots stay put.

        Raises: CacheCapacityError: a growing layout.
        """
        raise CacheCapacityError(f"the {self.mode} cache has no fixed slots to copy; export with --cache-mode static")


class ConcatLayout(CacheLayout):
    """A growing cache: ``present = concat(past, new)``; ``attention_mask`` marks padding slots."""

    mode, control, in_place, has_capacity = "concat", "attention_mask", False, False

    def control_spec(self) -> TensorSpec:
        return TensorSpec(self.control, "int64", (BATCH, TOTAL))

    def cache_shapes(self, width: int) -> tuple[tuple, tuple]:
        return (BATCH, PAST, width), (BATCH, TOTAL, width)

    def dynamic_shapes(self, layers: int, batch, steps: int | None = None):
        from torch.export import Dim

        past = Dim(PAST, min=0, max=1 << 20)
        # the mask's axis is past + sequence, derived by the exporter and renamed after export; with a fixed
        # sequence length torch.export needs the relation spelled out
        total = Dim.DYNAMIC if steps is None else past + steps
        return {0: batch, 1: total}, tuple({0: batch, 1: past} for _ in range(layers))

    def example_state(self, batch, past, steps, width, layers, capacity, dtype):
        import torch

        mask = torch.ones(batch, past + steps, dtype=torch.long)
        return mask, self.empty(batch, past, width, layers, dtype)

    def policy(self, control):
        from .model.cache import ConcatCache

        return ConcatCache(control)

    def _cache_ranges(self, role, build, capacity, seq):
        past: Range = tuple(build.past_length) if role == "decode" else (0, 0, build.past_length[2])
        return {PAST: past, TOTAL: tuple(p + s for p, s in zip(past, seq))}

    def cache_shape(self, batch, length, width):
        return (batch, length, width)

    def new_state(self, batch, widths, capacity, allocate):
        caches = [allocate(self.cache_shape(batch, 0, width)) for width in widths]
        return CacheState(np.zeros(batch, dtype=np.int64), caches, np.zeros((batch, 0), dtype=np.int64))

    def control_input(self, state, valid):
        return np.ascontiguousarray(np.concatenate((state.key_valid, np.asarray(valid, dtype=np.int64)), axis=1))

    def advance(self, state, valid, control, presents):
        super().advance(state, valid, control, presents)
        state.key_valid = np.asarray(control, dtype=np.int64)

    def held(self, cache, state):
        return cache

    def slot_valid(self, state, slots):
        keep = np.asarray(state.key_valid) != 0
        if keep.shape[1] != slots:
            raise CacheCapacityError(f"the concat cache holds {slots} slots but its mask covers {keep.shape[1]}")
        return keep


class StaticLayout(CacheLayout):
    """A fixed-capacity cache ``[B, 1, capacity, C]`` written in place at ``write_indices`` (slot t = position t)."""

    mode, control, in_place, has_capacity = "static", "write_indices", True, True
    min_opset, supports_plugin = 24, True

    def control_spec(self) -> TensorSpec:
        return TensorSpec(self.control, "int64", (BATCH,))

    def cache_shapes(self, width: int) -> tuple[tuple, tuple]:
        shape = (BATCH, 1, CAPACITY, width)
        return shape, shape

    def dynamic_shapes(self, layers: int, batch, steps: int | None = None):
        from torch.export import Dim

        capacity = Dim(CAPACITY, min=2, max=1 << 22)
        return {0: batch}, tuple({0: batch, 2: capacity} for _ in range(layers))

    def example_state(self, batch, past, steps, width, layers, capacity, dtype):
        import torch

        if capacity < past + steps:
            raise ConfigError(f"a static cache of {capacity} slots cannot trace {past} + {steps} rows")
        indices = torch.full((batch,), past, dtype=torch.long)
        return indices, self.empty(batch, capacity, width, layers, dtype)

    def policy(self, control):
        from .model.cache import StaticCache

        return StaticCache(control)

    def _cache_ranges(self, role, build, capacity, seq):
        if not capacity or capacity < 1:
            raise ConfigError("a static-cache artifact needs max_cache_length in its manifest")
        if build.prompt_length[2] > capacity:
            raise ConfigError(f"[build] prompt_length max {build.prompt_length[2]} exceeds the static cache "
                              f"capacity {capacity}")
        return {CAPACITY: (capacity, capacity, capacity)}

    def cache_shape(self, batch, length, width):
        return (batch, 1, length, width)

    def new_state(self, batch, widths, capacity, allocate):
        if not capacity or capacity < 1:
            raise CacheCapacityError("a static cache needs a capacity (the manifest has none; pass capacity=)")
        caches = [allocate(self.cache_shape(batch, capacity, width)) for width in widths]
        return CacheState(np.zeros(batch, dtype=np.int64), caches, capacity=int(capacity))

    def room(self, prompt_length, capacity):
        return (capacity or 0) - prompt_length + 1

    def check_request(self, prompt_length, new_tokens, capacity):
        if new_tokens > self.room(prompt_length, capacity):
            raise CacheCapacityError(f"a prompt of {prompt_length} tokens plus {new_tokens} new ones exceeds the "
                                     f"static cache capacity {capacity} (export with a larger max_cache_length)")

    def check_step(self, state, steps, capacity):
        held = int(state.lengths.max(initial=0))
        capacity = state.capacity or capacity  # a state may be smaller than the engine's capacity
        if held + steps > (capacity or 0):
            raise CacheCapacityError(f"{held} cached + {steps} new tokens exceed the static cache capacity {capacity}")

    def control_input(self, state, valid):
        return np.ascontiguousarray(state.lengths, dtype=np.int64).copy()

    def held(self, cache, state):
        return cache[:, 0, : int(state.lengths.max(initial=0))]

    def slots(self, array, row, start, stop):
        return array[row, 0, start:stop]

    def slot_valid(self, state, slots):
        return np.arange(slots)[None, :] < np.asarray(state.lengths)[:, None]


class GenaiLayout(CacheLayout):
    """onnxruntime-genai's cache: per layer a "key" and a "value" buffer ``[B, 1, capacity, C/2]``, the two column
    halves of the latent row (genai gives both the same width), written in place at ``total - S`` of the mask.

    The graph's I/O (:meth:`io`) is genai's decoder-only contract: ``input_ids [B, S]``, ``attention_mask [B, total]``
    (1 a real token, 0 left padding; genai grows it by one column per step), the halves per layer, then ``logits
    [B, S, V]`` (every position) and the presents (the same buffers: ``past_present_share_buffer``).
    """

    mode, control, in_place, has_capacity, min_opset = "genai", "attention_mask", True, True, 24
    past_key_names, past_value_names = "past_key_values.%d.key", "past_key_values.%d.value"
    present_key_names, present_value_names = "present.%d.key", "present.%d.value"

    def check_model(self, config: MLAConfig) -> None:
        """Refuse a model whose cache genai cannot hold: DeepSeek Sparse Attention's index keys are a second cache
        per layer, which genai's key/value contract has no place for."""
        if config.is_sparse:
            raise ConfigError(f"{config.name}: the genai target holds one key/value pair per layer; DeepSeek Sparse "
                              "Attention's index-key cache has no place in it (export without --target genai)")

    def block_widths(self, latent_dim: int) -> tuple[int, int]:
        """The key and value halves of the latent row.

        Raises:
            ConfigError: an odd latent width (genai needs the halves equal).
        """
        if latent_dim % 2:
            raise ConfigError(f"the genai target splits the latent row in two equal halves; {latent_dim} is odd")
        return latent_dim // 2, latent_dim // 2

    def control_spec(self) -> TensorSpec:
        return TensorSpec(self.control, "int64", (BATCH, TOTAL))

    def cache_shapes(self, width: int) -> tuple[tuple, tuple]:
        shape = (BATCH, 1, CAPACITY, self.block_widths(width)[0])
        return shape, shape

    def io(self, config, precision, head_inputs=None, head_outputs=None, layers=None):
        """genai's inputs and outputs, in graph order (the heads are genai's: ``input_ids``; ``logits [B, S, V]``)."""
        self.check_model(config)
        if precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        dtype, past = PRECISIONS[precision], self.cache_shapes(config.latent_dim)[0]
        layers = config.num_hidden_layers if layers is None else layers
        inputs = [*(head_inputs or [TensorSpec("input_ids", "int64", (BATCH, SEQ))]), self.control_spec()]
        outputs = list(head_outputs or [TensorSpec("logits", dtype, (BATCH, SEQ, config.vocab_size))])
        for i in range(layers):
            inputs += [TensorSpec(self.past_key_names % i, dtype, past), TensorSpec(self.past_value_names % i, dtype, past)]
            outputs += [TensorSpec(self.present_key_names % i, dtype, past),
                        TensorSpec(self.present_value_names % i, dtype, past)]
        return inputs, outputs

    def describe(self, config: MLAConfig) -> dict[str, Any]:
        """The layout in words: the halves' channels and per-layer names."""
        half, c = self.block_widths(config.latent_dim)[0], config.latent_dim
        return {"mode": self.mode, "width": c, "blocks": [[0, half], [half, c]], "sequence_axis": -2,
                "layers": [{"past": [self.past_key_names % i, self.past_value_names % i],
                            "present": [self.present_key_names % i, self.present_value_names % i]}
                           for i in range(config.num_hidden_layers)], "aliased": True}

    def dynamic_shapes(self, layers: int, batch, steps: int | None = None):
        from torch.export import Dim

        capacity = Dim(CAPACITY, min=2, max=1 << 22)
        return {0: batch, 1: Dim.DYNAMIC}, tuple({0: batch, 2: capacity} for _ in range(2 * layers))

    def example_state(self, batch, past, steps, width, layers, capacity, dtype):
        import torch

        mask = torch.ones(batch, past + steps, dtype=torch.long)
        slots = max(capacity, past + steps + 1)  # the capacity axis traced apart from the mask's
        caches = [torch.zeros(batch, 1, slots, self.block_widths(width)[0], dtype=dtype) for _ in range(2 * layers)]
        return mask, caches

    def policy(self, control):
        from .model.cache import MaskedBlockCache

        return MaskedBlockCache(control)

    def layer_caches(self, flat):
        return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(flat) // 2)]

    def flat_caches(self, presents):
        return [half for present in presents for half in present]

    def _runs_in_genai(self, *args, **kwargs):
        raise ConfigError("the genai cache is held by onnxruntime-genai; mla-deploy's engines and TensorRT builds "
                          "take an artifact (export without --target genai)")

    _cache_ranges = cache_shape = new_state = control_input = held = slot_valid = _runs_in_genai


CONCAT = ConcatLayout()
STATIC = StaticLayout()
#: the onnxruntime-genai target's layout (no artifact cache mode)
GENAI = GenaiLayout()
_LAYOUTS = {layout.mode: layout for layout in (CONCAT, STATIC)}
assert tuple(_LAYOUTS) == CACHE_MODES


def get_layout(mode: str | CacheLayout) -> CacheLayout:
    """The layout of ``mode`` (``concat`` or ``static``); a layout is returned as is.

    Raises:
        ConfigError: an unknown mode.
    """
    if isinstance(mode, CacheLayout):
        return mode
    try:
        return _LAYOUTS[mode]
    except (KeyError, TypeError):
        raise ConfigError(f"cache mode must be one of {', '.join(CACHE_MODES)}, got {mode!r}") from None

"""Functional cache policies: how a layer's new rows meet its past cache, and which slots a query sees.

The cache is never module state: each step takes the past cache in and returns the present one, so a
model built on these exports to ONNX with the cache as explicit inputs and outputs.

* :class:`ConcatCache`: ``past [..., P, C]`` in, ``present [..., P+S, C]`` out (``P`` may be 0).
* :class:`StaticCache`: a fixed-capacity ``[..., T_max, C]`` buffer; the ``S`` new rows of sequence ``b``
  are written at ``write_indices[b]`` and the rest is left as is (ONNX ``TensorScatter``, in place in
  ONNX Runtime when input and output share a buffer). Slot ``t`` holds position ``t``.
* :class:`MaskedBlockCache`: the latent row split into column blocks, each a fixed-capacity
  ``[B, 1, T_max, w]`` buffer written in place (``TensorScatter``) at slot ``total - S`` of an
  ``attention_mask [B, total]`` whose zeros mark (left) padding: the cache as onnxruntime-genai holds it
  (the policy of :data:`mla_deploy.cache_layout.GENAI`, the layout of :mod:`mla_deploy.exporter.genai`).
"""

from __future__ import annotations

import torch

from ..errors import CacheCapacityError, ConfigError


@torch.library.custom_op("mla_deploy::tensor_scatter", mutates_args=())
def tensor_scatter(past: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor) -> torch.Tensor:
    """ONNX ``TensorScatter`` (opset 24, axis -2, linear): ``past`` with ``update`` written at ``write_indices``.

    Args:
        past: ``[B, ..., T_max, C]``.
        update: ``[B, ..., S, C]`` (same leading axes).
        write_indices: ``[B]`` int64, the first slot written for each batch row.
    Returns:
        ``[B, ..., T_max, C]``.
    """
    steps = update.shape[-2]
    if bool((write_indices < 0).any()) or bool((write_indices + steps > past.shape[-2]).any()):
        raise CacheCapacityError(
            f"cache capacity {past.shape[-2]} exceeded: writing {steps} row(s) at {write_indices.tolist()}")
    lead = (1,) * (past.dim() - 1)
    idx = write_indices.view(-1, *lead) + torch.arange(steps, device=past.device).view(*lead[1:], steps, 1)
    return past.scatter(-2, idx.expand(update.shape), update)


@tensor_scatter.register_fake
def _tensor_scatter_fake(past, update, write_indices):
    return torch.empty_like(past)


class ConcatCache:
    """A growing cache (HF convention): present = concat(past, new) along the sequence axis (-2).

    Args:
        key_valid: optional ``[B, P+S]`` (nonzero = a real token), Hugging Face's ``attention_mask``;
            padded slots (of shorter sequences in a batch) are never attended. None: all valid.
    """

    def __init__(self, key_valid: torch.Tensor | None = None):
        self.key_valid = key_valid

    def update(self, past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Args: past ``[..., P, C]``, new ``[..., S, C]``. Returns: ``[..., P+S, C]``."""
        return torch.cat((past, new), dim=-2)

    def write_latent(self, past: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a step's latent rows. Args: past ``[B, P, C]``, new ``[B, S, C]``.
        Returns: present ``[B, P+S, C]`` and the rows to attend (the same tensor)."""
        present = self.update(past, new)
        return present, present

    def lengths_after(self, steps: int) -> torch.Tensor:
        """Valid rows per sequence after this step: not known to a concat cache (its padding is a mask)."""
        raise ConfigError("this needs the static cache ([B, 1, T_max, C] and write_indices); the concat cache "
                          "marks padding with a mask instead of per-sequence lengths")

    def mask(self, seq_len: int, past: torch.Tensor) -> torch.Tensor:
        """Which slots each new query may attend: ``[B or 1, 1, S, P+S]`` bool.

        Slot order is time order, so a query at slot ``P+i`` sees slots ``<= P+i`` that are valid.
        """
        past_len = past.shape[-2]
        q = torch.arange(seq_len, device=past.device) + past_len  # [S]
        k = torch.arange(seq_len + past_len, device=past.device)  # [T]
        visible = (k.unsqueeze(0) <= q.unsqueeze(1)).unsqueeze(0).unsqueeze(0)  # [1, 1, S, T]
        if self.key_valid is not None:
            visible = visible & (self.key_valid != 0).unsqueeze(1).unsqueeze(1)  # [B, 1, S, T]
        return visible


class StaticCache:
    """A fixed-capacity cache written in place at per-sequence offsets.

    Args:
        write_indices: ``[B]`` int64: the number of valid rows of each sequence before this step, which is
            where its new rows go and the position of its first new token.
    """

    def __init__(self, write_indices: torch.Tensor):
        self.write_indices = write_indices

    def update(self, past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Args: past ``[B, ..., T_max, C]``, new ``[B, ..., S, C]``. Returns: ``[B, ..., T_max, C]``."""
        return tensor_scatter(past, new, self.write_indices)

    def write_latent(self, past: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a step's latent rows in place. Args: past ``[B, 1, T_max, C]``, new ``[B, S, C]``.
        Returns: present ``[B, 1, T_max, C]`` and its rows ``[B, T_max, C]`` to attend."""
        present = self.update(past, new.unsqueeze(1))
        return present, present.squeeze(1)

    def lengths_after(self, steps: int) -> torch.Tensor:
        """``[B]`` int64 valid rows per sequence once this step's ``steps`` rows are written."""
        return self.write_indices + steps

    def mask(self, seq_len: int, past: torch.Tensor) -> torch.Tensor:
        """``[B, 1, S, T_max]`` bool: slot ``t`` is visible to new token ``i`` iff ``t <= write_indices[b] + i``."""
        q = self.write_indices.unsqueeze(1) + torch.arange(seq_len, device=past.device)  # [B, S]
        k = torch.arange(past.shape[-2], device=past.device)  # [T_max]
        return (k.view(1, 1, -1) <= q.unsqueeze(-1)).unsqueeze(1)


class MaskedBlockCache:
    """A fixed-capacity cache kept as column blocks of the latent row, addressed by an attention mask.

    Each layer's past is a tuple of buffers ``[B, 1, T_max, w_j]`` whose widths sum to ``C`` (e.g. two halves of
    288 for DeepSeek's 576). Slot ``t`` holds the token of the mask's column ``t``; a step of ``S`` tokens writes
    slots ``total - S .. total - 1`` (the same for every sequence: padding is on the left, marked by zeros).

    Args:
        attention_mask: ``[B, total]`` (1 a real token, 0 padding) over the cached and the new tokens.
    """

    def __init__(self, attention_mask: torch.Tensor):
        self.attention_mask = attention_mask

    def write_indices(self, steps: int) -> torch.Tensor:
        """``[B]`` int64: the first slot this step writes (``total - steps``)."""
        total = self.attention_mask.shape[1]
        return torch.zeros_like(self.attention_mask[:, 0], dtype=torch.long) + (total - steps)

    def positions(self, steps: int) -> torch.Tensor:
        """``[B, steps]`` int64 position of each new token: real tokens before it (``cumsum(mask) - 1``, as
        transformers' ``generate`` computes them; 0 for padding)."""
        return (self.attention_mask.long().cumsum(1) - 1)[:, -steps:].clamp(min=0)

    def write_latent(self, past: tuple, new: torch.Tensor) -> tuple[tuple, tuple]:
        """Write a step's rows ``new [B, S, C]`` across the blocks. Args: past a tuple of ``[B, 1, T_max, w_j]``.
        Returns: present (the same tuple layout) and the rows to attend, a tuple of ``[B, T_max, w_j]``."""
        index, start, present = self.write_indices(new.shape[1]), 0, []
        for block in past:
            width = block.shape[-1]
            present.append(tensor_scatter(block, new[..., start:start + width].unsqueeze(1), index))
            start += width
        return tuple(present), tuple(p.squeeze(1) for p in present)

    def lengths_after(self, steps: int) -> torch.Tensor:
        """Not known per sequence (the padding is a mask)."""
        raise ConfigError("the masked block cache marks padding with a mask instead of per-sequence lengths")

    def mask(self, seq_len: int, past: torch.Tensor) -> torch.Tensor:
        """``[B, 1, S, T_max]`` bool: slot ``t`` is visible to new token ``i`` iff ``t <= total - S + i`` and the
        mask's column ``t`` is a real token."""
        total, capacity = self.attention_mask.shape[1], past.shape[-2]
        q = torch.arange(seq_len, device=past.device) + (total - seq_len)  # [S]
        k = torch.arange(capacity, device=past.device)  # [T_max]
        valid = torch.nn.functional.pad(self.attention_mask != 0, (0, capacity - total))  # [B, T_max]
        return ((k.unsqueeze(0) <= q.unsqueeze(1)).unsqueeze(0) & valid.unsqueeze(1)).unsqueeze(1)

"""Pure-PyTorch reference of the MLA decode attention that :mod:`.triton_kernel` computes.

Shapes: B batch, H heads, S new tokens per sequence, T cache slots, C = r + dr latent width
(576 = 512 + 64 for DeepSeek), r = ``kv_lora_rank``.
"""

from __future__ import annotations

import torch


def as_rows(q: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Normalise the accepted layouts.

    Args:
        q: ``[B, H, C]`` (one new token) or ``[B, H, S, C]``.
        cache: ``[B, T, C]`` or ``[B, 1, T, C]`` (the static cache layout).
    Returns:
        q ``[B, H, S, C]``, cache ``[B, T, C]`` (views) and S.
    """
    q4 = q.unsqueeze(2) if q.dim() == 3 else q
    cache3 = cache.squeeze(1) if cache.dim() == 4 else cache
    if q4.dim() != 4 or cache3.dim() != 3:
        raise ValueError(f"q must be [B, H, C] or [B, H, S, C] and cache [B, T, C] or [B, 1, T, C]; "
                         f"got {tuple(q.shape)} and {tuple(cache.shape)}")
    if q4.shape[0] != cache3.shape[0] or q4.shape[-1] != cache3.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and cache {tuple(cache.shape)} disagree on batch or width")
    return q4, cache3, q4.shape[2]


def visible(lengths: torch.Tensor, steps: int, slots: int) -> torch.Tensor:
    """``[B, S, T]`` bool: new token ``s`` of sequence ``b`` sees slot ``t`` iff ``t < lengths[b] - S + 1 + s``."""
    limit = lengths.view(-1, 1).long() - steps + 1 + torch.arange(steps, device=lengths.device)  # [B, S]
    return torch.arange(slots, device=lengths.device).view(1, 1, -1) < limit.unsqueeze(-1)


def mla_decode_reference(q: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, softmax_scale: float,
                         kv_lora_rank: int) -> torch.Tensor:
    """Attention of every head's latent query over the shared latent cache, in float32.

    Args:
        q: ``[B, H, C]`` or ``[B, H, S, C]``: ``[q_nope . W_UK | rope(q_pe)]``.
        cache: ``[B, T, C]`` or ``[B, 1, T, C]``: rows ``[c_kv | k_pe]``; only the first ``lengths[b]`` are valid.
        lengths: ``[B]`` int32/int64 valid rows per sequence (this step's S rows included).
        softmax_scale: multiplies the scores before the softmax.
        kv_lora_rank: r; the values are cache channels ``[0, r)``.
    Returns:
        ``[B, H, r]`` (or ``[B, H, S, r]``) in ``q``'s dtype; a query that sees no slot gets zeros.
    """
    q4, cache3, steps = as_rows(q, cache)
    scores = torch.einsum("bhsc,btc->bhst", q4.float(), cache3.float()) * softmax_scale  # [B, H, S, T]
    mask = visible(lengths, steps, cache3.shape[1]).unsqueeze(1)  # [B, 1, S, T]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible slot: 0
    out = torch.einsum("bhst,btr->bhsr", probs, cache3[..., :kv_lora_rank].float())
    out = out.to(q.dtype)
    return out.squeeze(2) if q.dim() == 3 else out

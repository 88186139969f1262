"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the lightning indexer that picks, per query, the cached tokens
its MLA layer attends to.

Per layer, with ``x [B, S, D]`` the layer's normed input and ``q_a = q_a_layernorm(q_a_proj(x))`` the compressed
query the MLA query path also reads (Hn ``index_n_heads``, Di ``index_head_dim``, dr ``qk_rope_head_dim``):

* keys ``k = rope(LayerNorm(wk x))`` ``[B, S, Di]``: the first dr channels rotated by the model's rope, the rest
  not. They are the layer's second cache (``index`` rows beside the latent rows, written by the same cache policy),
  so a decode step scores its query against every earlier token's key without recomputing it.
* queries ``q = rope(wq_b q_a)`` ``[B, S, Hn, Di]``; scores ``sum_h w_h relu(q_h . k_t / sqrt(Di))`` with
  ``w = weights_proj(x) / sqrt(Hn)``, in float32.
* the ``min(index_topk, T)`` highest-scoring slots among those the query may see (itself included) are kept
  (``TopK``, then a ``ScatterElements`` of the chosen slots into a boolean row): the attention mask becomes
  ``mask & chosen``. While a query sees at most ``index_topk`` tokens every one is chosen: dense MLA.

The rope here is DeepSeek's interleaved one; DeepSeek-V3.2 rotates the indexer's pairs ``(i, i + dr/2)``, which
its rows, permuted at load (:func:`interleave_index_rows`), turn into interleaved pairs without changing a score.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import MLAConfig
from .rope import apply_rope, half_rotated_rows


class Indexer(nn.Module):
    """The lightning indexer of one layer, parameters named as transformers' ``self_attn.indexer``."""

    def __init__(self, config: MLAConfig):
        super().__init__()
        c = config
        self.heads, self.head_dim, self.rope_dim, self.topk = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim, c.index_topk
        self.wq_b = nn.Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, bias=False)
        self.wk = nn.Linear(c.hidden_size, c.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(c.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(c.hidden_size, c.index_n_heads, bias=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The first ``qk_rope_head_dim`` channels of ``x [..., Di]`` rotated, the rest as they are."""
        rope, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope(rope, cos, sin), rest), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rows this step adds to the index cache: ``[B, S, Di]``."""
        w = self.k_norm.weight.float(), self.k_norm.bias.float()
        k = nn.functional.layer_norm(self.wk(x).float(), (self.head_dim,), *w, self.k_norm.eps)
        return self._rotate(k, cos, sin).to(x.dtype)

    def forward(self, x, q_a, cos, sin, mask, past, cache):
        """Args:
            x ``[B, S, D]``; q_a ``[B, S, q_lora_rank]``; cos, sin ``[B, S, dr]``; mask ``[B|1, 1, S, T]`` bool (the
            slots each query may see); past the index cache in the policy's layout; cache the policy.
        Returns:
            the mask narrowed to the chosen slots ``[B, 1, S, T]`` and the present index cache.
        """
        present, keys = cache.write_latent(past, self.keys(x, cos, sin))  # keys [B, T, Di]
        q = self.wq_b(q_a).unflatten(-1, (self.heads, self.head_dim))  # [B, S, Hn, Di]
        q = self._rotate(q.float(), cos.unsqueeze(2), sin.unsqueeze(2))
        scores = torch.relu((q @ keys.float().transpose(-1, -2).unsqueeze(1)) * self.head_dim ** -0.5)  # [B,S,Hn,T]
        weights = self.weights_proj(x).float() * self.heads ** -0.5  # [B, S, Hn]
        index = (weights.unsqueeze(-2) @ scores).squeeze(-2)  # [B, S, T]
        index = index.masked_fill(~mask[:, 0], float("-inf"))
        k = torch.sym_min(self.topk, index.shape[-1])
        chosen = torch.zeros_like(index, dtype=torch.bool).scatter(-1, index.topk(k, dim=-1).indices, True)
        return mask & chosen.unsqueeze(1), present


def interleave_index_rows(key: str, weight: torch.Tensor, config: MLAConfig) -> torch.Tensor:
    """``weight`` (tensor ``key``) with the indexer's rope channels in interleaved order when they were written for
    half-rotated rope (DeepSeek-V3.2): each head's first ``qk_rope_head_dim`` rows of ``indexer.wq_b``, those of
    ``indexer.wk`` and the matching entries of ``indexer.k_norm`` (LayerNorm's statistics ignore the order). Query
    and key are permuted alike, so no score changes; any other tensor is returned unchanged."""
    c = config
    order = half_rotated_rows(c.qk_rope_head_dim)
    rest = torch.arange(c.qk_rope_head_dim, c.index_head_dim)
    if key.endswith("indexer.wq_b.weight"):
        rows = torch.arange(weight.shape[0]).view(c.index_n_heads, c.index_head_dim)
        return weight[torch.cat((rows[:, order], rows[:, c.qk_rope_head_dim:]), dim=-1).flatten()]
    if key.endswith(("indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias")):
        return weight[torch.cat((order, rest))]
    return weight

"""The masked block cache (:class:`~mla_deploy.model.cache.MaskedBlockCache`, the onnxruntime-genai layout) in
PyTorch: the latent row as two column halves written at the mask's slot, positions from the mask, the absorbed
query scored block by block; a padded batch (right, left, or padding in the middle) equals each sequence alone
through the original CC model."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, positions, rel_err, tiny_model
from mla_deploy.model.cache import MaskedBlockCache

PROMPTS = [[5, 9, 17, 3, 40, 2], [7, 11, 13]]
PAD = 0


@torch.no_grad()
def _alone(prompt: list[int], new: list[int]) -> torch.Tensor:
    """The CC model over ``prompt + new`` from position 0, no cache: the logits of the last len(new)+1 tokens."""
    model = tiny_model("CC")
    ids = torch.tensor([prompt + new])
    return model(ids, positions(1, 0, ids.shape[1]), model.empty_cache(1))[0][0, len(prompt) - 1:]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("form", ["A_CC", "A_CC_ME"])
@torch.no_grad()
def test_padded_batch_equals_each_sequence_alone(side, form):
    model = tiny_model(form)
    c = model.config
    half = c.latent_dim // 2
    width = max(map(len, PROMPTS))
    pads = [[PAD] * (width - len(p)) for p in PROMPTS]
    ids = torch.tensor([p + q if side == "right" else q + p for p, q in zip(PROMPTS, pads)])
    mask = torch.tensor([[1] * len(p) + [0] * len(q) if side == "right" else [0] * len(q) + [1] * len(p)
                         for p, q in zip(PROMPTS, pads)])
    caches = [(torch.zeros(2, 1, 16, half), torch.zeros(2, 1, 16, half)) for _ in range(c.num_hidden_layers)]
    cache = MaskedBlockCache(mask)
    logits, caches = model(ids, cache.positions(width), caches, cache)
    last = [len(p) - 1 if side == "right" else width - 1 for p in PROMPTS]
    steps = [[logits[b, last[b]]] for b in range(2)]
    new = [[31, 4], [8, 22]]  # fed tokens (any ids: the check is the function, not greedy)
    for t in range(2):
        mask = torch.cat((mask, torch.ones(2, 1, dtype=torch.long)), dim=1)  # a padded row's gap stays masked
        cache = MaskedBlockCache(mask)
        logits, caches = model(torch.tensor([[new[0][t]], [new[1][t]]]), cache.positions(1), caches, cache)
        for b in range(2):
            steps[b].append(logits[b, 0])
    for b, prompt in enumerate(PROMPTS):
        assert rel_err(torch.stack(steps[b]), _alone(prompt, new[b])) < TOL
    assert all(isinstance(layer, tuple) and layer[0].shape == (2, 1, 16, half) for layer in caches)


def test_positions_and_mask_follow_the_attention_mask():
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 1, 1]])
    cache = MaskedBlockCache(mask)
    assert cache.positions(2).tolist() == [[1, 2], [2, 3]]  # the padding gap is not counted
    assert cache.write_indices(2).tolist() == [3, 3]
    visible = cache.mask(2, torch.zeros(2, 1, 7, 4))[:, 0]  # [B, S, T_max]
    assert visible[0, 1].tolist() == [True, True, False, False, True, False, False]
    assert visible[1, 0].tolist() == [False, True, True, True, False, False, False]

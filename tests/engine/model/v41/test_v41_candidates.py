"""The two-level top-k's first level (``attention.candidate_blocks``): when the block budget
covers every block, the shortcut (no top-k) keeps exactly the blocks the top-k would."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.v41.attention import candidate_blocks


def _by_topk(scores: torch.Tensor, complete: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """The level as the top-k over blocks always computes it (the shortcut's reference)."""
    t = scores.shape[-1]
    blocks = F.pad(scores, (0, -t % block_size), value=float("-inf")).view(scores.shape[0], -1, block_size).amax(dim=-1)
    newest = torch.div(complete - 1, block_size, rounding_mode="floor")
    blocks = blocks.masked_fill(torch.arange(blocks.shape[1])[None, :] == newest[:, None], float("inf"))
    top = blocks.topk(min(topk_blocks, blocks.shape[1]), dim=-1)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    return keep[:, :, None].expand(-1, -1, block_size).flatten(1)[:, :t]


def test_a_budget_over_every_block_keeps_the_reachable_ones() -> None:
    g = torch.Generator().manual_seed(3)
    t, bs = 61, 8  # 8 blocks, the last one short
    scores = torch.randn(5, t, generator=g)
    complete = torch.tensor([0, 1, 9, 40, 61])  # no row yet, one row, ..., every row
    scores = scores.masked_fill(torch.arange(t)[None, :] >= complete[:, None], float("-inf"))
    for budget in (8, 9, 2048):
        assert torch.equal(candidate_blocks(scores, complete, budget, bs), _by_topk(scores, complete, budget, bs))
    assert torch.equal(candidate_blocks(scores, complete, 3, bs), _by_topk(scores, complete, 3, bs))  # the top-k itself
    assert not candidate_blocks(scores, complete, 2048, bs)[0].any() and candidate_blocks(scores, complete, 2048, bs)[4].all()

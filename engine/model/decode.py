"""Row picking for the slot decoders' CSA step: each decode token's top-k compressed rows.

``pick_rows`` takes indexer scores over a padded ``(B, T)`` (sequences of unequal row counts) and
runs ``torch.topk`` per group of equal counts, on exactly that many columns, so its tie order is the
general path's (``Indexer.topk_rows`` over a sequence's own rows: at decode no row is in the
future); ``pad_bias`` hides the padding columns. ``host_decode`` uses both (its compiled
``cpu_slots.top_rows`` leaves rows with ties across the cut to ``pick_rows``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.reference import hide

if TYPE_CHECKING:
    from engine.model.attention import Indexer


def pad_bias(counts: list[int], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(B, width)``: 0 on the first ``counts[i]`` columns of row i, -inf after."""
    return hide(torch.arange(width, device=device)[None, :] >= torch.tensor(counts, device=device)[:, None], dtype)


def pick_rows(idx: Indexer, scores: torch.Tensor, counts: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each query's top-k rows from its indexer ``scores (B, T)`` over ``counts[i]`` rows:
    ``(B, k)`` indices and bias ``(B, k)`` (-inf on padding when a sequence has < k rows, else
    None). ``topk`` runs per group of equal row counts on exactly that many columns."""
    k_max = min(idx.topk, max(counts))
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(counts):
        groups.setdefault(c, []).append(i)
    if len(groups) == 1:
        return scores[:, : counts[0]].topk(k_max, dim=-1).indices, None
    chosen = torch.zeros(len(counts), k_max, dtype=torch.long, device=scores.device)
    taken = [0] * len(counts)
    for c, members in groups.items():
        if c == 0:
            continue
        k = min(idx.topk, c)
        m = torch.tensor(members, device=scores.device)
        chosen[m, :k] = scores[m, :c].topk(k, dim=-1).indices
        for i in members:
            taken[i] = k
    bias = None if all(k == k_max for k in taken) else pad_bias(taken, k_max, dtype, scores.device)
    return chosen, bias

"""``cpu_slots.top_rows``: the compiled top-k of the CSA rows picks ``decode.pick_rows``' set in
its order of scores, and leaves ties across the cut (and NaN) to ``torch.topk``."""

from __future__ import annotations

import pytest
import torch

from engine.model import cpu_fused, cpu_slots
from engine.model.decode import pick_rows

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="numba missing")


class _Indexer:
    topk = 16


@pytest.mark.parametrize("kind", ["distinct", "relu", "coarse"])
def test_top_rows_matches_pick_rows(kind: str) -> None:
    """Random scores (distinct, ReLU'd with many exact zeros, rounded to halves: many ties) over
    rows of unequal counts: wherever ``top_rows`` answers, each row's set and its scores in
    order equal ``pick_rows``' (ties inside the set may list other columns of the same score);
    it declines exactly when a row's k-th best equals its best left out."""
    g = torch.Generator().manual_seed(5)
    answered = declined = 0
    for _ in range(60):
        t = int(torch.randint(1, 90, (), generator=g))
        s = torch.randn(8, t, generator=g)
        if kind == "relu":
            s = s.relu()
        elif kind == "coarse":
            s = (s * 2).round() / 2
        counts = torch.randint(max(1, t - 8), t + 1, (8,), generator=g).tolist()
        want, _ = pick_rows(_Indexer, s, counts, torch.float32)
        tie = False
        for i, c in enumerate(counts):
            k = min(16, c)
            ordered = s[i, :c].sort(descending=True).values
            tie |= k < c and bool(ordered[k - 1] == ordered[k])
        got = cpu_slots.top_rows(s, counts, 16)
        assert (got is None) == tie
        if got is None:
            declined += 1
            continue
        answered += 1
        chosen, taken = got
        for i, c in enumerate(counts):
            k = taken[i]
            assert k == min(16, c)
            assert set(chosen[i, :k].tolist()) == set(want[i, :k].tolist())
            assert torch.equal(s[i, chosen[i, :k]], s[i, want[i, :k]])
    assert answered > 0
    if kind == "coarse":
        assert declined > 0


def test_top_rows_declines_nan() -> None:
    s = torch.randn(2, 20)
    s[1, 3] = float("nan")
    assert cpu_slots.top_rows(s, [20, 20], 16) is None

"""``cpu_slots.top_rows``: the compiled top-k of the CSA rows picks ``decode.pick_rows``' rows in
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
    rows of unequal counts: each row ``top_rows`` answers has ``pick_rows``' set with the same
    scores in the same order (tied rows lowest column first); it leaves to ``torch.topk`` exactly
    the rows whose k-th best equals their best left out."""
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
        tie = []
        for i, c in enumerate(counts):
            ordered = s[i, :c].sort(descending=True).values
            if c > 16 and bool(ordered[15] == ordered[16]):
                tie.append(i)
        chosen, taken, left = cpu_slots.top_rows(s, counts, 16)
        assert left == tie
        for i, c in enumerate(counts):
            k = taken[i]
            assert k == min(16, c)
            if i in left:
                declined += 1
            else:
                answered += 1
                assert set(chosen[i, :k].tolist()) == set(want[i, :k].tolist())
                assert torch.equal(s[i, chosen[i, :k]], s[i, want[i, :k]])
                for a in range(1, k):  # ties: lowest column first
                    if s[i, chosen[i, a]] == s[i, chosen[i, a - 1]]:
                        assert chosen[i, a] > chosen[i, a - 1]
    assert answered > 0
    if kind == "coarse":
        assert declined > 0


def test_top_rows_declines_nan() -> None:
    s = torch.randn(2, 20)
    s[1, 3] = float("nan")
    assert cpu_slots.top_rows(s, [20, 20], 16)[2] == [1]


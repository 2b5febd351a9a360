"""``kernels.topk.row_topk`` against its definition (a stable descending sort) and ``torch.topk``'s set.

Ties matter here: V4.1's indexer scores are sums of relus, so whole runs of a row are exactly 0.0,
and future rows are -inf; on CPU through ``test_interpret.py`` (small)."""

from __future__ import annotations

import os

import pytest
import torch

from bench.kernel_helpers import kernel_test_device

pytestmark = pytest.mark.gpu
DEV = kernel_test_device()
SMALL = os.environ.get("KERNELS_TEST_SMALL", "1" if DEV == "cpu" else "0") == "1"
SHAPES = [(5, 100, 7), (3, 64, 64), (4, 300, 50), (2, 1000, 512)] if SMALL else [(64, 4096, 512), (33, 8192, 512), (17, 3000, 1), (9, 257, 256)]


@pytest.mark.parametrize("shape", SHAPES)
def test_row_topk_picks_the_lowest_columns_among_ties(shape) -> None:
    """Rows of relu'd scores (runs of exact zeros), one with its second half at -inf (fewer finite
    scores than k where k > T/2), one all zero, one with -0.0 beside 0.0: the same values and
    columns as the definition, and the same set of values as ``torch.topk``."""
    from kernels.topk import row_topk, row_topk_reference

    s, t, k = shape
    g = torch.Generator().manual_seed(t + k)
    x = torch.randn(s, t, generator=g).relu()
    x[0, t // 2 :] = float("-inf")
    x[1] = 0.0
    x[-1, :3] = -0.0
    x = x.to(DEV)
    got_v, got_i = row_topk(x, k)
    want_v, want_i = row_topk_reference(x, k)
    assert got_i.dtype == torch.int64 and torch.equal(got_i, want_i) and torch.equal(got_v, want_v)
    assert torch.equal(got_v.sort(dim=-1).values, x.topk(k, dim=-1).values.sort(dim=-1).values)
    if DEV == "cuda":  # torch.topk on CUDA breaks ties to the lowest column too: the same set of columns
        assert torch.equal(got_i, x.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values)


def test_row_topk_distinct_scores_match_torch_topk() -> None:
    """Without ties the set is ``torch.topk``'s on any device."""
    from kernels.topk import row_topk

    x = torch.randn(8, 500 if SMALL else 4096, generator=torch.Generator().manual_seed(1)).to(DEV)
    _, idx = row_topk(x, 40)
    assert torch.equal(idx, x.topk(40, dim=-1, sorted=False).indices.sort(dim=-1).values)

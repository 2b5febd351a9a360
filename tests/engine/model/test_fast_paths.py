"""The model core's fast paths against its general path (fp32, CPU): same results.

- the slot decoders' grouped top-k (``decode.pick_rows``) on exact score ties vs ``Indexer.topk_rows``;
- the transposed Sinkhorn vs its plain formula (bitwise);
- ``PackedLinear`` (the oneDNN lm_head) vs ``F.linear``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.decode import pick_rows
from engine.model.layers import GroupedLinear, PackedLinear, replicate_streams
from kernels.reference import sinkhorn
from engine.model.loader import load_model

TOL = 1e-5


def test_indexer_groups_break_ties_like_topk_rows(tiny_model_dir) -> None:
    """Exact score ties (all-zero indexer rows) at several row counts: the grouped selection over
    padded scores picks the very rows ``topk_rows`` picks for each sequence alone."""
    model = load_model(tiny_model_dir, dtype="float32", progress=False)
    attn = next(layer.self_attn for layer in model.model.layers if layer.self_attn.indexer is not None)
    idx, r = attn.indexer, attn.compressor.rate
    g = torch.Generator().manual_seed(6)
    counts, scores, want = [], [], []
    t_max = 90
    for n_rows in (3, 16, 17, 40, 40, 90):
        rows = torch.zeros(n_rows, idx.width)
        rows[: n_rows // 3] = torch.randn(n_rows // 3, idx.width, generator=g)  # some non-ties
        pos = n_rows * r - 1  # the token that closed the last window
        q = torch.randn(1, idx.n_heads, idx.width, generator=g)
        w = torch.randn(1, idx.n_heads, generator=g)
        top, valid = idx.topk_rows(q, w, rows, torch.tensor([pos]))
        assert bool(valid.all())
        want.append(top[0])
        padded = torch.full((t_max,), -5.0)  # padding columns past the count (never picked)
        padded[:n_rows] = idx.scores(q, w, rows)[0]
        scores.append(padded)
        counts.append(n_rows)
    chosen, bias = pick_rows(idx, torch.stack(scores), counts, torch.float32)
    for i, top in enumerate(want):
        k = top.shape[0]
        assert torch.equal(chosen[i, :k], top)
        if bias is not None:
            assert bool((bias[i, k:] == float("-inf")).all()) and bool((bias[i, :k] == 0).all())


@pytest.mark.parametrize("n", [1, 3, 32, 2048])
def test_sinkhorn_matches_plain_formula(n: int) -> None:
    eps, iters = 1e-6, 20
    comb = torch.softmax(3 * torch.randn(n, 4, 4, generator=torch.Generator().manual_seed(n)), dim=-1) + eps
    want = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        want = want / (want.sum(dim=-1, keepdim=True) + eps)
        want = want / (want.sum(dim=-2, keepdim=True) + eps)
    assert torch.equal(sinkhorn(comb, iters, eps), want)


def test_packed_linear_matches_linear() -> None:
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(128, 5000, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(5000, 128, generator=g) * 0.05)
    packed = PackedLinear(lin)
    for rows in (1, 2, 5, 32, 70):
        x = torch.randn(rows, 128, generator=g)
        assert (packed(x) - F.linear(x, lin.weight)).abs().max().item() <= TOL
    with torch.no_grad():  # a new weight (a reload) is packed again
        lin.weight.mul_(2)
    x = torch.randn(8, 128, generator=g)
    assert (packed(x) - F.linear(x, lin.weight)).abs().max().item() <= TOL


def test_replicate_streams_is_the_broadcast_copy() -> None:
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = replicate_streams(x, 4)
    assert got.shape == (6, 4, 40) and got.is_contiguous()
    assert torch.equal(got, x.unsqueeze(1).expand(-1, 4, -1).contiguous())
    assert replicate_streams(x[:0], 4).shape == (0, 4, 40)


def test_grouped_linear_rows_is_forward_in_row_order() -> None:
    """``GroupedLinear.rows``: ``forward``'s values as a contiguous ``(N, G, out/G)`` tensor."""
    g = torch.Generator().manual_seed(4)
    lin = GroupedLinear(48, 4 * 16, 4, torch.float32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.1)
    for n in (1, 7, 33):
        x = torch.randn(n, 4, 48, generator=g)
        with torch.no_grad():  # the model runs in inference mode (bmm's out= takes no autograd)
            got = lin.rows(x)
        assert got.shape == (n, 4, 16) and got.is_contiguous()
        torch.testing.assert_close(got, lin(x), rtol=1e-6, atol=1e-6)

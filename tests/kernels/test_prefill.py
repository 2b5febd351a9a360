"""``kernels.prefill`` (prefill attention, indexer top-k, mHC input) against their PyTorch references.

bf16 rel. error ≤ 1e-2, fp32 ≤ 1e-4. On the GPU machine: ``pytest -m gpu tests/kernels``; on CPU
under Triton's interpreter through ``test_interpret.py`` (fp32 only there: the interpreter's bf16
``tl.dot`` is wrong, see ``kernels/_common.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.prefill import (
    HcPreTuning,
    IndexerTuning,
    hc_pre_block_parts,
    hc_pre_norm,
    hc_pre_parts_reference,
    prefill_attention,
    prefill_attention_reference,
    prefill_topk,
    prefill_topk_reference,
)
from bench.kernel_helpers import TOL, kernel_test_device, poison, rel_err

pytestmark = pytest.mark.gpu
DEV = kernel_test_device()
SMALL = os.environ.get("KERNELS_TEST_SMALL", "1" if DEV == "cpu" else "0") == "1"
DTYPES = [torch.float32] if DEV == "cpu" else [torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def _exact_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False


def _case(s: int, prev: int, w: int, h: int, d: int, n_rows: int, dtype, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(s, h, d, generator=g, device=DEV).to(dtype)
    pad = max(0, w - 1 - prev)
    keys = torch.randn(w - 1 + s, d, generator=g, device=DEV).to(dtype)
    keys[:pad] = float("nan")  # padding is never read
    sinks = torch.randn(h, generator=g, device=DEV)
    rows = torch.randn(n_rows, d, generator=g, device=DEV).to(dtype) if n_rows else None
    return q, keys, pad, sinks, rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["swa", "hca", "csa"])
@pytest.mark.parametrize("prev", [0, 5, 200])
def test_prefill_attention(dtype, mode, prev) -> None:
    s, w, h, d = (40, 16, 4, 64) if SMALL else (700, 128, 64, 512)
    n_rows = 0 if mode == "swa" else (12 if SMALL else 300)
    q, keys, pad, sinks, rows = _case(s, prev, w, h, d, n_rows, dtype, seed=prev + len(mode))
    g = torch.Generator().manual_seed(3)
    row_len = row_idx = None
    if rows is not None:
        # rows visible to query i grow with its position (r = 4 tokens per row), capped at the pool
        row_len = ((torch.arange(s) + prev + 1) // (4 if mode == "csa" else 2)).clamp(max=n_rows).to(DEV)
        if mode == "csa":
            k = 8 if SMALL else 64
            row_idx = torch.full((s, k), -1, dtype=torch.int32)
            for i in range(s):
                n = int(row_len[i])
                pick = torch.randperm(n, generator=g)[: min(n, k)]
                place = torch.randperm(k, generator=g)[: pick.numel()]
                row_idx[i, place] = pick.int()
            row_idx = row_idx.to(DEV)
    scale = d**-0.5
    want = prefill_attention_reference(q.float(), keys.float().nan_to_num(), pad, sinks, w, None if rows is None else rows.float(), row_len, row_idx, scale)
    poison(DEV)
    got = prefill_attention(q, keys, pad, sinks, w, rows, row_len, row_idx, scale)
    assert got.shape == q.shape and got.dtype == dtype
    assert rel_err(got, want) <= TOL[dtype]


@pytest.mark.parametrize("query_tile", [4096, 7])  # one scoring call, or tiles of 7 queries
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_topk(dtype, query_tile) -> None:
    s, hi, di, t, k = (24, 4, 16, 9, 4) if SMALL else (1500, 64, 128, 400, 128)
    g = torch.Generator(device=DEV).manual_seed(5)
    q = torch.randn(s, hi, di, generator=g, device=DEV).to(dtype)
    w = torch.randn(s, hi, generator=g, device=DEV).to(dtype)
    rows = torch.randn(t, di, generator=g, device=DEV).to(dtype)
    row_len = ((torch.arange(s, device=DEV) + 3) // 3).clamp(max=t)
    scale = di**-0.5 * hi**-0.5
    got = prefill_topk(q, w, rows, row_len, k, scale, IndexerTuning(query_tile=query_tile))
    want = prefill_topk_reference(q, w, rows, row_len, k, scale)
    assert got.shape == want.shape == (s, min(k, t)) and got.dtype == torch.int32
    # same count of picked rows per query, each visible, and the picked scores are the top ones
    assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1))
    assert bool(((got < row_len[:, None]) | (got < 0)).all())
    logits = torch.matmul(q.float(), rows.float().t())
    scores = (logits.relu() * w.float().unsqueeze(-1)).sum(dim=-2) * scale  # (S, T)
    pick = lambda idx: torch.where(idx >= 0, scores.gather(1, idx.clamp(min=0).long()), 0.0).sort(dim=1).values
    assert rel_err(pick(got), pick(want)) <= 1e-5


@pytest.mark.parametrize("tuning", [HcPreTuning(), HcPreTuning(block_m=16, block_k=32, bf16x3=False)], ids=["default", "m16-k32-widened"])
@pytest.mark.parametrize("n", [1, 70, 300])
def test_hc_pre_block_parts(n, tuning) -> None:
    hc, h = 4, (32 if SMALL else 4096)
    g = torch.Generator(device=DEV).manual_seed(n)
    streams = torch.randn(n, hc, h, generator=g, device=DEV).to(torch.bfloat16)
    fn = torch.randn((2 + hc) * hc, hc * h, generator=g, device=DEV) * 0.01
    got = hc_pre_block_parts(streams, fn, tuning=tuning)
    want = hc_pre_parts_reference(streams, fn)
    m = fn.shape[0]
    assert got.shape[0] == n and got.shape[2] == want.shape[2]
    assert rel_err(got.sum(1)[:, : m + 1], want[:, 0, : m + 1]) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_pre_norm(dtype) -> None:
    from engine.model.config import ModelConfig
    from engine.model.layers import HyperConnection, RMSNorm
    from engine.model.tiny import tiny_config_dict

    cfg = ModelConfig.from_dict(tiny_config_dict("tiny"))
    hc = HyperConnection(cfg).to(DEV)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(7)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g, device=DEV) * 0.05)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g, device=DEV) * 0.1)
        norm.weight.copy_(1 + 0.1 * torch.randn(norm.weight.shape, generator=g, device=DEV))
    streams = torch.randn(150, cfg.hc_mult, cfg.hidden_size, generator=g, device=DEV).to(dtype)
    hc.fused = False
    with torch.no_grad():
        post_w, comb_w, x_w = hc(streams)
        x_w = norm(x_w)
        post, comb, x = hc_pre_norm(hc, norm, streams)
    assert rel_err(post, post_w) <= 1e-4 and rel_err(comb, comb_w) <= 1e-4
    assert rel_err(x, x_w) <= TOL[dtype]
    with torch.no_grad():  # a new fn in place: the cached bf16 terms of the old one must not be used
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g, device=DEV) * 0.05)
        post_w, comb_w, _ = hc(streams)
        post, comb, _ = hc_pre_norm(hc, norm, streams)
    assert rel_err(post, post_w) <= 1e-4 and rel_err(comb, comb_w) <= 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["swa", "hca", "csa"])
@pytest.mark.parametrize("fold_q", [0, 1, 2])
def test_prefill_attention_folded_norm_rope(dtype, mode, fold_q) -> None:
    """Raw q in (``fold_q`` 1: norm + RoPE in registers, 2: logit scale + correction dot; 0: q
    comes normalised and rotated), the output's RoPE undo inside the kernel (the model's
    ``_forward_fast`` for one sequence) against norm_rope → reference attention → inverse RoPE."""
    s, w, h, d, r = (40, 16, 4, 64, 16) if SMALL else (700, 128, 64, 512, 64)
    prev = 5
    n_rows = 0 if mode == "swa" else (12 if SMALL else 300)
    q, keys, pad, sinks, rows = _case(s, prev, w, h, d, n_rows, dtype, seed=11 + len(mode))
    q = q * 3.0  # not unit scale: the norm matters
    ang = (torch.arange(s, device=DEV)[:, None] + prev).float() * (0.5 ** torch.arange(r // 2, device=DEV).float())[None, :]
    cos, sin = ang.cos().to(dtype).contiguous(), ang.sin().to(dtype).contiguous()
    row_len = row_idx = None
    if rows is not None:
        row_len = ((torch.arange(s) + prev + 1) // 4).clamp(max=n_rows).to(DEV)
        if mode == "csa":
            k = 8 if SMALL else 64
            g = torch.Generator().manual_seed(4)
            row_idx = torch.full((s, k), -1, dtype=torch.int32)
            for i in range(s):
                n = int(row_len[i])
                row_idx[i, : min(n, k)] = torch.randperm(n, generator=g)[: min(n, k)].int()
            row_idx = row_idx.to(DEV)
    scale = d**-0.5
    eps = 1e-6
    want = prefill_attention_reference(
        q.float(), keys.float().nan_to_num(), pad, sinks, w, None if rows is None else rows.float(), row_len, row_idx, scale,
        q_norm_eps=eps, rope=(cos.float(), sin.float()),
    )  # fmt: skip
    poison(DEV)
    q_in = q
    if fold_q == 0:
        from kernels.fused import norm_rope

        q_in = norm_rope(q, None, 2, eps, cos, sin, torch.arange(s, device=DEV))
    got = prefill_attention(q_in, keys, pad, sinks, w, rows, row_len, row_idx, scale, q_norm_eps=eps, rope=(cos, sin), fold_q=fold_q)
    assert got.shape == q.shape and got.dtype == dtype
    assert rel_err(got, want) <= TOL[dtype]
    if dtype == torch.float32 and fold_q == 1:  # the reference's fold is the model's unfolded math
        from kernels.fused import norm_rope_reference

        at = torch.arange(s, device=DEV)
        qn = norm_rope_reference(q, None, 2, eps, cos, sin, at)
        plain = prefill_attention_reference(qn, keys.nan_to_num(), pad, sinks, w, rows, row_len, row_idx, scale)
        assert rel_err(norm_rope_reference(plain, None, 0, 0.0, cos, sin, at, sign=-1.0), want) <= 1e-5


@pytest.mark.parametrize("block_q", [1, 2, 4])
def test_indexer_scores_prefill(block_q) -> None:
    from kernels.indexer import indexer_scores_prefill, indexer_scores_reference

    s, hi, di, t = (23, 4, 16, 40) if SMALL else (701, 64, 128, 400)
    g = torch.Generator(device=DEV).manual_seed(block_q)
    q = torch.randn(s, hi, di, generator=g, device=DEV).to(torch.bfloat16)
    w = torch.randn(s, hi, generator=g, device=DEV).to(torch.bfloat16)
    rows = torch.randn(t, di, generator=g, device=DEV).to(torch.bfloat16)
    row_len = ((torch.arange(s, device=DEV) + 2) // 2).clamp(max=t - 3).to(torch.int32)
    row_len[s // 2] = 0  # a query with no row yet
    scale = di**-0.5 * hi**-0.5
    want = indexer_scores_reference(q, w, rows, torch.zeros_like(row_len), row_len, scale, t)
    poison(DEV)
    got = indexer_scores_prefill(q, w, rows, row_len, scale, t, block_q=block_q, block_t=16 if SMALL else 64, num_warps=4)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and bool((got[~fin] == float("-inf")).all())
    assert rel_err(got[fin], want[fin]) <= 1e-5

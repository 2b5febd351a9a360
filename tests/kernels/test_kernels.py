"""Triton kernels against their PyTorch references (bf16 rel. error ≤ 1e-2, fp32 ≤ 1e-4).

On the GPU machine: ``pytest -m gpu tests/kernels``. On a CPU with Triton the same tests run under
Triton's interpreter: ``TRITON_INTERPRET=1 pytest -m gpu tests/kernels/test_kernels.py`` (what
``test_interpret.py`` does in CI, at smaller sizes).
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.compressor import gated_pool, gated_pool_reference
from kernels.decode_attention import decode_attention, decode_attention_reference
from kernels.indexer import indexer_scores, indexer_scores_reference, indexer_topk
from kernels.moe import moe_experts, moe_experts_reference, route, route_reference
from kernels.reference import score
from bench.kernel_helpers import (
    TOL,
    attn_inputs,
    kernel_test_device,
    poison,
    pool_inputs,
    rel_err,
    verify_attn_inputs,
)

pytestmark = pytest.mark.gpu
DEV = kernel_test_device()
SMALL = os.environ.get("KERNELS_TEST_SMALL", "1" if DEV == "cpu" else "0") == "1"  # interpreter: smaller sizes
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def _exact_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False  # references in true fp32


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


# ---- decode attention -----------------------------------------------------------------------------
ATTN_CASES = [
    # (B, H, D, W, mode, rows per sequence, topk, splits)
    (5, 64, 512, 128, "csa", [300, 0, 17, 512, 90], 64, None),
    (5, 64, 512, 128, "hca", [30, 0, 7, 70, 1], 0, None),
    (3, 64, 512, 128, "swa", 0, 0, 1),
    (4, 64, 512, 128, "csa", [200, 64, 5, 100], 64, 1),
    (4, 4, 48, 16, "hca", [9, 3, 0, 20], 0, None),  # tiny-model sizes, D not a power of two
    (2, 20, 64, 16, "csa", [40, 2], 8, 3),  # heads not a multiple of the head block
]
if SMALL:
    ATTN_CASES = [
        (3, 32, 64, 32, "csa", [40, 0, 9], 16, None),
        (3, 32, 64, 32, "hca", [10, 0, 33], 0, None),
        (2, 16, 64, 32, "swa", 0, 0, 1),
        (3, 16, 64, 16, "csa", [20, 5, 0], 8, 1),
        (2, 4, 48, 16, "hca", [9, 3], 0, 2),
        (2, 20, 32, 16, "csa", [40, 2], 8, 3),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"{c[4]}-B{c[0]}H{c[1]}D{c[2]}W{c[3]}-s{c[7]}")
def test_decode_attention(case, dtype) -> None:
    b, h, d, w, mode, n_rows, topk, splits = case
    inp = attn_inputs(b, h, d, w, mode, n_rows, topk, dtype, DEV, seed=sum(map(ord, str(case))) % 1000)
    ref = decode_attention_reference(**inp.args())
    poison(DEV)
    out = decode_attention(**inp.args(), num_splits=splits)
    _check(out, ref, dtype)


def test_decode_attention_default_slots_and_max_rows() -> None:
    """No ``swa_slot`` (sequence b uses slot b) and an explicit ``max_rows`` bound."""
    inp = attn_inputs(3, 16, 64, 16, "hca", [5, 12, 0], 0, torch.float32, DEV, seed=7)
    swa = inp.swa[inp.swa_slot.long()].contiguous()
    args = {**inp.args(), "swa": swa, "swa_slot": None}
    _check(decode_attention(**args, max_rows=40), decode_attention_reference(**args), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_rope_out_at_positions(splits, dtype) -> None:
    """``rope=(cos, sin), fold_q=0, rope_pos=pos``: the output un-rotated at each query's position
    (full tables, as the static decode step passes them) by the main kernel or the split combine."""
    from kernels.fused import norm_rope_reference

    b, h, d, rope = (3, 16, 64, 16) if SMALL else (3, 64, 512, 64)
    inp = attn_inputs(b, h, d, 32, "hca", [20, 0, 45], 0, dtype, DEV, seed=5)
    g = torch.Generator().manual_seed(3)
    ang = torch.rand(100, rope // 2, generator=g) * 6.28
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    pos = torch.tensor([7, 99, 0], device=DEV)
    ref = norm_rope_reference(decode_attention_reference(**inp.args()), None, 0, 0.0, cos, sin, pos, sign=-1.0)
    poison(DEV)
    out = decode_attention(**inp.args(), num_splits=splits, rope=(cos, sin), rope_pos=pos, fold_q=0)
    _check(out, ref, dtype)


VERIFY_CASES = [
    # (slots, width, H, D, W, mode, rows per slot, topk, splits)
    (4, 4, 64, 512, 128, "csa", [300, 0, 17, 90], 64, None),
    (3, 2, 64, 512, 128, "hca", [30, 0, 7], 0, None),
    (2, 3, 64, 512, 128, "swa", 0, 0, 1),
    (16, 4, 64, 512, 128, "csa", [20] * 16, 64, None),
]
if SMALL:
    VERIFY_CASES = [
        (3, 4, 16, 64, 16, "csa", [20, 0, 9], 8, None),
        (3, 2, 16, 48, 16, "hca", [9, 0, 33], 0, 3),
        (2, 3, 20, 32, 16, "swa", 0, 0, 1),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: f"{c[5]}-b{c[0]}x{c[1]}H{c[2]}D{c[3]}W{c[4]}-s{c[8]}")
def test_decode_attention_multi_query(case, dtype) -> None:
    """A verify step's offsets in one launch (ring before the step + fresh keys, per-query rows),
    against the reference; the output un-rotated at each query's position as the step asks."""
    from kernels.fused import norm_rope_reference

    b, width, h, d, w, mode, n_rows, topk, splits = case
    rows = n_rows if isinstance(n_rows, list) else [n_rows] * b
    args, first = verify_attn_inputs(b, width, h, d, w, mode, rows, topk, dtype, DEV, seed=b * width)
    ang = torch.rand(4 * w + width, 8, generator=torch.Generator().manual_seed(1)) * 6.28
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    pos = torch.tensor([p + j for j in range(width) for p in first], device=DEV)
    ref = norm_rope_reference(decode_attention_reference(**args), None, 0, 0.0, cos, sin, pos, sign=-1.0)
    poison(DEV)
    out = decode_attention(**args, num_splits=splits, rope=(cos, sin), rope_pos=pos, fold_q=0, max_rows=int(args["row_len"].max()) if mode == "hca" else None)
    _check(out, ref, dtype)


# ---- indexer ----------------------------------------------------------------------------------------
IDX_CASES = [(5, 64, 128, [300, 0, 17, 700, 90], 512), (3, 8, 16, [5, 40, 2], 4)]
if SMALL:
    IDX_CASES = [(4, 64, 32, [100, 0, 17, 70], 32), (3, 8, 16, [5, 40, 2], 4)]


def _indexer_case(case, dtype, seed):
    b, hi, di, n_rows, _ = case
    g = torch.Generator().manual_seed(seed)
    starts, at = [], 2
    for n in n_rows:
        starts.append(at)
        at += n + 5
    q = torch.randn(b, hi, di, generator=g).to(DEV, dtype)
    wts = torch.randn(b, hi, generator=g).to(DEV, dtype)
    rows = torch.randn(at, di, generator=g).to(DEV, dtype)
    return q, wts, rows, torch.tensor(starts, device=DEV), torch.tensor(n_rows, device=DEV, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", IDX_CASES, ids=lambda c: f"B{c[0]}Hi{c[1]}Di{c[2]}")
def test_indexer_scores_and_topk(case, dtype) -> None:
    q, wts, rows, start, n = _indexer_case(case, dtype, seed=case[1])
    scale = case[2] ** -0.5 * case[1] ** -0.5
    ref = indexer_scores_reference(q, wts, rows, start, n, scale)
    poison(DEV)
    out = indexer_scores(q, wts, rows, start, n, scale)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(out)), "the -inf mask differs"
    assert (out[~finite] == float("-inf")).all()
    _check(out[finite], ref[finite], torch.float32 if dtype == torch.float32 else torch.bfloat16)
    # top-k: the chosen rows' reference scores match the reference's own top-k (ties may reorder)
    k = case[4]
    idx = indexer_topk(q, wts, rows, start, n, k, scale)
    assert idx.shape == (q.shape[0], min(k, ref.shape[1])) and idx.dtype == torch.int32
    want = ref.topk(idx.shape[1], dim=-1).values
    got = torch.where(idx >= 0, ref.gather(1, idx.clamp(min=0).long()), float("-inf")).sort(dim=-1, descending=True).values
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    assert torch.allclose(got[fin], want[fin], rtol=2e-2, atol=1e-3)


# ---- compressor pooling -------------------------------------------------------------------------------
POOL_CASES = [(4, 512, True, [3, 1, 2, 5]), (4, 128, True, [2, 1]), (128, 512, False, [2, 1, 1]), (8, 64, False, [4, 2])]
if SMALL:
    POOL_CASES = [(4, 64, True, [3, 1, 2, 5]), (4, 32, True, [2, 1]), (32, 64, False, [2, 1, 1]), (8, 48, False, [4, 2])]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"r{c[0]}d{c[1]}{'csa' if c[2] else 'hca'}")
def test_gated_pool(case, dtype) -> None:
    r, d, overlap, windows = case
    kv, gate, bias, win, prev = pool_inputs(windows, r, d, overlap, dtype, DEV, seed=r + d)
    ref = gated_pool_reference(kv, gate, bias, win, prev, overlap)
    poison(DEV)
    _check(gated_pool(kv, gate, bias, win, prev, overlap), ref, dtype)


# ---- MoE -------------------------------------------------------------------------------------------------
def _sorted_by_index(w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    idx_s, order = idx.sort(dim=-1)
    return w.gather(1, order), idx_s


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("temp,normalize", [(0.7, True), (1.3, False)], ids=["temp", "unnormalised"])
def test_route_v41_options(temp, normalize, dtype) -> None:
    """V4.1's router: logits divided by ``gate_temp`` (correctly rounded) before scoring, the
    picks' scores left unnormalised without ``norm_topk_prob``; picks in descending order."""
    n, e, k = (37, 384, 6) if not SMALL else (19, 64, 6)
    g = torch.Generator().manual_seed(4)
    logits = (2 * torch.randn(n, e, generator=g)).to(DEV, dtype)
    bias = (0.1 * torch.randn(e, generator=g)).to(DEV)
    w_ref, i_ref = route_reference(logits, k, 1.5, bias, temp=temp, normalize=normalize)
    w, i = route(logits, k, 1.5, bias, temp=temp, normalize=normalize)
    scores = score(logits / temp, "sqrtsoftplus")
    sel = (scores + bias).gather(1, i)
    assert (sel[:, :-1] >= sel[:, 1:]).all()  # torch.topk's sorted order
    w_ref, i_ref = _sorted_by_index(w_ref, i_ref)
    w, i = _sorted_by_index(w, i)
    assert torch.equal(i, i_ref)
    _check(w, w_ref, dtype)
    if not normalize:  # the raw scores times the scaling
        _check(w, 1.5 * scores.gather(1, i).float(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("hashed", [False, True], ids=["score", "hash"])
def test_route(hashed, dtype) -> None:
    n, e, k = (37, 256, 6) if not SMALL else (19, 64, 6)
    g = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(n, e, generator=g)).to(DEV, dtype)
    bias = (0.1 * torch.randn(e, generator=g)).to(DEV)
    tid2eid = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(100)]).to(DEV)
    token_ids = torch.randint(0, 100, (n,), generator=g).to(DEV)
    kw = {"tid2eid": tid2eid, "token_ids": token_ids} if hashed else {"bias": bias}
    w_ref, i_ref = route_reference(logits, k, 1.5, **kw)
    w, i = route(logits, k, 1.5, **kw)
    assert i.dtype == torch.int64 and w.dtype == torch.float32
    w_ref, i_ref = _sorted_by_index(w_ref, i_ref)
    w, i = _sorted_by_index(w, i)
    assert torch.equal(i, i_ref)
    _check(w, w_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_moe_experts(dtype) -> None:
    n, e, k, hidden, inter = (37, 32, 6, 256, 128) if not SMALL else (13, 32, 6, 64, 32)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, hidden, generator=g).to(DEV, dtype)
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=g) * hidden**-0.5).to(DEV, dtype)
    down = (torch.randn(e, hidden, inter, generator=g) * inter**-0.5).to(DEV, dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(DEV)
    w = torch.rand(n, k, generator=g).to(DEV)
    gate_up[idx[0, 0]] *= 8  # some gates past the clamp limit
    ref = moe_experts_reference(x, w, idx, gate_up, down, limit=3.0)
    poison(DEV)
    _check(moe_experts(x, w, idx, gate_up, down, limit=3.0), ref, dtype)
    shared = torch.randn(n, hidden, generator=g).to(DEV, dtype)  # added inside the combine
    _check(moe_experts(x, w, idx, gate_up, down, limit=3.0, add=shared), ref + shared, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("n,shared,v41", [(1, True, False), (2, False, False), (3, True, False), (10, True, False), (1, True, True)])
def test_moe_gemv(dtype, n, shared, v41) -> None:
    """Few-token experts (GEMV kernels, shared expert as slot k) against the fp32 reference;
    ``v41``: an intermediate size no 1024 tile divides (V4.1-Flash's 2304: a 256 K block)."""
    from kernels.moe_gemv import moe_gemv, moe_gemv_reference, shared_act

    e, k, hidden, inter = (8, 6, 4096, 2048) if not SMALL else (16, 4, 96, 40)  # SMALL: masked tails
    if v41:
        hidden, inter = (5120, 2304) if not SMALL else (96, 1280)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(n, hidden, generator=g).to(DEV, dtype)
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=g) * hidden**-0.5).to(DEV, dtype)
    down = (torch.randn(e, hidden, inter, generator=g) * inter**-0.5).to(DEV, dtype)
    sh = tuple((torch.randn(a, b, generator=g) * b**-0.5).to(DEV, dtype) for a, b in ((inter, hidden), (inter, hidden), (hidden, inter)))
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(DEV)
    w = torch.rand(n, k, generator=g).to(DEV)
    gate_up[idx[0, 0]] *= 8  # some gates past the clamp limit
    shared_w = sh if shared else None
    ref = moe_gemv_reference(x.float(), w, idx, gate_up.float(), down.float(), 3.0, None if not shared else tuple(t.float() for t in sh))
    tol_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    poison(DEV)
    _check(moe_gemv(x, w, idx, gate_up, down, 3.0, shared_w).float(), ref, tol_dtype)
    if shared:  # the shared expert's SwiGLU rows first (as next to the router), then the routed slots
        poison(DEV)
        act = shared_act(x, sh, k, 3.0)
        _check(moe_gemv(x, w, idx, gate_up, down, 3.0, sh, act=act).float(), ref, tol_dtype)


# ---- dense GEMV (kernels.gemv) --------------------------------------------------------------------
GEMV_CASES = [  # (N, K, groups, cfg): the slice's shapes, masked tails, one grouped
    (2560, 4096, 1, None), (256, 4096, 1, None), (8192, 4096, 8, None), (4096, 8192, 1, (8, 1024, 8)),
    (1000, 1000, 1, None), (48, 200, 4, (4, 64, 4)), (4096, 1280, 1, None),  # V4.1's q_lora: a 256 tile, no tail
]  # fmt: skip
if SMALL:
    GEMV_CASES = [(96, 256, 1, None), (40, 100, 1, (4, 64, 4)), (64, 128, 4, (8, 64, 4)), (7, 64, 1, (1, 128, 4)), (1024, 1280, 1, None)]


def test_even_tile() -> None:
    """A K block without a masked tail where a large enough power of two divides K."""
    from kernels._common import even_tile

    assert [even_tile(k, 1024) for k in (4096, 2048, 1000, 1024, 512)] == [1024] * 5  # divides, or K fits one block
    assert even_tile(2304, 1024) == 256 and even_tile(1280, 1024) == 256 and even_tile(5632, 1024) == 512
    assert even_tile(1100, 1024) == 1024  # 4 divides 1100: too small a block, the masked tail stays
    assert even_tile(2304, 1024, least=512) == 1024


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("n,k,groups,cfg", GEMV_CASES)
def test_gemv(dtype, n, k, groups, cfg) -> None:
    """The weight-streaming GEMV (plain, grouped, fp32 logits out) against the fp32 reference;
    two tokens take the reference path."""
    from kernels import gemv as gm

    g = torch.Generator().manual_seed(31)
    x = torch.randn(2, groups * k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(DEV, dtype)
    ref = gm.gemv_reference(x.float(), w.float(), groups)
    tol_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    poison(DEV)
    _check(gm.gemv(x[:1], w, groups, cfg=cfg).float(), ref[:1], tol_dtype)
    poison(DEV)
    got = gm.gemv(x[:1], w, groups, torch.float32, cfg=cfg)  # the lm_head's fp32 logits
    assert got.dtype == torch.float32
    _check(got, ref[:1], tol_dtype)
    if dtype == torch.bfloat16:  # rounded to bf16 as F.linear(...).float() is
        assert torch.equal(got, got.to(dtype).float())
        wide = gm.gemv(x[:1], w, groups, torch.float32, cfg=cfg, round_to_x=False)  # F.linear(x.float(), w.float())
        _check(wide, ref[:1], torch.float32)
    _check(gm.gemv(x, w, groups).float(), ref, tol_dtype)


# ---- mHC mixing weights ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 37, 300] if not SMALL else [1, 37])
def test_hc_mix(n) -> None:
    from kernels.mhc import hc_mix, hc_mix_reference

    hc, iters, eps = 4, 20, 1e-6
    g = torch.Generator().manual_seed(11)
    mixes = (3 * torch.randn(n, (2 + hc) * hc, generator=g)).to(DEV)
    scale = (1 + 0.2 * torch.randn(3, generator=g)).to(DEV)
    base = (0.5 * torch.randn((2 + hc) * hc, generator=g)).to(DEV)
    want = hc_mix_reference(mixes, scale, base, hc, iters, eps)
    got = hc_mix(mixes, scale, base, hc, iters, eps)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-5


# ---- fused static-decode glue (kernels.fused) and FP8 experts (kernels.moe_fp8) ----------------
FUSED_DTYPES = DTYPES if DEV == "cuda" else [torch.float32]  # the interpreter's bf16 casts truncate


def _compressor_pools(g: torch.Generator, s1: int, r: int, p: int, d: int, tc: int, dtype, overlap: bool) -> dict:
    """Random slot pools of one compressor (``compress_step``'s buffers, overlap and rows)."""
    gate_dt = torch.promote_types(dtype, torch.float32)
    return {
        "buf_kv": torch.randn(s1, r, p, generator=g).to(DEV, dtype), "buf_gate": torch.randn(s1, r, p, generator=g).to(DEV, dtype),
        "overlap_kv": torch.randn(s1, r, d, generator=g).to(DEV, dtype) if overlap else None,
        "overlap_gate": torch.randn(s1, r, d, generator=g).to(DEV, gate_dt) if overlap else None,
        "rows": torch.randn(s1, tc + 1, d, generator=g).to(DEV, dtype),
    }  # fmt: skip


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
def test_fused_compress_step(dtype, overlap) -> None:
    """``compress_step``'s kernel against ``compress_step_reference`` (the general path's ops):
    tokens at positions that close a window (first and later ones) and that do not, stale pool
    contents, every pool compared after the call."""
    from kernels import fused as fk

    r, d = 4, (64 if SMALL else 512)
    p = 2 * d if overlap else d
    g = torch.Generator().manual_seed(31)
    b, s1, tc = 6, 9, 20
    pos = torch.tensor([3, 7, 5, 0, 2 * r + 3, 11], device=DEV)  # closes: window 0, 1, none, none, 2, 2
    slots = torch.tensor([4, 0, 8, 2, 6, 1], device=DEV)
    kv = torch.randn(b, p, generator=g).to(DEV, dtype)
    gate = (2 * torch.randn(b, p, generator=g)).to(DEV, dtype)
    pools = _compressor_pools(g, s1, r, p, d, tc, dtype, overlap)
    bias = torch.randn(r, p, generator=g).to(DEV)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(DEV)
    ang = torch.rand(200, 8, generator=g) * 6.28
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    got = {k: None if v is None else v.clone() for k, v in pools.items()}
    want = {k: None if v is None else v.clone() for k, v in pools.items()}
    fk.compress_step(kv, gate, pos, slots, got["buf_kv"], got["buf_gate"], got["overlap_kv"], got["overlap_gate"], bias, w, 1e-6, cos, sin, got["rows"])
    fk.compress_step_reference(kv, gate, pos, slots, want["buf_kv"], want["buf_gate"], want["overlap_kv"], want["overlap_gate"], bias, w, 1e-6, cos, sin, want["rows"])
    for k, v in want.items():
        if v is not None:
            _check(got[k], v, dtype)


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("r", [4, 128])
def test_fused_compress_step_verify_in_one_pass(dtype, overlap, width, r) -> None:
    """A verify's ``width`` offsets in one ``compress_step`` launch (``cols`` per offset) against
    the same kernel offset by offset and against the reference's one pass: slots whose window
    closes at the first, a middle and the last offset (later offsets then write the next window's
    first entries, which the pooled window must not see), a first window (no overlap yet), and
    one that closes nothing; every pool compared after the call."""
    from kernels import fused as fk

    d = 64 if SMALL else 512
    p = 2 * d if overlap else d
    g = torch.Generator().manual_seed(37)
    s1, tc = 9, 20
    # the window closes at offset: 0 (window 1); 1 (window 0, the first); the last (window 2);
    # 3 for r 4 and width 4, else none; 2 for r 4 and width 4, else none; 2 / 0 for width 4 / 2 (window 0)
    first = torch.tensor([2 * r - 1, r - 2, 3 * r - width, 0, 3 * r + 1, r - width + 1])
    slots = torch.tensor([4, 0, 8, 2, 6, 1])
    b = first.shape[0]
    pos = torch.cat([first + o for o in range(width)]).to(DEV)  # offset-major columns
    cols = slots.repeat(width).to(DEV)
    kv = torch.randn(b * width, p, generator=g).to(DEV, dtype)
    gate = (2 * torch.randn(b * width, p, generator=g)).to(DEV, dtype)
    pools = _compressor_pools(g, s1, r, p, d, tc, dtype, overlap)
    bias = torch.randn(r, p, generator=g).to(DEV)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(DEV)
    ang = torch.rand(4 * r + 8, 8, generator=g) * 6.28
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    copy = lambda: {k: None if v is None else v.clone() for k, v in pools.items()}  # noqa: E731
    one, steps, ref = copy(), copy(), copy()

    def call(fn, st, at: slice, **kw) -> None:
        fn(kv[at], gate[at], pos[at], cols[at], st["buf_kv"], st["buf_gate"], st["overlap_kv"], st["overlap_gate"], bias, w, 1e-6, cos, sin, st["rows"], **kw)

    call(fk.compress_step, one, slice(None), cols=b)
    for o in range(width):
        call(fk.compress_step, steps, slice(o * b, (o + 1) * b))
    call(fk.compress_step_reference, ref, slice(None), cols=b)
    for k, v in pools.items():
        if v is not None:
            assert torch.equal(one[k], steps[k]), k  # the same kernel's math, offset after offset
            _check(one[k], ref[k], dtype)
    assert not torch.equal(one["rows"], pools["rows"])  # windows did close


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("n", [1, 5])
def test_fused_hyper_connection(dtype, n) -> None:
    from engine.model.layers import collapse, unweighted_rms_norm
    from kernels import fused as fk
    from kernels.mhc import hc_mix_parts, hc_mix_reference

    hc, h, iters, eps, norm_eps = 4, (256 if SMALL else 4096), 20, 1e-6, 1e-6
    g = torch.Generator().manual_seed(21)
    streams = torch.randn(n, hc, h, generator=g).to(DEV, dtype)
    fn = (0.05 * torch.randn((2 + hc) * hc, hc * h, generator=g)).to(DEV)
    scale = (1 + 0.2 * torch.randn(3, generator=g)).to(DEV)
    base = (0.5 * torch.randn((2 + hc) * hc, generator=g)).to(DEV)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(DEV)
    flat = unweighted_rms_norm(streams.flatten(1).float(), norm_eps)
    pre_r, post_r, comb_r = hc_mix_reference(flat @ fn.t(), scale, base, hc, iters, eps)
    x_r = fk.collapse_norm_reference(pre_r, streams, w, norm_eps)
    for kw in ({"target_programs": 7}, {"block_k": 16, "max_splits": 64}):  # the second: > PRESUM_SPLITS at n=1
        parts = fk.hc_pre_parts(streams, fn, **kw)
        pre, post, comb = hc_mix_parts(parts, hc * h, norm_eps, scale, base, hc, iters, eps)
        for a, b in ((pre, pre_r), (post, post_r), (comb, comb_r)):
            assert (a - b).abs().max().item() <= 1e-4
    assert rel_err(fk.collapse_norm(pre_r, streams, w, norm_eps), x_r) <= TOL[dtype]
    out = torch.randn(n, h, generator=g).to(DEV, dtype)
    want = fk.hc_merge_reference(post_r, comb_r, out, streams)
    assert rel_err(fk.hc_merge(post_r, comb_r, out, streams), want) <= TOL[dtype]
    assert collapse(pre_r, streams).shape == (n, h)


@pytest.mark.parametrize("n", [1, 5])
def test_fused_hyper_head(n) -> None:
    """``hc_mix_parts(head=True)``: ``HyperHead``'s gates from split-K partials (many splits)."""
    from engine.model.layers import unweighted_rms_norm
    from kernels import fused as fk
    from kernels.mhc import hc_mix_parts

    hc, h, eps, norm_eps = 4, (256 if SMALL else 4096), 1e-6, 1e-6
    g = torch.Generator().manual_seed(22)
    streams = torch.randn(n, hc, h, generator=g).to(DEV, torch.bfloat16)
    fn = (0.05 * torch.randn(hc, hc * h, generator=g)).to(DEV)
    scale = (1 + 0.2 * torch.randn(1, generator=g)).to(DEV)
    base = (0.5 * torch.randn(hc, generator=g)).to(DEV)
    mixes = unweighted_rms_norm(streams.flatten(1).float(), norm_eps) @ fn.t()
    want = torch.sigmoid(mixes * scale + base) + eps
    parts = fk.hc_pre_parts(streams, fn, block_k=16, max_splits=64)
    pre, post, comb = hc_mix_parts(parts, hc * h, norm_eps, scale, base, hc, 0, eps, head=True)
    assert (pre - want).abs().max().item() <= 1e-4 and post.numel() == comb.numel() == 0


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("rows_per_program", [1, 8])  # the decode-size and the prefill-size launch
def test_fused_norm_rope(dtype, mode, rows_per_program) -> None:
    from engine.model.config import RopeParams
    from engine.model.rope import Rotary
    from kernels import fused as fk

    # 3 tokens x 5 heads = 15 rows: with 8 rows per program the second program is partly masked
    nr = fk.NormRopeTuning(rows=rows_per_program, min_rows=1 if rows_per_program > 1 else 1 << 30)
    n, heads, d, rope_dim = 3, 5, (128 if SMALL else 512), 64
    g = torch.Generator().manual_seed(22)
    x = torch.randn(n, heads, d + 16, generator=g).to(DEV, dtype)[..., :d]  # strided rows
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(DEV)
    rot = Rotary(RopeParams(rope_type="default", theta=10000.0), rope_dim, 4096)
    cos, sin = rot.cos_sin(torch.arange(5000, device=DEV), dtype)
    pos = torch.tensor([0, 7, 4099], device=DEV)
    for sign, div in ((1.0, 1), (-1.0, 1), (1.0, 4)):
        want = fk.norm_rope_reference(x, w, mode, 1e-6, cos, sin, pos, div, sign)
        got = fk.norm_rope(x, w, mode, 1e-6, cos, sin, pos, div, sign, tuning=nr)
        assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(fk.norm_rope(x, w, mode, 1e-6, tuning=nr), fk.norm_rope_reference(x, w, mode, 1e-6, None, None, None)) <= 1e-2
    # scattered into rows of a pool (the static decode's window ring); the other rows untouched
    pool = torch.randn(40, d, generator=g).to(DEV, dtype)
    dst = torch.randperm(40, generator=g)[: n * heads].to(DEV)
    got = fk.norm_rope(x, w, mode, 1e-6, cos, sin, pos, out=pool.clone(), out_rows=dst, tuning=nr)
    want = fk.norm_rope_reference(x, w, mode, 1e-6, cos, sin, pos).reshape(-1, d)
    assert rel_err(got[dst], want) <= (1e-5 if dtype == torch.float32 else 1e-2)
    keep = torch.ones(40, dtype=torch.bool, device=DEV)
    keep[dst] = False
    assert torch.equal(got[keep], pool[keep])


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
def test_fused_swiglu(dtype) -> None:
    from kernels import fused as fk

    g = torch.Generator().manual_seed(23)
    a, b = (4 * torch.randn(2, 3, 300, generator=g)).to(DEV, dtype).unbind(0)
    assert rel_err(fk.swiglu(a, b, 7.0), fk.swiglu_reference(a, b, 7.0)) <= TOL[dtype]


@pytest.mark.parametrize("n", [1, 13, 64])
def test_moe_experts_fp8(n) -> None:
    """FP8 block-scaled experts against the bf16/fp32 reference on the dequantized weights."""
    from kernels.moe_fp8 import dequantize_blocks, moe_experts_fp8, quantize_blocks

    if DEV == "cpu" and n > 13:
        pytest.skip("interpreter: small cases only")
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    e, h, i, k = (8, 256, 128, 3) if SMALL else (32, 4096, 2048, 6)
    g = torch.Generator().manual_seed(24)
    gq, gs = quantize_blocks((torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(DEV))
    dq, ds = quantize_blocks((torch.randn(e, h, i, generator=g) / i**0.5).to(DEV))
    x = torch.randn(n, h, generator=g).to(DEV, dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(DEV)
    w = torch.rand(n, k, generator=g).to(DEV)
    want = moe_experts_reference(x, w, idx, dequantize_blocks(gq, gs, dtype), dequantize_blocks(dq, ds, dtype), 10.0)
    poison(DEV)
    got = moe_experts_fp8(x, w, idx, gq, gs, dq, ds, 10.0)
    assert rel_err(got, want) <= TOL[dtype]

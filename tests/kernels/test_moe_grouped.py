"""``kernels.moe_grouped`` (prefill grouped GEMM, fused SwiGLU) against per-group PyTorch GEMMs.

bf16 rel. error ≤ 1e-2, fp32 ≤ 1e-4; on CPU through ``test_interpret.py`` (fp32, small)."""

from __future__ import annotations

import os

import pytest
import torch

from bench.kernel_helpers import TOL, kernel_test_device, rel_err

pytestmark = pytest.mark.gpu
DEV = kernel_test_device()
SMALL = os.environ.get("KERNELS_TEST_SMALL", "1" if DEV == "cpu" else "0") == "1"
DTYPES = [torch.float32] if DEV == "cpu" else [torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def _exact_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False


def _groups(m: int, e: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (m,), generator=g)
    ids[ids == 1] = 0  # an empty group
    counts = torch.bincount(ids, minlength=e)
    return torch.cumsum(counts, 0).to(torch.int32).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swiglu", [False, True])
def test_grouped_mm(dtype, swiglu) -> None:
    from kernels.moe_grouped import grouped_mm, grouped_mm_reference

    m, e, n, k = (70, 5, 32, 32) if SMALL else (3000, 16, 512, 1024)
    cfg = (16, 16, 16, 4, 1) if SMALL else (64, 128, 64, 4, 4 if dtype != torch.float32 else 2)
    g = torch.Generator(device=DEV).manual_seed(1)
    xs = torch.randn(m, k, generator=g, device=DEV).to(dtype)
    w = (torch.randn(e, n, k, generator=g, device=DEV) * k**-0.5).to(dtype)
    offs = _groups(m, e, 3)
    lim = 1.5 if swiglu else None
    got = grouped_mm(xs, w, offs, swiglu_limit=lim, cfg=cfg)
    want = grouped_mm_reference(xs.float(), w.float(), offs, swiglu_limit=lim)
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_err(got, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_prefill(dtype) -> None:
    from kernels import moe_grouped
    from kernels.moe import moe_experts_reference

    n, e, h, i, top = (24, 6, 32, 16, 3) if SMALL else (1500, 32, 512, 256, 6)
    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(n, h, generator=g, device=DEV).to(dtype)
    gate_up = (torch.randn(e, 2 * i, h, generator=g, device=DEV) * h**-0.5).to(dtype)
    down = (torch.randn(e, h, i, generator=g, device=DEV) * i**-0.5).to(dtype)
    indices = torch.stack([torch.randperm(e, device="cpu")[:top] for _ in range(n)]).to(DEV)
    weights = torch.rand(n, top, generator=g, device=DEV)
    tuning = moe_grouped.GroupedMoETuning(up=(16, 16, 16, 4, 1), down=(16, 16, 16, 4, 1)) if SMALL else moe_grouped.GROUPED_MOE
    got = moe_grouped.moe_experts_prefill(x, weights, indices, gate_up, down, 1.0, tuning=tuning)
    want = moe_experts_reference(x.float(), weights, indices, gate_up.float(), down.float(), 1.0)
    assert rel_err(got, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [1.5, 0.0])
def test_weighted_swiglu_epilogue(dtype, limit) -> None:
    """With ``row_weight``: V4.1's ``weighted_swiglu`` of the GEMM's output rounded to ``dtype``
    (an empty group, one group longer than BM); the same bits but for the GEMM's summation order
    (and the interpreter's truncating bf16 casts): fp32 noise; bf16 up to ~3 ulps (gate, up and
    the output each rounded once more or less)."""
    from kernels.moe_grouped import grouped_mm, grouped_mm_reference
    from kernels.v41_moe import weighted_swiglu_reference

    m, e, n, k = (70, 5, 32, 32) if SMALL else (3000, 16, 512, 1024)
    cfg = (16, 16, 16, 4, 1) if SMALL else (64, 128, 64, 4, 4 if dtype != torch.float32 else 2)
    g = torch.Generator(device=DEV).manual_seed(4)
    xs = torch.randn(m, k, generator=g, device=DEV).to(dtype)
    w = (torch.randn(e, n, k, generator=g, device=DEV) * 2 * k**-0.5).to(dtype)  # |h| up to ~8: the clamps bite at 1.5
    rw = torch.rand(m, generator=g, device=DEV)
    offs = _groups(m, e, 3)
    sizes = torch.diff(offs.cpu(), prepend=offs.new_zeros(1).cpu())
    assert sizes.min() == 0 and sizes.max() > cfg[0]
    got = grouped_mm(xs, w, offs, swiglu_limit=limit, row_weight=rw, cfg=cfg)
    want = weighted_swiglu_reference(grouped_mm_reference(xs, w, offs), rw, limit)
    assert got.shape == (m, n // 2) and got.dtype == dtype
    rtol, atol = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-5, 2**-10)}[dtype]  # atol: of the largest |output| (K = 1024 fp32 sums in another order)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * want.float().abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swiglu", [False, True])
def test_gathered_rows_and_tail_tiles(dtype, swiglu) -> None:
    """``rows=``: the loads gather the GEMM's rows from unsorted ``xs``, the same bits as the GEMM
    of ``xs[rows]``; ``tail``: an expert's last tile of at most ``tail`` rows runs as a smaller
    tile (groups here spill 1..tail rows past a full tile, one is empty), within the tolerance
    of the reference (another MMA shape on the GPU)."""
    from kernels.moe_grouped import GemmConfig, grouped_mm, grouped_mm_reference

    bm = 32 if SMALL else 128
    sizes = [bm + 3, 0, bm, 2 * bm + bm // 4, 5, bm + 1]  # spills of 3, bm/4, 1 rows; one group under a tile
    e, n, k = len(sizes), (32 if SMALL else 512), (32 if SMALL else 1024)
    m = sum(sizes)
    base = (bm, 16, 16, 4, 1) if SMALL else (bm, 128, 64, 8, 4 if dtype != torch.float32 else 2)
    g = torch.Generator(device=DEV).manual_seed(6)
    xs = torch.randn(m + 7, k, generator=g, device=DEV).to(dtype)
    w = (torch.randn(e, n, k, generator=g, device=DEV) * k**-0.5).to(dtype)
    rows = torch.randperm(m + 7, generator=torch.Generator().manual_seed(7))[:m].to(DEV)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32).to(DEV)
    lim = 1.5 if swiglu else None
    plain = grouped_mm(xs[rows], w, offs, swiglu_limit=lim, cfg=base)
    assert torch.equal(grouped_mm(xs, w, offs, swiglu_limit=lim, rows=rows, cfg=base), plain)
    tailed = grouped_mm(xs, w, offs, swiglu_limit=lim, rows=rows, cfg=GemmConfig(*base, tail=bm // 4))
    want = grouped_mm_reference(xs[rows].float(), w.float(), offs, swiglu_limit=lim)
    assert tailed.shape == want.shape and rel_err(tailed, want) <= TOL[dtype]

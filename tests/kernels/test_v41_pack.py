"""V4.1's fused pack-and-write kernels (``kernels.v41_pack``) against ``kernels.v41_kv``'s packers
with ``index_copy_`` and ``quant.fp4_indexer``, bit for bit: random blocks from tiny to huge
magnitudes, zeros and -0.0, subnormals, and values on, next to and exactly at the rounding
midpoints of e4m3 and e2m1 (the compressed rows' e4m3 scales too).

GPU: ``pytest -m gpu tests/kernels/test_v41_pack.py``; on CPU the GPU tests run under Triton's
interpreter (``tests/kernels/test_interpret.py``, ~10 s)."""

from __future__ import annotations

import pytest
import torch

from engine.model.v41.quant import fp4_indexer
from kernels import v41_pack
from kernels.v41_kv import FP4_GRID, pack_fp4_keys, pack_fp4_rows, pack_fp8_window
from tests.kernels.interpreted import INTERPRETED, ON_GPU, run_gpu_tests_interpreted

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16]  # bf16 holds every edge value below exactly


def _midpoints(grid: torch.Tensor) -> torch.Tensor:
    """The grid, its midpoints and their fp32 neighbours (all ≥ 0)."""
    mid = (grid[1:] + grid[:-1]) / 2
    return torch.cat([grid, mid, torch.nextafter(mid, torch.zeros(())), torch.nextafter(mid, torch.full((), 1e30))])


def _e4m3_grid() -> torch.Tensor:
    g = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # non-negative codes
    return g[torch.isfinite(g)]


def _blocks(block: int, kind: str, seed: int) -> torch.Tensor:
    """Blocks ``(n, block)`` fp32 of one format's edge cases, then random ones at ``2^-30 .. 2^30``
    (``2^-30 .. 2^8`` for ``rows``, whose scale must stay within e4m3)."""
    g = torch.Generator().manual_seed(seed)
    top = 8 if kind == "rows" else 30
    rand = torch.randn(48, block, generator=g) * torch.exp2(torch.randint(-30, top + 1, (48, 1), generator=g).float())
    if kind == "fp8":  # scale 1 (amax 300 .. 448): the e4m3 midpoints themselves
        vals, amax = _midpoints(_e4m3_grid()), 300.0
    else:  # scale 1 (amax 6): the e2m1 midpoints
        vals, amax = _midpoints(torch.tensor(FP4_GRID)), 6.0
        vals = vals[vals <= 6.0]
    vals = vals[: vals.numel() // (block - 1) * (block - 1)].reshape(-1, block - 1)
    mids = torch.cat([vals, torch.full((vals.shape[0], 1), amax)], dim=1)
    mids = torch.cat([mids, -mids, mids * 2.0**-12, -mids * 2.0**5])
    edge = [torch.zeros(block), torch.full((block,), -0.0), torch.full((block,), 1e-41), torch.randn(block, generator=g) * 1e-39]
    if kind != "rows":
        edge += [torch.randn(block, generator=g) * 1e36, torch.full((block,), -2e38)]
    out = [mids, torch.stack(edge), rand]
    if kind == "rows":  # amax / 6 at e4m3's midpoints and their neighbours: the scale's rounding
        amax = 6.0 * _midpoints(_e4m3_grid())
        amax = amax[(amax >= 6.0 * 2.0**-9) & (amax <= 6.0 * 448.0)]
        fill = (torch.rand(amax.numel(), block, generator=g) * 2 - 1) * amax[:, None]
        fill[:, 0] = amax
        out.append(fill)
    return torch.cat(out)


def _rows(d: int, block: int, kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows ``(n, d)`` of ``_blocks`` (shuffled, the last row topped up with random blocks)."""
    b = _blocks(block, kind, seed)
    per = d // block
    b = torch.cat([b, b[: (-b.shape[0]) % per]])[torch.randperm(b.shape[0] + (-b.shape[0]) % per, generator=torch.Generator().manual_seed(seed))]
    return b.reshape(-1, d).to(dtype).to(DEVICE)


def _pools(n: int, widths: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random-byte pools ``(n + 3, w)`` for both outputs and ``n`` distinct rows in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    q, s = (torch.randint(0, 256, (n + 3, w), generator=g, dtype=torch.uint8).to(DEVICE) for w in widths)
    return q, s, torch.randperm(n + 3, generator=g)[:n].to(DEVICE)


def _skip_without_triton() -> None:
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 512])
def test_write_fp8_window_is_pack_fp8_window(dtype: torch.dtype, d: int) -> None:
    _skip_without_triton()
    x = _rows(d, 32, "fp8", dtype)
    q, e, at = _pools(x.shape[0], (d, d // 32), d)
    want_q, want_e = q.clone(), e.clone()
    codes, exps = pack_fp8_window(x)
    want_q.index_copy_(0, at, codes.view(torch.uint8))
    want_e.index_copy_(0, at, exps)
    v41_pack.write_fp8_window(x, q.view(-1, 1, d), e.view(-1, 1, d // 32), at)  # (S, W, ...) pools
    assert torch.equal(q, want_q) and torch.equal(e, want_e)


# format → (packer, fused writer, channels per scale, the pools' seed offset)
FP4 = {"rows": (pack_fp4_rows, v41_pack.write_fp4_rows, 16, 1), "keys": (pack_fp4_keys, v41_pack.write_fp4_keys, 32, 2)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt, d", [("rows", 64), ("rows", 512), ("keys", 64), ("keys", 128)])
def test_write_fp4_is_its_packer(dtype: torch.dtype, fmt: str, d: int) -> None:
    """``write_fp4_rows`` / ``write_fp4_keys``: ``pack_fp4_rows`` / ``pack_fp4_keys`` and
    ``index_copy_`` into the pools, bit for bit, the other rows untouched."""
    _skip_without_triton()
    pack, write, block, seed = FP4[fmt]
    x = _rows(d, block, fmt, dtype)
    q, s, flat = _pools(x.shape[0], (d // 2, d // block), d + seed)
    want_q, want_s = q.clone(), s.clone()
    pq, ps = pack(x)
    want_q.index_copy_(0, flat, pq)
    want_s.index_copy_(0, flat, ps.view(torch.uint8))
    write(x, q, s, flat)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,d", [(4, 64), (2, 128)])
def test_fp4_indexer_quant_is_fp4_indexer(dtype: torch.dtype, heads: int, d: int) -> None:
    _skip_without_triton()
    x = _rows(heads * d, 32, "keys", dtype, seed=3).view(-1, heads, d)
    got, want = v41_pack.fp4_indexer_quant(x), fp4_indexer(x)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got.view(bits), want.view(bits))  # -0.0 included


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("r,d", [(2, 512), (4, 64), (3, 48)])
def test_pool_group_is_the_compressors_pooling(dtype: torch.dtype, r: int, d: int) -> None:
    """``pool_group``: the same buffer writes as ``index_copy_`` (bit for bit) and the group's
    softmax pooling within fp32 rounding, for groups closing, opening and in between."""
    _skip_without_triton()
    g = torch.Generator().manual_seed(11)
    slots, pos = torch.tensor([3, 0, 2, 5]), torch.tensor([r - 1, 0, 2 * r + 1, 7 * r - 1])
    bufs = [torch.randn(6, r, d, generator=g) * 3 for _ in range(2)]
    kv, gate = (torch.randn(4, d, generator=g) * 3 for _ in range(2))
    want_bufs = [t.clone().to(DEVICE) for t in bufs]
    got_bufs = [t.clone().to(DEVICE) for t in bufs]
    args = [t.to(DEVICE) for t in (kv, gate)]
    want = v41_pack.pool_group_reference(*args, *want_bufs, slots.to(DEVICE), pos.to(DEVICE), dtype)
    got = v41_pack.pool_group(*args, *got_bufs, slots.to(DEVICE), pos.to(DEVICE), dtype, kernel=True)
    assert all(torch.equal(a, b) for a, b in zip(got_bufs, want_bufs))
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_off_triton_the_packers_and_index_copy() -> None:
    """The slot step's PyTorch ops (without Triton: CPU, no interpreter)."""
    x = _rows(64, 32, "keys", torch.float32)[:5].cpu()
    q, e, at = (t.cpu() for t in _pools(5, (64, 2), 7))
    want_q, want_e = q.clone(), e.clone()
    codes, exps = pack_fp8_window(x)
    want_q.index_copy_(0, at, codes.view(torch.uint8))
    want_e.index_copy_(0, at, exps)
    v41_pack.write_fp8_window(x, q, e, at)
    assert torch.equal(q, want_q) and torch.equal(e, want_e)
    assert torch.equal(v41_pack.fp4_indexer_quant(x.view(5, 1, 64)), fp4_indexer(x.view(5, 1, 64)))
    assert torch.equal(v41_pack.fp4_indexer_quant(x[:, :48]), x[:, :48])  # not whole blocks: unquantised


"""The V4.1 KV fake-quantisers: grids, scales and round-to-nearest-even ties."""

from __future__ import annotations

import torch

from engine.model.v41.quant import FP4_GRID, fp4_compressed, fp4_indexer, fp8_window, pow2_ceil, round_e2m1


def test_pow2_ceil_is_exact() -> None:
    t = torch.tensor([1.0, 1.5, 2.0, 0.3, 2.0**-20, 3.0 * 2.0**-100, 1000.0])
    assert pow2_ceil(t).tolist() == [1.0, 2.0, 2.0, 0.5, 2.0**-20, 2.0**-98, 1024.0]


def test_e2m1_rounds_to_nearest_ties_to_even_code() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 4.9, -1.25, -1.75, -0.1])
    assert round_e2m1(x).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 4.0, -1.0, -2.0, -0.0]
    grid = torch.tensor(FP4_GRID)
    assert torch.equal(round_e2m1(grid), grid) and torch.equal(round_e2m1(-grid), -grid)


def test_e2m1_equals_the_nearest_grid_point_by_brute_force() -> None:
    """Every midpoint, its fp32 neighbours and a dense sweep: the nearest grid value, a tie to
    the even code (fp32 and bf16)."""
    grid = torch.tensor(FP4_GRID)
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1]), torch.linspace(0, 6, 4801)])
    x = torch.cat([x, -x])
    dist = (x.abs()[:, None] - grid[None, :]).abs()  # (n, 8)
    best = dist == dist.min(dim=1, keepdim=True).values
    code = torch.where(best.sum(1) > 1, best.int().argmax(1) + (best.int().argmax(1) % 2), best.int().argmax(1))  # a tie: the even code
    want = torch.where(torch.signbit(x), -grid[code], grid[code])
    assert torch.equal(round_e2m1(x), want)
    xb = x.bfloat16()
    assert torch.equal(round_e2m1(xb).float(), round_e2m1(xb.float()))


def test_fp4_blocks_land_on_the_scaled_grid() -> None:
    """Each block is ``grid value × scale``, the scale from the block's input max as documented."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor(FP4_GRID)
    amax32, amax16 = x.view(3, -1, 32).abs().amax(-1, keepdim=True), x.view(3, -1, 16).abs().amax(-1, keepdim=True)
    cases = (
        (fp4_indexer(x), 32, pow2_ceil(amax32.clamp_min(6 * 2.0**-126) * (1 / 6.0))),  # ue8m0
        (fp4_compressed(x), 16, (amax16.clamp_min(6 * 2.0**-9) / 6.0).to(torch.float8_e4m3fn).float()),  # e4m3
    )
    for q, block, scale in cases:
        codes = q.view(3, -1, block) / scale
        assert torch.isin(codes.abs(), grid).all()
        assert ((q.view(3, -1, block) - x.view(3, -1, block)).abs() <= scale).all()  # within one grid step


def test_fp8_window_is_e4m3_with_power_of_two_scales() -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 3
    q = fp8_window(x)
    blocks, xb = q.view(4, 2, 32), x.view(4, 2, 32)
    scale = pow2_ceil(xb.abs().amax(-1, keepdim=True) / 448.0)
    assert torch.equal((blocks / scale).to(torch.float8_e4m3fn).float(), blocks / scale)
    assert ((q - x).abs() <= x.abs() / 16 + 1e-12).all()  # 3 mantissa bits: half an ulp ≤ 1/16


def test_shapes_that_do_not_block_pass_through() -> None:
    x = torch.randn(2, 24)
    assert fp8_window(x) is x and fp4_indexer(x) is x and torch.equal(fp4_compressed(x[:, :20]), x[:, :20])

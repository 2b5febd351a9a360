"""The FP8 GEMV (``kernels.fp8_gemv``) against the fp32 reference and against the FP8 GEMM.

GPU: ``pytest -m gpu tests/kernels/test_fp8_gemv.py``; on CPU the same tests run under Triton's
interpreter at small sizes (``test_fp8_gemv_under_interpreter``). The exact cases reuse
``test_fp8_gemm``'s inputs (small integers times powers of two: every product and partial sum is
exact in fp32), so the in-register dequantisation, masks and scale grids must match bit for bit:
shapes off the 128 grid, an all-zero weight block and an all-zero activation group, block
exponents from 2^-126 to 2^100.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import dequantize_weight, fp8_linear, quantize_weight, scales_to_fp32
from kernels.fp8_gemv import fp8_gemv, fp8_gemv_reference
from tests.kernels.interpreted import INTERPRETED, ON_GPU, run_gpu_tests_interpreted
from tests.kernels.test_fp8_gemm import _exact_case

DEV = "cuda" if ON_GPU else "cpu"
# the interpreter runs a program at a time: few rows there (its cost is the program count)
SHAPES = [(136, 300), (8, 1000)] if not ON_GPU else [(1024, 4096), (4096, 1024), (1000, 1000), (512, 4096), (32768, 1024)]
CFGS = [None, (4, 256, 4)] if not ON_GPU else [None, (1, 128, 4), (4, 256, 4)]  # the default, (one-row programs), a K tile of two scale blocks


def _gpu_or_interpreter() -> None:
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (see test_fp8_gemv_under_interpreter)")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_dequantised_math_is_exact(shape, cfg) -> None:
    _gpu_or_interpreter()
    n, k = shape
    x, wq, ws = _exact_case(1, n, k, seed=n + k)
    want = x @ dequantize_weight(wq, ws).t()
    assert torch.isfinite(want).all() and (n <= 128 or want.abs().max() > 2.0**90)
    got = fp8_gemv(x.to(DEV), wq.to(DEV), ws.to(DEV), out_dtype=torch.float32, cfg=cfg)
    assert torch.equal(got.cpu(), want), f"max abs diff {(got.cpu() - want).abs().max().item():.3g}"


@pytest.mark.gpu
def test_gemv_grouped_is_exact() -> None:
    """``groups``: the block-diagonal projection (the attention's ``o_a``), each group's columns
    quantised on their own."""
    _gpu_or_interpreter()
    groups, rpg, k = 2, 128, 256
    x, wq, ws = _exact_case(1, groups * rpg, groups * k, seed=5)
    wq, ws = wq[:, :k].contiguous(), ws[:, : k // 128].contiguous()
    want = fp8_gemv_reference(x, wq, ws, groups, torch.float32)
    dense = dequantize_weight(wq, ws)
    assert torch.equal(want[0, :rpg], x[0, :k] @ dense[:rpg].t())
    got = fp8_gemv(x.to(DEV), wq.to(DEV), ws.to(DEV), groups, out_dtype=torch.float32, cfg=None if ON_GPU else (4, 256, 4))
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_equals_the_gemm_on_random_bf16(shape) -> None:
    """Gaussian bf16 activations with groups of many magnitudes (the e4m3 rounding of the
    activations is real here): the GEMV quantises them as the GEMM does, so the two agree up to
    fp32 summation order and the bf16 cast (within 1e-2 relative)."""
    _gpu_or_interpreter()
    n, k = shape
    g = torch.Generator().manual_seed(6)
    wq, ws = quantize_weight(torch.randn(n, k, generator=g) / k**0.5)
    x = (torch.randn(1, k, generator=g) * torch.logspace(-4, 4, k, base=2.0)).to(DEV, torch.bfloat16)
    wq, ws = wq.to(DEV), scales_to_fp32(ws).to(DEV)
    want = fp8_linear(x, wq, ws).float()
    got = fp8_gemv(x, wq, ws)
    assert got.dtype == torch.bfloat16 and got.shape == (1, n)
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err <= 1e-2, f"relative error {err:.3g}"


def test_gemv_reference_for_several_rows() -> None:
    """More than one row (or no Triton) is the reference: the GEMM's function."""
    g = torch.Generator().manual_seed(7)
    wq, ws = quantize_weight(torch.randn(130, 260, generator=g))
    x = torch.randn(3, 260, generator=g)
    assert torch.equal(fp8_gemv(x, wq, scales_to_fp32(ws)), fp8_linear(x, wq, scales_to_fp32(ws)))


@pytest.mark.slow  # the Triton interpreter: minutes on a 2-core box; the GPU suite runs these kernels natively
def test_fp8_gemv_under_interpreter() -> None:
    """The GPU tests above on CPU through Triton's interpreter (a child pytest)."""
    run_gpu_tests_interpreted(__file__)

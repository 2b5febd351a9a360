"""The block-scaled FP8 GEMM (``kernels.fp8_gemm``) against its PyTorch reference.

GPU: ``pytest -m gpu tests/kernels/test_fp8_gemm.py``; on CPU the same tests run under Triton's
interpreter at small sizes (``test_fp8_gemm_under_interpreter``). The exactness tests use inputs
whose every product and partial sum is exact in fp32 (small integers times powers of two), so the
kernel's dequantised math must equal the fp32 reference bit for bit, scale extremes included.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreted import INTERPRETED, ON_GPU, run_gpu_tests_interpreted
from kernels.fp8_gemm import (
    BLOCK,
    FP8,
    Fp8GemmConfig,
    dequantize_weight,
    fp8_linear,
    fp8_linear_reference,
    quantize_act,
    quantize_act_reference,
    quantize_weight,
    scales_to_fp32,
    ue8m0_scale,
)

DEV = "cuda" if ON_GPU else "cpu"
SMALL = not ON_GPU
# both tilings (and both activation paths) at every size: the streaming one with split K, the tile one
CONFIGS = {
    "default": Fp8GemmConfig(),
    "fused": Fp8GemmConfig(fuse_quant_max_m=1 << 30),
    "tile-only": Fp8GemmConfig(small_m=0),
    "no-fold": Fp8GemmConfig(fold_scales=False),
}
SHAPES = [(1, 200, 300), (5, 256, 256), (70, 136, 260)] if SMALL else [
    (1, 1024, 4096), (64, 2048, 4096), (300, 4096, 2048), (37, 1000, 1000), (1, 32768, 1024)
]


def _gpu_or_interpreter() -> None:
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (see test_fp8_gemm_under_interpreter)")


# ---- CPU: the references' own invariants -----------------------------------------------------------
def test_ue8m0_scale_is_the_smallest_fitting_power_of_two() -> None:
    g = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.rand(10000, generator=g).mul(60).sub(30).exp2(), 448 * torch.tensor([1.0, 2.0, 0.5, 2.0**-20])])
    s = ue8m0_scale(amax)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5), "not a power of two"
    assert torch.all(448 * s >= amax) and torch.all(448 * s / 2 < amax)


def test_quantize_weight_round_trip_and_edges() -> None:
    """N, K not multiples of 128 (the grid rounds up), an all-zero block, e8m0 scales."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 300, generator=g) * 0.02
    w[128:, :128] = 0.0
    q, s = quantize_weight(w)
    assert q.dtype == FP8 and s.dtype == torch.float8_e8m0fnu and tuple(s.shape) == (2, 3)
    deq = dequantize_weight(q, s)
    assert torch.all(deq[128:, :128] == 0)
    assert ((deq - w).norm() / w.norm()).item() < 0.05  # e4m3 has 3 mantissa bits
    assert torch.equal(scales_to_fp32(s.view(torch.uint8)), scales_to_fp32(s))


# ---- kernel vs reference (GPU, or the interpreter) -------------------------------------------------
def _exact_case(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer activations in [-2, 2] (each 128-group holds a ±2, so its scale is 2^-7 and the
    quantisation is lossless; one group all zero), integer e4m3 weights in [-3, 3] with block
    exponents from -126 to +100 across N blocks (±2 across K blocks) and one all-zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (m, k), generator=g).float()
    x[:, ::BLOCK] = 2.0
    if k > BLOCK:
        x[:, BLOCK : 2 * BLOCK] = 0.0
    q = torch.randint(-3, 4, (n, k), generator=g).float()
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    exps = torch.linspace(-120, 100, nb).round()[:, None] + torch.randint(-2, 3, (nb, kb), generator=g)
    exps[0, 0] = -126.0
    q[:BLOCK, -BLOCK:] = 0.0
    scale = torch.ldexp(torch.ones(nb, kb), exps.to(torch.int32))
    return x, q.to(FP8), scale


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantised_math_is_exact(shape, config) -> None:
    """fp32 out: the kernel's scales, masks and K-block sums equal the fp32 reference exactly."""
    _gpu_or_interpreter()
    m, n, k = shape
    x, wq, ws = _exact_case(m, n, k, seed=m + n + k)
    want = x @ dequantize_weight(wq, ws).t()  # fp32 on the CPU: exact for these inputs
    assert torch.isfinite(want).all() and want.abs().max() > 2.0**90  # the large exponents are there
    got = fp8_linear(x.to(DEV), wq.to(DEV), ws.to(DEV), CONFIGS[config], out_dtype=torch.float32)
    assert torch.equal(got.cpu(), want), f"max abs diff {(got.cpu() - want).abs().max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_quantize_act_bitwise(shape) -> None:
    _gpu_or_interpreter()
    m, _, k = shape
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 6, k, base=2.0)  # groups of many magnitudes
    x[:, :BLOCK] = 0.0
    x = x.to(DEV, torch.bfloat16)
    q, s = quantize_act(x)
    q_ref, s_ref = quantize_act_reference(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(CONFIGS) if not SMALL else ["default", "tile-only"])
@pytest.mark.parametrize("shape", SHAPES)
def test_random_bf16_against_reference(shape, config) -> None:
    """Gaussian bf16 activations and weights: bf16 out within 1e-2 of the reference (the quantised
    activations are the same on both sides; what is left is fp32 summation order and the cast)."""
    _gpu_or_interpreter()
    m, n, k = shape
    g = torch.Generator().manual_seed(4)
    wq, ws = quantize_weight(torch.randn(n, k, generator=g) / k**0.5)
    x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
    wq, ws = wq.to(DEV), scales_to_fp32(ws).to(DEV)
    want = fp8_linear_reference(x, wq, ws).float()
    if ON_GPU:
        torch.full((1 << 24,), float("nan"), device=DEV)  # poison: unwritten outputs would show
    got = fp8_linear(x, wq, ws, CONFIGS[config])
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err <= 1e-2, f"relative error {err:.3g}"


@pytest.mark.slow  # the Triton interpreter: minutes on a 2-core box; the GPU suite runs these kernels natively
def test_fp8_gemm_under_interpreter() -> None:
    """The GPU tests above on CPU through Triton's interpreter (a child pytest: the interpreter is
    chosen when Triton kernels are defined)."""
    run_gpu_tests_interpreted(__file__)

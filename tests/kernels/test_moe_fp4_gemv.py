"""The FP4 experts' GEMV form (``kernels.moe_fp4_gemv``, decode batch 1-2) against the dequantised
reference and the grouped FP4 kernel.

GPU: ``pytest -m gpu tests/kernels/test_moe_fp4_gemv.py``; on CPU under Triton's interpreter
(``test_moe_fp4_gemv_under_interpreter``). Every dequantised FP4 weight is exact in bf16, so fp32
matches the reference to summation order; bf16 rounds the products as the grouped path does
(within 1e-2 relative of the fp32 reference).
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels.moe import moe_experts_reference
from kernels.moe_fp4 import dequantize_fp4
from kernels.moe_fp4_gemv import moe_fp4_gemv
from kernels.moe_gemv import MoEGemvTuning
from tests.kernels.interpreted import INTERPRETED, ON_GPU, run_gpu_tests_interpreted
from tests.kernels.test_moe_fp4 import _fp4

DEV = "cuda" if ON_GPU else "cpu"
E, H, I = (8, 128, 128) if not ON_GPU else (256, 4096, 2048)  # V4-Flash's experts on the GPU


@functools.lru_cache(maxsize=1)  # the dtype variants of a case share it (2 × 2 GB of codes at the GPU sizes)
def _case(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    gq, gs = _fp4(E, 2 * I, H, g)
    dq, ds = _fp4(E, H, I, g)
    x = torch.randn(n, H, generator=g) * 4
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    return x, weights, indices, (gq, gs, dq, ds)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(1, 6), (2, 6), (1, 1)])
def test_fp4_gemv_matches_reference(n, k, dtype) -> None:
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    x, weights, indices, (gq, gs, dq, ds) = _case(n, k, seed=n * 7 + k)
    limit = 10.0
    # the reference over the picked experts only: dequantising all 256 at the GPU sizes takes ~50 GB
    # of host memory and minutes (what killed parallel GPU test workers)
    used, picks = indices.unique(return_inverse=True)
    want = moe_experts_reference(x, weights, picks, dequantize_fp4(gq[used], gs[used]), dequantize_fp4(dq[used], ds[used]), limit)
    dev = [t.to(DEV) for t in (gq, gs, dq, ds)]
    tuning = MoEGemvTuning(up=(32, 128, 4), down=(32, 128, 4)) if not ON_GPU else MoEGemvTuning()  # few programs in the interpreter
    got = moe_fp4_gemv(x.to(DEV, dtype), weights.to(DEV), indices.to(DEV), *dev, limit, tuning=tuning).float().cpu()
    err = ((got - want).norm() / want.norm()).item()
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.slow  # the Triton interpreter: minutes on a 2-core box; the GPU suite runs these kernels natively
def test_moe_fp4_gemv_under_interpreter() -> None:
    run_gpu_tests_interpreted(__file__)

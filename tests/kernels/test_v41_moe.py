"""V4.1's in-order expert combine (``kernels.v41_moe``) against its reference, and the reference
against ``MoE.forward``'s own sum.

GPU: ``pytest -m gpu tests/kernels/test_v41_moe.py``; on CPU the GPU tests run under Triton's
interpreter (``test_v41_moe_under_interpreter``, slow)."""

from __future__ import annotations

import pytest
import torch

from kernels.v41_moe import combine_in_order, combine_in_order_reference
from tests.kernels.interpreted import INTERPRETED, ON_GPU, run_gpu_tests_interpreted

DEVICE = "cuda" if ON_GPU else "cpu"


def _inputs(n: int, k: int, h: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(n * k + h)
    y = (torch.randn(n * k, h, generator=g) * torch.logspace(-6, 6, n * k, base=2.0)[:, None]).to(dtype)
    row_of_slot = torch.randperm(n * k, generator=g)
    add = torch.randn(n, h, generator=g).to(dtype)
    return y.to(device), row_of_slot.to(device), add.to(device)


def test_reference_sums_as_the_general_path() -> None:
    """``MoE.forward``: ``y = 0; y[tok] += expert out`` in ascending expert order, then ``+= shared``."""
    y, rows, add = _inputs(7, 3, 40, torch.float32)
    want = torch.zeros(7, 40)
    for j in range(3):
        want[torch.arange(7)] += y[rows.view(7, 3)[:, j]]
    want += add
    assert torch.equal(combine_in_order_reference(y, rows, 3, add), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32])
def test_kernel_is_the_reference_bit_for_bit(dtype: torch.dtype) -> None:
    """fp32 adds in one fixed order: the same bits (bf16: the one final cast, CUDA only; the
    interpreter's bf16 casts truncate)."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    y, rows, add = _inputs(5 if INTERPRETED else 300, 6, 1100, dtype, DEVICE)
    assert torch.equal(combine_in_order(y, rows, 6, add), combine_in_order_reference(y, rows, 6, add))


@pytest.mark.slow
def test_v41_moe_under_interpreter() -> None:
    run_gpu_tests_interpreted(__file__)

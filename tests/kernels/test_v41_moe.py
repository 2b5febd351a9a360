"""V4.1's expert glue (``kernels.v41_moe``: weighted SwiGLU, in-order combine) against its
references, and the references against ``Expert.forward`` / ``MoE.forward``'s own ops.

GPU: ``pytest -m gpu tests/kernels/test_v41_moe.py``; on CPU the GPU tests run under Triton's
interpreter (``test_v41_moe_under_interpreter``, slow)."""

from __future__ import annotations

import pytest
import torch

from engine.model.v41.config import V41Config
from engine.model.v41.layers import Expert
from kernels.v41_moe import combine_in_order, combine_in_order_reference, weighted_swiglu, weighted_swiglu_reference
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


@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu_reference_is_the_expert(limit: float) -> None:
    """``Expert.forward`` of rows with their weights = ``w2(weighted_swiglu_reference(w1|w3 rows))``."""
    cfg = V41Config(hidden_size=64, moe_intermediate_size=32, swiglu_limit=limit, num_hidden_layers=4, compress_ratios=(0, 2, 2, 2),
                    kv_source_layer_ids=(1,), index_source_layer_ids=(1, 3), candidate_source_layer_id=1)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    ex = Expert(cfg, torch.float32)
    for p in ex.parameters():
        p.data = torch.randn(p.shape, generator=g) * 2
    x, w = torch.randn(9, 64, generator=g), torch.rand(9, generator=g)
    h = torch.cat([ex.w1(x), ex.w3(x)], dim=-1)
    assert torch.equal(ex.w2(weighted_swiglu_reference(h, w, limit)), ex(x, w[:, None]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32])
def test_swiglu_kernel_matches_the_reference(dtype: torch.dtype) -> None:
    """On CUDA (``expf`` and IEEE division as PyTorch's silu) the same bits at nearly every element
    and fp32 noise elsewhere; under the interpreter (numpy's exp) fp32 noise."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(3)
    h = (torch.randn(7 if INTERPRETED else 500, 2 * 2304, generator=g) * 6).to(dtype).to(DEVICE)
    w = torch.rand(h.shape[0], generator=g).to(DEVICE)
    for limit in (10.0, 0.0):
        got, want = weighted_swiglu(h, w, limit).float(), weighted_swiglu_reference(h, w, limit).float()
        torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-7)
        if ON_GPU:
            assert (got == want).float().mean().item() >= 0.999, (dtype, limit)


@pytest.mark.slow
def test_v41_moe_under_interpreter() -> None:
    run_gpu_tests_interpreted(__file__)

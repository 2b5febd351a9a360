"""V4.1's mHC collapse+norm and expand kernels (``kernels.v41_mhc``) against their references,
and the references against the general path's own ops.

GPU: ``pytest -m gpu tests/kernels/test_v41_mhc.py``; on CPU the GPU tests run under Triton's
interpreter (``test_v41_mhc_under_interpreter``, slow)."""

from __future__ import annotations

import pytest
import torch

from engine.model.v41.layers import RMSNorm, collapse, expand
from kernels import v41_mhc
from tests.kernels.interpreted import INTERPRETED, ON_GPU, run_gpu_tests_interpreted

DEVICE = "cuda" if ON_GPU else "cpu"
KERNEL_DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]  # the interpreter's bf16 casts truncate


def _inputs(n: int, hc: int, h: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(n + h)
    streams = torch.randn(n, hc, h, generator=g).to(dtype)
    x = torch.randn(n, h, generator=g).to(dtype)
    pre, post = torch.rand(n, hc, generator=g), torch.rand(n, hc, generator=g) * 2
    comb = torch.rand(n, hc, hc, generator=g).softmax(-1)
    weight = torch.rand(h, generator=g) + 0.5
    return [t.to(device) for t in (streams, x, pre, post, comb, weight)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_are_the_general_path(dtype: torch.dtype) -> None:
    streams, x, pre, post, comb, weight = _inputs(5, 4, 96, dtype)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = weight
    assert torch.equal(v41_mhc.collapse_norm_reference(pre, streams, weight, 1e-6), norm(collapse(pre, streams)))
    assert torch.equal(v41_mhc.expand_reference(x, streams, post, comb), expand(x, streams, post, comb))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("h", [96, 5120])
def test_kernels_match_the_references(dtype: torch.dtype, h: int) -> None:
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    streams, x, pre, post, comb, weight = _inputs(3 if INTERPRETED else 300, 4, h, dtype, DEVICE)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: a last-bit difference of the fp32 sums moves a rounding
    got = v41_mhc.collapse_norm(pre, streams, weight, 1e-6).float()
    want = v41_mhc.collapse_norm_reference(pre, streams, weight, 1e-6).float()
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    got = v41_mhc.expand(x, streams, post, comb).float()
    want = v41_mhc.expand_reference(x, streams, post, comb).float()
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    if dtype == torch.bfloat16:  # nearly every element the same bits
        assert (got == want).float().mean().item() > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("n,h,max_splits", [(1, 96, 64), (3, 100, 8), (1, 5120, 64), (40, 5120, 64)])
def test_mix_collapse_norm_is_the_separate_kernels(dtype: torch.dtype, n: int, h: int, max_splits: int) -> None:
    """``mix_collapse_norm`` = ``hc_mix_parts`` and ``collapse_norm``: the collapse bit for bit,
    the gates too under the interpreter (on the GPU their sums may take another reduction tree:
    there within 1e-6); one token with the dot split 64 ways (the gates' presum), a width no tile
    divides, a batch."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    if INTERPRETED and (h > 1000) != (n == 1):
        pytest.skip("the interpreter: the wide case at one token only")
    from kernels.fused import hc_pre_parts
    from kernels.mhc import hc_mix_parts

    hc, iters = 4, 20
    streams, x, pre, post, comb, weight = _inputs(n, hc, h, dtype, DEVICE)
    g = torch.Generator().manual_seed(7)
    fn = (torch.randn((2 + hc) * hc, hc * h, generator=g) * (hc * h) ** -0.5).to(DEVICE)
    scale, base = torch.rand(3, generator=g).to(DEVICE), torch.randn((2 + hc) * hc, generator=g).to(DEVICE) * 0.1
    parts = hc_pre_parts(streams, fn, max_splits=max_splits)
    site = (hc * h, 1e-6, scale, base, hc, iters, 1e-6)
    *gates, y = v41_mhc.mix_collapse_norm(parts, *site, pre, streams, weight, 1e-6)
    for got, want in zip(gates, hc_mix_parts(parts, *site)):
        assert torch.equal(got, want) if INTERPRETED else torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(y, v41_mhc.collapse_norm(pre, streams, weight, 1e-6))


@pytest.mark.slow
def test_v41_mhc_under_interpreter() -> None:
    run_gpu_tests_interpreted(__file__)

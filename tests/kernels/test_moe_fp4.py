"""FP4 (e2m1, e8m0 per 32) routed experts (``kernels.moe_fp4``) against the dequantised reference.

GPU: ``pytest -m gpu tests/kernels/test_moe_fp4.py``; on CPU the same tests run under Triton's
interpreter (``test_moe_fp4_under_interpreter``). Every dequantised FP4 weight is exact in bf16,
so in fp32 the kernel must match the reference up to summation order.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.loader import dequantize
from tests.kernels.interpreted import INTERPRETED, ON_GPU, run_gpu_tests_interpreted
from kernels.moe import moe_experts_reference
from kernels.moe_fp4 import Fp4GroupedTiles, Fp4PrefillTuning, dequantize_fp4, dequantize_fp4_kernel, fp4_grouped_linear, moe_experts_fp4

DEV = "cuda" if ON_GPU else "cpu"
SMALL = not ON_GPU
IN_REGISTERS = Fp4PrefillTuning(min_rows_per_expert=10**9, fp8=False)  # this module's kernels at any size


def _fp4(e: int, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed codes (every byte value) and e8m0 scales 2^-9..2^-5, one code-0 (2^-127) group."""
    q = torch.randint(-128, 128, (e, n, k // 2), generator=g, dtype=torch.int16).to(torch.int8)
    s = torch.randint(127 - 9, 127 - 4, (e, n, k // 32), generator=g).to(torch.uint8)
    s[0, 0, 0] = 0
    return q, s.view(torch.float8_e8m0fnu)


def _needs_kernel() -> None:
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (see test_moe_fp4_under_interpreter)")


def test_dequantize_matches_the_loader() -> None:
    """Two independent decoders of the release's FP4 layout agree bit for bit."""
    q, s = _fp4(2, 64, 256, torch.Generator().manual_seed(0))
    for e in range(2):
        assert torch.equal(dequantize_fp4(q[e], s[e]), dequantize(q[e], s[e]))
    assert torch.equal(dequantize_fp4(q, s.view(torch.uint8)), dequantize_fp4(q, s))


@pytest.mark.gpu
def test_kernel_decoder_is_bit_exact() -> None:
    """The tile kernel's in-register decoder gives ``dequantize_fp4``'s fp32 values bit for bit: every
    byte (both nibbles, ±0 included) under every e8m0 scale code but NaN's (0: 2^-127, up to 254)."""
    _needs_kernel()
    n, k = 128, 256 * 4
    q = torch.arange(256, dtype=torch.int32).repeat(n, k // 2 // 256).to(torch.uint8).view(torch.int8)  # (n, k/2): each byte 2x per row
    s = torch.arange(n * k // 32, dtype=torch.int32).remainder(255).to(torch.uint8).view(n, k // 32)  # codes 0..254
    out = dequantize_fp4_kernel(q[None].to(DEV), s[None].to(DEV), torch.float32)[0]  # the tile kernel's decoder, _fp4_tile
    want = dequantize_fp4(q, s)
    assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32))
    normal = s.repeat_interleave(32, dim=-1) >= 2  # bf16 values from 2^-126 (the interpreter flushes subnormal conversions)
    bf16 = dequantize_fp4_kernel(q[None].to(DEV), s[None].to(DEV))[0].cpu()
    assert torch.equal(bf16[normal], want.bfloat16()[normal])  # exact in bf16 too


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_words_kernel_decodes_every_code_exactly(dtype) -> None:
    """The words kernel's own decoders (32-bit words; fp32: subnormal fp32 bits scaled by 2^126,
    bf16 on the GPU: two codes an instruction in inline PTX) and its reordered inputs: one-hot rows,
    16 a row tile, read the dequantised weights back bit for bit, every byte (both nibbles, ±0)
    under the e8m0 codes 2-252 (normal bf16 values, no fp32 overflow), for each K tile it takes."""
    _needs_kernel()
    n, k = 128, 512
    q = torch.arange(256, dtype=torch.int32).repeat(n, k // 2 // 256).to(torch.uint8).view(torch.int8)
    q = torch.stack([row.roll(r) for r, row in enumerate(q)])  # row r shifted by r: every byte at every place of a word
    s = (torch.arange(n * k // 32, dtype=torch.int32) % 251 + 2).to(torch.uint8).view(n, k // 32)
    want = dequantize_fp4(q, s).t().contiguous()  # (k, n): row r = input r's weights
    eye = torch.eye(k, dtype=dtype, device=DEV)
    for bk in (128, 256):
        offs = torch.tensor([k], dtype=torch.int32, device=DEV)
        got = fp4_grouped_linear(eye, q[None].to(DEV), s[None].to(DEV), offs, block_m=16, prefill=IN_REGISTERS, tiles=Fp4GroupedTiles(bk=bk))
        assert torch.equal(got.cpu(), want.to(dtype)), bk


@pytest.mark.gpu
def test_prefill_sizes_through_the_bf16_scratch() -> None:
    """At prefill sizes (``Fp4PrefillTuning``) the experts decoded once into bf16 chunks and
    ``torch._grouped_mm`` give the in-register kernel's product up to summation order, every chunk
    split (several experts per chunk, empty experts and chunks included)."""
    if not ON_GPU:
        pytest.skip("torch._grouped_mm needs CUDA")
    g = torch.Generator().manual_seed(3)
    e, n, k = 12, 512, 1024
    q, s = _fp4(e, n, k, g)
    counts = torch.tensor([0, 130, 7, 0, 0, 0, 300, 1, 64, 0, 256, 2])
    offs = torch.cumsum(counts, 0).to(torch.int32).to(DEV)
    xs = torch.randn(int(counts.sum()), k, generator=g).to(DEV, torch.bfloat16)
    q, s = q.to(DEV), s.to(DEV)
    kernel = fp4_grouped_linear(xs, q, s, offs, prefill=IN_REGISTERS).float()
    for per in (1, 3, e):
        got = fp4_grouped_linear(xs, q, s, offs, prefill=Fp4PrefillTuning(min_rows_per_expert=1, scratch_bytes=per * n * k * 2, fp8=False)).float()
        err = ((got - kernel).norm() / kernel.norm()).item()
        assert err <= 1e-2, (per, err)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 64], ids=["words-kernel", "tiles-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear(dtype, block_m) -> None:
    _needs_kernel()
    g = torch.Generator().manual_seed(1)
    e, n, k = (4, 256, 256) if SMALL else (16, 4096, 2048)
    q, s = _fp4(e, n, k, g)
    counts = torch.tensor([3, 0, 20, 1] if SMALL else [1, 0, 37, 200] * (e // 4))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = torch.randn(int(counts.sum()), k, generator=g)
    want = torch.cat([xs[o - c : o] @ dequantize_fp4(q[i], s[i]).t() for i, (c, o) in enumerate(zip(counts.tolist(), offs.tolist()))])
    got = fp4_grouped_linear(xs.to(DEV, dtype), q.to(DEV), s.to(DEV), offs.to(DEV), block_m=block_m, prefill=IN_REGISTERS).float().cpu()
    err = ((got - want).norm() / want.norm()).item()
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", [1, 13])
def test_moe_experts_fp4(n_tokens) -> None:
    _needs_kernel()
    g = torch.Generator().manual_seed(2)
    e, h, i, k = (8, 256, 128, 3) if SMALL else (32, 4096, 2048, 6)
    dtype = torch.float32 if SMALL else torch.bfloat16
    gq, gs = _fp4(e, 2 * i, h, g)
    dq, ds = _fp4(e, h, i, g)
    x = torch.randn(n_tokens, h, generator=g).to(DEV, dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n_tokens)]).to(DEV)
    w = torch.rand(n_tokens, k, generator=g).to(DEV)
    want = moe_experts_reference(x, w, idx, dequantize_fp4(gq, gs, dtype).to(DEV), dequantize_fp4(dq, ds, dtype).to(DEV), 10.0)
    got = moe_experts_fp4(x, w, idx, gq.to(DEV), gs.to(DEV), dq.to(DEV), ds.to(DEV), 10.0)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.slow  # the Triton interpreter: minutes on a 2-core box; the GPU suite runs these kernels natively
def test_moe_fp4_under_interpreter() -> None:
    """The kernel tests above on CPU through Triton's interpreter (a child pytest)."""
    run_gpu_tests_interpreted(__file__)

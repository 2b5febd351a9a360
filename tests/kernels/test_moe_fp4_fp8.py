"""FP4 experts on FP8 tensor cores (``kernels.moe_fp4_fp8``) against the dequantised reference.

GPU: ``pytest -m gpu tests/kernels/test_moe_fp4_fp8.py``; on CPU the same tests run under Triton's
interpreter (``test_moe_fp4_fp8_under_interpreter``, slow). The inputs' e4m3 values and every
dequantised weight are exact, their products exact in fp32, so against
``fp4_fp8_grouped_linear_reference`` on the same quantised inputs only the fp32 summation order
differs. The kernel's decode folds a block's group scales into its e4m3 codes
(``fp4_to_e4m3_reference``), exact where the group scales lie within 2^14, as in these tests. The
compile test builds the kernel with its inline PTX for sm_90 on any machine.
"""

from __future__ import annotations

import pytest
import torch

from kernels import moe_fp4_fp8
from kernels.fp8_gemm import quantize_act_reference
from kernels.moe_fp4 import dequantize_fp4
from kernels.moe_fp4_fp8 import fp4_fp8_grouped_linear, fp4_fp8_grouped_linear_reference
from tests.kernels.interpreted import INTERPRETED, ON_GPU, run_gpu_tests_interpreted

DEV = "cuda" if ON_GPU else "cpu"


def _fp4(e: int, n: int, k: int, g: torch.Generator, lo: int = 127 - 9, hi: int = 127 - 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed codes (every byte value) and e8m0 scale codes in ``[lo, hi)``."""
    q = torch.randint(-128, 128, (e, n, k // 2), generator=g, dtype=torch.int16).to(torch.int8)
    return q, torch.randint(lo, hi, (e, n, k // 32), generator=g).to(torch.uint8)


def _grouped_case(seed: int, lo: int, hi: int, gpu_counts: list[int]):
    """FP4 experts with scale codes in ``[lo, hi)``, groups of ``gpu_counts`` rows on a GPU (5, 0 and
    40 rows elsewhere), their inputs, the inputs quantised and the reference's fp32 product."""
    g = torch.Generator().manual_seed(seed)
    e, n, k = (6, 512, 1024) if ON_GPU else (3, 128, 256)
    q, s = _fp4(e, n, k, g, lo=lo, hi=hi)
    counts = torch.tensor(gpu_counts if ON_GPU else [5, 0, 40])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(int(counts.sum()), k, generator=g) * 4
    xq, xs = quantize_act_reference(x)
    return q, s, offs, x, xq, xs, fp4_fp8_grouped_linear_reference(xq, xs, q, s, offs, torch.float32)


ACCUMULATION = 2**-10  # Hopper's FP8 tensor cores keep ~14 bits a step, ~8 steps a 128-input product


def _within_accumulation(got: torch.Tensor, want: torch.Tensor, xq, xs, q, s, offs, rounding: float = 0.0) -> bool:
    """``got`` equals ``want`` up to the FP8 tensor cores' accumulation: each output within
    ``ACCUMULATION`` of the sum of its products' magnitudes (the classic bound of a rounded sum; a
    wrong scale, row or code is off by about the output itself, ~2^-5 of that sum at these K), plus
    ``rounding`` of the output (a cast)."""
    mag = fp4_fp8_grouped_linear_reference(xq.float().abs().to(xq.dtype), xs, q & 0x77, s, offs, torch.float32)  # |codes|: signs cleared
    return bool(((got.float().cpu() - want).abs() <= ACCUMULATION * mag + rounding * want.abs()).all())


def _needs_kernel() -> None:
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (see test_moe_fp4_fp8_under_interpreter)")


def test_reference_is_the_dequantised_product() -> None:
    """The reference (e4m3 inputs times their scales, FP4 weights dequantised) against a plain
    fp32 product of the dequantised inputs: the same values, so equal up to summation order."""
    g = torch.Generator().manual_seed(0)
    q, s = _fp4(2, 64, 256, g)
    x = torch.randn(9, 256, generator=g)
    xq, xs = quantize_act_reference(x)
    xd = (xq.float().view(9, 2, 128) * xs[:, :, None]).view(9, 256)
    offs = torch.tensor([4, 9], dtype=torch.int32)
    got = fp4_fp8_grouped_linear_reference(xq, xs, q, s, offs, torch.float32)
    want = torch.cat([xd[:4] @ dequantize_fp4(q[0], s[0]).t(), xd[4:] @ dequantize_fp4(q[1], s[1]).t()])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert ((xd - x).norm() / x.norm()).item() < 0.05  # the e4m3 rounding of the inputs, DeepSeek's own


def test_e4m3_fold_is_exact_within_2_14() -> None:
    """``fp4_to_e4m3_reference``: each block's codes in units of its largest group scale; where the
    four scales lie within 2^14 of each other the e4m3 weights times their block scale are the
    dequantised FP4 weights exactly; a block spread wider loses only its smallest groups' values."""
    g = torch.Generator().manual_seed(3)
    q, s = _fp4(2, 64, 512, g, lo=127 - 20, hi=127 + 5)
    s.view(2, 64, 4, 4)[..., 1:] = s.view(2, 64, 4, 4)[..., :1]  # most blocks: one scale
    s.view(2, 64, 4, 4)[:, :, 1, 3] = s.view(2, 64, 4, 4)[:, :, 1, 0] - 14  # a spread of exactly 2^14
    s.view(2, 64, 4, 4)[:, :, 2, 2] = s.view(2, 64, 4, 4)[:, :, 2, 0] + 9  # the largest group elsewhere than first
    w8, sw = moe_fp4_fp8.fp4_to_e4m3_reference(q, s)
    assert w8.dtype == torch.float8_e4m3fn and sw.shape == (2, 64, 4)
    back = (w8.float().view(2, 64, 4, 128) * sw[..., None]).view(2, 64, 512)
    assert torch.equal(back, dequantize_fp4(q, s))
    s.view(2, 64, 4, 4)[:, :, 3, 1] = s.view(2, 64, 4, 4)[:, :, 3, 0] - 20  # a spread of 2^20: that group rounds
    w8, sw = moe_fp4_fp8.fp4_to_e4m3_reference(q, s)
    back = (w8.float().view(2, 64, 4, 128) * sw[..., None]).view(2, 64, 512)
    want = dequantize_fp4(q, s)
    wide = torch.zeros(2, 64, 4, 128, dtype=torch.bool)
    wide[:, :, 3, 32:64] = True
    assert torch.equal(back[~wide.view(2, 64, 512)], want[~wide.view(2, 64, 512)])
    assert (back - want).abs().max() <= want.view(2, 64, 4, 128)[:, :, 3, :32].abs().max() * 2**-14


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [None, (16, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)], ids=["default", "bm16", "bm64", "bm128", "bn128"])
def test_kernel_matches_the_reference(tiles) -> None:
    """Groups of 0, 1, a row tile and several row tiles; scale codes 2^-12..2^1 (within 2^14 a
    block): the kernel's product of the quantised inputs equals the reference's up to the FP8
    tensor cores' accumulation (``_within_accumulation``: run 85 saw 4.6e-4 of the largest output
    from the same K = 128 e4m3 products in the removed scratch GEMM; the interpreter's fp32 math
    ~1e-7), in fp32 and in bf16."""
    _needs_kernel()
    q, s, offs, x, xq, xs, want = _grouped_case(6, 127 - 12, 127 + 2, [1, 0, 128, 300, 17, 0])
    got = fp4_fp8_grouped_linear(x.to(DEV), q.to(DEV), s.to(DEV), offs.to(DEV), tiles=tiles)
    assert got.shape == want.shape and _within_accumulation(got, want, xq, xs, q, s, offs)
    bf16 = fp4_fp8_grouped_linear(x.to(DEV, torch.bfloat16), q.to(DEV), s.to(DEV), offs.to(DEV), tiles=tiles).float().cpu()
    xq16, xs16 = quantize_act_reference(x.bfloat16())
    want16 = fp4_fp8_grouped_linear_reference(xq16, xs16, q, s, offs, torch.float32)
    assert _within_accumulation(bf16, want16, xq16, xs16, q, s, offs, rounding=2**-7)  # one bf16 rounding (the interpreter truncates)


@pytest.mark.gpu
def test_kernel_decodes_every_code_exactly() -> None:
    """One-hot rows read the decoded weights back: every byte (both nibbles, ±0) under scale codes
    with each spread inside 2^14, the ``SCALE_MIN`` clamp and the largest group anywhere in its
    block, gives exactly the dequantised weight (the one product is exact, nothing else adds)."""
    _needs_kernel()
    n, k = 128, 512
    q = torch.arange(256, dtype=torch.int32).repeat(n, k // 2 // 256).to(torch.uint8).view(torch.int8)
    q = torch.stack([row.roll(r) for r, row in enumerate(q)])  # row r shifted by r: every byte at every place
    g = torch.Generator().manual_seed(7)
    s = torch.randint(127 - 20, 127 + 8, (n, k // 32), generator=g).to(torch.uint8)
    blocks = s.view(n, k // 128, 4)
    blocks[:] = torch.maximum(blocks, blocks.amax(-1, keepdim=True) - 14)  # every block's spread within 2^14
    blocks[:4] = 2  # blocks below SCALE_MIN
    x = torch.eye(k)
    got = fp4_fp8_grouped_linear(x.to(DEV), q[None].to(DEV), s[None].to(DEV), torch.tensor([k], dtype=torch.int32, device=DEV))
    assert torch.equal(got.cpu(), dequantize_fp4(q, s).t())


def test_the_kernel_builds_for_sm90() -> None:
    """With its inline-PTX decode the kernel keeps the decoded weights in registers as the wgmma's
    first operand (``m64nBMk32`` e4m3 products whose A is a register list, not a shared-memory
    descriptor)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*u8", "start_ptr": "*i32", "end_ptr": "*i32", "pstart_ptr": "*i32",
        "out_ptr": "*bf16", **dict.fromkeys(["E", "M", "N", "K"], "i32"), **dict.fromkeys(["BM", "BN", "LOG_E", "S_MIN", "ASM", "PRECISION"], "constexpr"),
    }  # fmt: skip
    assert list(signature) == moe_fp4_fp8._fp4_fp8_kernel.arg_names
    aligned = {(i,): [["tt.divisibility", 16]] for i in (*range(8), 10, 11)}
    bm, bn, warps, stages = moe_fp4_fp8.fp8_tiles(192)  # the 8K prefill's tiles: 128 rows x 64 weight rows
    consts = {"BM": bm, "BN": bn, "LOG_E": 9, "S_MIN": moe_fp4_fp8.SCALE_MIN, "ASM": True, "PRECISION": "tf32"}
    kernel = triton.compile(ASTSource(moe_fp4_fp8._fp4_fp8_kernel, signature=signature, attrs=aligned, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    ptx = kernel.asm["ptx"]
    products = [line.split("}, ", 1)[1] for line in ptx.splitlines() if "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in line]
    assert len(products) == 4 and all(p.startswith("{%r") for p in products)  # K = 128 a block; A: four registers, not a descriptor
    assert "0x08080808" in ptx  # the inline-PTX decode


@pytest.mark.slow  # the Triton interpreter: minutes on a 2-core box; the GPU suite runs these kernels natively
def test_moe_fp4_fp8_under_interpreter() -> None:
    """The kernel tests above on CPU through Triton's interpreter (a child pytest)."""
    run_gpu_tests_interpreted(__file__)

"""FP4 experts on FP8 tensor cores (``kernels.moe_fp4_fp8``) against the dequantised reference.

GPU: ``pytest -m gpu tests/kernels/test_moe_fp4_fp8.py``; on CPU the same tests run under Triton's
interpreter (``test_moe_fp4_fp8_under_interpreter``, slow). The inputs' e4m3 values and every
dequantised weight are exact, their products exact in fp32, so against
``fp4_fp8_grouped_linear_reference`` on the same quantised inputs only the fp32 summation order
differs. The compile tests build the kernels with their inline PTX for sm_90 on any machine.
The e4m3 scratch (``fp4_to_e4m3``) is exact where a block's group scales lie within 2^14, so its
GEMM (``fp8_grouped_mm``) is held to the same reference and bound.
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


@pytest.mark.gpu
@pytest.mark.parametrize("chain", [True, False], ids=["chained", "per-group"])
@pytest.mark.parametrize("tiles", [(16, 128, 4, 3), (64, 128, 4, 3)], ids=["bm16", "bm64"])
def test_grouped_linear_matches_the_reference(chain, tiles) -> None:
    """Groups of 0, 1, a row tile and several row tiles; scale codes spread over 2^-20..2^4
    (groups of one 128-input step at different scales): the kernel's product of the quantised
    inputs equals the reference's up to the accumulation's rounding. Hopper's FP8 tensor cores
    add into their accumulator at reduced precision (DeepSeek-V3's report: about 14 bits, hence
    its promotion into fp32 registers, here every 32 inputs): up to 3.3e-4 of the largest output
    on an H100 for 64-row tiles (run 85), so each output is held to ``_within_accumulation``; the
    interpreter's fp32 math gives ~1e-7."""
    _needs_kernel()
    q, s, offs, x, xq, xs, want = _grouped_case(1, 127 - 20, 127 + 5, [1, 0, 64, 200, 17, 0])
    bm, bn, warps, stages = tiles
    got = fp4_fp8_grouped_linear(x.to(DEV), q.to(DEV), s.to(DEV), offs.to(DEV), block_m=bm, block_n=bn, warps=warps, stages=stages, chain=chain)
    assert _within_accumulation(got, want, xq, xs, q, s, offs)
    bf16 = fp4_fp8_grouped_linear(x.to(DEV, torch.bfloat16), q.to(DEV), s.to(DEV), offs.to(DEV), block_m=bm, chain=chain).float().cpu()
    xq16, xs16 = quantize_act_reference(x.bfloat16())
    want16 = fp4_fp8_grouped_linear_reference(xq16, xs16, q, s, offs, torch.float32)
    assert _within_accumulation(bf16, want16, xq16, xs16, q, s, offs, rounding=2**-7)  # one bf16 rounding (the interpreter truncates)


def test_e4m3_scratch_reference_is_exact_within_2_14() -> None:
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
@pytest.mark.parametrize("rows, k_blocks", [(64, 1), (128, 2), (32, 2)])
def test_e4m3_scratch_kernel_is_the_reference_bytes(rows, k_blocks) -> None:
    """``fp4_to_e4m3`` (inline-PTX decode, fp32 rescale, e4m3 store) gives the reference's bytes and
    scales where they are exact (a block's scales within 2^14; past that the e4m3 rounding of the
    interpreter and of torch differ), the ``SCALE_MIN`` clamp included, for any program shape."""
    _needs_kernel()
    g = torch.Generator().manual_seed(4)
    q, s = _fp4(3, 128, 256, g, lo=127 - 12, hi=127 + 2)
    s[0, :4, :4] = 2  # a block of scales below SCALE_MIN
    w8, sw = moe_fp4_fp8.fp4_to_e4m3(q.to(DEV), s.to(DEV), rows=rows, k_blocks=k_blocks)
    want_w8, want_sw = moe_fp4_fp8.fp4_to_e4m3_reference(q, s)
    assert torch.equal(w8.cpu().view(torch.uint8), want_w8.view(torch.uint8)) and torch.equal(sw.cpu(), want_sw)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(16, 128, 4, 2), (128, 128, 8, 3)], ids=["bm16", "bm128"])
def test_scratch_path_matches_the_reference(tiles) -> None:
    """The e4m3 scratch and ``fp8_grouped_mm`` against ``fp4_fp8_grouped_linear_reference`` (groups of
    0, 1, a row tile and several; scales within 2^14 a block, so the scratch is exact): only the
    accumulation's rounding differs (``_within_accumulation``: 4.6e-4 of the largest output on an H100, run 85);
    ``fp4_fp8_scratch_linear`` with a scratch of one expert at a time gives the same bits as one
    of all of them."""
    _needs_kernel()
    q, s, offs, x, xq, xs, want = _grouped_case(5, 127 - 12, 127 + 2, [1, 0, 128, 300, 17, 0])
    n, k = q.shape[1], x.shape[1]
    w8, sw = moe_fp4_fp8.fp4_to_e4m3(q.to(DEV), s.to(DEV))
    bm, bn, warps, stages = tiles
    out = torch.empty(x.shape[0], n, device=DEV)
    got = moe_fp4_fp8.fp8_grouped_mm(xq.to(DEV), xs.to(DEV), w8, sw, offs.to(DEV), out, block_m=bm, block_n=bn, warps=warps, stages=stages)
    assert _within_accumulation(got, want, xq, xs, q, s, offs)
    whole = moe_fp4_fp8.fp4_fp8_scratch_linear(x.to(DEV), q.to(DEV), s.to(DEV), offs.to(DEV))
    one_by_one = moe_fp4_fp8.fp4_fp8_scratch_linear(x.to(DEV), q.to(DEV), s.to(DEV), offs.to(DEV), scratch_bytes=n * k)
    assert torch.equal(whole, one_by_one) and _within_accumulation(whole, want, xq, xs, q, s, offs)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(16, 64, 4, 2), (64, 128, 4, 3), (128, 128, 8, 3)], ids=["bm16", "bm64", "bm128"])
def test_swapped_kernel_matches_the_reference(tiles) -> None:
    """``fp4_fp8_swapped_linear`` (the weights decoded in registers as the product's first operand)
    against the reference (groups of 0, 1, a row tile and several; scales within 2^14 a block):
    only the accumulation's rounding differs, and it multiplies the same e4m3 operands with the
    same scales as the scratch path (``fp4_to_e4m3``'s bytes), so the two agree as closely."""
    _needs_kernel()
    q, s, offs, x, xq, xs, want = _grouped_case(6, 127 - 12, 127 + 2, [1, 0, 128, 300, 17, 0])
    got = moe_fp4_fp8.fp4_fp8_swapped_linear(x.to(DEV), q.to(DEV), s.to(DEV), offs.to(DEV), tiles=tiles)
    assert got.shape == want.shape and _within_accumulation(got, want, xq, xs, q, s, offs)
    bf16 = moe_fp4_fp8.fp4_fp8_swapped_linear(x.to(DEV, torch.bfloat16), q.to(DEV), s.to(DEV), offs.to(DEV), tiles=tiles).float().cpu()
    xq16, xs16 = quantize_act_reference(x.bfloat16())
    want16 = fp4_fp8_grouped_linear_reference(xq16, xs16, q, s, offs, torch.float32)
    assert _within_accumulation(bf16, want16, xq16, xs16, q, s, offs, rounding=2**-7)


@pytest.mark.parametrize("chain", [True, False])
def test_the_kernel_builds_for_sm90(chain) -> None:
    """With its inline PTX decode and one ``K = 32`` e4m3 wgmma per scale group (Triton's own ptxas,
    no GPU needed)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*u8", "offs_ptr": "*i32", "out_ptr": "*bf16", "N": "i32", "K": "i32",
        **dict.fromkeys(["BM", "BN", "G", "ASM", "PRECISION", "CHAIN"], "constexpr"),
    }  # fmt: skip
    assert list(signature) == moe_fp4_fp8._fp4_fp8_kernel.arg_names
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(8)}
    consts = {"BM": 64, "BN": 128, "G": 32, "ASM": True, "PRECISION": "tf32", "CHAIN": chain}
    kernel = triton.compile(ASTSource(moe_fp4_fp8._fp4_fp8_kernel, signature=signature, attrs=aligned, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})  # fmt: skip
    ptx = kernel.asm["ptx"]
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 4  # one per 32-input group
    assert "and.b32 a, %r" in ptx or "0x08080808" in ptx


def test_the_scratch_kernels_build_for_sm90() -> None:
    """The e4m3 scratch decode (inline PTX, ``cvt`` to e4m3) and the block-scaled grouped GEMM (one
    ``K = 128`` e4m3 product a block: four k32 wgmmas) build for sm_90 (Triton's own ptxas)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32", "start_ptr": "*i32", "end_ptr": "*i32", "pstart_ptr": "*i32",
        "out_ptr": "*bf16", **dict.fromkeys(["E", "M", "N", "K", "stride_o"], "i32"), **dict.fromkeys(["BM", "BN", "LOG_E", "PRECISION"], "constexpr"),
    }  # fmt: skip
    assert list(signature) == moe_fp4_fp8._fp8_grouped_kernel.arg_names
    aligned = {(i,): [["tt.divisibility", 16]] for i in (*range(8), 11, 12)}
    consts = {"BM": 128, "BN": 128, "LOG_E": 9, "PRECISION": "tf32"}
    kernel = triton.compile(ASTSource(moe_fp4_fp8._fp8_grouped_kernel, signature=signature, attrs=aligned, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})  # fmt: skip
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in kernel.asm["ptx"]
    signature = {"w_ptr": "*u8", "s_ptr": "*u8", "w8_ptr": "*fp8e4nv", "sw_ptr": "*fp32", "N": "i32", "K": "i32", **dict.fromkeys(["BN", "KB", "S_MIN", "ASM"], "constexpr")}
    assert list(signature) == moe_fp4_fp8._fp4_e4m3_kernel.arg_names
    kernel = triton.compile(ASTSource(moe_fp4_fp8._fp4_e4m3_kernel, signature=signature, attrs={(i,): [["tt.divisibility", 16]] for i in range(6)},
                                      constexprs={"BN": 64, "KB": 2, "S_MIN": moe_fp4_fp8.SCALE_MIN, "ASM": True}), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})  # fmt: skip
    assert "0x08080808" in kernel.asm["ptx"] and "e4m3x2" in kernel.asm["ptx"]


def test_the_swapped_kernel_builds_for_sm90() -> None:
    """The swapped kernel keeps the decoded weights in registers as the wgmma's first operand
    (``m64nBMk32`` e4m3 products whose A is a register list, not a shared-memory descriptor)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*u8", "start_ptr": "*i32", "end_ptr": "*i32", "pstart_ptr": "*i32",
        "out_ptr": "*bf16", **dict.fromkeys(["E", "M", "N", "K"], "i32"), **dict.fromkeys(["BM", "BN", "LOG_E", "S_MIN", "ASM", "PRECISION"], "constexpr"),
    }  # fmt: skip
    assert list(signature) == moe_fp4_fp8._fp4_fp8_swapped_kernel.arg_names
    aligned = {(i,): [["tt.divisibility", 16]] for i in (*range(8), 10, 11)}
    consts = {"BM": 128, "BN": 128, "LOG_E": 9, "S_MIN": moe_fp4_fp8.SCALE_MIN, "ASM": True, "PRECISION": "tf32"}
    kernel = triton.compile(ASTSource(moe_fp4_fp8._fp4_fp8_swapped_kernel, signature=signature, attrs=aligned, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})  # fmt: skip
    products = [line.split("}, ", 1)[1] for line in kernel.asm["ptx"].splitlines() if "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in line]
    assert len(products) == 4 and all(p.startswith("{%r") for p in products)  # A: four registers, not a descriptor


@pytest.mark.slow  # the Triton interpreter: minutes on a 2-core box; the GPU suite runs these kernels natively
def test_moe_fp4_fp8_under_interpreter() -> None:
    """The kernel tests above on CPU through Triton's interpreter (a child pytest)."""
    run_gpu_tests_interpreted(__file__)

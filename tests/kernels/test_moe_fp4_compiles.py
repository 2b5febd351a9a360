"""The FP4 words kernel's bf16 form (inline PTX: two codes an instruction) builds for sm_90 with the
Triton installed here (no GPU needed: Triton's own ptxas builds the cubin), so a Triton release that
no longer accepts the inline assembly or its operand packing fails here before a Hopper machine
does. Its values are checked on the GPU (``test_moe_fp4.py``, bit for bit)."""

from __future__ import annotations

import pytest

from kernels import moe_fp4

SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "offs_ptr": "*i32", "out_ptr": "*bf16", "N": "i32", "K": "i32",
    **dict.fromkeys(["BM", "BN", "BK", "G", "PRECISION", "BF16X2"], "constexpr"),
}  # fmt: skip


@pytest.mark.parametrize("bk", [128, 256])
def test_the_bf16_words_kernel_builds_for_sm90(bk) -> None:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert list(SIGNATURE) == moe_fp4._fp4_words_kernel.arg_names
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(7)}  # pointers, N and K, as a launch specialises them
    consts = {"BM": 16, "BN": 128, "BK": bk, "G": moe_fp4.GROUP, "PRECISION": "tf32", "BF16X2": True}
    kernel = triton.compile(ASTSource(moe_fp4._fp4_words_kernel, signature=SIGNATURE, attrs=aligned, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})  # fmt: skip
    ptx = kernel.asm["ptx"]
    pairs = bk // 8 * 128 // 2  # a K step's (BK/8, BN) words, decoded two a register per nibble position: BK/16·BN pairs a nibble
    assert ptx.count("mul.rn.bf16x2") >= 2 * 8 * pairs // (4 * 32)  # two products a pair, per thread of 4 warps, each K step
    assert "prmt.b32" in ptx

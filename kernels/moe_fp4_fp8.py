"""FP4 routed experts at prefill sizes on FP8 tensor cores: DeepSeek's ``act_quant`` + ``fp4_gemm``.

DeepSeek's inference multiplies an FP4 expert by quantising its input to e4m3 per row and 128-input
group (``kernels.fp8_gemm.quantize_act``: ue8m0 scales, the same as its FP8 dense layers) and
running an FP8 product against the e2m1 weights with their e8m0 scale per 32 inputs.
``fp4_fp8_grouped_linear_reference`` (dequantise both sides, fp32 matmul) is that function.

``fp4_fp8_grouped_linear`` computes it in one grouped Triton kernel with the product's operands
swapped, ``outᵀ = W · xᵀ``: each program owns ``BN`` rows of one expert's weights and ``BM`` of its
token rows, and per 128-input block

- decodes the packed codes to e4m3 with integer operations (``_e4m3_pair``: a byte
  ``h3 h2 h1 h0 l3 l2 l1 l0`` of two codes ``s e1 e0 m`` gives ``l3 0 0 l2 l1 l0 0 0`` and
  ``h3 0 0 h2 h1 h0 0 0``, each the e2m1 value times 2^-6 exactly, subnormals included; inline PTX
  on four bytes a register), then folds the block's four group scales into the codes
  (``_e4m3_block``: in units of the largest group scale ``2^S`` each code is
  ``e2m1 · 2^(s − S + 6)``, the block's scale ``2^(S − 6)``; exact while the four group scales lie
  within 2^14 of each other, past that e4m3's subnormals round the smaller groups'
  values; ``fp4_to_e4m3_reference`` is this fold in torch);
- multiplies that ``(BN, 128)`` e4m3 tile, left in registers as the wgmma's first operand (the
  second, the rows' e4m3 inputs transposed, comes from shared memory), in one ``K = 128`` product
  per block, and applies the input rows' and weight rows' scales to it in fp32 registers.

So the weights are read as stored (a quarter of bf16's bytes), never written back decoded, and the
decode never leaves registers. Swapping the operands is what keeps it there: a decoded tile as
the second operand goes through shared memory before every product (the per-32-group kernel of
run 79 did that and was slower than a bf16 scratch; so was decoding into an e4m3 scratch for a
block-scaled FP8 grouped GEMM, runs 84-86; both removed). Run 87 (H100, V4-Flash's 256 experts):
at 8K tokens (192 rows an expert) gate_up 6.01 / down 3.04 ms against 8.85 / 4.70 for the bf16
scratch; at 2K (48 rows) 2.48 / 1.27 against 3.27 / 1.61 for ``kernels.moe_fp4``'s in-register
kernel. The inputs' e4m3 rounding is DeepSeek's own; the tensor cores' FP8 accumulation keeps
~14 bits a step (DeepSeek-V3's report), hence the fp32 promotion every 128 inputs.
"""

from __future__ import annotations

import torch

from kernels._common import HAS_TRITON, INTERPRET, mma, tl, triton, use_triton
from kernels.fp8_gemm import FP8, quantize_act, quantize_act_reference
from kernels.moe_fp4 import BLOCK, GROUP, dequantize_fp4
from kernels.moe_grouped import tile_schedule

SCALE_MIN = 7  # the e8m0 code a 128-input block's scale is at least: 2^(7 - 127 - 6) = 2^-126, fp32's least normal


def fp4_fp8_grouped_linear_reference(
    xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:  # fmt: skip
    """The function the kernel computes, without Triton: each group's dequantised inputs
    ``qx · sx`` (e4m3 codes and their scales per 128) times its dequantised weights, fp32 math,
    cast to ``out_dtype``."""
    m, k = xq.shape
    x = (xq.float().view(m, -1, BLOCK) * xs[:, :, None]).view(m, k)
    out = torch.empty(m, wq.shape[1], dtype=out_dtype, device=xq.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = (x[start:end] @ dequantize_fp4(wq[g], ws[g]).t()).to(out_dtype)
        start = end
    return out


def fp4_to_e4m3_reference(wq: torch.Tensor, ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 weights ``wq (E, N, K/2)``, ``ws (E, N, K/32)`` → e4m3 ``(E, N, K)`` and fp32 scales
    ``(E, N, K/128)`` whose product is the dequantised weight (module docstring: exact while a
    block's four group scales lie within 2^14; its scale code is at least ``SCALE_MIN``)."""
    e, n, half = wq.shape
    k = 2 * half
    code = ws.contiguous().view(torch.uint8).to(torch.int32).view(e, n, k // BLOCK, BLOCK // GROUP)
    top = code.amax(-1).clamp(min=SCALE_MIN)  # (E, N, KB)
    unit = torch.pow(2.0, (133 - top).float())  # 2^(127 + 6 - S)
    w8 = (dequantize_fp4(wq, ws).view(e, n, k // BLOCK, BLOCK) * unit[..., None]).to(FP8).view(e, n, k)
    return w8, torch.pow(2.0, (top - 133).float())


def fp8_tiles(rows_per_expert: float) -> tuple[int, int, int, int]:
    """``fp4_fp8_grouped_linear``'s tiles for a mean of ``rows_per_expert`` rows an expert: 128 rows
    × 64 weight rows, 4 warps, from 128 rows an expert, else 64 × 64 (H100, V4-Flash's experts: at
    192 rows gate_up 6.01 against 8.00 ms for 64 × 64, at 48 rows 2.48 against 3.03, run 87; 16 ×
    64 lost to 64 × 64 at 24 and 96 rows, run 88)."""
    return (128, 64, 4, 3) if rows_per_expert >= 128 else (64, 64, 4, 3)


def fp4_fp8_grouped_linear(
    x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Rows ``x (M, K)`` (bf16/fp16/fp32) sorted by group (``offs`` int32 group ends) times the
    FP4 weights ``wq (E, N, K/2)``, ``ws (E, N, K/32)`` → ``(M, N)`` in ``x.dtype``, the inputs
    quantised to e4m3 per 128 first, in one grouped kernel (module docstring): each program
    decodes a ``(block_n, 128)`` weight tile a step (``fp4_to_e4m3_reference``'s bytes) into the
    FP8 product's first operand, which stays in registers, and multiplies the ``block_m`` rows'
    e4m3 inputs transposed; ``tiles`` (block_m, block_n, warps, stages; by default
    ``fp8_tiles``), ``block_n`` dividing N."""
    m, k = x.shape
    e, n, half = wq.shape
    bm, bn, warps, stages = tiles or fp8_tiles(m / max(e, 1))
    assert 2 * half == k and k % BLOCK == 0 and n % bn == 0 and ws.shape == (e, n, k // GROUP), "fp4_fp8_grouped_linear: shapes"
    if not use_triton(x):
        return fp4_fp8_grouped_linear_reference(*quantize_act_reference(x), wq, ws, offs, x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    xq, xs = quantize_act(x.contiguous())
    n_tiles = n // bn
    starts, pstart = tile_schedule(offs, bm, n_tiles)
    _fp4_fp8_kernel[((triton.cdiv(m, bm) + e) * n_tiles,)](
        xq, xs.contiguous(), wq.contiguous().view(torch.uint8), ws.contiguous().view(torch.uint8), starts, offs, pstart, out, e, m, n, k,
        BM=bm, BN=bn, LOG_E=max(1, (e - 1).bit_length()) + 1, S_MIN=SCALE_MIN, ASM=not INTERPRET,
        PRECISION="interpret" if INTERPRET else "tf32", num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


if HAS_TRITON:
    from kernels.moe_grouped import group_of

    @triton.jit
    def _e4m3_pair(packed, ASM: tl.constexpr):
        """Packed e2m1 bytes → the e4m3 codes of their low and high nibbles, each the e2m1 value
        times 2^-6 (module docstring)."""
        if ASM:
            lo, hi = tl.inline_asm_elementwise(
                """{ .reg .b32 a, b;
                and.b32 a, $2, 0x08080808; shl.b32 a, a, 4; and.b32 b, $2, 0x07070707; shl.b32 b, b, 2; or.b32 $0, a, b;
                shr.b32 a, $2, 2; and.b32 a, a, 0x1C1C1C1C; and.b32 b, $2, 0x80808080; or.b32 $1, a, b; }""",
                "=r,=r,r", [packed], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4,
            )  # fmt: skip
        else:
            lo = ((packed & 0x08) << 4) | ((packed & 0x07) << 2)
            hi = (packed & 0x80) | ((packed >> 2) & 0x1C)
        return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def _e4m3_block(packed, code, BN: tl.constexpr, S_MIN: tl.constexpr, ASM: tl.constexpr):
        """One 128-input block of ``BN`` weight rows: packed codes ``(BN, 64)`` and their group
        scales' e8m0 codes ``(BN, 4)`` → e4m3 ``(BN, 128)`` in input order and the rows' fp32 block
        scales ``2^(S − 133)`` (module docstring). The group factors multiply in fp16, exact: a
        product that fp16 rounds is far below e4m3's least subnormal."""
        lo, hi = _e4m3_pair(packed, ASM)
        v = tl.reshape(tl.join(lo, hi), (BN, 128)).to(tl.float16)  # the e2m1 values · 2^-6, input order
        code = code.to(tl.int32)
        top = tl.maximum(tl.max(code, axis=1), S_MIN)
        unit = (tl.maximum(139 - (top[:, None] - code), 1) << 23).to(tl.float32, bitcast=True).to(tl.float16)  # 2^(12 - (S - s)), (BN, 4)
        unit = tl.reshape(tl.broadcast_to(unit[:, :, None], (BN, 4, 32)), (BN, 128))
        return (v * unit).to(tl.float8e4nv), ((top - 6) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp4_fp8_kernel(
        xq_ptr, xs_ptr, w_ptr, s_ptr, start_ptr, end_ptr, pstart_ptr, out_ptr, E, M, N, K,
        BM: tl.constexpr, BN: tl.constexpr, LOG_E: tl.constexpr, S_MIN: tl.constexpr, ASM: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """``fp4_fp8_grouped_linear``: a ``(BN, BM)`` tile of ``outᵀ`` = the decoded weights (the
        product's first operand, left in registers) times the rows' e4m3 inputs transposed."""
        pid = tl.program_id(0)
        if pid < tl.load(pstart_ptr + E):
            g = group_of(pstart_ptr, pid, E, LOG_E)
            row0 = tl.load(start_ptr + g)
            row1 = tl.load(end_ptr + g)
            m_tiles = (row1 - row0 + BM - 1) // BM
            local = pid - tl.load(pstart_ptr + g)
            rows = row0 + (local % m_tiles) * BM + tl.arange(0, BM)
            r_ok = rows < row1
            rows_c = tl.minimum(rows, M - 1).to(tl.int64)
            cols = (local // m_tiles) * BN + tl.arange(0, BN)
            kb_n = K // 128
            w_rows = w_ptr + g.to(tl.int64) * N * (K // 2) + cols.to(tl.int64)[:, None] * (K // 2) + tl.arange(0, 64)[None, :]  # (BN, 64)
            s_rows = s_ptr + g.to(tl.int64) * N * (K // 32) + cols.to(tl.int64)[:, None] * (K // 32) + tl.arange(0, 4)[None, :]  # (BN, 4)
            x_cols = xq_ptr + rows_c[None, :] * K + tl.arange(0, 128)[:, None]  # (128, BM): the inputs transposed
            acc = tl.zeros((BN, BM), tl.float32)
            for kb in range(0, kb_n):
                w8, sw = _e4m3_block(tl.load(w_rows + kb * 64), tl.load(s_rows + kb * 4), BN, S_MIN, ASM)
                xt = tl.load(x_cols + kb * 128)
                sx = tl.load(xs_ptr + rows_c * kb_n + kb)
                acc += (mma(w8, xt, PRECISION) * sx[None, :]) * sw[:, None]  # powers of two: exact in either order
            o_ptrs = out_ptr + rows.to(tl.int64)[None, :] * N + cols[:, None]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=r_ok[None, :])


__all__ = ["fp4_fp8_grouped_linear_reference", "fp4_fp8_grouped_linear", "fp4_to_e4m3_reference", "fp8_tiles"]

"""FP4 routed experts at prefill sizes on FP8 tensor cores: DeepSeek's ``act_quant`` + ``fp4_gemm``.

DeepSeek's inference multiplies an FP4 expert by quantising its input to e4m3 per row and 128-input
group (``kernels.fp8_gemm.quantize_act``: ue8m0 scales, the same as its FP8 dense layers) and
running an FP8 product against the e2m1 weights with their e8m0 scale per 32 inputs. Every e2m1
value is an e4m3 value, so a weight tile decodes to FP8 codes with integer operations only, and
the 32-input scale groups are promoted into fp32 registers one by one::

    y[m, n] = Σ_kb  sx[m, kb] · Σ_{j<4}  sw[n, 4·kb + j] · Σ_{k in group 4·kb + j}  qx[m, k] · w[n, k]

The inner sum is one ``K = 32`` FP8 tensor-core product (e4m3 products are exact in fp32), the
two outer sums fp32 multiply-adds in registers; with ``chain`` (the default) one accumulator
instead, kept in units of the current group's scale (``inner · 2^(s_prev − s) + product``, exact
while the ratio of neighbouring scales stays inside fp32's exponent range, clamped past it).
``fp4_fp8_grouped_linear_reference`` (dequantise both sides, fp32 matmul) is the same function up
to fp32 summation order and the tensor cores' reduced-precision accumulation (5e-5 of the largest
output on an H100, run 79).

The decode (``_e4m3_pair``): a packed byte ``h3 h2 h1 h0 l3 l2 l1 l0`` (two codes ``s e1 e0 m``)
gives the e4m3 bytes ``l3 0 0 l2 l1 l0 0 0`` and ``h3 0 0 h2 h1 h0 0 0``: exponent ``e1 e0`` and
mantissa ``m 0 0`` are the e2m1 value times 2^-6 exactly (e = 0: the subnormal m·2^-7 = (m/2)·2^-6),
so 2^6 joins the scale. On the GPU four bytes at a time in inline PTX (two and-shift-or per
output word); under the interpreter the same bit operations on bytes.

The kernel walks, per (expert, ``BN``-column tile) program, its expert's rows in ``BM``-row
tiles (``kernels.moe_fp4``'s schedule), the weight tile decoded per row tile. It reads the packed
weights (a quarter of bf16's bytes) and multiplies on FP8 tensor cores, but is not yet faster
than ``kernels.moe_fp4``'s bf16 scratch path, so that stays the default
(``Fp4PrefillTuning.fp8_products``). Run 79 (H100, V4-Flash's 256 experts at an 8K prefill, 192
rows an expert): gate_up 9.95 / down 4.66 ms against 8.96 / 4.72 for the scratch path (166 / 177
TFLOP/s, ~12% of the FP8 rate); 64×128 tiles with 4 warps were the fastest of 64/128 × 4/8 warps.
Each ``K = 32`` product waits on its decoded tile's trip through shared memory, four to a
128-input step. The inputs' e4m3 rounding is DeepSeek's own (its ``linear`` quantises every
FP8/FP4 layer's input).

``fp4_fp8_scratch_linear`` (``Fp4PrefillTuning.fp8_scratch``) takes the other road: decode the
experts once per call into an e4m3 scratch (``fp4_to_e4m3``: a 128-input block of a row in units
of its largest group scale ``2^S``, each code ``e2m1 · 2^(s − S + 6)``, the block's scale
``2^(S − 6)``; exact while the block's four group scales lie within 2^14 of each other, past that
e4m3's subnormals round the smaller groups) and run a block-scaled FP8 grouped GEMM over it
(``fp8_grouped_mm``: one ``K = 128`` product per block, the input's and the weight row's scales
applied in fp32 registers, programs as ``kernels.moe_grouped``'s: an expert's row tiles beside each
other, so they read each weight tile from L2). Half the bf16 scratch's bytes, FP8 products, and no
decode inside the product loop. Runs 84-85 (H100, 8K): the GEMM 3.81 / 1.82 ms (gate_up / down,
64×128 tiles, 4 warps), the conversion 4.0-5.4 / 1.7-2.3 ms by program shape (32 rows × 16
blocks the fastest, now the path's) — about half the copy rate. Run 84's whole path (before both
choices) tied the bf16 scratch (13.79 against 13.68 ms a layer); the parts now sum to ~15% less,
not yet timed as a whole, so it stays opt-in.
"""

from __future__ import annotations

import math

import torch

from kernels._common import HAS_TRITON, INTERPRET, mma, tl, triton, use_triton
from kernels.fp8_gemm import FP8, quantize_act, quantize_act_reference
from kernels.moe_fp4 import BLOCK, GROUP, dequantize_fp4, scratch_chunks
from kernels.moe_grouped import tile_schedule

SCALE_MIN = 7  # the e8m0 code a 128-input block's scale is at least: 2^(7 - 127 - 6) = 2^-126, fp32's least normal


def fp4_fp8_grouped_linear_reference(
    xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:  # fmt: skip
    """``fp4_fp8_grouped_linear`` without Triton: each group's dequantised inputs ``qx · sx`` times
    its dequantised weights, fp32 math, cast to ``out_dtype``."""
    m, k = xq.shape
    x = (xq.float().view(m, -1, BLOCK) * xs[:, :, None]).view(m, k)
    out = torch.empty(m, wq.shape[1], dtype=out_dtype, device=xq.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = (x[start:end] @ dequantize_fp4(wq[g], ws[g]).t()).to(out_dtype)
        start = end
    return out


def fp4_fp8_grouped_linear(
    x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, *, block_m: int = 64, block_n: int = 128,
    warps: int = 4, stages: int = 3, chain: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Rows ``x (M, K)`` (bf16/fp16/fp32) sorted by group (``offs`` int32 group ends) times the
    FP4 weights ``wq (E, N, K/2)``, ``ws (E, N, K/32)`` → ``(M, N)`` in ``x.dtype``, the inputs
    quantised to e4m3 per 128 first (module docstring)."""
    m, k = x.shape
    e, n, half = wq.shape
    assert 2 * half == k and k % BLOCK == 0 and n % block_n == 0 and ws.shape == (e, n, k // GROUP), "fp4_fp8_grouped_linear: shapes"
    if not use_triton(x):
        xq, xs = quantize_act_reference(x)
        return fp4_fp8_grouped_linear_reference(xq, xs, wq, ws, offs, x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    xq, xs = quantize_act(x.contiguous())
    _fp4_fp8_kernel[(e, n // block_n)](
        xq, xs, wq.contiguous().view(torch.uint8), ws.contiguous().view(torch.uint8), offs, out, n, k,
        BM=block_m, BN=block_n, G=GROUP, ASM=not INTERPRET, PRECISION="interpret" if INTERPRET else "tf32", CHAIN=chain, num_warps=warps, num_stages=stages,
    )  # fmt: skip
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


def fp4_to_e4m3(wq: torch.Tensor, ws: torch.Tensor, rows: int = 32, k_blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp4_to_e4m3_reference`` in one Triton pass (the same bytes), a program per ``rows`` weight
    rows × ``k_blocks`` 128-input blocks (by default the most of 16 that divides K: run 85's
    fastest shape, 32 × 16); N a multiple of ``rows``, K of 128 · ``k_blocks``."""
    e, n, half = wq.shape
    k = 2 * half
    k_blocks = k_blocks or math.gcd(16, k // BLOCK)
    assert n % rows == 0 and k % (BLOCK * k_blocks) == 0 and ws.shape == (e, n, k // GROUP), "fp4_to_e4m3: shapes"
    if not use_triton(wq):
        return fp4_to_e4m3_reference(wq, ws)
    w8 = torch.empty(e, n, k, dtype=FP8, device=wq.device)
    sw = torch.empty(e, n, k // BLOCK, dtype=torch.float32, device=wq.device)
    if e:
        _fp4_e4m3_kernel[(e, n // rows, k // (BLOCK * k_blocks))](
            wq.contiguous().view(torch.uint8), ws.contiguous().view(torch.uint8), w8, sw, n, k,
            BN=rows, KB=k_blocks, S_MIN=SCALE_MIN, ASM=not INTERPRET, num_warps=4,
        )  # fmt: skip
    return w8, sw


def fp8_grouped_mm(
    xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
    *, block_m: int = 128, block_n: int = 128, warps: int = 8, stages: int = 3,
) -> torch.Tensor:  # fmt: skip
    """Rows ``xq (M, K)`` e4m3 with scales ``xs (M, K/128)``, sorted by group (``offs`` int32 group
    ends), times ``w8[g] (N, K)`` e4m3 with scales ``sw[g] (N, K/128)`` → written into ``out (M, N)``
    (module docstring); ``block_n`` divides N."""
    m, k = xq.shape
    e, n, _ = w8.shape
    assert k % BLOCK == 0 and n % block_n == 0 and out.shape == (m, n) and out.stride(1) == 1 and xq.is_contiguous() and w8.is_contiguous()
    if m == 0:
        return out
    n_tiles = n // block_n
    starts, pstart = tile_schedule(offs, block_m, n_tiles)
    _fp8_grouped_kernel[((triton.cdiv(m, block_m) + e) * n_tiles,)](
        xq, xs.contiguous(), w8, sw.contiguous(), starts, offs, pstart, out, e, m, n, k, out.stride(0),
        BM=block_m, BN=block_n, LOG_E=max(1, (e - 1).bit_length()) + 1, PRECISION="interpret" if INTERPRET else "tf32",
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def fp4_fp8_scratch_linear(
    x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, scratch_bytes: int = 2 << 30,
    tiles: tuple[int, int, int, int] = (64, 128, 4, 3),
) -> torch.Tensor:  # fmt: skip
    """``fp4_fp8_grouped_linear``'s function through an e4m3 scratch (module docstring): the inputs
    quantised once, ``scratch_bytes`` of e4m3 experts decoded at a time (``fp4_to_e4m3``), their rows
    through ``fp8_grouped_mm`` with ``tiles`` (block_m, block_n, warps, stages) (one host sync for
    the group ends) → ``(M, N)`` in ``x.dtype``."""
    m, k = x.shape
    e, n, half = wq.shape
    assert 2 * half == k and k % BLOCK == 0 and n % 128 == 0 and ws.shape == (e, n, k // GROUP), "fp4_fp8_scratch_linear: shapes"
    if not use_triton(x):
        return fp4_fp8_grouped_linear_reference(*quantize_act_reference(x), wq, ws, offs, x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    xq, xs = quantize_act(x.contiguous())
    bm, bn, warps, stages = tiles
    for a, b, r0, r1 in scratch_chunks(offs, max(1, scratch_bytes // (n * k))):
        w8, sw = fp4_to_e4m3(wq[a:b], ws[a:b])
        fp8_grouped_mm(xq[r0:r1], xs[r0:r1], w8, sw, offs[a:b] - r0, out[r0:r1], block_m=bm, block_n=bn, warps=warps, stages=stages)
    return out



def swapped_tiles(rows_per_expert: float) -> tuple[int, int, int, int]:
    """``fp4_fp8_swapped_linear``'s tiles for a mean of ``rows_per_expert`` rows an expert: 128 rows
    × 64 weight rows, 4 warps, from 128 rows an expert, else 64 × 64 (run 87, H100, V4-Flash's
    experts: at 192 rows gate_up 6.01 against 8.00 ms for 64 × 64, at 48 rows 2.48 against 3.03)."""
    return (128, 64, 4, 3) if rows_per_expert >= 128 else (64, 64, 4, 3)


def fp4_fp8_swapped_linear(
    x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``fp4_fp8_scratch_linear``'s function in one grouped kernel with the product's operands
    swapped (module docstring): each program decodes a ``(block_n, 128)`` weight tile a step
    (``fp4_to_e4m3``'s bytes) into the FP8 product's first operand, which stays in registers, and
    multiplies the ``block_m`` rows' e4m3 inputs transposed; ``tiles`` (block_m, block_n, warps,
    stages; by default ``swapped_tiles``), ``block_n`` dividing N → ``(M, N)`` in ``x.dtype``."""
    m, k = x.shape
    e, n, half = wq.shape
    bm, bn, warps, stages = tiles or swapped_tiles(m / max(e, 1))
    assert 2 * half == k and k % BLOCK == 0 and n % bn == 0 and ws.shape == (e, n, k // GROUP), "fp4_fp8_swapped_linear: shapes"
    if not use_triton(x):
        return fp4_fp8_grouped_linear_reference(*quantize_act_reference(x), wq, ws, offs, x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    xq, xs = quantize_act(x.contiguous())
    n_tiles = n // bn
    starts, pstart = tile_schedule(offs, bm, n_tiles)
    _fp4_fp8_swapped_kernel[((triton.cdiv(m, bm) + e) * n_tiles,)](
        xq, xs.contiguous(), wq.contiguous().view(torch.uint8), ws.contiguous().view(torch.uint8), starts, offs, pstart, out, e, m, n, k,
        BM=bm, BN=bn, LOG_E=max(1, (e - 1).bit_length()) + 1, S_MIN=SCALE_MIN, ASM=not INTERPRET,
        PRECISION="interpret" if INTERPRET else "tf32", num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out

if HAS_TRITON:
    from kernels.moe_fp4 import _e8m0
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
    def _fp4_e4m3_kernel(w_ptr, s_ptr, w8_ptr, sw_ptr, N, K, BN: tl.constexpr, KB: tl.constexpr, S_MIN: tl.constexpr, ASM: tl.constexpr):
        """``KB`` ``(BN, 128)`` blocks of expert ``program_id(0)``'s rows → e4m3 and their scales."""
        e = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        w_rows = w_ptr + e * N * (K // 2) + cols[:, None] * (K // 2) + tl.arange(0, 64)[None, :]  # (BN, 64) packed
        s_rows = s_ptr + e * N * (K // 32) + cols[:, None] * (K // 32) + tl.arange(0, 4)[None, :]  # (BN, 4) e8m0
        for j in range(KB):
            kb = tl.program_id(2) * KB + j
            w8, scale = _e4m3_block(tl.load(w_rows + kb * 64), tl.load(s_rows + kb * 4), BN, S_MIN, ASM)
            kk = kb * 128 + tl.arange(0, 128)
            tl.store(w8_ptr + e * N * K + cols[:, None] * K + kk[None, :], w8)
            tl.store(sw_ptr + e * N * (K // 128) + cols * (K // 128) + kb, scale)

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
    def _fp8_grouped_kernel(
        xq_ptr, xs_ptr, w_ptr, sw_ptr, start_ptr, end_ptr, pstart_ptr, out_ptr, E, M, N, K, stride_o,
        BM: tl.constexpr, BN: tl.constexpr, LOG_E: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
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
            kk = tl.arange(0, 128)
            a_ptrs = xq_ptr + rows_c[:, None] * K + kk[None, :]  # (BM, 128)
            b_ptrs = w_ptr + g.to(tl.int64) * N * K + cols.to(tl.int64)[None, :] * K + kk[:, None]  # (128, BN)
            sb_ptrs = sw_ptr + g.to(tl.int64) * N * kb_n + cols * kb_n  # (BN,)
            acc = tl.zeros((BM, BN), tl.float32)
            for kb in range(0, kb_n):
                a = tl.load(a_ptrs + kb * 128)
                b = tl.load(b_ptrs + kb * 128)
                sa = tl.load(xs_ptr + rows_c * kb_n + kb)
                sb = tl.load(sb_ptrs + kb)
                acc += (mma(a, b, PRECISION) * sa[:, None]) * sb[None, :]  # the row scale first, as kernels.fp8_gemm
            o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None])

    @triton.jit
    def _fp4_fp8_swapped_kernel(
        xq_ptr, xs_ptr, w_ptr, s_ptr, start_ptr, end_ptr, pstart_ptr, out_ptr, E, M, N, K,
        BM: tl.constexpr, BN: tl.constexpr, LOG_E: tl.constexpr, S_MIN: tl.constexpr, ASM: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """``fp4_fp8_swapped_linear``: a ``(BN, BM)`` tile of ``outᵀ`` = the decoded weights (the
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
                acc += (mma(w8, xt, PRECISION) * sx[None, :]) * sw[:, None]  # the row scale first, as the scratch GEMM
            o_ptrs = out_ptr + rows.to(tl.int64)[None, :] * N + cols[:, None]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=r_ok[None, :])

    @triton.jit
    def _group_operands(x_tile, x_offs, r_ok, w_tile, w_offs, g, G: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr):
        """Scale group ``g``'s operands: the rows' e4m3 inputs ``(BM, G)`` and the weight tile decoded
        to e4m3 ``(G, BN)`` (``_e4m3_pair``, low nibble first: input order)."""
        a = tl.load(x_tile + g * G + x_offs, mask=r_ok[:, None], other=0.0)
        lo, hi = _e4m3_pair(tl.load(w_tile + g * (G // 2) + w_offs), ASM)
        return a, tl.trans(tl.reshape(tl.join(lo, hi), (BN, G)))

    @triton.jit
    def _mma_acc(a, b, acc, PRECISION: tl.constexpr):
        """``acc + a·b`` with ``acc`` the tensor cores' accumulator on the GPU (``mma``'s widening under the interpreter)."""
        if PRECISION == "interpret":
            out = acc + mma(a, b, PRECISION)
        else:
            out = tl.dot(a, b, acc)
        return out

    @triton.jit
    def _fp4_fp8_kernel(
        xq_ptr, xs_ptr, w_ptr, s_ptr, offs_ptr, out_ptr, N, K,
        BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, ASM: tl.constexpr, PRECISION: tl.constexpr, CHAIN: tl.constexpr,
    ):  # fmt: skip
        e = tl.program_id(0)
        nb = tl.program_id(1)
        end = tl.load(offs_ptr + e)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        if end > start:
            kb_n = K // 128
            cols = nb * BN + tl.arange(0, BN)
            jj = tl.arange(0, G // 2)
            kk = tl.arange(0, G)
            w_tile = w_ptr + e.to(tl.int64) * N * (K // 2)  # this expert's packed rows
            w_offs = cols[:, None] * (K // 2) + jj[None, :]  # (BN, G/2) int32: one row of codes is K/2 bytes
            s_tile = s_ptr + e.to(tl.int64) * N * (K // G)
            s_offs = cols * (K // G)  # (BN,)
            ty = out_ptr.dtype.element_ty
            for m0 in range(start, end, BM):
                rows = m0 + tl.arange(0, BM)
                r_ok = rows < end
                x_tile = xq_ptr + tl.full((), m0, tl.int64) * K
                x_offs = tl.arange(0, BM)[:, None] * K + kk[None, :]  # (BM, G) int32, from the tile's first row
                acc = tl.zeros((BM, BN), tl.float32)
                for kb in range(0, kb_n):
                    g0 = kb * (128 // G)
                    if CHAIN:  # one accumulator: the running sum kept in units of the current group's scale
                        code = tl.load(s_tile + g0 + s_offs).to(tl.int32)  # (BN,) e8m0
                        a, b = _group_operands(x_tile, x_offs, r_ok, w_tile, w_offs, g0, G, BN, ASM)
                        inner = mma(a, b, PRECISION)
                        for j in tl.static_range(1, 128 // G):
                            nxt = tl.load(s_tile + g0 + j + s_offs).to(tl.int32)
                            ratio = (tl.minimum(tl.maximum(code - nxt, -126), 127) + 127) << 23  # 2^(code − nxt)
                            code = nxt
                            a, b = _group_operands(x_tile, x_offs, r_ok, w_tile, w_offs, g0 + j, G, BN, ASM)
                            inner = _mma_acc(a, b, inner * ratio.to(tl.float32, bitcast=True)[None, :], PRECISION)
                        inner = inner * _e8m0(code.to(tl.uint32))[None, :]
                    else:
                        inner = tl.zeros((BM, BN), tl.float32)
                        for j in tl.static_range(128 // G):
                            a, b = _group_operands(x_tile, x_offs, r_ok, w_tile, w_offs, g0 + j, G, BN, ASM)
                            sb = _e8m0(tl.load(s_tile + g0 + j + s_offs).to(tl.uint32))  # (BN,)
                            inner += mma(a, b, PRECISION) * sb[None, :]
                    sa = tl.load(xs_ptr + rows * kb_n + kb, mask=r_ok, other=0.0)  # (BM,)
                    acc += inner * sa[:, None]
                acc = acc * 64.0  # the decode's 2^-6 (module docstring)
                tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(ty), mask=r_ok[:, None])


__all__ = [
    "fp4_fp8_grouped_linear", "fp4_fp8_grouped_linear_reference", "fp4_fp8_scratch_linear", "fp4_to_e4m3", "fp4_to_e4m3_reference",
    "fp4_fp8_swapped_linear", "fp8_grouped_mm", "swapped_tiles",
]  # fmt: skip

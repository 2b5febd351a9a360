"""Routed experts with FP4 (e2m1) weights as DeepSeek-V4 ships them, dequantised inside the kernel.

Layout (the release's, stacked per layer): ``wq (E, N, K/2)`` int8, two e2m1 codes per byte, the
low nibble first (input ``2j`` low, ``2j+1`` high); ``ws (E, N, K/32)`` float8_e8m0fnu (or its
exponent bytes as uint8), one power-of-two scale per 32 inputs of a row. A code is sign · e2m1
magnitude {0, 0.5, 1, 1.5, 2, 3, 4, 6}: every dequantised weight ``code · 2^s`` is exact in bf16.

``fp4_grouped_linear`` is ``kernels.moe_fp8``'s grouped GEMM with the weight tile decoded in
registers: one program per (expert, ``BN``-column tile) returns at once when its expert has no
rows, else walks its rows in row tiles (``default_block_m``) and K in steps, a bf16 tensor-core
product with fp32 accumulation per step. A quarter of bf16's weight bytes (plus 1/32 for the
scales). Two kernels, by row tile (run 74, H100, V4-Flash experts, ``bench.fp4_experts_bench``):

- up to ``WORDS_MAX_ROWS`` rows (decode: the decode costs more than the product), ``_fp4_words_kernel``
  reads the packed bytes as 32-bit words and decodes each nibble position's codes straight into
  the dot's operand, for bf16 two codes an instruction in inline PTX (``_fp4_nibble_bf16x2``: a
  byte permute, two shifts, two masks and two ``mul.bf16x2`` per pair), against the rows' inputs
  reordered per K step so that each nibble position's are contiguous; ``Fp4GroupedTuning``'s tiles
  by rows. Run 76 (64 tokens): gate_up 0.974 / down 0.478 ms, 1.65× / 1.62× the byte floor of the
  touched experts; 1.296 / 0.659 ms with one code per instruction (``_fp4_nibble``) and the inputs
  at stride 8, 1.446 / 0.731 ms for the tile kernel (run 74);
- larger row tiles, ``_fp4_tiles_kernel`` decodes a ``(BN, BK)`` tile (``_fp4_tile``: the nibbles
  joined in input order) and runs one ``K = BK`` product: there the words kernel's 16-deep
  products cost more than the decode saves (run 74, before the paired decode and the reordered
  inputs: 2048 tokens, 48 rows an expert, gate_up 3.28 against 9.25 ms).

That decode is paid again for every row tile, so at prefill sizes (``Fp4PrefillTuning``) the
products go elsewhere: half-precision rows on Hopper, from 24 rows an expert on average, to
``kernels.moe_fp4_fp8`` (DeepSeek's ``act_quant`` + ``fp4_gemm``: inputs rounded to e4m3, the
weights decoded in registers as an FP8 product's first operand; run 87, H100: 8K tokens gate_up
6.01 ms against 8.85 for the bf16 scratch, 2K 2.48 against 3.27 for the tile kernel); elsewhere,
in bf16 where ``torch._grouped_mm`` exists, from ``min_rows_per_expert`` rows an expert, the
experts are decoded once per call into a bf16 scratch, a chunk of experts at a time
(``dequantize_fp4_kernel``, the tile kernel's decoder ``_fp4_tile``), and multiplied by
``torch._grouped_mm``: the same bf16 weights and fp32 accumulation, another summation order.
fp32 rows (the parity path) always take this module's kernels. The choice is made from shapes
alone; a captured decode step's few rows an expert never reach either (the bf16 scratch reads
the group ends on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._common import HAS_TRITON, INTERPRET, dot_precision, mma, tl, triton, use_triton
from kernels.moe import has_grouped_mm
from kernels.moe_fp8 import default_block_m, grouped_linear_reference, quantized_moe_experts

BLOCK = 128  # K per step; every 32-wide scale group lies inside one step
GROUP = 32  # inputs per e8m0 scale
WORDS_MAX_ROWS = 16  # row tiles up to this take _fp4_words_kernel (module docstring)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequantize_fp4(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q (..., N, K/2)`` packed e2m1 and ``scale (..., N, K/32)`` → ``(..., N, K)`` (the kernel's reference)."""
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), device=q.device)
    u8 = q.contiguous().view(torch.uint8).long()
    vals = torch.stack([lut[u8 & 0xF], lut[u8 >> 4]], dim=-1).flatten(-2)  # (..., N, K)
    s = scale.view(torch.float8_e8m0fnu) if scale.dtype == torch.uint8 else scale
    return (vals * s.float().repeat_interleave(GROUP, dim=-1)).to(dtype)


@dataclass(frozen=True)
class Fp4PrefillTuning:
    """``fp4_grouped_linear`` at prefill sizes (module docstring). With ``fp8`` (the default),
    half-precision rows on a GPU with FP8 tensor cores (Hopper on), from
    ``fp8_min_rows_per_expert`` rows per expert on average, take ``kernels.moe_fp4_fp8``'s FP8
    kernel (the inputs rounded to e4m3 as DeepSeek's inference does; on an H100, runs 87-88, −8% /
    −24% / −46% / −32% at 1K / 2K / 4K / 8K tokens, 24 / 48 / 96 / 192 rows an expert of
    V4-Flash, against the path before it: the in-register kernel, from 96 rows the bf16 scratch;
    at decode sizes, 0.4-1.5 rows, 25-30% slower). Otherwise bf16
    rows from ``min_rows_per_expert`` are decoded once into a bf16 scratch, ``scratch_bytes`` of
    weights at a time; fp32 rows (the parity path) keep the in-register kernels."""

    min_rows_per_expert: int = 96
    scratch_bytes: int = 2 << 30
    fp8: bool = True
    fp8_min_rows_per_expert: int = 24


FP4_PREFILL = Fp4PrefillTuning()


@dataclass(frozen=True)
class Fp4GroupedTiles:
    """``_fp4_words_kernel``'s launch: ``bn`` output columns per program, ``bk`` inputs per K
    step (``BLOCK`` where ``bk`` does not divide K), warps and pipeline stages."""

    bn: int = 128
    bk: int = 128
    warps: int = 4
    stages: int = 3


@dataclass(frozen=True)
class Fp4GroupedTuning:
    """``_fp4_words_kernel``'s tiles by rows: fewer than ``few_rows`` rows touch at most that many
    experts, too few programs of ``many``'s size to keep the memory busy, so ``few`` halves the
    columns and doubles the bytes a program has in flight. Run 73 (H100, V4-Flash experts, 24 tiles,
    ``python -m bench.fp4_experts_bench``): 6 rows gate_up 73.4 against 112.5 µs, 24 rows 179.3
    against 186.3; from 96 rows ``many`` is the best or within 1% of it."""

    few_rows: int = 32
    few: Fp4GroupedTiles = Fp4GroupedTiles(bn=64, bk=256, stages=4)
    many: Fp4GroupedTiles = Fp4GroupedTiles()

    def tiles(self, rows: int) -> Fp4GroupedTiles:
        return self.few if rows < self.few_rows else self.many


FP4_GROUPED = Fp4GroupedTuning()


def dequantize_fp4_kernel(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``dequantize_fp4`` in one Triton pass (``_fp4_tile``, the tile kernel's decoder):
    ``q (E, N, K/2)``, ``scale (E, N, K/32)`` → ``(E, N, K)`` in ``dtype``; N and K multiples of 128."""
    e, n, half = q.shape
    k = 2 * half
    assert n % BLOCK == 0 and k % BLOCK == 0 and scale.shape == (e, n, k // GROUP), "dequantize_fp4_kernel: shapes"
    out = torch.empty(e, n, k, dtype=dtype, device=q.device)
    _fp4_dequant_kernel[(e, n // 64, k // BLOCK)](q.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8), out, n, k, BN=64, BK=BLOCK, G=GROUP)
    return out


def fp4_grouped_linear(
    xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, *, block_m: int | None = None,
    prefill: Fp4PrefillTuning = FP4_PREFILL, tiles: Fp4GroupedTiles | None = None,
) -> torch.Tensor:  # fmt: skip
    """Rows ``xs (M, K)`` sorted by group (group ``g`` = rows ``[offs[g-1], offs[g])``, ``offs``
    int32 group ends) times ``dequant(wq[g], ws[g])ᵀ`` → ``(M, N)`` in ``xs.dtype``; at prefill
    sizes through a bf16 scratch (``prefill``, module docstring)."""
    m, k = xs.shape
    e, n, half = wq.shape
    tiles = tiles or FP4_GROUPED.tiles(m)
    assert 2 * half == k and n % BLOCK == 0 and n % tiles.bn == 0 and k % BLOCK == 0 and ws.shape == (e, n, k // GROUP), "fp4_grouped_linear: shapes"
    assert xs.is_contiguous() and wq.is_contiguous() and ws.is_contiguous()
    out = torch.empty(m, n, dtype=xs.dtype, device=xs.device)
    if not use_triton(xs):
        return grouped_linear_reference(xs, wq, ws, offs, dequantize_fp4, out)
    if m == 0:
        return out
    fp8_cores = xs.is_cuda and xs.dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(xs.device)[0] >= 9
    if fp8_cores and prefill.fp8 and m >= prefill.fp8_min_rows_per_expert * e:
        from kernels.moe_fp4_fp8 import fp4_fp8_grouped_linear  # (it imports this module)

        return fp4_fp8_grouped_linear(xs, wq, ws, offs)
    if xs.is_cuda and m >= prefill.min_rows_per_expert * e and has_grouped_mm(xs.dtype):
        return _through_scratch(xs, wq, ws, offs, out, max(1, prefill.scratch_bytes // (n * k * xs.element_size())))
    if block_m is None:
        block_m = default_block_m(m, e)
    precision = dot_precision(xs.dtype)
    if block_m > WORDS_MAX_ROWS:
        _fp4_tiles_kernel[(e, n // BLOCK)](
            xs, wq.view(torch.uint8), ws.view(torch.uint8), offs, out, n, k, BM=block_m, BN=BLOCK, BK=BLOCK, G=GROUP,
            PRECISION=precision, num_warps=4, num_stages=3,
        )  # fmt: skip
        return out
    bk = tiles.bk if k % tiles.bk == 0 else BLOCK
    by_nibble = xs.view(m, k // bk, bk // 8, 8).transpose(2, 3).contiguous().view(m, k)  # input 8j + i of a K step at i·bk/8 + j
    _fp4_words_kernel[(e, n // tiles.bn)](
        by_nibble, wq.view(torch.int32), ws.view(torch.uint8), offs, out, n, k, BM=block_m, BN=tiles.bn, BK=bk, G=GROUP,
        PRECISION=precision, BF16X2=xs.dtype == torch.bfloat16 and not INTERPRET, num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip
    return out


def scratch_chunks(offs: torch.Tensor, per: int) -> list[tuple[int, int, int, int]]:
    """The experts of group ends ``offs`` a scratch of ``per`` experts at a time: ``(first expert,
    end expert, first row, end row)`` of each chunk with rows (one host sync for the ends)."""
    ends = offs.tolist()
    chunks = [(a, min(len(ends), a + per)) for a in range(0, len(ends), per)]
    return [(a, b, ends[a - 1] if a else 0, ends[b - 1]) for a, b in chunks if ends[b - 1] > (ends[a - 1] if a else 0)]


def _through_scratch(xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, per: int) -> torch.Tensor:
    """``fp4_grouped_linear`` at prefill sizes: ``per`` experts at a time decoded to ``xs.dtype``,
    their rows through ``torch._grouped_mm``, written into ``out``."""
    for a, b, r0, r1 in scratch_chunks(offs, per):
        w = dequantize_fp4_kernel(wq[a:b], ws[a:b], xs.dtype)  # (C, N, K)
        out[r0:r1] = torch._grouped_mm(xs[r0:r1], w.transpose(-2, -1), offs=offs[a:b] - r0)
    return out


def moe_experts_fp4(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    gate_up_q: torch.Tensor,
    gate_up_s: torch.Tensor,
    down_q: torch.Tensor,
    down_s: torch.Tensor,
    limit: float,
    add: torch.Tensor | None = None,
    prefill: Fp4PrefillTuning = FP4_PREFILL,
) -> torch.Tensor:
    """``kernels.moe.moe_experts`` with the checkpoint's FP4 expert weights (module docstring):
    ``gate_up_q (E, 2I, H/2)`` (gate rows, then up rows), ``down_q (E, H, I/2)``, scales ``/32``;
    ``add`` (e.g. the shared expert's output) joins the sum; ``prefill``: the grouped products'
    path at prefill sizes."""

    def linear(xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return fp4_grouped_linear(xs, wq, ws, offs, prefill=prefill)

    return quantized_moe_experts(x, weights, indices, gate_up_q, gate_up_s, down_q, down_s, limit, dequantize_fp4, linear, add=add)


_PAIR_ASM = """{{ .reg .b32 p, s, m, c;
    prmt.b32 p, $1, $2, $3; shl.b32 s, p, {sign}; shl.b32 m, p, {code};
    and.b32 s, s, 0x80008000; and.b32 m, m, 0x01C001C0; or.b32 p, s, m;
    mov.b32 c, 0x7E807E80; mul.rn.bf16x2 p, p, c; mul.rn.bf16x2 $0, p, $5; }}"""  # _fp4_nibble_bf16x2; 0x7E80 is bf16 2^126

if HAS_TRITON:
    # the low nibble of a byte: sign bit 3 → 15, code bits 0-2 → 6-8 (16 bits up for word b); the high one: bits 7, 4-6
    _PAIR_ASM_LOW = tl.constexpr(_PAIR_ASM.format(sign=12, code=6))
    _PAIR_ASM_HIGH = tl.constexpr(_PAIR_ASM.format(sign=8, code=2))

    @triton.jit
    def _e8m0(sc):
        """e8m0 codes (uint32) → their fp32 scales 2^(sc-127); code 0 is 2^-127 (a subnormal)."""
        return tl.where(sc == 0, 0x400000, sc << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp4_nibble(words, I: tl.constexpr):
        """The e2m1 values in nibble ``I`` of uint32 ``words`` (8 codes each), fp32, unscaled.

        The code ``s e1 e0 m`` placed as the fp32 bits ``s << 31 | e1 e0 m << 22`` is the e2m1
        value × 2^-126 exactly (e = 0 a subnormal, which fp32 products keep), then × 2^126: two
        shifts, a mask and a product, no select."""
        if 4 * I <= 22:
            mag = (words << (22 - 4 * I)) & 0x01C00000
        else:
            mag = (words >> (4 * I - 22)) & 0x01C00000
        bits = ((words << (28 - 4 * I)) & 0x80000000) | mag
        return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126

    @triton.jit
    def _fp4_nibble_bf16x2(words, scale, I: tl.constexpr):
        """``_fp4_nibble(words, I) · scale`` rounded to bf16 (the same values), two weights an
        instruction: one ``prmt`` puts byte ``I // 2`` of two neighbouring words in the halves of a
        register, two shifts and masks place both codes as bf16 bits ``s << 15 | e1 e0 m << 6`` (the
        e2m1 value × 2^-126, e = 0 a bf16 subnormal), two ``mul.bf16x2`` by 2^126 and by the
        ``scale`` pair (exact: powers of two). Inline PTX for sm_90 over whichever two elements
        Triton packs in a register, each with its own word and scale lane."""
        sel = tl.full(words.shape, (I // 2) * 0x1111 + 0x4400, tl.uint32)  # bytes I//2 of word a → lanes 0-1, of word b → 2-3
        if I % 2 == 0:
            out = tl.inline_asm_elementwise(_PAIR_ASM_LOW, "=r,r,r,r,r,r", [words, sel, scale], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            out = tl.inline_asm_elementwise(_PAIR_ASM_HIGH, "=r,r,r,r,r,r", [words, sel, scale], dtype=tl.bfloat16, is_pure=True, pack=2)
        return out

    @triton.jit
    def _fp4_rows_dot(w_base, s_base, rows, k0, K, x_ptr, BR: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
        """Weight rows ``rows`` over inputs ``[k0, k0+BK)`` times the fp32-widened ``x_ptr[k0:k0+BK]``,
        as ``(BR, BK/8)`` fp32 partial sums (sum them over axis 1): the rows' packed bytes read as
        32-bit words, each nibble position's codes decoded (``_fp4_nibble``) against the inputs at
        stride 8, the group's scale once per word (a word's 8 codes share one group)."""
        jj = tl.arange(0, BK // 8)
        gg = tl.arange(0, BK // G)
        words = tl.load(w_base + rows.to(tl.int64)[:, None] * (K // 8) + k0 // 8 + jj[None, :]).to(tl.uint32, bitcast=True)
        sc = tl.load(s_base + rows.to(tl.int64)[:, None] * (K // G) + k0 // G + gg[None, :]).to(tl.uint32)  # (BR, BK/G)
        scale = _e8m0(tl.reshape(tl.broadcast_to(sc[:, :, None], (BR, BK // G, G // 8)), (BR, BK // 8)))
        acc = tl.zeros((BR, BK // 8), tl.float32)
        for i in tl.static_range(8):
            x = tl.load(x_ptr + k0 + 8 * jj + i).to(tl.float32)
            acc += _fp4_nibble(words, i) * x[None, :]
        return acc * scale

    @triton.jit
    def _fp4_tile(w_base, s_base, cols, k0, K, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
        """The dequantised weight tile ``(BN, BK)`` fp32 of columns ``cols`` and inputs ``[k0, k0+BK)``.

        A code ``s e1 e0 m`` is placed as the fp16 bits ``s << 15 | e1 e0 m << 9``: the value
        2^(e-15)·(1 + m/2), for e = 0 the subnormal m·2^-15 — the e2m1 value times 2^-14, exactly
        (the fp16 → fp32 conversion keeps subnormals) — then times 2^14 and the group's scale: no
        select per weight."""
        jj = tl.arange(0, BK // 2)
        packed = tl.load(w_base + cols.to(tl.int64)[:, None] * (K // 2) + k0 // 2 + jj[None, :]).to(tl.int32)  # (BN, BK/2) bytes
        codes = tl.reshape(tl.join(packed & 0xF, (packed >> 4) & 0xF), (BN, BK))  # low nibble first
        bits = ((codes & 8) << 12) | ((codes & 7) << 9)
        val = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0
        gg = tl.arange(0, BK // G)
        sc = tl.load(s_base + cols.to(tl.int64)[:, None] * (K // G) + k0 // G + gg[None, :]).to(tl.int32)  # (BN, BK/G) e8m0
        scale = _e8m0(sc.to(tl.uint32))
        return tl.reshape(tl.reshape(val, (BN, BK // G, G)) * scale[:, :, None], (BN, BK))

    @triton.jit
    def _fp4_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
        """One ``(BN, BK)`` tile of expert ``program_id(0)``'s decoded weights (``dequantize_fp4_kernel``)."""
        e = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        k0 = tl.program_id(2) * BK
        tile = _fp4_tile(w_ptr + e * N * (K // 2), s_ptr + e * N * (K // G), cols, k0, K, BN, BK, G)
        dst = out_ptr + e * N * K + cols.to(tl.int64)[:, None] * K + k0 + tl.arange(0, BK)[None, :]
        tl.store(dst, tile.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _fp4_tiles_kernel(
        x_ptr, w_ptr, s_ptr, offs_ptr, out_ptr, N, K,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """``fp4_grouped_linear``'s kernel for row tiles of more than ``WORDS_MAX_ROWS`` rows: each ``(BN, BK)``
        weight tile decoded by ``_fp4_tile`` once per row tile, one ``K = BK`` product."""
        e = tl.program_id(0)
        nb = tl.program_id(1)
        end = tl.load(offs_ptr + e)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        if end > start:
            cols = nb * BN + tl.arange(0, BN)
            kk = tl.arange(0, BK)
            ty = out_ptr.dtype.element_ty
            w_base = w_ptr + e.to(tl.int64) * N * (K // 2)
            s_base = s_ptr + e.to(tl.int64) * N * (K // G)
            for m0 in range(start, end, BM):
                rows = m0 + tl.arange(0, BM)
                r_ok = rows < end
                acc = tl.zeros((BM, BN), tl.float32)
                for k0 in range(0, K, BK):
                    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + k0 + kk[None, :], mask=r_ok[:, None], other=0.0)
                    w = _fp4_tile(w_base, s_base, cols, k0, K, BN, BK, G)  # (BN, BK)
                    acc += mma(x, tl.trans(w).to(ty), PRECISION)
                tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(ty), mask=r_ok[:, None])

    @triton.jit
    def _fp4_words_kernel(
        x_ptr, w_ptr, s_ptr, offs_ptr, out_ptr, N, K,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, PRECISION: tl.constexpr, BF16X2: tl.constexpr,
    ):  # fmt: skip
        """``fp4_grouped_linear``'s kernel for row tiles of up to 16 rows (decode), over the packed
        weights read as 32-bit words (8 codes, input ``8j + i`` in nibble ``i`` of word ``j``): per
        K step one ``(BK/8, BN)`` word tile and its scales, then for each nibble ``i`` the codes of
        inputs ``k0 + 8j + i`` decoded and scaled straight into the dot's ``(K, N)`` operand
        (``_fp4_nibble_bf16x2`` for bf16 on the GPU, else ``_fp4_nibble``) against those inputs,
        which ``x_ptr`` holds reordered nibble position first (``fp4_grouped_linear``): contiguous
        loads, no join, reshape or transpose of the weight tile."""
        e = tl.program_id(0)
        nb = tl.program_id(1)
        end = tl.load(offs_ptr + e)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        if end > start:
            cols = nb * BN + tl.arange(0, BN)
            jj = tl.arange(0, BK // 8)
            gg = tl.arange(0, BK // G)
            ty = out_ptr.dtype.element_ty
            w_base = w_ptr + e.to(tl.int64) * N * (K // 8) + cols.to(tl.int64)[None, :] * (K // 8) + jj[:, None]  # (BK/8, BN)
            s_base = s_ptr + e.to(tl.int64) * N * (K // G) + cols.to(tl.int64)[None, :] * (K // G) + gg[:, None]  # (BK/G, BN)
            for m0 in range(start, end, BM):
                rows = m0 + tl.arange(0, BM)
                r_ok = rows < end
                x_base = x_ptr + rows.to(tl.int64)[:, None] * K + jj[None, :]  # (BM, BK/8): nibble position 0's inputs
                acc = tl.zeros((BM, BN), tl.float32)
                for k0 in range(0, K, BK):
                    words = tl.load(w_base + k0 // 8).to(tl.uint32, bitcast=True)
                    sc = tl.load(s_base + k0 // G).to(tl.uint32)  # (BK/G, BN) e8m0
                    sc = tl.reshape(tl.broadcast_to(sc[:, None, :], (BK // G, G // 8, BN)), (BK // 8, BN))  # word j: group j·8/G
                    scale = _e8m0(sc)
                    if BF16X2:
                        scale = scale.to(tl.bfloat16)  # exact: a power of two
                    for i in tl.static_range(8):
                        if BF16X2:
                            w = _fp4_nibble_bf16x2(words, scale, i)
                        else:
                            w = (_fp4_nibble(words, i) * scale).to(ty)
                        x = tl.load(x_base + k0 + i * (BK // 8), mask=r_ok[:, None], other=0.0)
                        acc += mma(x, w, PRECISION)
                tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(ty), mask=r_ok[:, None])


__all__ = ["FP4_GROUPED", "FP4_PREFILL", "Fp4GroupedTiles", "Fp4GroupedTuning", "Fp4PrefillTuning", "dequantize_fp4", "dequantize_fp4_kernel", "fp4_grouped_linear", "moe_experts_fp4"]

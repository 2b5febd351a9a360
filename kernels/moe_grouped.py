"""Routed experts for prefill: a Triton grouped GEMM with the SwiGLU fused into the gate/up GEMM.

``kernels.moe.moe_experts`` runs ``torch._grouped_mm`` twice with a SwiGLU kernel between them.
At prefill sizes (8K tokens: ~192 rows per expert) this module's kernel replaces that:

    act = swiglu(xs @ gate_up[e]ᵀ)     one program per (expert, BN gate columns + the BN matching up
                                        columns, BM rows): two accumulators, SwiGLU in the epilogue,
                                        (M, 2I) never reaches memory
    y   = act @ down[e]ᵀ               the same kernel without the SwiGLU

The epilogue rounds both accumulators to the output dtype first (the unfused path's ``(M, 2I)``
GEMM output), then in fp32: V4's ``swiglu_rows`` (clamps always, ``tl.exp``), or with a per-row
routing weight V4.1's ``kernels.v41_moe.weighted_swiglu`` (``w · (silu(min(g, L)) · clamp(u, -L,
L))``, no clamps where L ≤ 0, ``g / (1 + expf(-g))`` with libdevice's ``expf`` and a correctly
rounded division on CUDA, plain ``/`` and ``tl.exp`` under the interpreter). One kernel; constexpr
switches pick the epilogue.

Tile schedule without a host sync: the launch covers an upper bound of tiles
(``cdiv(M, BM) + E`` row tiles × column tiles), each program finds its expert by a binary search
over the per-expert program offsets (computed on the device), programs past the end exit. Programs
of one expert are consecutive (column tile major, row tile minor), so the row tiles of an expert
read each weight tile at about the same time (one HBM read) and the expert's rows stay in L2.
Rows of a tile past the expert's end are clamped on load and masked on store. An expert's last
tile with at most ``GemmConfig.tail`` rows runs as a ``tail``-row tile (the same tile code with
fewer rows): at V4.1's ~128 rows per expert about half the experts spill a few rows past one
128-row tile, and the tensor cores are what bounds the padded 128-row tiles. With ``rows`` the
loads gather the GEMM's rows from the unsorted token rows (no sorted copy of them in memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels._common import HAS_TRITON, INTERPRET, dot_precision, mma, tl, triton, use_triton

class GemmConfig(NamedTuple):
    """One grouped GEMM launch: rows and columns per tile, K step, warps, pipeline stages, and
    ``tail``: an expert's last tile with at most this many rows runs as a ``tail``-row tile (0:
    always ``bm`` rows; at ~128 rows per expert half the experts spill a few rows into a second
    mostly empty 128-row tile). A plain 5- or 6-tuple in this order is taken too."""

    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int
    tail: int = 0


@dataclass(frozen=True)
class GroupedMoETuning:
    """When ``kernels.moe.moe_experts`` takes this path, and its launch configs (the bench sweeps them).

    ``up``/``down``: ``GemmConfig`` of the gate/up (BN: gate columns; the tile is BM × 2·BN) and the
    down GEMM; None = ``torch._grouped_mm`` (kernels.moe) for that GEMM. ``min_rows``..``max_rows``:
    the N·k slots this path takes (decode batches stay on ``_grouped_mm``). Run 8 (H200, 256
    experts): at 2K tokens (12K slots, ~48 rows per expert, weight-bound) up+SwiGLU 2.12 ms vs 2.68,
    down 1.11 vs 1.33 for ``_grouped_mm``; at 8K (49K slots) ``_grouped_mm`` wins (up 3.18 vs 3.73,
    down 1.72 vs 1.89 ms).
    """

    up: GemmConfig | None = (64, 128, 64, 4, 4)
    down: GemmConfig | None = (64, 128, 64, 4, 4)
    min_rows: int = 4096
    max_rows: int = 16384


GROUPED_MOE = GroupedMoETuning()  # the default


def tile_schedule(offs: torch.Tensor, bm: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row starts ``(E,)`` int32 and per-expert program offsets ``(E+1,)`` int32 (exclusive scan)
    of the groups ending at ``offs``: ``bm``-row tiles × ``n_tiles`` column tiles a group (the
    launch of this module's kernel and ``kernels.moe_fp4_fp8``'s scratch GEMM; ``group_of``)."""
    ends = offs.to(torch.int32)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + bm - 1) // bm * n_tiles
    pstart = torch.cat([ends.new_zeros(1), torch.cumsum(tiles, 0, dtype=torch.int32)])
    return starts, pstart


def grouped_mm(
    xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, swiglu_limit: float | None = None,
    row_weight: torch.Tensor | None = None, rows: torch.Tensor | None = None, cfg: GemmConfig | tuple = (64, 128, 64, 4, 4),
) -> torch.Tensor:  # fmt: skip
    """Rows ``xs (M, K)`` sorted by group (group ``g`` = rows ``[offs[g-1], offs[g])``) times
    ``w[g]ᵀ`` (``w (E, N, K)``) → ``(M, N)``; with ``swiglu_limit`` ``w`` holds gate rows ``[:N/2]``
    and up rows ``[N/2:]`` and the result is the clamped SwiGLU ``(M, N/2)`` (``swiglu_rows``);
    with ``row_weight (M,)`` fp32 as well, V4.1's weighted SwiGLU (``weighted_swiglu``, module
    docstring). ``rows (M,)`` int: the GEMM's row ``i`` is ``xs[rows[i]]`` (the gather done by the
    loads; ``xs`` then has any number of rows). Triton only."""
    m, k = xs.shape if rows is None else (rows.numel(), xs.shape[1])
    e, n, k2 = w.shape
    assert k == k2 and xs.stride(-1) == 1 and w.stride(-1) == 1
    weighted = row_weight is not None
    assert not weighted or (swiglu_limit is not None and row_weight.shape == (m,) and row_weight.dtype == torch.float32), (
        "row_weight: (M,) fp32, with swiglu_limit"
    )
    bm, bn, bk, warps, stages, tail = GemmConfig(*cfg)
    if xs.element_size() == 4:  # fp32 tiles (tests) take twice the shared memory per stage
        stages = min(stages, 2)
    assert k % bk == 0
    n_out = n // 2 if swiglu_limit is not None else n
    out = torch.empty(m, n_out, dtype=xs.dtype, device=xs.device)
    if m == 0:
        return out
    n_tiles = triton.cdiv(n_out, bn)
    starts, pstart = tile_schedule(offs, bm, n_tiles)
    grid = ((triton.cdiv(m, bm) + e) * n_tiles,)
    limit = float(swiglu_limit or 0.0)
    _gmm_kernel[grid](
        xs, w, out, starts, offs, pstart, row_weight.contiguous() if weighted else out, rows if rows is not None else offs,
        e, m, n_out, k, xs.stride(0), w.stride(0), w.stride(1), out.stride(0), limit, n_tiles, n_out,
        BM=bm, BN=bn, BK=bk, TAIL=tail if 0 < tail < bm else 0, SWIGLU=swiglu_limit is not None, WEIGHTED=weighted,
        CLAMP=not weighted or limit > 0, EXACT=weighted and not INTERPRET, GATHER=rows is not None,
        LOG_E=max(1, (e - 1).bit_length()) + 1, PRECISION=dot_precision(xs.dtype), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def grouped_mm_reference(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, swiglu_limit: float | None = None) -> torch.Tensor:
    """One ``F.linear`` per group (fp32 math), the SwiGLU as ``kernels.moe`` applies it."""
    import torch.nn.functional as F

    outs, start = [], 0
    for g, end in enumerate(offs.tolist()):
        h = xs[start:end].float() @ w[g].float().t()
        if swiglu_limit is not None:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate.clamp(max=swiglu_limit)) * up.clamp(min=-swiglu_limit, max=swiglu_limit)
        outs.append(h)
        start = end
    return torch.cat(outs).to(xs.dtype)


def moe_experts_prefill(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float,
    add: torch.Tensor | None = None, tuning: GroupedMoETuning = GROUPED_MOE,
) -> torch.Tensor:  # fmt: skip
    """``kernels.moe.moe_experts`` with this module's grouped GEMMs (``tuning.up``/``down``; a
    ``None`` config keeps ``torch._grouped_mm`` for that GEMM); ``add`` as there."""
    from kernels.moe import grouped_experts, grouped_linear, swiglu_rows

    n_exp = gate_up.shape[0]

    def up(xs, offs, counts):
        if tuning.up is None:
            return swiglu_rows(grouped_linear(xs, gate_up, offs, counts), limit)
        return grouped_mm(xs, gate_up, offs, swiglu_limit=limit, cfg=tuning.up)

    def dn(act, offs, counts):
        if tuning.down is None:
            return grouped_linear(act, down, offs, counts)
        return grouped_mm(act, down, offs, cfg=tuning.down)

    return grouped_experts(x, weights, indices, n_exp, gate_up.shape[1] // 2, limit, up, dn, fused_act=True, add=add)


def use_prefill_gemm(x: torch.Tensor, indices: torch.Tensor, tuning: GroupedMoETuning = GROUPED_MOE) -> bool:
    return (
        use_triton(x) and x.dtype in (torch.bfloat16, torch.float16) and tuning.min_rows <= indices.numel() <= tuning.max_rows
        and (tuning.up is not None or tuning.down is not None)
    )  # fmt: skip


if HAS_TRITON:
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def group_of(pstart_ptr, pid, E, LOG_E: tl.constexpr):
        """The group of program ``pid``: the largest ``e`` with ``pstart[e] <= pid`` (a binary
        search over ``tile_schedule``'s offsets; empty groups have no programs: equal offsets)."""
        lo = pid * 0
        hi = lo + E
        for _ in tl.static_range(LOG_E):
            mid = (lo + hi) // 2
            go = (tl.load(pstart_ptr + mid) <= pid) & (hi - lo > 1)
            lo = tl.where(go, mid, lo)
            hi = tl.where(go | (hi - lo <= 1), hi, mid)
        return lo

    @triton.jit
    def _gmm_tile(
        x_ptr, w_ptr, out_ptr, rw_ptr, src_ptr, e, r0, r1, n_t, M, N_OUT, K,
        stride_x, stride_we, stride_wn, stride_o, limit, up_off,
        TM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWIGLU: tl.constexpr, WEIGHTED: tl.constexpr,
        CLAMP: tl.constexpr, EXACT: tl.constexpr, GATHER: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[r0, r1)`` (at most ``TM``) of expert ``e`` times its column tile ``n_t``:
        the K loop, the epilogue (module docstring) and the masked store."""
        rows = r0 + tl.arange(0, TM)
        r_ok = rows < r1
        rows_c = tl.minimum(rows, M - 1).to(tl.int64)
        if GATHER:  # the GEMM's row i is x's row src[i]
            a_rows = tl.load(src_ptr + rows_c).to(tl.int64)
        else:
            a_rows = rows_c
        cols = n_t * BN + tl.arange(0, BN)
        c_ok = cols < N_OUT
        cols_c = tl.minimum(cols, N_OUT - 1).to(tl.int64)
        kk = tl.arange(0, BK)
        a_ptrs = x_ptr + a_rows[:, None] * stride_x + kk[None, :]
        w_base = w_ptr + e.to(tl.int64) * stride_we
        b_ptrs = w_base + cols_c[None, :] * stride_wn + kk[:, None]  # (BK, BN)
        acc = tl.zeros((TM, BN), dtype=tl.float32)
        if SWIGLU:
            u_ptrs = b_ptrs + up_off * stride_wn
            acc2 = tl.zeros((TM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(a_ptrs + k0)
            b = tl.load(b_ptrs + k0)
            if PRECISION == "interpret":
                acc += mma(a, b, PRECISION)
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if SWIGLU:
                u = tl.load(u_ptrs + k0)
                if PRECISION == "interpret":
                    acc2 += mma(a, u, PRECISION)
                else:
                    acc2 = tl.dot(a, u, acc2, input_precision=PRECISION)
        ty = out_ptr.dtype.element_ty
        if SWIGLU:  # the GEMM's outputs in the output dtype, then the SwiGLU in fp32 (module docstring)
            g = acc.to(ty).to(tl.float32)
            up = acc2.to(ty).to(tl.float32)
            if CLAMP:
                g = tl.minimum(g, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
            if EXACT:  # PyTorch's CUDA silu: x / (1 + expf(-x)), IEEE exp and division
                res = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)) * up
            else:
                res = g / (1.0 + tl.exp(-g)) * up
            if WEIGHTED:
                res = tl.load(rw_ptr + rows_c)[:, None] * res
        else:
            res = acc
        o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
        tl.store(o_ptrs, res.to(ty), mask=r_ok[:, None] & c_ok[None, :])

    @triton.jit
    def _gmm_kernel(
        x_ptr, w_ptr, out_ptr, start_ptr, end_ptr, pstart_ptr, rw_ptr, src_ptr,
        E, M, N_OUT, K, stride_x, stride_we, stride_wn, stride_o, limit, n_tiles, up_off,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TAIL: tl.constexpr, SWIGLU: tl.constexpr,
        WEIGHTED: tl.constexpr, CLAMP: tl.constexpr, EXACT: tl.constexpr, GATHER: tl.constexpr,
        LOG_E: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        total = tl.load(pstart_ptr + E)
        if pid < total:
            e = group_of(pstart_ptr, pid, E, LOG_E)
            row0 = tl.load(start_ptr + e)
            row1 = tl.load(end_ptr + e)
            m_tiles = (row1 - row0 + BM - 1) // BM
            local = pid - tl.load(pstart_ptr + e)
            n_t = local // m_tiles
            r0 = row0 + (local % m_tiles) * BM
            r1 = tl.minimum(r0 + BM, row1)
            if TAIL > 0 and r1 - r0 <= TAIL:  # an expert's last few rows: a TAIL-row tile, not a BM-row one
                _gmm_tile(
                    x_ptr, w_ptr, out_ptr, rw_ptr, src_ptr, e, r0, r1, n_t, M, N_OUT, K, stride_x, stride_we, stride_wn, stride_o,
                    limit, up_off, TAIL, BN, BK, SWIGLU, WEIGHTED, CLAMP, EXACT, GATHER, PRECISION,
                )  # fmt: skip
            else:
                _gmm_tile(
                    x_ptr, w_ptr, out_ptr, rw_ptr, src_ptr, e, r0, r1, n_t, M, N_OUT, K, stride_x, stride_we, stride_wn, stride_o,
                    limit, up_off, BM, BN, BK, SWIGLU, WEIGHTED, CLAMP, EXACT, GATHER, PRECISION,
                )  # fmt: skip


__all__ = ["grouped_mm", "grouped_mm_reference", "moe_experts_prefill", "use_prefill_gemm"]


SHAPES = {"v4": (256, 4096, 2048, 6), "v41": (384, 5120, 2304, 6)}  # (experts, hidden, inter, top-k)
UP_CONFIGS: list[GemmConfig] = [  # BN: gate columns (the tile is BM × 2·BN); 8 warps for BM 128; 6th: tail rows
    (64, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4), (64, 256, 64, 8, 3), (128, 128, 64, 8, 4, 32), (128, 128, 64, 8, 4, 64),
]  # fmt: skip
DOWN_CONFIGS: list[GemmConfig] = [
    (64, 128, 64, 4, 4), (64, 256, 64, 4, 3), (64, 256, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 256, 64, 8, 4, 32), (128, 256, 64, 8, 4, 64),
]  # fmt: skip


def _sweep(shape: str, tokens: list[int], iters: int = 10) -> list[dict]:  # pragma: no cover - device only
    """Microbench at ``SHAPES[shape]``, uniform random top-k routing: each GEMM per config of
    ``UP_CONFIGS`` / ``DOWN_CONFIGS`` against the torch path (``torch._grouped_mm``, then for gate|up
    V4's ``swiglu_rows`` or V4.1's ``weighted_swiglu``; the fused kernel takes the same epilogue).
    A config that does not compile or fit the shared memory prints its error and is skipped.
    Returns one row per (tokens, GEMM, config); ``err``: max |Δ| / max |torch path|."""
    from kernels.moe import swiglu_rows
    from kernels.v41_moe import weighted_swiglu

    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    e, h, i, top = SHAPES[shape]
    v41, limit = shape == "v41", 10.0 if shape == "v41" else 7.0
    gate_up = torch.randn(e, 2 * i, h, device=dev, dtype=bf16) * h**-0.5
    down = torch.randn(e, h, i, device=dev, dtype=bf16) * i**-0.5

    def t_ms(fn):
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / iters

    rows = []
    for n in tokens:
        flat = torch.rand(n, e, device=dev).argsort(dim=-1)[:, :top].reshape(-1)
        offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
        m = flat.numel()
        xs = torch.randn(m, h, device=dev, dtype=bf16)
        act = torch.randn(m, i, device=dev, dtype=bf16)
        rw = torch.rand(m, device=dev) if v41 else None

        def torch_up():
            hh = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)
            return weighted_swiglu(hh, rw, limit) if v41 else swiglu_rows(hh, limit)

        gemms = {
            "up": (2.0 * m * h * 2 * i, gate_up.numel() * 2, UP_CONFIGS, torch_up,
                   lambda c: grouped_mm(xs, gate_up, offs, swiglu_limit=limit, row_weight=rw, cfg=c)),
            "down": (2.0 * m * i * h, down.numel() * 2, DOWN_CONFIGS, lambda: torch._grouped_mm(act, down.transpose(-2, -1), offs=offs),
                     lambda c: grouped_mm(act, down, offs, cfg=c)),
        }  # fmt: skip
        for name, (flop, nbytes, configs, ref, fused) in gemms.items():
            want = ref().float()
            for c in [None, *configs]:
                try:
                    fn = ref if c is None else (lambda c=c: fused(c))
                    err = ((fn().float() - want).abs().max() / want.abs().max()).item()
                    t = t_ms(fn)
                except Exception as exc:  # noqa: BLE001 - a config that cannot compile or fit
                    print(f"{shape} n={n} {name} {c}: failed {exc!r}"[:300], flush=True)
                    continue
                row = {"shape": shape, "tokens": n, "rows": m, "gemm": name, "config": c or "torch", "ms": t,
                       "tflops": flop / t / 1e9, "weight_gbps": nbytes / t / 1e6, "err": err}  # fmt: skip
                rows.append(row)
                print(f"{shape} n={n} rows={m} {name} {row['config']}: {t:.3f} ms {row['tflops']:.0f} TF/s "
                      f"{row['weight_gbps']:.0f} GB/s err {err:.1e}", flush=True)  # fmt: skip
            best = min((r for r in rows if r["shape"] == shape and r["tokens"] == n and r["gemm"] == name and r["err"] < 1e-2), key=lambda r: r["ms"])
            print(f"{shape} n={n} {name} best {best['config']} {best['ms']:.3f} ms", flush=True)
    return rows


if __name__ == "__main__":  # pragma: no cover
    import argparse
    import json

    ap = argparse.ArgumentParser(description="grouped GEMM configs against torch._grouped_mm (CUDA)")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["v41"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[8192, 2048])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", help="JSON of every row")
    args = ap.parse_args()
    results = [r for s in args.shapes for r in _sweep(s, args.tokens, args.iters)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

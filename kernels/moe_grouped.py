"""Routed experts for prefill: a Triton grouped GEMM with the SwiGLU fused into the gate/up GEMM.

``kernels.moe.moe_experts`` runs ``torch._grouped_mm`` twice with a SwiGLU kernel between them.
At prefill sizes (8K tokens: ~192 rows per expert) this module's kernel replaces that:

    act = swiglu(xs @ gate_up[e]ᵀ)     one program per (expert, BN gate columns + the BN matching up
                                        columns, BM rows): two accumulators, SwiGLU in the epilogue,
                                        (M, 2I) never reaches memory
    y   = act @ down[e]ᵀ               the same kernel without the SwiGLU

Tile schedule without a host sync: the launch covers an upper bound of tiles
(``cdiv(M, BM) + E`` row tiles × column tiles), each program finds its expert by a binary search
over the per-expert program offsets (computed on the device), programs past the end exit. Programs
of one expert are consecutive (column tile major, row tile minor), so the row tiles of an expert
read each weight tile at about the same time (one HBM read) and the expert's rows stay in L2.
Rows of a tile past the expert's end are clamped on load and masked on store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._common import HAS_TRITON, dot_precision, mma, tl, triton, use_triton

GemmConfig = tuple[int, int, int, int, int]  # (BM, BN, BK, num_warps, num_stages)


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


def _schedule(offs: torch.Tensor, bm: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row starts ``(E,)`` int32 and per-expert program offsets ``(E+1,)`` int32 (exclusive scan)."""
    ends = offs.to(torch.int32)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + bm - 1) // bm * n_tiles
    pstart = torch.cat([ends.new_zeros(1), torch.cumsum(tiles, 0, dtype=torch.int32)])
    return starts, pstart


def grouped_mm(
    xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, swiglu_limit: float | None = None,
    cfg: tuple[int, int, int, int, int] = (64, 128, 64, 4, 4),
) -> torch.Tensor:  # fmt: skip
    """Rows ``xs (M, K)`` sorted by group (group ``g`` = rows ``[offs[g-1], offs[g])``) times
    ``w[g]ᵀ`` (``w (E, N, K)``) → ``(M, N)``; with ``swiglu_limit`` ``w`` holds gate rows ``[:N/2]``
    and up rows ``[N/2:]`` and the result is the clamped SwiGLU ``(M, N/2)``. Triton only."""
    m, k = xs.shape
    e, n, k2 = w.shape
    assert k == k2 and xs.stride(-1) == 1 and w.stride(-1) == 1
    bm, bn, bk, warps, stages = cfg
    if xs.element_size() == 4:  # fp32 tiles (tests) take twice the shared memory per stage
        stages = min(stages, 2)
    assert k % bk == 0
    n_out = n // 2 if swiglu_limit is not None else n
    out = torch.empty(m, n_out, dtype=xs.dtype, device=xs.device)
    if m == 0:
        return out
    n_tiles = triton.cdiv(n_out, bn)
    starts, pstart = _schedule(offs, bm, n_tiles)
    grid = ((triton.cdiv(m, bm) + e) * n_tiles,)
    _gmm_kernel[grid](
        xs, w, out, starts, offs, pstart, e, m, n_out, k, xs.stride(0), w.stride(0), w.stride(1), out.stride(0),
        float(swiglu_limit or 0.0), n_tiles, n_out,
        BM=bm, BN=bn, BK=bk, SWIGLU=swiglu_limit is not None, LOG_E=max(1, (e - 1).bit_length()) + 1,
        PRECISION=dot_precision(xs.dtype), num_warps=warps, num_stages=stages,
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

    @triton.jit
    def _gmm_kernel(
        x_ptr, w_ptr, out_ptr, start_ptr, end_ptr, pstart_ptr,
        E, M, N_OUT, K, stride_x, stride_we, stride_wn, stride_o, limit, n_tiles, up_off,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWIGLU: tl.constexpr, LOG_E: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        total = tl.load(pstart_ptr + E)
        if pid < total:
            # largest e with pstart[e] <= pid (empty experts have no programs: equal offsets)
            lo = pid * 0
            hi = lo + E
            for _ in tl.static_range(LOG_E):
                mid = (lo + hi) // 2
                go = (tl.load(pstart_ptr + mid) <= pid) & (hi - lo > 1)
                lo = tl.where(go, mid, lo)
                hi = tl.where(go | (hi - lo <= 1), hi, mid)
            e = lo
            row0 = tl.load(start_ptr + e)
            row1 = tl.load(end_ptr + e)
            m_tiles = (row1 - row0 + BM - 1) // BM
            local = pid - tl.load(pstart_ptr + e)
            n_t = local // m_tiles
            m_t = local % m_tiles
            rows = row0 + m_t * BM + tl.arange(0, BM)
            r_ok = rows < row1
            rows_c = tl.minimum(rows, M - 1).to(tl.int64)
            cols = n_t * BN + tl.arange(0, BN)
            c_ok = cols < N_OUT
            cols_c = tl.minimum(cols, N_OUT - 1).to(tl.int64)
            kk = tl.arange(0, BK)
            a_ptrs = x_ptr + rows_c[:, None] * stride_x + kk[None, :]
            w_base = w_ptr + e.to(tl.int64) * stride_we
            b_ptrs = w_base + cols_c[None, :] * stride_wn + kk[:, None]  # (BK, BN)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if SWIGLU:
                u_ptrs = b_ptrs + up_off * stride_wn
                acc2 = tl.zeros((BM, BN), dtype=tl.float32)
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
            if SWIGLU:  # as kernels.moe: the GEMM's bf16 outputs, then the clamped SwiGLU in fp32
                g = tl.minimum(acc.to(ty).to(tl.float32), limit)
                up = tl.minimum(tl.maximum(acc2.to(ty).to(tl.float32), -limit), limit)
                res = g / (1.0 + tl.exp(-g)) * up
            else:
                res = acc
            o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
            tl.store(o_ptrs, res.to(ty), mask=r_ok[:, None] & c_ok[None, :])


__all__ = ["grouped_mm", "grouped_mm_reference", "moe_experts_prefill", "use_prefill_gemm"]


def _sweep(out_dir: str = ".") -> None:  # pragma: no cover - device only
    """Microbench on the bench's shapes (H 4096, I 2048, 256 experts, top-6, uniform random
    routing): each GEMM per config against ``torch._grouped_mm`` (+ the SwiGLU kernel for gate/up).
    Writes the fastest config of each GEMM to ``best_up`` / ``best_down`` (``torch`` if it wins)."""
    from kernels.moe import swiglu_rows

    torch.manual_seed(0)
    dev = "cuda"
    e, h, i, top = 256, 4096, 2048, 6
    gate_up = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * h**-0.5
    down = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * i**-0.5

    def t_ms(fn, iters=10):
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / iters

    ups = [(64, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 5)]
    downs = [(64, 256, 64, 4, 4), (64, 256, 64, 4, 3), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4)]
    best = {}
    for n in (8192, 2048):
        idx = torch.rand(n, e, device=dev).argsort(dim=-1)[:, :top]
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=e)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        m = flat.numel()
        xs = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
        act = torch.randn(m, i, device=dev, dtype=torch.bfloat16)
        f_up, f_dn = 2.0 * m * h * 2 * i, 2.0 * m * i * h
        ref_up = t_ms(lambda: swiglu_rows(torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs), 7.0))
        ref_dn = t_ms(lambda: torch._grouped_mm(act, down.transpose(-2, -1), offs=offs))
        print(f"n={n} rows={m}: torch up+swiglu {ref_up:.3f} ms ({f_up / ref_up / 1e9:.0f} TF/s), down {ref_dn:.3f} ms ({f_dn / ref_dn / 1e9:.0f} TF/s)", flush=True)
        cand_up, cand_dn = [("torch", ref_up)], [("torch", ref_dn)]
        want = swiglu_rows(torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs), 7.0).float()
        for c in ups:
            try:
                got = grouped_mm(xs, gate_up, offs, swiglu_limit=7.0, cfg=c)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                t = t_ms(lambda c=c: grouped_mm(xs, gate_up, offs, swiglu_limit=7.0, cfg=c))
                print(f"  up {c}: {t:.3f} ms ({f_up / t / 1e9:.0f} TF/s) err {err:.1e}", flush=True)
                cand_up.append((".".join(map(str, c)), t if err < 1e-2 else 1e9))
            except Exception as exc:  # noqa: BLE001
                print(f"  up {c}: failed {exc!r}"[:300], flush=True)
        want = torch._grouped_mm(act, down.transpose(-2, -1), offs=offs).float()
        for c in downs:
            try:
                got = grouped_mm(act, down, offs, cfg=c)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                t = t_ms(lambda c=c: grouped_mm(act, down, offs, cfg=c))
                print(f"  down {c}: {t:.3f} ms ({f_dn / t / 1e9:.0f} TF/s) err {err:.1e}", flush=True)
                cand_dn.append((".".join(map(str, c)), t if err < 1e-2 else 1e9))
            except Exception as exc:  # noqa: BLE001
                print(f"  down {c}: failed {exc!r}"[:300], flush=True)
        best[n] = (min(cand_up, key=lambda a: a[1])[0], min(cand_dn, key=lambda a: a[1])[0])
        print(f"n={n} best up {best[n][0]} down {best[n][1]}", flush=True)
    with open(f"{out_dir}/best_up", "w") as f:
        f.write(best[8192][0])
    with open(f"{out_dir}/best_down", "w") as f:
        f.write(best[8192][1])


if __name__ == "__main__":  # pragma: no cover
    import sys

    _sweep(sys.argv[1] if len(sys.argv) > 1 else ".")

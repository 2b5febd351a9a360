"""Each kernel of ``kernels/`` against its PyTorch reference, on DeepSeek-V4-Flash shapes, one run.

    python -m bench.kernels_bench --output FILE.json [--only attn,indexer,pool,route,moe] [--tiny]

Per case: median time of ours and of the reference (CUDA events, L2 flushed before every run),
the fewest bytes the call must move and the FLOPs it must do, and the fraction of the H200's
measured ceilings reached: copy bandwidth 4.24 TB/s (bytes read + written) and bf16 matmul
787 TFLOP/s (GPU.md). ``rel_err`` = ‖ours − ref‖ / ‖ref‖ on the same inputs. Attention and the
indexer also report ours replayed from a CUDA graph (launch overhead removed).

Shapes: decode batch 1, 16, 64 at 1K and 32K context; 64 heads × 512 (attention), 64 × 128
(indexer, top-512), CSA r=4 / HCA r=128 (compressors), 256 experts top-6, hidden 4096,
intermediate 2048 (MoE; the full 12.9 GB of one layer's experts in bf16). ``--tiny`` runs small
shapes on any device (CPU: wall-clock timing, references only unless ``TRITON_INTERPRET=1``) to
check the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial

import torch

from kernels import _common
from kernels.compressor import gated_pool, gated_pool_cost, gated_pool_reference
from kernels.decode_attention import (
    decode_attention,
    decode_attention_cost,
    decode_attention_reference,
)
from kernels.indexer import (
    indexer_cost,
    indexer_scores,
    indexer_scores_reference,
    indexer_topk,
    indexer_topk_reference,
)
from kernels.moe import (
    moe_cost,
    moe_experts,
    moe_experts_reference,
    route,
    route_reference,
)
from bench.kernel_helpers import attn_inputs, pool_inputs, rel_err

COPY_BW = 4.24e12  # bytes/s, H200 device-to-device copy, read + write (GPU.md)
MM_RATE = 787e12  # FLOP/s, H200 bf16 8192³ matmul (GPU.md)


class Timer:
    """Median milliseconds of ``fn``; on CUDA with events around each run and the L2 flushed
    before it (a 256 MB memset, outside the timed region)."""

    def __init__(self, device: torch.device, budget_ms: float = 60.0) -> None:
        self.cuda = device.type == "cuda"
        self.budget_ms = budget_ms
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def _once(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def __call__(self, fn: Callable[[], object], max_reps: int = 100) -> float:
        fn()  # compile / warm up
        est = statistics.median(self._once(fn) for _ in range(3))
        reps = int(min(max_reps, max(3, self.budget_ms / max(est, 1e-3))))
        return statistics.median(self._once(fn) for _ in range(reps))

    def graph(self, fn: Callable[[], object]) -> float | None:
        """Median ms of one replay of ``fn`` captured in a CUDA graph (None off CUDA)."""
        if not self.cuda:
            return None
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            return self(g.replay)
        except Exception as exc:  # noqa: BLE001 - not capturable: say so, keep the eager numbers
            print(f"graph capture failed: {exc!r}"[:300], flush=True)
            return None


def copy_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * 10 * a.numel() / (start.elapsed_time(end) / 1e3)


def row(kernel: str, case: str, ours: float | None, ref: float | None, nbytes: float, flops: float, err: float | None, **extra) -> dict:
    out = {"kernel": kernel, "case": case, "ours_ms": ours, "ref_ms": ref, "bytes": nbytes, "flops": flops, "rel_err": err}
    if ours:
        out["speedup"] = ref / ours if ref else None
        out["bw_frac"] = nbytes / (ours * 1e-3) / COPY_BW
        out["mm_frac"] = flops / (ours * 1e-3) / MM_RATE
    out.update(extra)
    return out


# ---- cases ---------------------------------------------------------------------------------------------
def bench_attention(t: Timer, dev: str, tiny: bool, rows: list[dict]) -> None:
    h, d, w, topk = (8, 64, 16, 16) if tiny else (64, 512, 128, 512)
    batches, ctxs = ((1, 3), (256,)) if tiny else ((1, 16, 64), (1024, 32768))
    for ctx in ctxs:
        for b in batches:
            for mode in ("csa", "hca"):
                n = ctx // 4 if mode == "csa" else ctx // (8 if tiny else 128)
                k = min(topk, n)
                inp = attn_inputs(b, h, d, w, mode, n, k, torch.bfloat16, dev, seed=b, full_window=True)
                args = inp.args()
                ours_fn = partial(decode_attention, **args, max_rows=n)
                out = ours_fn()
                ref = decode_attention_reference(**args)
                keys = w + (k if mode == "csa" else n)
                nbytes, flops = decode_attention_cost(b, h, d, keys)
                nbytes += 4 * b * k if mode == "csa" else 0
                t_ours, t_ref = t(ours_fn), t(partial(decode_attention_reference, **args), max_reps=20)
                graph = t.graph(ours_fn)
                rows.append(row("decode_attention", f"{mode} B={b} ctx={ctx} keys={keys}", t_ours, t_ref, nbytes, flops, rel_err(out, ref), graph_ms=graph))
                if not tiny and b == 64 and ctx == 32768 and mode == "csa":
                    for bh, bn, nw in ((32, 32, 8), (16, 64, 4), (16, 16, 4)):
                        try:
                            fn = partial(decode_attention, **args, block_h=bh, block_n=bn, num_warps=nw)
                            err = rel_err(fn(), ref)
                            rows.append(row("decode_attention", f"  variant BH={bh} BN={bn} warps={nw}", t(fn), None, nbytes, flops, err))
                        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result too
                            rows.append({"kernel": "decode_attention", "case": f"  variant BH={bh} BN={bn}", "error": repr(exc)[:300]})


def bench_indexer(t: Timer, dev: str, tiny: bool, rows: list[dict]) -> None:
    hi, di, topk = (8, 16, 8) if tiny else (64, 128, 512)
    batches, ctxs = ((1, 3), (256,)) if tiny else ((1, 16, 64), (1024, 32768))
    for ctx in ctxs:
        for b in batches:
            n = ctx // 4
            g = torch.Generator().manual_seed(b)
            q = torch.randn(b, hi, di, generator=g).to(dev, torch.bfloat16)
            wts = torch.randn(b, hi, generator=g).to(dev, torch.bfloat16)
            pool = torch.randn(b * n, di, generator=g).to(dev, torch.bfloat16)
            start = (torch.arange(b) * n).to(dev)
            length = torch.full((b,), n, device=dev)
            scale = di**-0.5 * hi**-0.5
            ours_fn = partial(indexer_topk, q, wts, pool, start, length, topk, scale, t_max=n)
            ref_fn = partial(indexer_topk_reference, q, wts, pool, start, length, topk, scale, t_max=n)
            err = rel_err(indexer_scores(q, wts, pool, start, length, scale, t_max=n), indexer_scores_reference(q, wts, pool, start, length, scale, t_max=n))
            nbytes, flops = indexer_cost(b, hi, di, n)
            t_scores = t(partial(indexer_scores, q, wts, pool, start, length, scale, t_max=n))
            rows.append(row("indexer", f"topk B={b} ctx={ctx} rows={n}", t(ours_fn), t(ref_fn, max_reps=20), nbytes, flops, err, scores_only_ms=t_scores, graph_ms=t.graph(ours_fn)))
            rows.append(row("indexer", f"  scores only B={b} ctx={ctx}", t_scores, None, nbytes, flops, err))
            if not tiny and b == 64 and ctx == 32768:
                for bt, nw in ((128, 8), (32, 4)):
                    fn = partial(indexer_scores, q, wts, pool, start, length, scale, t_max=n, block_t=bt, num_warps=nw)
                    try:
                        rows.append(row("indexer", f"  scores variant BT={bt} warps={nw}", t(fn), None, nbytes, flops, err))
                    except Exception as exc:  # noqa: BLE001
                        rows.append({"kernel": "indexer", "case": f"  scores variant BT={bt}", "error": repr(exc)[:300]})


def bench_pool(t: Timer, dev: str, tiny: bool, rows: list[dict]) -> None:
    kinds = [("csa", 4, 64 if tiny else 512, True), ("csa-indexer", 4, 16 if tiny else 128, True), ("hca", 8 if tiny else 128, 64 if tiny else 512, False)]
    for name, r, d, overlap in kinds:
        for label, windows in (("B=1", [1]), ("B=16", [1] * 16), ("B=64", [1] * 64), ("prefill 8K", [8192 // r])):
            if tiny and label != "B=16":
                continue
            kv, gate, bias, win, prev = pool_inputs(windows, r, d, overlap, torch.bfloat16, dev, seed=r)
            err = rel_err(gated_pool(kv, gate, bias, win, prev, overlap), gated_pool_reference(kv, gate, bias, win, prev, overlap))
            nbytes, flops = gated_pool_cost(len(win), r, d, overlap)
            rows.append(row("gated_pool", f"{name} {label} windows={len(win)}", t(partial(gated_pool, kv, gate, bias, win, prev, overlap)),
                            t(partial(gated_pool_reference, kv, gate, bias, win, prev, overlap)), nbytes, flops, err))  # fmt: skip


def bench_route(t: Timer, dev: str, tiny: bool, rows: list[dict]) -> None:
    e, k = (64, 6) if tiny else (256, 6)
    for n in (1, 16, 64, 2048):
        g = torch.Generator().manual_seed(n)
        logits = torch.randn(n, e, generator=g).to(dev, torch.bfloat16)
        bias = (0.1 * torch.randn(e, generator=g)).to(dev)
        w, i = route(logits, k, 1.5, bias)
        w_ref, i_ref = route_reference(logits, k, 1.5, bias)
        err = rel_err(w.gather(1, i.argsort(-1)), w_ref.gather(1, i_ref.argsort(-1)))
        same = bool(torch.equal(i.sort(-1).values, i_ref.sort(-1).values))
        nbytes, flops = 2 * n * e + 12 * n * k + 4 * e, 12.0 * n * e
        rows.append(row("route", f"score N={n}", t(partial(route, logits, k, 1.5, bias)), t(partial(route_reference, logits, k, 1.5, bias)), nbytes, flops, err, same_experts=same))


def bench_moe(t: Timer, dev: str, tiny: bool, rows: list[dict]) -> None:
    e, k, hidden, inter = (16, 6, 128, 64) if tiny else (256, 6, 4096, 2048)
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(e, 2 * inter, hidden, device=dev, dtype=torch.bfloat16, generator=g) * hidden**-0.5
    down = torch.randn(e, hidden, inter, device=dev, dtype=torch.bfloat16, generator=g) * inter**-0.5
    for n in (1, 16, 64, 2048):
        x = torch.randn(n, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        logits = torch.randn(n, e, device=dev, dtype=torch.bfloat16, generator=g)
        w, idx = route(logits, k, 1.5, torch.zeros(e, device=dev))
        touched = int(idx.unique().numel())
        out = moe_experts(x, w, idx, gate_up, down, 10.0)
        ref = moe_experts_reference(x, w, idx, gate_up, down, 10.0)
        nbytes, flops = moe_cost(n, k, touched, hidden, inter)
        rows.append(row("moe_experts", f"{'decode' if n <= 64 else 'prefill'} N={n} experts={touched}", t(partial(moe_experts, x, w, idx, gate_up, down, 10.0)),
                        t(partial(moe_experts_reference, x, w, idx, gate_up, down, 10.0), max_reps=10), nbytes, flops, rel_err(out, ref)))  # fmt: skip


BENCHES = {"attn": bench_attention, "indexer": bench_indexer, "pool": bench_pool, "route": bench_route, "moe": bench_moe}


def compiled_resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of our Triton kernels."""
    import kernels.compressor as kc
    import kernels.decode_attention as ka
    import kernels.indexer as ki
    import kernels.moe as km

    out = []
    fns = [ka._decode_attn_kernel, ka._decode_attn_combine_kernel, ki._indexer_kernel, kc._gated_pool_kernel, km._route_kernel, km._swiglu_kernel, km._combine_kernel]
    for fn in fns:
        for caches in getattr(fn, "device_caches", {}).values():
            for key, k in caches[0].items():
                try:
                    k._init_handles()
                    meta = k.metadata
                    out.append({"kernel": fn.__name__, "regs": k.n_regs, "spills": k.n_spills, "shared": meta.shared, "warps": meta.num_warps, "stages": meta.num_stages, "key": str(key)[:200]})
                except Exception as exc:  # noqa: BLE001 - diagnostics only
                    out.append({"kernel": fn.__name__, "error": repr(exc)[:200]})
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict]) -> None:
    print(f"{'kernel':16s} {'case':40s} {'ours ms':>9s} {'graph ms':>9s} {'ref ms':>9s} {'speedup':>8s} {'MB':>9s} {'GFLOP':>8s} {'%BW':>6s} {'%MM':>6s} {'rel err':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:16s} {r['case']:40s} ERROR {r['error'][:90]}")
            continue
        print(
            f"{r['kernel']:16s} {r['case']:40s} {_fmt(r['ours_ms'], '9.4f')} {_fmt(r.get('graph_ms'), '9.4f')} {_fmt(r['ref_ms'], '9.3f')} "
            f"{_fmt(r.get('speedup'), '7.1f') + 'x' if r.get('speedup') else '       -'} {r['bytes'] / 1e6:9.2f} {r['flops'] / 1e9:8.2f} "
            f"{_fmt(100 * r['bw_frac'] if r.get('bw_frac') is not None else None, '5.1f')}% {_fmt(100 * r['mm_frac'] if r.get('mm_frac') is not None else None, '5.1f')}% "
            f"{_fmt(r['rel_err'], '8.1e')}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default="kernels_bench.json")
    ap.add_argument("--only", default=",".join(BENCHES), help="comma list of " + ",".join(BENCHES))
    ap.add_argument("--tiny", action="store_true", help="small shapes: checks the script, not the chip")
    ap.add_argument("--budget-ms", type=float, default=60.0, help="timed milliseconds per measurement")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    t = Timer(dev, args.budget_ms)
    info = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": getattr(_common.triton, "__version__", None),
        "interpret": _common.INTERPRET,
        "copy_bw_measured": copy_bandwidth(dev),
        "ceilings": {"copy_bw": COPY_BW, "bf16_mm": MM_RATE},
        "triton_path": _common.use_triton(torch.empty(0, device=dev)),
    }
    print(json.dumps(info), flush=True)
    rows: list[dict] = []
    failed = False
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                BENCHES[name](t, dev.type, args.tiny, rows)
        except Exception as exc:  # noqa: BLE001 - keep the other kernels numbers
            failed = True
            traceback.print_exc()
            rows.append({"kernel": name, "case": "(whole bench)", "error": repr(exc)[:300]})
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    try:
        resources = compiled_resources() if dev.type == "cuda" else []
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        resources = [{"error": repr(exc)[:300]}]
    for r in resources:
        print("compiled", json.dumps(r)[:260])
    with open(args.output, "w") as f:
        json.dump({**info, "rows": rows, "compiled": resources}, f, indent=2)
    print_table(rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The checkpoint's FP4 routed experts on CUDA at V4-Flash's shapes (256 experts, hidden 4096,
intermediate 2048, uniform random top-6): ``kernels.moe_fp4.fp4_grouped_linear``'s tiles beside
the bytes of the experts the routing touches at the copy rate measured in the same run (bytes
read + written per second, as every floor in docs/PERFORMANCE.md), at prefill sizes the bf16
scratch path and ``kernels.moe_fp4_fp8``'s FP8 kernel (its tiles: ``--fp8-grid``), and the whole
routed MoE through the GEMV kernels beside the grouped kernel at a few tokens (where
``MoEGemvTuning.fp4_max_slots`` switches).

    python -m bench.fp4_experts_bench --out OUT.json [--tokens 1 4 16 64 128] [--grid 64,128/128,256/4,8/2,3,4]
        [--fp8-grid 64,128/64/4,8/2,3,4]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch

from bench.fp8_gemm_bench import copy_rate
from bench.kernel_helpers import graph_time_ms
from kernels.moe_fp4 import GROUP, Fp4GroupedTiles, Fp4PrefillTuning, fp4_grouped_linear, moe_experts_fp4
from kernels.moe_fp4_fp8 import fp4_fp8_grouped_linear
from kernels.moe_fp4_gemv import moe_fp4_gemv

EXPERTS, HIDDEN, INTER, TOP = 256, 4096, 2048, 6
ROUTINGS = 8  # cycled, so that no call finds its experts in L2
IN_REGISTERS = Fp4PrefillTuning(min_rows_per_expert=1 << 30, fp8=False)
SCRATCH = Fp4PrefillTuning(min_rows_per_expert=1, fp8=False)


def _fp4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed codes and e8m0 scales 2^-9..2^-5 of every expert, on the GPU."""
    q = torch.randint(-128, 128, (EXPERTS, n, k // 2), dtype=torch.int8, device="cuda")
    return q, torch.randint(118, 123, (EXPERTS, n, k // GROUP), dtype=torch.uint8, device="cuda")


def eager_ms(fn: Callable[[int], object], reps: int, iters: int) -> float:
    """Milliseconds per call of ``fn(i)``, ``i = 0..reps-1``, run eagerly ``iters`` times (the
    scratch path reads the group ends on the host, so it cannot be captured)."""
    for i in range(reps):
        fn(i)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        for i in range(reps):
            fn(i)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters / reps


def grouped_rows(
    tokens: list[int], configs: list[Fp4GroupedTiles], iters: int, baseline: Callable | None = None, fp8: list[tuple] = (),
) -> list[dict]:  # fmt: skip
    """One row per (tokens, GEMM, tiles): ms per call, × the byte floor, TFLOP/s, error against the
    first case; ``baseline`` (``fp4_grouped_linear``'s signature without keywords) joins as a case.
    Each of ``fp8`` (block_m, block_n, warps, stages) adds the FP8 kernel with those tiles; from 16
    rows per expert on average the bf16 scratch path and the FP8 kernel with its default tiles
    join too, and every case is timed eagerly (else in a CUDA graph)."""
    torch.manual_seed(0)
    shapes = {"gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
    weights = {name: _fp4(n, k) for name, (n, k) in shapes.items()}
    rate = copy_rate()  # the project's floor rate: the copy's bytes read + written per second, for bytes read
    rows = []
    for t in tokens:
        routings = [torch.rand(t, EXPERTS, device="cuda").argsort(dim=-1)[:, :TOP].reshape(-1) for _ in range(ROUTINGS)]
        offs = [torch.cumsum(torch.bincount(r, minlength=EXPERTS), 0).to(torch.int32) for r in routings]
        touched = sum(int((torch.bincount(r, minlength=EXPERTS) > 0).sum()) for r in routings) / ROUTINGS
        prefill = t * TOP >= 16 * EXPERTS
        for name, (n, k) in shapes.items():
            wq, ws = weights[name]
            xs = torch.randn(t * TOP, k, device="cuda", dtype=torch.bfloat16)
            floor_ms = touched * (n * k // 2 + n * k // GROUP) / rate * 1e3
            cases = {str(c): (lambda o, c=c: fp4_grouped_linear(xs, wq, ws, o, prefill=IN_REGISTERS, tiles=c)) for c in configs}
            if baseline is not None:
                cases["baseline"] = lambda o: baseline(xs, wq, ws, o)
            if prefill:
                cases["bf16 scratch"] = lambda o: fp4_grouped_linear(xs, wq, ws, o, prefill=SCRATCH)
                cases["fp8"] = lambda o: fp4_fp8_grouped_linear(xs, wq, ws, o)
            for c in fp8:  # (no host sync: captured at decode sizes)
                cases[f"fp8 {'/'.join(map(str, c))}"] = lambda o, c=c: fp4_fp8_grouped_linear(xs, wq, ws, o, tiles=c)
            want = None
            for label, fn in cases.items():
                try:
                    got = fn(offs[0]).float()
                    want = got if want is None else want
                    err = ((got - want).norm() / want.norm()).item()
                    call = lambda i, fn=fn: fn(offs[i])  # noqa: E731
                    ms = eager_ms(call, ROUTINGS, iters) if prefill else graph_time_ms(call, ROUTINGS, iters)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit
                    print(f"tokens={t} {name} {label}: failed {exc!r}"[:300], flush=True)
                    continue
                row = {"tokens": t, "gemm": name, "config": label, "ms": ms, "floor_ms": floor_ms, "x_floor": ms / floor_ms,
                       "tflops": 2 * t * TOP * n * k / ms / 1e9, "err": err}  # fmt: skip
                rows.append(row)
                print(f"tokens={t} {name} {label}: {ms * 1e3:.1f} us, {row['x_floor']:.2f}x floor ({floor_ms * 1e3:.1f} us), "
                      f"{row['tflops']:.0f} TFLOP/s, err {err:.1e}", flush=True)  # fmt: skip
    return rows


def moe_rows(tokens: list[int], iters: int, baselines: dict[str, Callable] | None = None) -> list[dict]:
    """The whole routed MoE at a few tokens: ``moe_fp4_gemv`` (the static decode step's path up to
    ``MoEGemvTuning.fp4_max_slots`` slots) beside ``moe_experts_fp4`` (the grouped kernel) and any
    ``baselines`` of the same signature."""
    torch.manual_seed(1)
    gq, gs = _fp4(2 * INTER, HIDDEN)
    dq, ds = _fp4(HIDDEN, INTER)
    rows = []
    for t in tokens:
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(t, TOP, device="cuda")
        picks = [torch.rand(t, EXPERTS, device="cuda").argsort(dim=-1)[:, :TOP] for _ in range(ROUTINGS)]
        for label, fn in {"gemv": moe_fp4_gemv, "grouped": moe_experts_fp4, **(baselines or {})}.items():
            ms = graph_time_ms(lambda i, fn=fn: fn(x, w, picks[i], gq, gs, dq, ds, 10.0), ROUTINGS, iters)
            rows.append({"tokens": t, "gemm": "moe", "config": label, "ms": ms})
            print(f"tokens={t} moe {label}: {ms * 1e3:.1f} us", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 128])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--grid", default="64,128/128,256/4,8/2,3,4",
                    help="values to cross of Fp4GroupedTiles' fields in order (bn/bk/warps/stages)")  # fmt: skip
    ap.add_argument("--fp8-grid", default="", help="values to cross of fp4_fp8_grouped_linear's tiles: block_m/block_n/warps/stages")
    ap.add_argument("--out", help="JSON of every row")
    args = ap.parse_args()
    axes = [[int(v) for v in part.split(",")] for part in args.grid.split("/")]
    fp8 = list(itertools.product(*[[int(v) for v in part.split(",")] for part in args.fp8_grid.split("/")])) if args.fp8_grid else []
    rows = grouped_rows(args.tokens, [Fp4GroupedTiles(*c) for c in itertools.product(*axes)], args.iters, fp8=fp8)
    rows += moe_rows([t for t in args.tokens if t <= 16], args.iters)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

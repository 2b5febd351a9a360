"""The block-scaled FP8 GEMM (``kernels.fp8_gemm``) on one GPU, beside its ceilings, in one run.

    python -m bench.fp8_gemm_bench --output FILE.json [--quick]

Per V4-Flash projection shape and row count M ∈ {1, 64, 8192}: time of ours (the default tiling
and a sweep of ``Fp8GemmConfig`` variants), of ``torch._scaled_mm`` (FP8 e4m3 with row-wise
scales: the dense FP8 rate without block scales) and of bf16 ``F.linear``, all from CUDA-graph
replays that rotate over enough weight copies (≥ 256 MB) that no call finds its weight in L2.
Reported: µs, TFLOP/s, and for M ≤ 64 the byte floor (weight + scale + activation + output bytes
at the device-to-device copy rate measured in the same run, bytes read + written). Also measured
here: the copy rate, the 8192³ bf16 and FP8 (row-wise ``_scaled_mm``) matmul rates, and ours'
relative error against ``fp8_linear_reference``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from dataclasses import asdict

import torch
import torch.nn.functional as F

from kernels.fp8_gemm import FP8, Fp8GemmConfig, fp8_linear, fp8_linear_reference, quantize_act, quantize_weight, scales_to_fp32
from bench.kernel_helpers import graph_time_ms

SHAPES = {  # name: (N, K) of W (N, K)
    "wq_a 4096->1024": (1024, 4096),
    "wq_b 1024->64x512": (32768, 1024),
    "shared w1 4096->2048": (2048, 4096),
    "shared w2 2048->4096": (4096, 2048),
    "wo_b 8192->4096": (4096, 8192),
}
ROWS = (1, 64, 8192)
VARIANTS = {  # the defaults are run 2's fastest (bench/results_recorded/fp8_gemm_h200_run2.json); their neighbours
    "default": Fp8GemmConfig(),
    "no fold": Fp8GemmConfig(fold_scales=False),
    "small bn128": Fp8GemmConfig(small_block_n=128),
    "small bn32": Fp8GemmConfig(small_block_n=32),
    "small 4/sm": Fp8GemmConfig(small_programs_per_sm=4),
    "small fused": Fp8GemmConfig(fuse_quant_max_m=64),
    "large 128x128 w8 s3": Fp8GemmConfig(large_block_m=128, large_warps=8, stages=3),
    "large 64x128 s3": Fp8GemmConfig(stages=3),
    "large 128x64 s4": Fp8GemmConfig(large_block_m=128, large_block_n=64),
    "large 64x256 w8": Fp8GemmConfig(large_block_n=256, large_warps=8),
}
ROTATE_BYTES = 256 << 20


def copy_rate() -> float:
    """Device-to-device copy, bytes read + written per second: eager ``copy_`` of 4 GiB (a kernel;
    captured in a graph the same copy becomes a memcpy node, run 1: 2.77 TB/s)."""
    a = torch.empty(1 << 31, dtype=torch.int16, device="cuda").random_()
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * 5 * a.numel() * 2 / (start.elapsed_time(end) * 1e-3)


def matmul_rates() -> dict[str, float]:
    """8192³ bf16 ``mm`` and FP8 ``_scaled_mm`` (row-wise scales), FLOP/s."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * n**3
    out = {"bf16_mm": flops / (graph_time_ms(lambda i: a @ b, reps=3, replays=5) * 1e-3)}
    a8, b8 = a.to(FP8), b.to(FP8)
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    ms = graph_time_ms(lambda i: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), reps=3, replays=5)
    out["fp8_scaled_mm_rowwise"] = flops / (ms * 1e-3)
    return out


def bench_shape(name: str, n: int, k: int, m: int, copy_bps: float, quick: bool) -> dict:
    """One (shape, M) row: ours (variants), _scaled_mm, bf16 F.linear."""
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    copies = max(2, min(48, math.ceil(ROTATE_BYTES / (n * k))))
    if m >= 4096:
        copies = 2  # compute-bound: L2 reuse of the weight does not change the time
    ws_q, ws_s = [], []
    for _ in range(copies):
        q, s = quantize_weight(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
        ws_q.append(q)
        ws_s.append(scales_to_fp32(s))
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    flops = 2 * m * n * k
    row: dict = {"shape": name, "N": n, "K": k, "M": m, "weight_copies": copies}
    ref = fp8_linear_reference(x[:64], ws_q[0], ws_s[0]).float()
    row["rel_err_vs_reference"] = ((fp8_linear(x[:64], ws_q[0], ws_s[0]).float() - ref).norm() / ref.norm()).item()
    ours = {}
    for vname, cfg in VARIANTS.items():
        if quick and vname != "default":
            continue
        if m > cfg.small_m and vname.startswith("small") or m <= cfg.small_m and vname.startswith("large"):
            continue
        try:
            ms = graph_time_ms(lambda i, cfg=cfg: fp8_linear(x, ws_q[i], ws_s[i], cfg), reps=copies, replays=10 if m < 4096 else 3)
            ours[vname] = {"us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12, "tiles": cfg.tiles(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)._asdict()}
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
            ours[vname] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    row["ours"] = ours
    if m >= 4096:  # the activation pass alone (inside ours' time when the tiling does not fuse it)
        ms = graph_time_ms(lambda i: quantize_act(x), reps=2, replays=10)
        row["quantize_act_us"] = ms * 1e3
    best = min((v["us"], k_) for k_, v in ours.items() if "us" in v)
    row["ours_best"] = {"variant": best[1], "us": best[0], "tflops": flops / (best[0] * 1e-6) / 1e12}
    # torch._scaled_mm with row-wise scales (the same FP8 bytes, no block scales)
    xq = x.to(FP8)
    sx = torch.ones(m, 1, device="cuda")
    sw = torch.ones(1, n, device="cuda")
    try:
        ms = graph_time_ms(
            lambda i: torch._scaled_mm(xq, ws_q[i].t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16), reps=copies, replays=10 if m < 4096 else 3
        )
        row["scaled_mm_rowwise"] = {"us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12}
    except Exception as exc:  # noqa: BLE001
        row["scaled_mm_rowwise"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    del ws_s
    wb = [q.view(torch.uint8).to(torch.bfloat16) for q in ws_q[: max(2, copies // 2)]]  # bf16: half the copies fill as much memory
    del ws_q
    ms = graph_time_ms(lambda i: F.linear(x, wb[i]), reps=len(wb), replays=10 if m < 4096 else 3)
    row["bf16_linear"] = {"us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12}
    if m <= 64:
        nbytes = n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128) + 2 * m * k + 2 * m * n
        floor_us = nbytes / copy_bps * 1e6
        row["byte_floor_us"] = floor_us
        row["ours_over_floor"] = best[0] / floor_us
        row["bf16_byte_floor_us"] = (2 * n * k + 2 * m * k + 2 * m * n) / copy_bps * 1e6
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--quick", action="store_true", help="the default tiling only")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    result: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "variants": {k: asdict(v) for k, v in VARIANTS.items()}}
    result["copy_rate_Bps"] = copy_rate()
    result["matmul_rates_flops"] = matmul_rates()
    rows = []
    for name, (n, k) in SHAPES.items():
        for m in ROWS:
            try:
                rows.append(bench_shape(name, n, k, m, result["copy_rate_Bps"], args.quick))
            except Exception:  # noqa: BLE001 - keep the other rows
                rows.append({"shape": name, "M": m, "error": traceback.format_exc()[-1500:]})
            with open(args.output, "w") as f:
                json.dump({**result, "rows": rows}, f, indent=1)
    print(f"copy {result['copy_rate_Bps'] / 1e12:.2f} TB/s; 8192^3 bf16 {result['matmul_rates_flops']['bf16_mm'] / 1e12:.0f} TFLOP/s, "
          f"fp8 rowwise {result['matmul_rates_flops']['fp8_scaled_mm_rowwise'] / 1e12:.0f} TFLOP/s")  # fmt: skip
    print(f"{'shape':22} {'M':>5} {'ours us':>9} {'TF':>6} {'variant':>14} {'smm us':>8} {'TF':>6} {'bf16 us':>8} {'TF':>6} {'floor':>7} {'x':>5} {'err':>8}")
    for r in rows:
        if "error" in r:
            print(r["shape"], r["M"], "ERROR", r["error"][-300:])
            continue
        smm = r["scaled_mm_rowwise"]
        print(
            f"{r['shape']:22} {r['M']:>5} {r['ours_best']['us']:9.1f} {r['ours_best']['tflops']:6.0f} {r['ours_best']['variant']:>14} "
            f"{smm.get('us', float('nan')):8.1f} {smm.get('tflops', float('nan')):6.0f} {r['bf16_linear']['us']:8.1f} {r['bf16_linear']['tflops']:6.0f} "
            f"{r.get('byte_floor_us', float('nan')):7.1f} {r.get('ours_over_floor', float('nan')):5.2f} {r['rel_err_vs_reference']:8.1e}"
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

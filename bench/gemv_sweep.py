"""Config sweep of the one-token dense GEMV (``kernels/gemv.py``) on a CUDA device:
``python -m bench.gemv_sweep [OUT_DIR]`` writes ``gemv_sweep.json``."""

from __future__ import annotations

import json
import sys

import torch

from bench.kernel_helpers import graph_time_ms
from kernels.gemv import config, gemv, gemv_reference


def sweep(out_dir: str = ".", pdl: bool = True) -> None:
    """The slice's dense projections at batch 1: ``gemv`` configs (launched with ``pdl``) against
    ``F.linear``, CUDA-graph replays of 8 calls over rotated weight copies (no L2 reuse between
    calls), µs per call and TB/s of weight read."""
    dev, dt = "cuda", torch.bfloat16
    shapes = [  # (name, N, K, groups)
        ("xproj hca", 2560, 4096, 1), ("xproj csa", 4160, 4096, 1), ("q_b", 32768, 1024, 1),
        ("idx q_b", 8192, 1024, 1), ("o_a", 8192, 4096, 8), ("o_b", 4096, 8192, 1), ("router", 256, 4096, 1),
        ("lm_head", 129280, 4096, 1),
        # V4.1-Flash's (hidden 5120, q_lora 1280, 64 × 512 heads, 8 × 1024 o_lora, 384 experts)
        ("v41 q_a", 1280, 5120, 1), ("v41 q_b", 32768, 1280, 1), ("v41 idx q_b", 4096, 1280, 1), ("v41 wkv", 512, 5120, 1),
        ("v41 o_a", 8192, 4096, 8), ("v41 o_b", 5120, 8192, 1), ("v41 router", 384, 5120, 1), ("v41 lm_head", 129280, 5120, 1),
    ]  # fmt: skip
    wide = [(4, 1024, 4), (4, 2048, 4), (8, 1024, 4), (8, 1024, 8), (2, 2048, 4), (16, 256, 4),
            (4, 256, 4), (8, 256, 4), (8, 256, 8), (16, 256, 8), (32, 256, 8), (8, 512, 4), (16, 512, 8)]
    narrow = [(1, 2048, 4), (1, 1024, 4), (1, 4096, 8), (2, 1024, 4)]
    g = torch.Generator(device=dev).manual_seed(0)
    results = []

    def graph_us(fn) -> float:
        return 1e3 * graph_time_ms(fn, reps=8, replays=10)

    for name, n, k, groups in shapes:
        copies = 2 if n * k > 1 << 28 else 8
        ws = [torch.randn(n, k, device=dev, dtype=dt, generator=g) * k**-0.5 for _ in range(copies)]
        nbytes = n * k * 2
        out_dtype = torch.float32 if name.endswith("lm_head") else None
        x = torch.randn(1, groups * k, device=dev, dtype=dt, generator=g)
        ref = gemv_reference(x.float(), ws[0].float(), groups)
        base = graph_us(lambda i, x=x, ws=ws: gemv_reference(x, ws[i % copies], groups, out_dtype))
        results.append({"shape": name, "what": "torch", "us": base, "tbps": nbytes / base / 1e6})
        cands = [c for c in dict.fromkeys([config(n, k), *(narrow if n <= 512 else wide)]) if (groups == 1 or (n // groups) % c[0] == 0) and c[1] <= 2 * k]
        line = f"{name:10s} torch {base:6.1f} us {nbytes / base / 1e6:5.2f} TB/s |"
        mine = []
        for cfg in cands:
            got = gemv(x, ws[0], groups, out_dtype, cfg=cfg, pdl=pdl)
            err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
            us = graph_us(lambda i, cfg=cfg, x=x, ws=ws: gemv(x, ws[i % copies], groups, out_dtype, cfg=cfg, pdl=pdl))
            mine.append({"shape": name, "what": f"gemv {cfg} pdl={int(pdl)}", "cfg": cfg, "us": us, "tbps": nbytes / us / 1e6, "err": err})
        results += mine
        best = min(mine, key=lambda r: r["us"])
        dflt = next(r for r in mine if r["cfg"] == config(n, k))
        line += f" default {dflt['us']:6.1f} us {dflt['tbps']:4.2f} TB/s, best {best['cfg']} {best['us']:6.1f} us (err {best['err']:.0e})"
        print(line, flush=True)
        del ws
    with open(f"{out_dir}/gemv_sweep.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    sweep(sys.argv[1] if len(sys.argv) > 1 else ".")

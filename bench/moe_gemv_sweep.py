"""Config sweep of the weight-streaming MoE GEMV (``kernels/moe_gemv.py``) on a CUDA device:
``python -m bench.moe_gemv_sweep [OUT_DIR]`` writes ``moe_gemv_sweep.json``."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from bench.kernel_helpers import graph_time_ms
from kernels.moe import moe_experts
from kernels.moe_gemv import MoEGemvTuning, moe_gemv, moe_gemv_reference


def sweep(out_dir: str = ".") -> None:
    """V4-Flash layer at batch 1-2: ``moe_gemv`` configs vs the grouped path (+ shared expert),
    CUDA-graph replays, weights of 8 different expert sets rotated (no L2 reuse)."""
    dev, dt = "cuda", torch.bfloat16
    e, h, i, k = 256, 4096, 2048, 6
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(e, 2 * i, h, device=dev, dtype=dt, generator=g) * h**-0.5
    down = torch.randn(e, h, i, device=dev, dtype=dt, generator=g) * i**-0.5
    sg, su = (torch.randn(i, h, device=dev, dtype=dt, generator=g) * h**-0.5 for _ in range(2))
    sd = torch.randn(h, i, device=dev, dtype=dt, generator=g) * i**-0.5
    results = []

    def graph_ms(fn) -> float:
        return graph_time_ms(lambda _: fn(), reps=20, replays=5)

    for n in (1, 2):
        x = torch.randn(n, h, device=dev, dtype=dt, generator=g)
        idx = torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(n)])
        w = torch.rand(n, k, device=dev, generator=g)
        touched = idx.unique().numel() + 1
        nbytes = touched * 3 * h * i * 2
        ref = moe_gemv_reference(x, w, idx, gate_up, down, 10.0, (sg, su, sd))
        base = graph_ms(
            lambda x=x, w=w, idx=idx: moe_experts(x, w, idx, gate_up, down, 10.0, add=F.linear(F.silu(F.linear(x, sg)) * F.linear(x, su), sd))
        )
        results.append({"n": n, "what": "grouped + shared (3 GEMVs)", "ms": base, "tbps": nbytes / base / 1e9})
        for up_cfg in [(8, 512, 4), (16, 256, 4), (4, 1024, 4), (16, 512, 8), (8, 1024, 8), (32, 256, 8)]:
            for down_cfg in [(8, 512, 4), (16, 256, 4), (4, 1024, 4), (16, 512, 8)]:
                tuning = MoEGemvTuning(up=up_cfg, down=down_cfg)
                got = moe_gemv(x, w, idx, gate_up, down, 10.0, (sg, su, sd), tuning=tuning)
                err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
                ms = graph_ms(
                    lambda x=x, w=w, idx=idx, t=tuning: moe_gemv(x, w, idx, gate_up, down, 10.0, (sg, su, sd), tuning=t)
                )
                results.append({"n": n, "what": f"gemv up={up_cfg} down={down_cfg}", "ms": ms, "tbps": nbytes / ms / 1e9, "err": err})
    for r in results:
        print(f"n={r['n']} {r['what']:48s} {r['ms'] * 1e3:8.1f} us {r['tbps']:6.2f} TB/s err {r.get('err', 0):.1e}")
    with open(f"{out_dir}/moe_gemv_sweep.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    sweep(sys.argv[1] if len(sys.argv) > 1 else ".")

"""Validate the simulator against a real run: same requests, same send times, same cluster shape.

Input: the JSON of ``deepserve bench serve --output`` against a real cluster (our router in front
of engine workers, or one worker). The workload is rebuilt from the run's own config (spec, request
count, seed: the same token content, so the same cache hits) and every request arrives in the
simulation at the moment the client actually sent it. The report is the relative error
(simulated - real) / real of mean / p50 / p90 TTFT, mean TPOT and request and output throughput.

The cost model must come from elsewhere than this run (``fit.py --measure-engine``, or another
``bench serve`` run), or the comparison proves nothing.

One command:

    python -m bench.simulator.validate --real real.json --decode 2 --policy cache_aware \\
        --cost-model cost.json [--prefill 0] [--dp-size 1] [--output validation.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from bench.simulator.cost_model import CostModel
from bench.simulator.sim import SimConfig, simulate
from bench.workloads import make_workload
from router.config import RouterConfig

METRICS = ("ttft_mean", "ttft_p50", "ttft_p90", "tpot_mean", "request_throughput", "output_throughput", "cache_hit_rate")


def _stats(ttft: list[float], tpot: list[float], n_done: int, out_tokens: int, duration: float, hit: float | None) -> dict:
    return {
        "ttft_mean": float(np.mean(ttft)) if ttft else None,
        "ttft_p50": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p90": float(np.percentile(ttft, 90)) if ttft else None,
        "tpot_mean": float(np.mean(tpot)) if tpot else None,
        "request_throughput": n_done / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "cache_hit_rate": hit,
    }


def validate(real: dict, cfg: SimConfig, cost: CostModel, run_index: int = 0) -> dict:
    c = real["config"]
    run = real["runs"][run_index]
    samples = run["samples"]
    wl = make_workload(c["workload"], c.get("num_requests"), c.get("seed", 0))
    assert len(wl.rows) == len(samples), f"rebuilt workload has {len(wl.rows)} rows, the run {len(samples)} samples"
    rows = [dataclasses.replace(r, timestamp=s["start"] * 1000.0) for r, s in zip(wl.rows, samples)]
    order = sorted(range(len(rows)), key=lambda i: rows[i].timestamp)
    cfg = dataclasses.replace(cfg, trace_block_size=c.get("block_size") or wl.block_size, content_seed=c.get("seed", 0))
    sim = simulate(cfg, cost, [rows[i] for i in order])
    by_idx = {order[k]: r for k, r in enumerate(sim.requests)}  # sim request k is row order[k]

    ok = [i for i, s in enumerate(samples) if s["error"] is None]
    r_ttft = [samples[i]["ttft"] for i in ok]
    r_tpot = [(samples[i]["e2e"] - samples[i]["ttft"]) / (n - 1) for i in ok if (n := samples[i]["completion_tokens"] or len(samples[i]["chunk_times"])) > 1]
    r_out = sum(samples[i]["completion_tokens"] or len(samples[i]["chunk_times"]) for i in ok)
    r_dur = max(samples[i]["start"] + samples[i]["e2e"] for i in ok) - min(s["start"] for s in samples)
    prompts = [samples[i]["prompt_tokens"] for i in ok if samples[i]["prompt_tokens"]]
    r_hit = sum(samples[i]["cached_tokens"] or 0 for i in ok) / sum(prompts) if prompts else None
    real_stats = _stats(r_ttft, r_tpot, len(ok), r_out, r_dur, r_hit)

    sim_reqs = [by_idx[i] for i in ok]
    s_ttft = [r.first_token - r.arrival for r in sim_reqs]
    s_tpot = [(r.finish - r.first_token) / (r.output - 1) for r in sim_reqs if r.output > 1]
    s_dur = max(r.finish for r in sim_reqs) - min(r.arrival for r in sim.requests)
    s_hit = sum(r.cached_local + r.cached_shared for r in sim_reqs) / sum(r.prompt for r in sim_reqs)
    sim_stats = _stats(s_ttft, s_tpot, len(sim_reqs), sum(r.output for r in sim_reqs), s_dur, s_hit)

    rel = {k: (sim_stats[k] - real_stats[k]) / real_stats[k] if real_stats[k] and sim_stats[k] is not None else None for k in METRICS}
    return {"real": real_stats, "simulated": sim_stats, "relative_error": rel, "requests": len(samples), "completed_real": len(ok),
            "sim_config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "router"}, "cost_model": cost.source}


def format_report(rep: dict) -> str:
    lines = [f"{'metric':<20}{'real':>12}{'simulated':>12}{'rel. error':>12}"]
    for k in METRICS:
        r, s, e = rep["real"][k], rep["simulated"][k], rep["relative_error"][k]
        scale = 1000.0 if k.startswith(("ttft", "tpot")) else 1.0
        unit = " ms" if scale > 1 else ""
        lines.append(f"{k + unit:<20}{'-' if r is None else f'{r * scale:.3f}':>12}{'-' if s is None else f'{s * scale:.3f}':>12}"
                     f"{'-' if e is None else f'{e:+.1%}':>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", required=True, help="deepserve bench serve --output JSON of the real run")
    ap.add_argument("--run", type=int, default=0, help="which run of a --rate sweep")
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--policy", default="cache_aware")
    ap.add_argument("--router-set", nargs="*", default=[], metavar="KEY=VALUE", help="RouterConfig overrides the real router ran with")
    ap.add_argument("--cost-model", default=None)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    real = json.loads(Path(args.real).read_text())
    router = RouterConfig.from_env(environ={}, **dict(kv.split("=", 1) for kv in args.router_set))
    cfg = SimConfig(prefill=args.prefill, decode=args.decode, dp_size=args.dp_size, policy=args.policy, router=router)
    rep = validate(real, cfg, CostModel.load(args.cost_model), args.run)
    print(format_report(rep))
    if args.output:
        Path(args.output).write_text(json.dumps(rep, indent=1))
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``deepserve simulate``: arguments and entry point."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace, or a workload spec (multi_turn:...)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per trace hash id (default 512, or the workload's)")
    p.add_argument("--prefill", type=int, default=0, help="prefill workers (0 = colocated: decode workers also prefill)")
    p.add_argument("--decode", type=int, default=1, help="decode (or mixed, with --prefill 0) workers")
    p.add_argument("--dp-size", type=int, default=1, help="DP ranks per worker (ranks of one worker step together)")
    p.add_argument("--policy", nargs="+", default=["cache_aware"], help="router policy name(s) (router.policies registry); several = one run each")
    p.add_argument("--prefill-policy", default=None, help="policy of the prefill pool (default: --policy)")
    p.add_argument("--decode-policy", default=None, help="policy of the decode pool (default: --policy)")
    p.add_argument("--router-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="RouterConfig / PolicyConfig overrides, e.g. pd_min_prompt_tokens=0 temperature=0.1")
    p.add_argument("--cost-model", default=None, help="cost model JSON (default: bench/simulator/default_cost_model.json)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace inter-arrival times by this")
    p.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=None, help="seconds")
    p.add_argument("--seed", type=int, default=0, help="workload seed (generated traces) and policy seed")
    p.add_argument("--output", default=None, help="write summaries, per-rank load and per-request samples as JSON")
    p.add_argument("--profile", action="store_true", help="print the top of a cProfile of the run")


def run(args: argparse.Namespace) -> int:
    import cProfile
    import json
    import pstats
    import sys
    from pathlib import Path

    from bench.report import machine_info
    from bench.simulator import report
    from bench.simulator.cost_model import CostModel
    from bench.simulator.sim import SimConfig, simulate
    from bench.workloads import make_workload
    from router.config import RouterConfig

    wl = make_workload(args.trace, args.num_requests, args.seed)
    block = args.block_size or wl.block_size
    cost = CostModel.load(args.cost_model)
    overrides = dict(kv.split("=", 1) for kv in args.router_set)
    overrides.setdefault("seed", str(args.seed))
    router_cfg = RouterConfig.from_env(environ={}, **overrides)
    print(f"trace {args.trace}: {wl.stats()}; cost model: {cost.source}", file=sys.stderr)
    names, summaries, docs = [], [], []
    for policy in args.policy:
        cfg = SimConfig(prefill=args.prefill, decode=args.decode, dp_size=args.dp_size, policy=policy,
                        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy, router=router_cfg,
                        trace_block_size=block, time_scale=args.time_scale)
        prof = cProfile.Profile() if args.profile else None
        if prof:
            prof.enable()
        sim = simulate(cfg, cost, wl.rows)
        if prof:
            prof.disable()
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
        s = report.summarize(sim, args.slo_ttft, args.slo_tpot)
        print(f"{policy}: {s['completed']}/{s['requests']} requests, {s['wall_s']:.1f} s wall", file=sys.stderr)
        names.append(policy)
        summaries.append(s)
        docs.append({"policy": policy, "summary": s, "per_rank": report.per_rank(sim), "samples": report.samples(sim)})
    print(report.format_table(names, summaries))
    if args.output:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        doc = {"config": config, "cost_model": cost.to_dict(), "trace_stats": wl.stats(), "machine": machine_info(), "runs": docs}
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(doc))
        print(f"wrote {args.output}", file=sys.stderr)
    return 0 if all(s["completed"] == s["requests"] for s in summaries) else 1

"""Sub-commands ``deepserve bench ...`` (load generation, traces, peer comparison) and
``deepserve simulate`` (the trace-driven cluster simulator). Heavy imports happen in ``func``."""

from __future__ import annotations

import argparse


def _serve(args: argparse.Namespace) -> int:
    from bench import serve

    return serve.run(args)


def _soak(args: argparse.Namespace) -> int:
    from bench import soak_bench

    return soak_bench.run(args)


def _trace_gen(args: argparse.Namespace) -> int:
    from bench.workloads import trace_gen

    return trace_gen.run(args)


def _simulate(args: argparse.Namespace) -> int:
    from bench.simulator import cli as sim_cli

    return sim_cli.run(args)


def add_trace_gen_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", choices=["multi_turn", "tool_agent"], default="multi_turn")
    ap.add_argument("--output", "-o", required=True)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--sessions", type=int, help="number of sessions")
    ap.add_argument("--session-rate", type=float, help="sessions per second")
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--num-requests", type=int, help="keep the first N requests")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="any TraceGenConfig field")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: load generation against any OpenAI-compatible endpoint")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    from bench import serve

    p = sub.add_parser("serve", help="send a workload to an endpoint; latency, throughput, goodput, cache hits")
    serve.add_arguments(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("soak", help="mixed traffic against a loopback stack with injected faults; failures, wrong tokens, RSS")
    from bench import soak_bench

    soak_bench.add_arguments(p)
    p.set_defaults(func=_soak)

    p = sub.add_parser("trace-gen", help="generate a Mooncake-format trace (sessions, turns, shared system prompts)")
    add_trace_gen_arguments(p)
    p.set_defaults(func=_trace_gen)

    p = subparsers.add_parser("simulate", help="trace-driven discrete-event simulation of router + worker pools")
    from bench.simulator import cli as sim_cli

    sim_cli.add_arguments(p)
    p.set_defaults(func=_simulate)

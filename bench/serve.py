"""``deepserve bench serve``: drive an OpenAI-compatible endpoint with a workload and report."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", "--base-url", dest="url", required=True, help="base URL of the endpoint, e.g. http://127.0.0.1:8000")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--workload", default=None, help="workload spec, e.g. fixed:input_length=1024,output_length=128 "
                        "(the default), chat, multi_turn, tool_agent, or a Mooncake trace FILE.jsonl (see bench/workloads)")
    source.add_argument("--dataset-name", choices=["random", "sharegpt"], help="vllm bench serve's datasets (bench/workloads/datasets.py)")
    p.add_argument("--dataset-path", help="sharegpt: the ShareGPT-format JSON file (nothing is downloaded)")
    p.add_argument("--random-input-len", type=int, default=1024, help="random: input tokens per request (default 1024)")
    p.add_argument("--random-output-len", type=int, default=128, help="random: output tokens per request (default 128)")
    p.add_argument("--random-prefix-len", type=int, default=0, help="random: tokens of a prefix every request shares (default 0)")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="random: lengths uniform in [len*(1-r), len*(1+r)] (default 0)")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt: output tokens per request (default: the reply's)")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--rate", "--request-rate", dest="rate", type=float, nargs="+", help="Poisson request rate(s) per second; several = a sweep")
    pace.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int, help="closed loop with this many requests in flight")
    p.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, default=None,
                   help="requests per run (default: the workload's, or 100; a dataset's 1000)")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace replay: multiply inter-arrival times by this")
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO, seconds (for goodput)")
    p.add_argument("--slo-tpot", "--slo-itl", dest="slo_tpot", type=float, default=None, help="TPOT SLO, seconds (for goodput)")
    p.add_argument("--slo-e2el", type=float, default=None, help="end-to-end latency SLO, seconds (for goodput)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="vllm bench serve's form of the SLOs: ttft:MS tpot:MS e2el:MS (milliseconds; overrides --slo-*)")
    p.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated percentiles to report (default 50,90,99)")
    p.add_argument("--output", default=None, help="write JSON with the config, summaries and every raw sample")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots (latency CDFs, throughput-latency)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of the endpoint's /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["chat", "completions", "internal"], default="chat")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = end-to-end)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for strict OpenAI endpoints)")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=None, help="override the workload's hash-id block size")
    p.add_argument("--vocab-size", type=int, default=None, help="internal endpoint: token ids modulo this")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each run")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from bench.client import ClientConfig, Pacing, RunResult, first_model, render_bodies, run_async, warmup_async
    from bench.report import SLO, format_table, summarize, write_json, write_plots
    from bench.workloads import dataset_workload, make_workload
    from bench.workloads.datasets import RandomConfig

    if args.dataset_name:
        rnd = RandomConfig(args.random_input_len, args.random_output_len, args.random_prefix_len, args.random_range_ratio)
        wl = dataset_workload(args.dataset_name, args.num_requests, args.seed, path=args.dataset_path, random=rnd,
                              output_len=args.sharegpt_output_len)
    else:
        wl = make_workload(args.workload or "fixed", args.num_requests, args.seed)
    rows = wl.rows
    model = args.model
    if model is None and args.endpoint != "internal":
        model = first_model(args.url, args.api_key, args.timeout)
        print(f"model {model} (the endpoint's first)", file=sys.stderr)
    cfg = ClientConfig(
        url=args.url, endpoint=args.endpoint, model=model or "", api_key=args.api_key,
        stream=not args.no_stream, ignore_eos=not args.no_ignore_eos, timeout_s=args.timeout,
        extra_body=json.loads(args.extra_body) if args.extra_body else {},
        block_size=args.block_size or wl.block_size, content_seed=args.seed, vocab_size=args.vocab_size,
    )
    if args.rate:
        pacings = [Pacing(rate=r, seed=args.seed) for r in args.rate]
    elif args.concurrency:
        pacings = [Pacing(concurrency=args.concurrency)]
    elif wl.timed:
        pacings = [Pacing(time_scale=args.time_scale)]
    else:
        pacings = [Pacing(concurrency=1)]
    print(f"workload {wl.name}: {wl.stats()}", file=sys.stderr)
    bodies = render_bodies(rows, cfg, wl.prompts)
    slo = SLO.parse(args.goodput) if args.goodput else SLO(args.slo_ttft, args.slo_tpot, args.slo_e2el)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    results: list[RunResult] = []
    summaries: list[dict] = []
    for pacing in pacings:
        if args.warmup:
            asyncio.run(warmup_async(cfg, args.warmup))
        bar = tqdm(total=len(rows), desc=pacing.label, unit="req", disable=args.no_progress, file=sys.stderr)
        errors = 0

        def done(s, bar=bar) -> None:
            nonlocal errors
            errors += 0 if s.ok else 1
            bar.update(1)
            if errors:
                bar.set_postfix(errors=errors, refresh=False)

        result = asyncio.run(run_async(rows, cfg, pacing, on_done=done, bodies=bodies))
        bar.close()
        results.append(result)
        summaries.append(summarize(result, slo, percentiles))
    print(format_table(summaries))
    if args.output:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        config["workload_stats"] = wl.stats()
        config["block_size"] = cfg.block_size
        write_json(args.output, config, results, summaries)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot:
        for p in write_plots(args.plot, results, summaries):
            print(f"wrote {p}", file=sys.stderr)
    return 0 if all(s["completed"] for s in summaries) else 1

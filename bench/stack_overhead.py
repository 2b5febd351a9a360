"""What the gateway and the router add to ITL and TTFT at many concurrent streams (issue 23's
"gateway + router add ≤ 2% to ITL at 64 concurrent streams"), beside the same client streaming
from the same fake worker directly, in one run.

Targets: ``stack`` = the client → ``deepserve gateway`` (OpenAI chat, SSE) → ``deepserve router``
→ one FAKE worker (``bench/fake_openai_worker.py``: the engine protocol, a fixed TTFT and ITL per
stream, so the engine costs no CPU; its output ids an English passage in the package tokenizer, so
the gateway's detokenizer holds none back); ``direct`` = the client → the same kind of fake
worker's own OpenAI chat route. Each target gets a fresh worker; the targets alternate over ``--rounds``, so
the box's noise hits both. ITL per vLLM's definition (``bench.report``): one per SSE chunk after
the first. Added ITL = stack − direct (mean and p50, p90, p99), its share of the direct ITL; CPU
per output token of the gateway and the router (``/proc``).

Client, gateway, router and worker share this machine's cores: on the 2-core development box the
figure is an upper bound for a deployment where the gateway has cores of its own.

Run: ``python -m bench.stack_overhead --output OUT.json [--concurrency 64] [--itl 0.03]
[--tokens 128] [--requests 256] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from bench import procs
from bench.client import ClientConfig, Pacing, run_async, warmup_async
from bench.peer_routers import cpu_seconds
from bench.report import machine_info, summarize
from bench.workloads import make_workload

MODEL = "DeepSeek-V4-Flash"


def run_target(target: str, args: argparse.Namespace, log_dir: Path) -> dict:
    """One run of ``args.requests`` streamed chat requests at ``args.concurrency`` through ``target``."""
    bindir = Path(sys.executable).parent
    wport = procs.free_port()
    worker_args = ("--ttft", str(args.ttft), "--itl", str(args.itl), "--output-tokens", str(args.tokens), "--model", MODEL, "--english")
    worker = procs.start(procs.fake_worker_cmd(wport, *worker_args), f"http://127.0.0.1:{wport}/health", log_dir / f"{target}-worker.log")
    stack: list = []
    try:
        url = f"http://127.0.0.1:{wport}"
        if target == "stack":
            rport, gport = procs.free_port(), procs.free_port()
            router = [str(bindir / "deepserve"), "router", "--host", "127.0.0.1", "--port", str(rport), "--worker", url, "--log-level", "WARNING"]
            stack.append(procs.start(router, f"http://127.0.0.1:{rport}/health", log_dir / "router.log", timeout=90))
            gateway = [str(bindir / "deepserve"), "gateway", "--engine-url", f"http://127.0.0.1:{rport}", "--port", str(gport),
                       "--served-model-name", MODEL, "--max-concurrent-requests", "4096"]  # fmt: skip
            stack.append(procs.start(gateway, f"http://127.0.0.1:{gport}/health", log_dir / "gateway.log", timeout=90))
            url = f"http://127.0.0.1:{gport}"
            time.sleep(1.0)  # the router's first worker poll
        wl = make_workload(f"fixed:input_length={args.input_len},output_length={args.tokens}", args.requests, seed=0)
        cfg = ClientConfig(url=url, endpoint="chat", model=MODEL, stream=True, block_size=wl.block_size, timeout_s=300)
        asyncio.run(warmup_async(cfg, 4))
        cpu0 = [cpu_seconds(p.pid) for p in stack]
        res = asyncio.run(run_async(wl.rows, cfg, Pacing(concurrency=args.concurrency)))
        cpu1 = [cpu_seconds(p.pid) for p in stack]
        s = summarize(res)
        out_tokens = max(1, s.get("total_output_tokens") or args.requests * args.tokens)
        s["cpu_us_per_token"] = {name: 1e6 * (b - a) / out_tokens for name, a, b in zip(("router", "gateway"), cpu0, cpu1)}
        return s
    finally:
        for p in reversed(stack):
            procs.stop(p)
        procs.stop(worker)


def added(stack: list[dict], direct: list[dict]) -> dict:
    """Per statistic of ITL and TTFT: the medians over rounds of each target, stack − direct, and
    that as a share of direct."""
    out: dict = {}
    for metric in ("itl_s", "ttft_s"):
        for stat in ("mean", "p50", "p90", "p99"):
            a = statistics.median(r[metric][stat] for r in stack)
            b = statistics.median(r[metric][stat] for r in direct)
            out[f"{metric[:-2]}_{stat}"] = {"stack_ms": 1e3 * a, "direct_ms": 1e3 * b, "added_ms": 1e3 * (a - b), "share": (a - b) / b if b else None}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--itl", type=float, default=0.03, help="the fake worker's seconds between tokens")
    ap.add_argument("--ttft", type=float, default=0.05, help="the fake worker's seconds to the first token")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {"stack": [], "direct": []}
    with TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for target in ("stack", "direct") if rnd % 2 == 0 else ("direct", "stack"):
                s = run_target(target, args, Path(tmp))
                runs[target].append(s)
                print(f"round {rnd} {target:<6} ITL mean {s['itl_s']['mean'] * 1e3:7.3f} ms p99 {s['itl_s']['p99'] * 1e3:7.3f}  "
                      f"TTFT p50 {s['ttft_s']['p50'] * 1e3:7.2f} ms  errors {s['errors'] or 'none'}"
                      + (f"  CPU us/token gateway {s['cpu_us_per_token']['gateway']:.1f} router {s['cpu_us_per_token']['router']:.1f}" if target == "stack" else ""),
                      flush=True)  # fmt: skip
    result = {"machine": machine_info(), "args": vars(args), "added": added(runs["stack"], runs["direct"]), "runs": runs}
    a = result["added"]
    print(f"ITL added at {args.concurrency} streams: mean {a['itl_mean']['added_ms']:.3f} ms ({100 * a['itl_mean']['share']:.2f}% of "
          f"{a['itl_mean']['direct_ms']:.2f} ms), p50 {a['itl_p50']['added_ms']:.3f}, p90 {a['itl_p90']['added_ms']:.3f}, "
          f"p99 {a['itl_p99']['added_ms']:.3f} ms; TTFT p50 added {a['ttft_p50']['added_ms']:.2f} ms")  # fmt: skip
    Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

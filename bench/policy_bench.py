"""Routing policies side by side on real engine workers: cache hit rate, TTFT and the router's
own added latency on a multi-turn shared-prefix Mooncake-format trace, in one run.

    python -m bench.policy_bench --output FILE.json [--workers 3] [--num-requests 60]

Each policy gets fresh workers (empty, worker-local KV caches: memory tier only, so a hit needs
the router to send a conversation back to the worker that holds its prefix), the same trace,
and a `deepserve router --policy P` service in front; `deepserve bench serve --endpoint internal`
replays the trace and reads cached tokens from the engine's events.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.integration.workers import free_port, start_workers

POLICIES = ("cache_aware", "round_robin", "least_load")


def _router(urls: list[str], policy: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "deepserve.cli", "router", "--port", str(port), "--policy", policy]
    for u in urls:
        cmd += ["--worker", u]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"router did not start, see {log}")


def _added_latency(url: str) -> float | None:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    s = re.search(r"^deepserve_router_added_latency_seconds_sum(?:\{[^}]*\})? (\S+)", text, re.M)
    c = re.search(r"^deepserve_router_added_latency_seconds_count(?:\{[^}]*\})? (\S+)", text, re.M)
    return float(s.group(1)) / float(c.group(1)) if s and c and float(c.group(1)) else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--output", default="policy_bench.json")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="policy-bench-"))
    model = args.model
    if model is None:
        from engine.model.tiny import make_tiny_model

        model = str(make_tiny_model(tmp / "model"))
    trace = tmp / "trace.jsonl"
    subprocess.run([sys.executable, "-m", "deepserve.cli", "bench", "trace-gen", "--preset", "multi_turn", "-o", str(trace),
                    "--block-size", "128", "--seed", "7", "--sessions", "24", "--session-rate", "2", "--num-requests", str(args.num_requests),
                    "--set", "system_median=1024", "user_median=96", "output_median=16", "max_output=32", "think_time_s=1.0",
                    "num_system_prompts=3"], check=True)
    results = {}
    for policy in POLICIES:
        workers = start_workers(Path(model), tmp / "kv-unused", ["mixed"] * args.workers, tmp, tiers="memory")
        router, url = _router([w.url for w in workers], policy, tmp / f"router-{policy}.log")
        out = tmp / f"{policy}.json"
        try:
            subprocess.run([sys.executable, "-m", "deepserve.cli", "bench", "serve", "--url", url, "--endpoint", "internal",
                            "--workload", str(trace), "--num-requests", str(args.num_requests), "--block-size", "128",
                            "--output", str(out), "--no-progress"], check=True)
            summary = json.loads(out.read_text())
            results[policy] = {"summary": summary.get("summary", summary.get("summaries")), "router_added_latency_s": _added_latency(url)}
        finally:
            router.terminate()
            for w in workers:
                w.terminate()
    Path(args.output).write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps({p: {"router_added_latency_ms": (r["router_added_latency_s"] or 0) * 1e3} for p, r in results.items()}, indent=2))


if __name__ == "__main__":
    main()

"""Gateway overhead: per request and per streamed token, against calling the worker directly,
and the SSE tokens/s one gateway process sustains.

The engine is a FAKE worker (this file, ``--fake-worker``): it speaks the worker HTTP surface of
``deepserve/protocol/messages.py`` and emits ``max_tokens`` pre-tokenised English tokens, one per event, as
fast as it can, so the engine is never the bottleneck. Three processes share the machine: the
fake worker, the gateway (``deepserve gateway --engine-url``, a subprocess so its CPU time can be
read from ``/proc``) and this load generator. The gateway's CPU per request / per token is the
number that transfers to other machines; wall-clock figures include the other two processes.

Run: ``python -m bench.gateway_bench [--requests 400] [--json out.json]``; prints a table and JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODEL = "DeepSeek-V4-Pro"


# ---- the FAKE worker ------------------------------------------------------------------------------
def fake_worker(port: int) -> None:
    from aiohttp import web

    from bench.fake_openai_worker import english_tokens

    tokens = english_tokens()
    n_tok = len(tokens)

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = body["request_id"]
        max_tokens = body["sampling"]["max_tokens"]
        prompt = len(body["prompt_token_ids"])
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for i in range(max_tokens):
            ev: dict[str, Any] = {"request_id": rid, "token_ids": [tokens[i % n_tok]]}
            if i == 0:
                ev["num_prompt_tokens"] = prompt
            if i == max_tokens - 1:
                ev["finish_reason"] = "length"
            await resp.write(json.dumps(ev).encode() + b"\n")
        await resp.write_eof()
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def abort(request: web.Request) -> web.Response:
        return web.json_response({"aborted": True})

    async def load(request: web.Request) -> web.Response:
        return web.json_response({"worker_id": "fake", "role": "mixed", "ranks": [{"dp_rank": 0}]})

    app = web.Application()
    app.router.add_post("/internal/generate", generate)
    app.router.add_post("/internal/abort", abort)
    app.router.add_get("/health", ok)
    app.router.add_get("/load", load)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---- helpers --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.1)
    raise RuntimeError(f"{url} not up")


class Client:
    def __init__(self, session: Any, worker: str, gateway: str) -> None:
        self.session, self.worker, self.gateway = session, worker, gateway
        self._n = 0

    async def direct(self, max_tokens: int) -> int:
        """POST /internal/generate on the worker; returns tokens received."""
        self._n += 1
        body = {"request_id": f"bench-{self._n}", "prompt_token_ids": [0, 1, 2, 3, 4, 5, 6, 7], "sampling": {"max_tokens": max_tokens}}
        got = 0
        async with self.session.post(self.worker + "/internal/generate", json=body) as r:
            async for line in r.content:
                if line.strip():
                    got += len(json.loads(line)["token_ids"])
        return got

    async def chat(self, max_tokens: int, stream: bool) -> int:
        body = {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": stream, "thinking": {"type": "disabled"},
        }
        async with self.session.post(self.gateway + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"gateway answered {r.status}: {await r.text()}")
            if not stream:
                return (await r.json())["usage"]["completion_tokens"]
            events = 0
            async for line in r.content:
                if line.startswith(b"data: {"):
                    events += 1
            return events - 2  # minus the role chunk and the finish chunk


async def timed(fn: Any, n: int, concurrency: int) -> tuple[float, int]:
    """Run ``fn()`` n times with ``concurrency`` in flight; (wall seconds, total tokens)."""
    queue = list(range(n))
    total = 0

    async def worker() -> None:
        nonlocal total
        while queue:
            queue.pop()
            got = await fn()
            total += got

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, total


async def measure(args: argparse.Namespace, worker_url: str, gateway_url: str, gateway_pid: int) -> dict[str, Any]:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        c = Client(session, worker_url, gateway_url)
        n = args.requests
        long = args.tokens
        # warm-up (connections, code paths)
        await timed(lambda: c.chat(4, True), 20, 4)
        await timed(lambda: c.direct(4), 20, 4)

        results: dict[str, Any] = {"requests": n, "long_tokens": long}

        async def run(name: str, fn: Any, count: int, conc: int) -> dict[str, float]:
            cpu0 = cpu_seconds(gateway_pid)
            wall, tokens = await timed(fn, count, conc)
            cpu = cpu_seconds(gateway_pid) - cpu0
            row = {
                "wall_ms_per_req": 1e3 * wall / count,
                "gateway_cpu_ms_per_req": 1e3 * cpu / count,
                "tokens": tokens,
                "tokens_per_s": tokens / wall,
                "gateway_cpu_util": cpu / wall,
            }
            results[name] = row
            return row

        # sequential latency (concurrency 1)
        await run("direct_1tok_seq", lambda: c.direct(1), n, 1)
        await run("chat_1tok_seq", lambda: c.chat(1, False), n, 1)
        await run("chat_stream_1tok_seq", lambda: c.chat(1, True), n, 1)
        await run("direct_long_seq", lambda: c.direct(long), max(20, n // 10), 1)
        await run("chat_stream_long_seq", lambda: c.chat(long, True), max(20, n // 10), 1)
        # throughput under concurrency
        await run("chat_1tok_c32", lambda: c.chat(1, False), n, 32)
        await run("chat_stream_long_c32", lambda: c.chat(long, True), max(64, n // 4), 32)

        r = results
        per_tok_cpu = (r["chat_stream_long_seq"]["gateway_cpu_ms_per_req"] - r["chat_stream_1tok_seq"]["gateway_cpu_ms_per_req"]) / (long - 1)
        per_tok_wall_gw = r["chat_stream_long_seq"]["wall_ms_per_req"] / long
        per_tok_wall_direct = r["direct_long_seq"]["wall_ms_per_req"] / long
        results["summary"] = {
            "overhead_ms_per_request_seq": r["chat_1tok_seq"]["wall_ms_per_req"] - r["direct_1tok_seq"]["wall_ms_per_req"],
            "gateway_cpu_ms_per_request": r["chat_1tok_seq"]["gateway_cpu_ms_per_req"],
            "gateway_cpu_ms_per_stream_request": r["chat_stream_1tok_seq"]["gateway_cpu_ms_per_req"],
            "gateway_cpu_us_per_streamed_token": 1e3 * per_tok_cpu,
            "overhead_us_per_token_wall_seq": 1e3 * (per_tok_wall_gw - per_tok_wall_direct),
            "sse_tokens_per_s_measured_c32": r["chat_stream_long_c32"]["tokens_per_s"],
            "sse_tokens_per_s_per_gateway_core": r["chat_stream_long_c32"]["tokens_per_s"] / max(1e-9, r["chat_stream_long_c32"]["gateway_cpu_util"]),
            "requests_per_s_per_gateway_core": 1e3 / r["chat_1tok_c32"]["gateway_cpu_ms_per_req"],
        }
        return results


def print_table(results: dict[str, Any]) -> None:
    print("\nFAKE worker (no model; engine is not the bottleneck). 3 processes share the machine "
          f"({os.cpu_count()} CPUs): worker, gateway, load generator.\n")
    print(f"{'case':26} {'wall ms/req':>12} {'gw CPU ms/req':>14} {'tokens/s':>10} {'gw CPU util':>12}")
    for name, row in results.items():
        if isinstance(row, dict) and "wall_ms_per_req" in row:
            print(f"{name:26} {row['wall_ms_per_req']:12.3f} {row['gateway_cpu_ms_per_req']:14.3f} {row['tokens_per_s']:10.0f} {row['gateway_cpu_util']:12.2f}")
    print("\nsummary")
    for key, value in results["summary"].items():
        print(f"  {key:40} {value:10.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per sequential case")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens of the long cases")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--profile", help="run the gateway under cProfile, writing the stats here")
    ap.add_argument("--fake-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fake_worker:
        fake_worker(args.port)
        return 0

    worker_port, gateway_port = free_port(), free_port()
    worker_url, gateway_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{gateway_port}"
    procs = [subprocess.Popen([sys.executable, "-m", "bench.gateway_bench", "--fake-worker", "--port", str(worker_port)])]
    try:
        wait_http(worker_url + "/health")
        env = {**os.environ, "DEEPSERVE_LOG_LEVEL": "warning"}
        prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        procs.append(subprocess.Popen(
            [sys.executable, *prof, "-m", "deepserve.cli", "gateway", "--engine-url", worker_url, "--port", str(gateway_port),
             "--served-model-name", MODEL, "--max-concurrent-requests", "1024"],
            env=env,
        ))
        wait_http(gateway_url + "/health")
        results = asyncio.run(measure(args, worker_url, gateway_url, procs[1].pid))
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)  # SIGINT lets cProfile write its stats
        for p in procs:
            p.wait(10)
    print_table(results)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

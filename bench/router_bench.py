"""The router's own speed, in front of fake workers that answer at once.

Measures, in one run, on this machine:

- **throughput**: non-streaming ``POST /internal/generate`` requests per second at concurrency
  32 (``max_tokens=1``: one NDJSON event back), sent straight to the fake workers and through a
  ``deepserve router`` service (one process, each policy in turn);
- **added TTFT**: time to the first event at concurrency 1, through the router minus direct
  (p50 and p99), plus the same under load at concurrency 32;
- **router CPU per request** (``/proc``): the router process's CPU time over the requests it
  served, the one number that does not depend on how the OS shares the cores between load
  generator, router and fake workers (req/s on a small box does, by +-20% run to run).

The fake worker is a raw asyncio HTTP/1.1 server (two ports, one process) and the load
generator a raw asyncio client with keep-alive connections, so that as little as possible of the
machine goes anywhere but the router. Every router request carries a ``prompt_tokens``-long
prompt drawn from ``--distinct-prompts`` ones, so cache-aware routing hashes real KV units.

    python -m bench.router_bench                       # table + bench/results/router_bench.json
    python -m bench.router_bench --servers             # also: aiohttp.web vs FastAPI+uvicorn
    git worktree add /tmp/rt-base <commit>             # then: old code against this tree's
    python -m bench.router_bench --ab-base /tmp/rt-base --rounds 8 --duration 2.5 --prompt-tokens 128 --distinct-prompts 60000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


# ---------------------------------------------------------------------------------------------
# Fake worker: raw asyncio HTTP/1.1, answers every generate with one finished event.
# ---------------------------------------------------------------------------------------------
def _response(body: bytes, ctype: bytes = b"application/x-ndjson", status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


class _FakeWorker(asyncio.Protocol):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.buf = b""
        load = {"worker_id": worker_id, "role": "mixed", "ranks": [{"dp_rank": 0, "running": 0, "waiting": 0, "queued_tokens": 0, "state_usage": 0.0}], "draining": False, "block_size": 128, "model": "fake"}
        self.static = {
            b"/load": _response(json.dumps(load).encode(), b"application/json"),
            b"/health": _response(b"{}", b"application/json"),
            b"/metrics": _response(b"", b"text/plain"),
            b"/internal/abort": _response(b"{}", b"application/json"),
        }
        self.kv = _response(b'{"seq":0,"events":[]}', b"application/json")

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            cl = 0
            i = head.lower().find(b"content-length:")
            if i >= 0:
                cl = int(head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else len(head)])
            if len(self.buf) < end + 4 + cl:
                return
            body = self.buf[end + 4 : end + 4 + cl]
            self.buf = self.buf[end + 4 + cl :]
            path = head.split(b" ", 2)[1]
            if path == b"/internal/generate":
                d = json.loads(body)
                line = b'{"request_id":"%s","token_ids":[7],"finish_reason":"length","num_prompt_tokens":%d,"worker_id":"%s"}\n' % (
                    d["request_id"].encode(),
                    len(d["prompt_token_ids"]),
                    self.worker_id.encode(),
                )
                self.transport.write(_response(line))
            elif path.startswith(b"/kv_events"):
                self.transport.write(self.kv)
            else:
                self.transport.write(self.static.get(path, _response(b"not found", b"text/plain", b"404 Not Found")))


def serve_fake(ports: list[int]) -> None:
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    servers = []
    for p in ports:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", p))
        servers.append(loop.run_until_complete(loop.create_server(lambda p=p: _FakeWorker(f"fake-{p}"), sock=sock, backlog=1024)))
    print("READY", flush=True)
    try:
        loop.run_forever()
    except KeyboardInterrupt:
        pass


def serve_echo(framework: str, port: int) -> None:
    """A do-nothing generate endpoint in ``framework``: what the server framework alone costs."""
    line = b'{"request_id":"x","token_ids":[7],"finish_reason":"length"}\n'
    if framework == "aiohttp":
        from aiohttp import web

        async def gen(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=line, content_type="application/x-ndjson")

        app = web.Application()
        app.router.add_post("/internal/generate", gen)
        print("READY", flush=True)
        loop = _new_loop()
        asyncio.set_event_loop(loop)
        web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=loop)
    else:
        import uvicorn
        from fastapi import FastAPI, Request
        from fastapi.responses import Response

        app = FastAPI()

        @app.post("/internal/generate")
        async def gen(request: Request) -> Response:  # noqa: F811
            await request.body()
            return Response(line, media_type="application/x-ndjson")

        print("READY", flush=True)
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def serve_naive_proxy(port: int, workers: list[str]) -> None:
    """Calibration: an aiohttp proxy with no routing logic (round-robin, body passed through)."""
    import itertools

    import aiohttp
    from aiohttp import web

    urls = itertools.cycle([w + "/internal/generate" for w in workers])

    async def gen(request: web.Request) -> web.Response:
        body = await request.read()
        async with request.app["session"].post(next(urls), data=body, headers={"Content-Type": "application/json"}) as r:
            return web.Response(body=await r.read(), content_type="application/x-ndjson")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="{}")

    async def ctx(app: web.Application):
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(ctx)
    app.router.add_post("/internal/generate", gen)
    app.router.add_get("/health", health)
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=loop)


def serve_io_floor(port: int, workers: list[str]) -> None:
    """Calibration: the router service's own HTTP server and worker pool (``router.http_server``,
    ``router.http1``) with no router in between: workers in turn, body passed through. What a
    request costs before any parsing, placement or accounting."""
    import itertools

    from router.http1 import Http1Pool
    from router.http_server import HttpServer, Response

    pools = itertools.cycle([Http1Pool(w) for w in workers])

    async def gen(request) -> Response:
        pool = next(pools)
        conn = await pool.request("/internal/generate", request.body)
        out: list[bytes] = []
        while (lines := await conn.read()) is not None:
            out += lines
        pool.release(conn, True)
        return Response(b"\n".join(out) + b"\n", 200, b"application/x-ndjson")

    async def health(request) -> Response:
        return Response(b"{}")

    async def main() -> None:
        await HttpServer({(b"POST", "/internal/generate"): gen, (b"GET", "/health"): health}).start("127.0.0.1", port)
        await asyncio.Event().wait()

    loop = _new_loop()
    asyncio.set_event_loop(loop)
    with contextlib.suppress(KeyboardInterrupt):
        loop.run_until_complete(main())


def serve_router(port: int, policy: str, workers: list[str]) -> None:
    from router.config import RouterConfig
    from router.service import serve

    serve(RouterConfig.from_env(port=port, policy=policy, worker=tuple(workers)))


# ---------------------------------------------------------------------------------------------
# Load generator: raw asyncio client, keep-alive, Content-Length or chunked answers.
# ---------------------------------------------------------------------------------------------
def _body(rid: str, prompt: list[int]) -> bytes:
    """The body ``bench.client`` sends to ``/internal/generate`` (so ``bench.peer_routers``'
    throughput scenario), with one output token."""
    sampling = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": False}
    return json.dumps({"request_id": rid, "prompt_token_ids": prompt, "sampling": sampling, "session_key": None}, separators=(",", ":")).encode()


def _request(port: int, body: bytes) -> bytes:
    return (
        b"POST /internal/generate HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (port, len(body))
    ) + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, float]:
    """Read one response; returns (status, perf_counter at its first body byte)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    low = head.lower()
    i = low.find(b"content-length:")
    if i >= 0:
        n = int(head[i + 15 : head.find(b"\r\n", i)])
        await reader.readexactly(n)
        return status, time.perf_counter()
    first = 0.0
    while True:  # chunked
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return status, first
        await reader.readexactly(size + 2)
        first = first or time.perf_counter()


_FRESH = itertools.count(1_000_000)  # first tokens no prompt of ``prompts`` has (see _closed_loop)


async def _closed_loop(ports: list[int], prompts: list[list[int]], concurrency: int, duration: float, tag: str, fresh: bool = False) -> dict:
    """``fresh``: every request's prompt is new (its first token is one never sent before), so
    every request is hashed from scratch and stores new KV units, as in ``bench.peer_routers``'
    throughput scenario (fresh workers, 128-token prompts each drawn anew); otherwise the
    bodies of the first 64 requests per connection are sent again with new request ids."""
    stop = time.perf_counter() + duration
    lat: list[float] = []
    errors = 0
    payload = [[_body("%s-%d-%d" % (tag, c, n), prompts[(c * 7 + n) % len(prompts)]) for n in range(64)] for c in range(concurrency)]

    async def conn(c: int) -> None:
        nonlocal errors
        port = ports[c % len(ports)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        n = 0
        while time.perf_counter() < stop:
            if fresh:
                p = prompts[(c * 7 + n) % len(prompts)]
                body = _body("%s-%d-%d" % (tag, c, n), [next(_FRESH), *p[1:]])
            else:
                body = payload[c][n % 64].replace(b'"%s-%d-%d"' % (tag.encode(), c, n % 64), b'"%s-%d-%d"' % (tag.encode(), c, n)) if n >= 64 else payload[c][n]
            t0 = time.perf_counter()
            writer.write(_request(port, body))
            status, _ = await _read_response(reader)
            lat.append(time.perf_counter() - t0)
            errors += status != 200
            n += 1
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(conn(c) for c in range(concurrency)))
    wall = time.perf_counter() - t0
    lat.sort()
    return {"requests": len(lat), "errors": errors, "req_per_s": len(lat) / wall, "lat_p50_ms": 1e3 * lat[len(lat) // 2], "lat_p99_ms": 1e3 * lat[int(len(lat) * 0.99)]}


async def _ttft(port: int, prompts: list[list[int]], n: int, tag: str) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = []
    for i in range(n):
        req = _request(port, _body(f"{tag}-{i}", prompts[i % len(prompts)]))
        t0 = time.perf_counter()
        writer.write(req)
        _, first = await _read_response(reader)
        out.append(first - t0)
    writer.close()
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(loop, pid: int, ports: list[int], prompts, args, tag: str) -> dict:
    """``args.repeat`` throughput windows; the median one, plus CPU microseconds per request of
    process ``pid`` (the router, or the fake worker for the direct baseline): unlike req/s, this
    does not depend on how the OS shares 2 cores between load generator, router and workers."""
    runs = []
    for i in range(args.repeat):
        c0 = _cpu_s(pid)
        r = loop.run_until_complete(_closed_loop(ports, prompts, args.concurrency, args.duration, f"{tag}{i}"))
        r["cpu_us_per_req"] = 1e6 * (_cpu_s(pid) - c0) / max(1, r["requests"])
        runs.append(r)
    runs.sort(key=lambda r: r["req_per_s"])
    best = dict(runs[len(runs) // 2])
    best["req_per_s_runs"] = [round(r["req_per_s"]) for r in runs]
    best["cpu_us_per_req"] = statistics.median(r["cpu_us_per_req"] for r in runs)
    return best


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(*args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "bench.router_bench", *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().startswith("READY"), f"{args[0]} did not start"
    return p


def _wait_http(port: int, path: str = "/health", timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"port {port} never answered {path}")


def _router_proc(policy: str, worker_urls: list[str]) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    mode = {"naive_proxy": ["_naive"], "io_floor": ["_floor"]}.get(policy, ["_router", "--policy", policy])
    p = subprocess.Popen([sys.executable, "-m", "bench.router_bench", *mode, "--port", str(port), "--worker", *worker_urls], cwd=REPO)
    _wait_http(port)
    return p, port


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(args: argparse.Namespace) -> dict:
    prompts = [[(k * 131 + j) % 30000 for j in range(args.prompt_tokens)] for k in range(args.distinct_prompts)]
    fake_ports = [_free_port(), _free_port()]
    fake = _spawn("_fake", "--ports", *map(str, fake_ports))
    loop = _new_loop()
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "uvloop": _has("uvloop"), "orjson": _has("orjson")},
        "params": {k: v for k, v in vars(args).items() if k != "func"},
    }
    try:
        loop.run_until_complete(_closed_loop(fake_ports, prompts, args.concurrency, 0.5, "warm"))
        direct = _measure(loop, fake.pid, fake_ports, prompts, args, "direct")
        direct_ttft = loop.run_until_complete(_ttft(fake_ports[0], prompts, args.ttft_requests, "dttft"))
        results["direct"] = {**direct, "ttft_p50_ms": 1e3 * _pct(direct_ttft, 0.5), "ttft_p99_ms": 1e3 * _pct(direct_ttft, 0.99)}
        urls = [f"http://127.0.0.1:{p}" for p in fake_ports]
        for policy in args.policies:
            proc, port = _router_proc(policy, urls)
            try:
                loop.run_until_complete(_closed_loop([port], prompts, args.concurrency, 1.0, f"w{policy}"))
                thr = _measure(loop, proc.pid, [port], prompts, args, policy)
                ttft = loop.run_until_complete(_ttft(port, prompts, args.ttft_requests, f"t{policy}"))
            finally:
                _stop(proc)
            p50, p99 = 1e3 * _pct(ttft, 0.5), 1e3 * _pct(ttft, 0.99)
            results[policy] = {
                **thr,
                "ttft_p50_ms": p50,
                "ttft_p99_ms": p99,
                "added_ttft_p50_ms": p50 - results["direct"]["ttft_p50_ms"],
                "added_ttft_p99_ms": p99 - results["direct"]["ttft_p99_ms"],
                "throughput_ratio": thr["req_per_s"] / direct["req_per_s"],
                "ttft_p50_ratio": p50 / results["direct"]["ttft_p50_ms"],
                "added_lat_c32_p50_ms": thr["lat_p50_ms"] - direct["lat_p50_ms"],
            }
        if args.servers:
            results["servers"] = {}
            for fw in ("aiohttp", "fastapi"):
                port = _free_port()
                p = _spawn("_echo", "--framework", fw, "--port", str(port))
                try:
                    time.sleep(1.5)  # READY is printed before the framework listens
                    loop.run_until_complete(_closed_loop([port], prompts[:1], args.concurrency, 0.5, "w" + fw))
                    results["servers"][fw] = loop.run_until_complete(_closed_loop([port], prompts[:1], args.concurrency, args.duration, fw))
                finally:
                    _stop(p)
    finally:
        _stop(fake)
        loop.close()
    return results


def _proc_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(f[11]) / tck, int(f[12]) / tck


def run_ab(args: argparse.Namespace) -> dict:
    """Router CPU per request of the code in ``--ab-base`` (another checkout, e.g. a ``git
    worktree`` of an older commit) against this tree's, in front of the same fake workers:
    ``--rounds`` rounds per policy, the two routers alternating (which goes first alternates
    too), a fresh router process each time, ``--duration`` seconds each after a 0.5 s warm-up.
    Prompts: ``--distinct-prompts`` random ones of ``--prompt-tokens`` tokens (a large number
    makes nearly every request a new prompt, as in ``bench.peer_routers``' throughput scenario).
    ``--ab-workers openai``: ``bench.fake_openai_worker``s instead of the raw fake (they publish
    KV events, so a cache-aware router's event polling is measured too)."""
    import random

    rng = random.Random(1)
    prompts = [[rng.randrange(30000) for _ in range(args.prompt_tokens)] for _ in range(args.distinct_prompts)]
    trees = {"base": str(Path(args.ab_base).resolve()), "new": str(REPO)}
    fake_ports = [_free_port(), _free_port()]
    if args.ab_workers == "openai":  # bench.fake_openai_worker: KV events, as in bench.peer_routers
        fakes = [subprocess.Popen([sys.executable, "-m", "bench.fake_openai_worker", "--port", str(p), "--worker-id", f"w{i}"], cwd=REPO) for i, p in enumerate(fake_ports)]
        for p in fake_ports:
            _wait_http(p)
    else:
        fakes = [_spawn("_fake", "--ports", *map(str, fake_ports))]
    urls = [f"http://127.0.0.1:{p}" for p in fake_ports]
    loop = _new_loop()
    out: dict = {"params": {k: v for k, v in vars(args).items() if k != "func"}, "trees": trees, "policies": {}}
    try:
        for policy in args.policies:
            res: dict[str, list] = {k: [] for k in trees}
            for r in range(args.rounds):
                for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                    port = _free_port()
                    p = subprocess.Popen([sys.executable, "-m", "bench.router_bench", "_router", "--policy", policy, "--port", str(port), "--worker", *urls], cwd=trees[name])
                    _wait_http(port)
                    try:
                        loop.run_until_complete(_closed_loop([port], prompts, args.concurrency, 0.5, f"w{r}{name}", args.fresh_prompts))
                        (u0, s0) = _proc_cpu(p.pid)
                        x = loop.run_until_complete(_closed_loop([port], prompts, args.concurrency, args.duration, f"m{r}{name}", args.fresh_prompts))
                        (u1, s1) = _proc_cpu(p.pid)
                    finally:
                        _stop(p)
                    n = max(1, x["requests"])
                    res[name].append({"user_us": 1e6 * (u1 - u0) / n, "sys_us": 1e6 * (s1 - s0) / n, "req_per_s": x["req_per_s"], "requests": x["requests"]})
            tot = {k: [e["user_us"] + e["sys_us"] for e in v] for k, v in res.items()}
            diff = [a - b for a, b in zip(tot["new"], tot["base"])]
            out["policies"][policy] = {"rounds": res, "cpu_us_per_req_median": {k: statistics.median(v) for k, v in tot.items()}, "new_minus_base_per_round": diff, "new_minus_base_median": statistics.median(diff)}
            print(f"{policy:<12} CPU µs/req base {statistics.median(tot['base']):6.1f} [{min(tot['base']):.0f}–{max(tot['base']):.0f}]"
                  f"  new {statistics.median(tot['new']):6.1f} [{min(tot['new']):.0f}–{max(tot['new']):.0f}]"
                  f"  new−base per round: median {statistics.median(diff):+.1f} {[round(d) for d in diff]}")
    finally:
        for fake in fakes:
            _stop(fake)
        loop.close()
    return out


def _has(mod: str) -> bool:
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


def print_table(r: dict) -> None:
    d = r["direct"]
    print(f"\nrouter bench: {r['machine']['cpus']} CPUs, python {r['machine']['python']}, uvloop={r['machine']['uvloop']} orjson={r['machine']['orjson']}, "
          f"concurrency {r['params']['concurrency']}, {r['params']['prompt_tokens']}-token prompts")
    hdr = f"{'target':<18}{'req/s':>9}{'x direct':>10}{'CPU us/req':>12}{'c32 p50 ms':>12}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'+TTFT p50':>11}{'+TTFT p99':>11}"
    print(hdr)
    print("-" * len(hdr))
    print(f"{'direct (fake)':<18}{d['req_per_s']:>9.0f}{1.0:>10.2f}{d['cpu_us_per_req']:>12.0f}{d['lat_p50_ms']:>12.3f}{d['ttft_p50_ms']:>13.3f}{d['ttft_p99_ms']:>13.3f}{'':>11}{'':>11}")
    for policy in r["params"]["policies"]:
        x = r[policy]
        print(f"{'router ' + policy:<18}{x['req_per_s']:>9.0f}{x['throughput_ratio']:>10.2f}{x['cpu_us_per_req']:>12.0f}{x['lat_p50_ms']:>12.3f}{x['ttft_p50_ms']:>13.3f}{x['ttft_p99_ms']:>13.3f}{x['added_ttft_p50_ms']:>11.3f}{x['added_ttft_p99_ms']:>11.3f}")
    print("(req/s: median of --repeat windows; CPU us/req: of the router process, or of the fake worker for 'direct')")
    for fw, x in r.get("servers", {}).items():
        print(f"{'echo ' + fw:<18}{x['req_per_s']:>9.0f}{x['req_per_s'] / d['req_per_s']:>10.2f}{x['lat_p50_ms']:>12.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode")
    f = sub.add_parser("_fake")
    f.add_argument("--ports", nargs="+", type=int, required=True)
    rt = sub.add_parser("_router")
    rt.add_argument("--port", type=int, required=True)
    rt.add_argument("--policy", required=True)
    rt.add_argument("--worker", nargs="+", required=True)
    nv = sub.add_parser("_naive")
    nv.add_argument("--port", type=int, required=True)
    nv.add_argument("--worker", nargs="+", required=True)
    fl = sub.add_parser("_floor")
    fl.add_argument("--port", type=int, required=True)
    fl.add_argument("--worker", nargs="+", required=True)
    e = sub.add_parser("_echo")
    e.add_argument("--framework", choices=["aiohttp", "fastapi"], required=True)
    e.add_argument("--port", type=int, required=True)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per throughput measurement")
    p.add_argument("--repeat", type=int, default=3, help="throughput windows per target (median reported)")
    p.add_argument("--ttft-requests", type=int, default=1000)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--distinct-prompts", type=int, default=64)
    p.add_argument("--policies", nargs="+", default=["naive_proxy", "round_robin", "cache_aware"], help="router policies to measure; for calibration: naive_proxy = a bare aiohttp proxy, io_floor = our HTTP server and worker pool with no router")
    p.add_argument("--servers", action="store_true", help="also compare aiohttp.web and FastAPI+uvicorn echo servers")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "router_bench.json"))
    p.add_argument("--ab-base", help="A/B mode: another checkout of the repository (old code) to compare this tree's router against (run_ab)")
    p.add_argument("--rounds", type=int, default=8, help="A/B mode: alternating rounds per policy")
    p.add_argument("--fresh-prompts", action="store_true", help="A/B mode: a new prompt for every request (see _closed_loop)")
    p.add_argument("--ab-workers", choices=["raw", "openai"], default="raw",
                   help="A/B mode: the fake workers: raw = this module's (no KV events), openai = bench.fake_openai_worker (KV events, as bench.peer_routers)")
    args = p.parse_args(argv)
    if args.mode == "_fake":
        serve_fake(args.ports)
    elif args.mode == "_router":
        serve_router(args.port, args.policy, args.worker)
    elif args.mode == "_naive":
        serve_naive_proxy(args.port, args.worker)
    elif args.mode == "_floor":
        serve_io_floor(args.port, args.worker)
    elif args.mode == "_echo":
        serve_echo(args.framework, args.port)
    elif args.ab_base:
        results = run_ab(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.out}")
    else:
        results = run(args)
        print_table(results)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The router's own CPU per request, in one process, without sockets (issue 6).

``bench.router_bench --ab-base`` measures the router process under load, where per-round
differences swing by ±15 µs on the shared 2-core box: steps of a few µs do not show there. This
drives the same code in process: the service's ``HttpServer`` connections and the worker pools'
``router.http1`` connections run on fake transports, each request a fresh 128-token prompt
(``/internal/generate`` body as ``bench.router_bench``'s), each worker answer one canned
finishing event (written back one loop turn later, as a socket read would be). Both of a
request's task wake-ups are in it (the client's request, the worker's answer); the socket system
calls are not. Two ``bench.fake_openai_worker``s are started only so the registry has live
workers (load and KV-event polling run as usual; no request reaches them).

    python -m bench.router_inproc --policy cache_aware --repeats 7

Prints CPU µs per request of each repeat (``--requests`` each, ``--concurrency`` connections);
compare medians of two trees run one after the other (±0.5 µs on a quiet box).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from router import http1, http_server
from router.config import RouterConfig
from router.service import RouterService, new_event_loop

_EVENT = b'{"request_id":"x","token_ids":[7],"finish_reason":"length","num_prompt_tokens":128,"num_cached_tokens":0,"worker_id":"w"}\n'
_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nContent-Length: %d\r\n\r\n%s" % (len(_EVENT), _EVENT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(i: int, rng: random.Random, prompt_tokens: int) -> bytes:
    prompt = [rng.randrange(30000) for _ in range(prompt_tokens)]
    body = json.dumps(
        {"request_id": f"r{i}", "prompt_token_ids": prompt, "sampling": {"max_tokens": 1, "temperature": 0.0, "ignore_eos": False}, "session_key": None},
        separators=(",", ":"),
    ).encode()
    return b"POST /internal/generate HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


class _WorkerTransport:
    """A worker connection's transport: each request is answered with ``_ANSWER`` next turn."""

    def __init__(self, conn: http1._Conn, loop: asyncio.AbstractEventLoop) -> None:
        self.conn, self.loop = conn, loop

    def write(self, data: bytes) -> None:
        self.loop.call_soon(self.conn.data_received, _ANSWER)

    def close(self) -> None:
        self.conn.connection_lost(None)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _ClientTransport:
    """A client connection's transport: an answer sends the client's next request."""

    def __init__(self, on_answer: Callable[[bytes], None]) -> None:
        self.write = on_answer

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _repeat(service: RouterService, requests: list[bytes], n: int, concurrency: int) -> float:
    """CPU µs per request over ``n`` requests (taken from the end of ``requests``)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    left = [n]

    def client() -> Callable[[], None]:
        conn = http_server._Connection(service.server)

        def send() -> None:
            loop.call_soon(conn.data_received, requests.pop())

        def on_answer(data: bytes) -> None:
            if not data.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"unexpected answer {data[:200]!r}")
            left[0] -= 1
            if left[0] <= 0:
                if not done.done():
                    done.set_result(None)
            elif left[0] >= concurrency:
                send()

        conn.connection_made(_ClientTransport(on_answer))
        return send

    senders = [client() for _ in range(concurrency)]
    c0 = time.process_time()
    for send in senders:
        send()
    await done
    return 1e6 * (time.process_time() - c0) / n


async def _main(args: argparse.Namespace) -> list[float]:
    rng = random.Random(1)
    requests = [_request(i, rng, args.prompt_tokens) for i in range(args.requests * (args.repeats + 1))]
    ports = [_free_port(), _free_port()]
    fakes = [subprocess.Popen([sys.executable, "-m", "bench.fake_openai_worker", "--port", str(p), "--worker-id", f"w{i}"]) for i, p in enumerate(ports)]
    try:
        await asyncio.sleep(2.0)
        cfg = RouterConfig.from_env(port=0, policy=args.policy, worker=tuple(f"http://127.0.0.1:{p}" for p in ports))
        service = RouterService(cfg)
        await service.start("127.0.0.1", 0)
        await asyncio.sleep(1.0)
        loop = asyncio.get_running_loop()
        for worker in service.router.registry.workers():
            for _ in range(args.concurrency + 4):
                conn = http1._Conn()
                conn.connection_made(_WorkerTransport(conn, loop))
                worker.client.pool._idle.append(conn)
        gc.freeze()
        gc.set_threshold(20_000, 10, 10)  # as router.service's serve
        await _repeat(service, requests, args.requests, args.concurrency)  # warm-up
        out = [await _repeat(service, requests, args.requests, args.concurrency) for _ in range(args.repeats)]
        await service.stop()
        return out
    finally:
        for f in fakes:
            f.kill()
            f.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--requests", type=int, default=20_000, help="requests per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    args = p.parse_args(argv)
    loop = new_event_loop()
    try:
        res = loop.run_until_complete(_main(args))
    finally:
        loop.close()
    print(f"{args.policy}: CPU µs/request median {statistics.median(res):.1f} [{min(res):.1f}–{max(res):.1f}]  {[round(r, 1) for r in res]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

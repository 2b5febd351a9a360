"""FAKE engine worker for router tests: speaks deepserve/protocol/messages.py's HTTP surface, runs no model.

Its output is a pure function of (prompt, position): ``fake_token(prompt, i)``, so the exact
stream an undisturbed request must produce is known (``expected_tokens``), and a request
continued elsewhere with ``output_token_ids`` goes on exactly where it stopped, as a real engine
resuming from the KV store would.

Behaviours for failure tests (flags or ``POST /fake/control``):
- ``--token-delay S``: sleep S seconds before each token (a decode step);
- ``--refuse N``: answer 503 to the next N generate requests (-1: always);
- ``--die-after K``: ``SIGKILL`` itself after emitting K tokens in total (a crash mid-stream);
- ``draining``: ``/health`` answers 503 and ``/load`` reports ``draining``;
- ``--require-token T``: every route but ``/health`` and ``/fake/*`` answers 401 without
  ``Authorization: Bearer T`` (the internal token, as a real worker);
- ``--tls CA CERT KEY``: serve https, requiring client certificates signed by CA (mTLS).
``GET /fake/stats`` tells what it served. Run: ``python -m tests.router.fake_worker --port 0``;
it prints ``READY <port>`` once listening.

Deliberately imports no package ``__init__`` of this repo (they may import torch): the KV key
function is loaded from ``kvstore/keys.py`` by path, so a fake starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import signal
import socket
import sys
from collections import Counter
from pathlib import Path

from aiohttp import web

VOCAB = 50_000
FINGERPRINT = "fake-model"
BLOCK_SIZE = 128


def _load_keys_module():
    path = Path(__file__).resolve().parents[2] / "kvstore" / "keys.py"
    spec = importlib.util.spec_from_file_location("_fake_kv_keys", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_token(prompt: list[int], position: int) -> int:
    """The token a fake worker emits at output ``position`` for ``prompt``."""
    h = hashlib.blake2b(digest_size=8)
    h.update(len(prompt).to_bytes(4, "little"))
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in prompt[:64]))
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in prompt[-64:]))
    h.update(position.to_bytes(4, "little"))
    return 100 + int.from_bytes(h.digest(), "little") % VOCAB


def expected_tokens(prompt: list[int], max_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    out = []
    for i in range(max_tokens):
        out.append(fake_token(prompt, i))
        if out[-1] in stop_token_ids:
            break
    return out


class FakeWorker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.worker_id, self.role, self.dp = args.worker_id, args.role, args.dp
        self.token_delay, self.refuse, self.die_after = args.token_delay, args.refuse, args.die_after
        self.draining = False
        self.emitted = 0
        self.active: dict[str, int] = {}  # request_id -> dp_rank
        self.aborted: set[str] = set()
        self.stats: Counter[str] = Counter()
        self.kv_log: list[dict] = []  # KV events, seq = index + 1
        self.keys = _load_keys_module() if args.kv_events else None
        self.kv_rows = args.kv_rows
        self.require_token = args.require_token

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.stats["requests"] += 1
        if self.refuse:
            self.refuse -= 1 if self.refuse > 0 else 0
            self.stats["refused"] += 1
            return web.Response(status=503, text="fake: refusing")
        rid, prompt = body["request_id"], body["prompt_token_ids"]
        sampling = body.get("sampling") or {}
        max_tokens, stops = int(sampling.get("max_tokens", 16)), tuple(sampling.get("stop_token_ids") or ())
        start = len(body.get("output_token_ids") or [])
        rank = int(body.get("dp_rank") or 0)
        prefill_only = bool(body.get("prefill_only"))
        self.stats["prefill_only" if prefill_only else ("continued" if start else "fresh")] += 1
        self.stats[f"rank{rank}"] += 1
        self.active[rid] = rank
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        try:
            pos = start
            while True:
                if rid in self.aborted:
                    self.aborted.discard(rid)
                    self.stats["aborted"] += 1
                    await resp.write(json.dumps({"request_id": rid, "token_ids": [], "finish_reason": "abort"}).encode() + b"\n")
                    break
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                tok = fake_token(prompt, pos)
                pos += 1
                ev = {"request_id": rid, "token_ids": [tok], "worker_id": self.worker_id}
                if pos == start + 1:
                    ev["num_prompt_tokens"] = len(prompt)
                if tok in stops:
                    ev["finish_reason"] = "stop"
                elif pos >= max_tokens or prefill_only:
                    ev["finish_reason"] = "length"
                self.emitted += 1
                if self.die_after and self.emitted >= self.die_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                await resp.write(json.dumps(ev).encode() + b"\n")
                if "finish_reason" in ev:
                    self._stored(prompt, rank)
                    break
        finally:
            self.active.pop(rid, None)
        await resp.write_eof()
        return resp

    def _stored(self, prompt: list[int], rank: int) -> None:
        if self.keys is not None and len(prompt) >= BLOCK_SIZE:
            keys = self.keys.chain_keys(prompt, BLOCK_SIZE, FINGERPRINT)
            self.kv_log.append({"kind": "stored", "keys": keys, "tier": "memory", "dp_rank": rank})

    async def abort(self, request: web.Request) -> web.Response:
        rid = json.loads(await request.read())["request_id"]
        self.stats["abort_calls"] += 1
        if rid in self.active:
            self.aborted.add(rid)
        return web.json_response({"ok": True})

    async def load(self, request: web.Request) -> web.Response:
        running = Counter(self.active.values())
        ranks = [{"dp_rank": r, "running": running[r], "waiting": 0, "queued_tokens": 0, "state_usage": 0.0} for r in range(self.dp)]
        return web.json_response(
            {"worker_id": self.worker_id, "role": self.role, "ranks": ranks, "draining": self.draining, "block_size": BLOCK_SIZE, "model": "fake", "fingerprint": FINGERPRINT}
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": not self.draining}, status=503 if self.draining else 200)

    async def kv_events(self, request: web.Request) -> web.Response:
        since = int(request.query.get("since", 0))
        evs = self.kv_log[since:]
        if self.kv_rows and request.query.get("format") == "rows":  # KVEvent.to_row layout
            rows = [[1 if e["kind"] == "stored" else 0, e["dp_rank"], e["tier"], e["keys"]] for e in evs]
            return web.json_response({"seq": len(self.kv_log), "rows": rows})
        return web.json_response({"seq": len(self.kv_log), "events": evs})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"vllm:num_requests_running {len(self.active)}\n")

    async def control(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        for k in ("draining", "refuse", "die_after", "token_delay"):
            if k in body:
                setattr(self, k, body[k])
        return web.json_response({"ok": True})

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(dict(self.stats))

    @web.middleware
    async def _authorize(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path != "/health" and not request.path.startswith("/fake/") and request.headers.get("Authorization") != f"Bearer {self.require_token}":
            self.stats["unauthorized"] += 1
            return web.json_response({"error": "missing or wrong internal token"}, status=401)
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authorize] if self.require_token else [])
        app.router.add_post("/internal/generate", self.generate)
        app.router.add_post("/internal/abort", self.abort)
        app.router.add_get("/load", self.load)
        app.router.add_get("/health", self.health)
        app.router.add_get("/kv_events", self.kv_events)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/fake/control", self.control)
        app.router.add_get("/fake/stats", self.get_stats)
        return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="FAKE engine worker for router tests")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--worker-id", default="fake-0")
    p.add_argument("--role", default="mixed", choices=["prefill", "decode", "mixed"])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--refuse", type=int, default=0)
    p.add_argument("--die-after", type=int, default=0)
    p.add_argument("--kv-events", action="store_true")
    p.add_argument("--kv-rows", action="store_true", help="answer /kv_events?format=rows with rows")
    p.add_argument("--require-token", default="", help="the internal token every route but /health needs")
    p.add_argument("--tls", nargs=3, metavar=("CA", "CERT", "KEY"), help="serve mTLS (client certificates from CA required)")
    args = p.parse_args(argv)
    tls = None
    if args.tls:
        from deepserve.internal_tls import InternalTLS  # stdlib only: still a fast start

        tls = InternalTLS(*args.tls).server_context
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)  # connections made before the app runs wait in the backlog, not refused
    print(f"READY {sock.getsockname()[1]}", flush=True)
    web.run_app(FakeWorker(args).app(), sock=sock, print=None, access_log=None, handle_signals=True, ssl_context=tls)


if __name__ == "__main__":
    sys.exit(main())

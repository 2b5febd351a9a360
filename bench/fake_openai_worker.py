"""A fast fake model server with known timings: OpenAI HTTP and the engine's internal protocol.

It answers ``/v1/chat/completions`` and ``/v1/completions`` (streaming and not, with
``stream_options.include_usage``) and the worker surface of ``deepserve/protocol/messages.py``
(``/internal/generate``, ``/internal/abort``, ``/load``, ``/health``, ``/kv_events``, ``/metrics``),
so routers (ours and the peers) can sit in front of it and the bench client can be checked against
timings it knows exactly.

Timing model (absolute deadlines from the request's arrival, so sleeps never accumulate jitter):
first token at ``ttft + prefill_per_token * uncached_prompt_tokens``, token ``i`` at that plus
``i * itl``. Output length is ``max_tokens`` (or ``--output-tokens`` when set).

Prefix cache model: each DP rank keeps an LRU of ``block_size``-token unit keys (chained hashes,
``kvstore.keys.chain_keys`` for token ids; the same chaining over whitespace-separated words for
text, where the bench workloads make one word one token). Cached prompt tokens are reported in
usage as ``prompt_tokens_details.cached_tokens`` and ``prompt_cache_hit_tokens``, and stored or
evicted units are published on ``/kv_events`` as ``KVEvent``s (``&format=rows``: as ``KVEvent.to_row``
rows, what the router asks for).

Run: ``python -m bench.fake_openai_worker --port 8100 --ttft 0.05 --itl 0.01``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

from aiohttp import web

from deepserve.protocol import KV_REMOVED, KV_ROWS_FORMAT, KV_STORED, LoadReport, RankLoad, TokenEvent
from kvstore.keys import ROOT_KEY, chain_keys

try:  # orjson is much faster; json works too
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    _loads = orjson.loads
except ImportError:  # pragma: no cover
    import json

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    _loads = json.loads


@dataclass(frozen=True)
class FakeWorkerConfig:
    ttft: float = 0.0  # seconds to the first token (plus the prefill term)
    itl: float = 0.0  # seconds between tokens
    prefill_per_token: float = 0.0  # extra first-token seconds per uncached prompt token
    output_tokens: int | None = None  # fixed output length; None = the request's max_tokens
    block_size: int = 128  # cache unit, tokens
    cache_blocks: int = 1_000_000  # LRU capacity per DP rank, in units
    dp_size: int = 1
    worker_id: str = "fake-0"
    role: str = "mixed"
    model: str = "fake-model"
    fingerprint: str = "fake-model"  # model fingerprint in unit keys (must match the router's)
    max_events: int = 100_000  # KV events kept for /kv_events
    text_tokens: tuple[int, ...] = ()  # engine-protocol output ids cycle through these (empty: 100 + n % 1000)


class PrefixCache:
    """LRU set of unit keys of one DP rank; ``lookup_insert`` returns matched units and changes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def lookup_insert(self, keys: list[str]) -> tuple[int, list[str], list[str]]:
        """(number of leading keys cached, keys newly stored, keys evicted)."""
        matched = 0
        for k in keys:
            if k not in self._keys:
                break
            self._keys.move_to_end(k)
            matched += 1
        stored = [k for k in keys[matched:] if k not in self._keys]
        for k in keys[matched:]:
            self._keys[k] = None
            self._keys.move_to_end(k)
        evicted: list[str] = []
        while len(self._keys) > self.capacity:
            evicted.append(self._keys.popitem(last=False)[0])
        return matched, stored, evicted


def text_unit_keys(words: list[str], block_size: int, fingerprint: str) -> list[str]:
    """Chained keys of whole ``block_size``-word units of a text prompt."""
    keys, parent = [], ROOT_KEY
    for start in range(0, len(words) - block_size + 1, block_size):
        h = hashlib.blake2b(digest_size=16)
        h.update(parent.encode())
        h.update(fingerprint.encode())
        h.update(" ".join(words[start : start + block_size]).encode())
        parent = h.hexdigest()
        keys.append(parent)
    return keys


class FakeWorker:
    """State of one fake worker: per-rank caches and load, KV events, counters."""

    def __init__(self, cfg: FakeWorkerConfig):
        self.cfg = cfg
        self.caches = [PrefixCache(cfg.cache_blocks) for _ in range(cfg.dp_size)]
        self.running = [0] * cfg.dp_size
        self.queued_tokens = [0] * cfg.dp_size
        self.events: list[list[Any]] = []  # KVEvent.to_row() layout; events[i] has seq first_seq + i
        self.first_seq = 1
        self.seq = 0
        self.aborted: set[str] = set()
        self.ids = itertools.count()
        self.counters = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0}

    def token_id(self, n: int) -> int:
        """The engine-protocol output id at position ``n``: ``text_tokens`` cycled, else ``100 + n % 1000``
        (ids that need not decode to whole characters: a gateway in front holds some of them back)."""
        text = self.cfg.text_tokens
        return text[n % len(text)] if text else 100 + n % 1000

    def pick_rank(self, requested: int | None) -> int:
        if requested is not None and 0 <= requested < self.cfg.dp_size:
            return requested
        if self.cfg.dp_size == 1:
            return 0
        return min(range(self.cfg.dp_size), key=self.running.__getitem__)

    def admit(self, keys: list[str], rank: int, prompt_tokens: int) -> int:
        """Look the prompt up in the rank's cache, publish KV events; returns cached tokens."""
        matched, stored, evicted = self.caches[rank].lookup_insert(keys)
        if stored:
            self._event(KV_STORED, stored, rank)
        if evicted:
            self._event(KV_REMOVED, evicted, rank)
        cached = min(matched * self.cfg.block_size, prompt_tokens)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += prompt_tokens
        self.counters["cached_tokens"] += cached
        return cached

    def _event(self, op: int, keys: list[str], rank: int) -> None:
        """Publish a memory-tier event, kept as its ``KVEvent.to_row`` row: ``/kv_events`` then
        costs a slice and one ``dumps`` (``KVEvent.to_dict`` per event, through ``asdict``, made a
        worker serving a cache-aware router spend ~15 µs more per request than one that is not).
        At least ``max_events`` are kept; the oldest are dropped a quarter at a time (dropping
        one per event moved the whole list each time)."""
        self.seq += 1
        self.events.append([op, rank, "memory", keys])
        if len(self.events) > self.cfg.max_events + self.cfg.max_events // 4:
            drop = len(self.events) - self.cfg.max_events
            del self.events[:drop]
            self.first_seq += drop

    def events_since(self, since: int) -> list[list[Any]]:
        """The rows of the events after seq ``since`` (all kept ones when it is older)."""
        return self.events[max(0, since - self.first_seq + 1) :]

    def first_token_delay(self, uncached: int) -> float:
        return self.cfg.ttft + self.cfg.prefill_per_token * uncached

    def n_out(self, max_tokens: int | None) -> int:
        return self.cfg.output_tokens or max(1, int(max_tokens or 16))


async def _sleep_until(loop: asyncio.AbstractEventLoop, deadline: float) -> None:
    delay = deadline - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)


def _prompt_words(body: dict, chat: bool) -> list[str]:
    if chat:
        words: list[str] = []
        for m in body.get("messages") or []:
            c = m.get("content")
            if isinstance(c, list):  # content parts
                c = " ".join(p.get("text", "") for p in c if isinstance(p, dict))
            if c:
                words.extend(str(c).split())
        return words
    prompt = body.get("prompt") or ""
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    return str(prompt).split()


def _openai_handler(worker: FakeWorker, chat: bool):
    obj = "chat.completion" if chat else "text_completion"

    async def handle(request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            body = _loads(await request.read())
        except ValueError:
            return web.json_response({"error": {"message": "invalid JSON", "type": "invalid_request_error"}}, status=400)
        cfg = worker.cfg
        words = _prompt_words(body, chat)
        n_prompt = len(words)
        rank = worker.pick_rank(None)
        cached = worker.admit(text_unit_keys(words, cfg.block_size, cfg.fingerprint), rank, n_prompt)
        n_out = worker.n_out(body.get("max_completion_tokens") or body.get("max_tokens"))
        first = t0 + worker.first_token_delay(n_prompt - cached)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(worker.ids)}"
        created = int(time.time())
        model = body.get("model") or cfg.model
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": cached},
            "prompt_cache_hit_tokens": cached,
            "prompt_cache_miss_tokens": n_prompt - cached,
        }
        worker.running[rank] += 1
        try:
            if not body.get("stream"):
                await _sleep_until(loop, first + (n_out - 1) * cfg.itl)
                text = " tok" * n_out
                choice = (
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                    if chat
                    else {"index": 0, "text": text, "finish_reason": "length"}
                )
                worker.counters["generation_tokens"] += n_out
                return web.Response(
                    body=_dumps({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": usage}),
                    content_type="application/json",
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            for i in range(n_out):
                await _sleep_until(loop, first + i * cfg.itl)
                last = i == n_out - 1
                if chat:
                    delta: dict[str, Any] = {"content": " tok"}
                    if i == 0:
                        delta["role"] = "assistant"
                    choice = {"index": 0, "delta": delta, "finish_reason": "length" if last else None}
                else:
                    choice = {"index": 0, "text": " tok", "finish_reason": "length" if last else None}
                await resp.write(b"data: " + _dumps({"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": [choice]}) + b"\n\n")
                worker.counters["generation_tokens"] += 1
            if (body.get("stream_options") or {}).get("include_usage"):
                await resp.write(b"data: " + _dumps({"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": [], "usage": usage}) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            worker.running[rank] -= 1

    return handle


class _GenerateFields(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    max_tokens: int
    prefill_only: bool
    dp_rank: int | None


def _generate_fields(d: dict[str, Any]) -> _GenerateFields:
    """What the fake worker reads of a ``GenerateRequest`` body, read off the JSON as its OpenAI
    routes read theirs: ``GenerateRequest.from_dict`` (an ``int()`` per token id, the sampling
    dataclass and its checks) made this route cost ~12 µs more per request than the chat route,
    CPU that a router in front of it shares the machine with in the peer comparison."""
    sampling = d.get("sampling") or {}
    return _GenerateFields(
        str(d["request_id"]),
        d["prompt_token_ids"],
        d.get("output_token_ids") or [],
        int(sampling.get("max_tokens", 16)),
        bool(d.get("prefill_only", False)),
        d.get("dp_rank"),
    )


def _generate_handler(worker: FakeWorker):
    async def handle(request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        req = _generate_fields(_loads(await request.read()))
        cfg = worker.cfg
        rank = worker.pick_rank(req.dp_rank)
        tokens = req.prompt_token_ids + req.output_token_ids  # a migrated request resumes after its output
        n_prompt = len(tokens)
        cached = worker.admit(chain_keys(tokens, cfg.block_size, cfg.fingerprint), rank, n_prompt)
        n_out = 1 if req.prefill_only else max(1, worker.n_out(req.max_tokens) - len(req.output_token_ids))
        first = t0 + worker.first_token_delay(n_prompt - cached)
        if n_out == 1 and req.request_id not in worker.aborted:
            # One event is the whole answer: one body with a Content-Length, as the non-streaming
            # OpenAI routes answer (so routers in front are compared on equal worker answers).
            worker.running[rank] += 1
            worker.queued_tokens[rank] += n_prompt
            try:
                await _sleep_until(loop, first)
            finally:
                worker.running[rank] -= 1
                worker.queued_tokens[rank] -= n_prompt
            ev = TokenEvent(req.request_id, [worker.token_id(n_prompt)], finish_reason="length", num_prompt_tokens=n_prompt,
                            num_cached_tokens=cached, worker_id=cfg.worker_id)
            worker.counters["generation_tokens"] += 1
            return web.Response(body=_dumps(ev.to_dict()) + b"\n", content_type="application/x-ndjson")
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        worker.running[rank] += 1
        worker.queued_tokens[rank] += n_prompt
        prefilled = False
        try:
            for i in range(n_out):
                await _sleep_until(loop, first + i * cfg.itl)
                if req.request_id in worker.aborted:
                    worker.aborted.discard(req.request_id)
                    ev = TokenEvent(req.request_id, [], finish_reason="abort", worker_id=cfg.worker_id)
                    await resp.write(_dumps(ev.to_dict()) + b"\n")
                    break
                last = i == n_out - 1
                ev = TokenEvent(
                    req.request_id,
                    [worker.token_id(n_prompt + len(req.output_token_ids) + i)],
                    finish_reason="length" if last else None,
                    num_prompt_tokens=n_prompt if i == 0 else 0,
                    num_cached_tokens=cached if i == 0 else 0,
                    worker_id=cfg.worker_id,
                )
                await resp.write(_dumps(ev.to_dict()) + b"\n")
                worker.counters["generation_tokens"] += 1
                if not prefilled:
                    worker.queued_tokens[rank] -= n_prompt
                    prefilled = True
            await resp.write_eof()
            return resp
        finally:
            if not prefilled:
                worker.queued_tokens[rank] -= n_prompt
            worker.running[rank] -= 1

    return handle


def build_app(cfg: FakeWorkerConfig) -> web.Application:
    worker = FakeWorker(cfg)
    app = web.Application(client_max_size=256 * 1024 * 1024)

    async def abort(request: web.Request) -> web.Response:
        worker.aborted.add(str((_loads(await request.read()))["request_id"]))
        return web.json_response({"ok": True})

    async def load(_: web.Request) -> web.Response:
        ranks = [RankLoad(r, running=worker.running[r], queued_tokens=worker.queued_tokens[r]) for r in range(cfg.dp_size)]
        report = LoadReport(cfg.worker_id, cfg.role, ranks, block_size=cfg.block_size, model=cfg.model)  # type: ignore[arg-type]
        return web.Response(body=_dumps({**report.to_dict(), "fingerprint": cfg.fingerprint}), content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def kv_events(request: web.Request) -> web.Response:
        since = int(request.query.get("since", 0))
        rows = worker.events_since(since)
        if request.query.get("format") == KV_ROWS_FORMAT:
            return web.Response(body=_dumps({"seq": worker.seq, "rows": rows}), content_type="application/json")
        evs = [{"kind": "stored" if op == KV_STORED else "removed", "keys": keys, "tier": tier, "dp_rank": rank} for op, rank, tier, keys in rows]
        return web.Response(body=_dumps({"seq": worker.seq, "events": evs}), content_type="application/json")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": cfg.model, "object": "model", "owned_by": "deepserve-bench"}]})

    async def metrics(_: web.Request) -> web.Response:
        c = worker.counters
        lines = [
            f"vllm:num_requests_running {sum(worker.running)}",
            "vllm:num_requests_waiting 0",
            f"vllm:prefix_cache_queries_total {c['prompt_tokens']}",
            f"vllm:prefix_cache_hits_total {c['cached_tokens']}",
            f"vllm:generation_tokens_total {c['generation_tokens']}",
            f"vllm:request_success_total {c['requests']}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({**worker.counters, "worker_id": cfg.worker_id})

    app.router.add_post("/v1/chat/completions", _openai_handler(worker, chat=True))
    app.router.add_post("/v1/completions", _openai_handler(worker, chat=False))
    app.router.add_post("/internal/generate", _generate_handler(worker))
    app.router.add_post("/internal/abort", abort)
    app.router.add_get("/load", load)
    app.router.add_get("/health", health)
    app.router.add_get("/readiness", health)
    app.router.add_get("/liveness", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/kv_events", kv_events)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    return app


ENGLISH = (
    "The quick brown fox jumps over the lazy dog while the gateway streams tokens to many clients "
    "at once, batching its writes and keeping per token work small. "
)


def english_tokens() -> tuple[int, ...]:
    """``ENGLISH`` in the package tokenizer's ids (every id decodes to whole characters)."""
    import deepseek_recipe as dr

    from server.model import package_tokenizer_path

    return tuple(dr.Tokenizer.from_file(str(package_tokenizer_path())).encode(ENGLISH))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--ttft", type=float, default=0.0, help="seconds to the first token")
    ap.add_argument("--itl", type=float, default=0.0, help="seconds between tokens")
    ap.add_argument("--prefill-per-token", type=float, default=0.0, help="extra TTFT seconds per uncached prompt token")
    ap.add_argument("--output-tokens", type=int, default=None, help="fixed output length (default: max_tokens)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--cache-blocks", type=int, default=1_000_000, help="prefix-cache capacity per DP rank, in units")
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--worker-id", default=None)
    ap.add_argument("--role", default="mixed", choices=["prefill", "decode", "mixed"])
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--fingerprint", default=None, help="model fingerprint in unit keys (default: --model)")
    ap.add_argument("--english", action="store_true",
                    help="engine-protocol output: the package tokenizer's ids of an English passage (whole words), as a model would emit")
    args = ap.parse_args(argv)
    cfg = FakeWorkerConfig(
        ttft=args.ttft, itl=args.itl, prefill_per_token=args.prefill_per_token, output_tokens=args.output_tokens,
        block_size=args.block_size, cache_blocks=args.cache_blocks, dp_size=args.dp_size,
        worker_id=args.worker_id or f"fake-{args.port}", role=args.role, model=args.model,
        fingerprint=args.fingerprint or args.model, text_tokens=english_tokens() if args.english else (),
    )
    web.run_app(build_app(cfg), host=args.host, port=args.port, access_log=None, print=None, backlog=4096, shutdown_timeout=1.0)


if __name__ == "__main__":
    main()

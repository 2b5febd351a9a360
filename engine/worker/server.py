"""The engine worker's HTTP surface (deepserve/protocol/messages.py), served with aiohttp.

One process serves the DP ranks its engine backend gives it (``--backend``, ``engine.backends``):
all ``dp`` ranks over one loaded model (reference), ``N`` rank processes of an expert-parallel
group (reference with ``--ep N``), or one rank of a lockstep group (deepinfer:
each rank its own worker process and port). Routes:
``POST /internal/generate`` (NDJSON token events), ``POST /internal/abort``, ``GET /load``,
``GET /health``, ``GET /kv_events``, ``GET /metrics``. SIGTERM drains: ``/health`` turns 503, new
requests are refused with 503, running ones finish (up to ``drain_timeout``), then the process
exits. Every route but ``/health`` (and ``/metrics`` with ``open_metrics``) needs the internal
token (``deepserve.internal_auth``) when one is set; without one the worker listens on loopback
only. ``/health`` is 503 while the engine thread is dead or stalled; a dead engine thread ends
the process with status 1, for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from deepserve.protocol import KV_ROWS_FORMAT, ErrorCode, GenerateRequest, LoadReport, Role, error_body
from engine.backends.base import BackendContext
from engine.backends.registry import build_backend
from engine.errors import EngineError
from engine.runtime.config import EngineConfig
from deepserve.protocol.validate import check_generate
from deepserve.internal_auth import InternalAuth
from engine.worker.loop import EngineLoop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker process serves and how."""

    model_dir: str
    host: str = "127.0.0.1"
    port: int = 8200
    role: Role = "mixed"
    dp: int = 1
    dtype: str = "auto"
    device: str = "cpu"
    served_model_name: str = "deepseek-v4"
    worker_id: str = ""
    drain_timeout: float = 30.0
    stall_timeout_s: float = 120.0  # /health turns 503 when the engine thread has work but no turn for this long
    engine: EngineConfig = field(default_factory=EngineConfig)
    register: tuple[str, ...] = ()  # router services to register with (deregistered on drain)
    advertise_url: str = ""  # the URL routers should use; default http(s)://host:port
    auth: InternalAuth = field(default_factory=InternalAuth, repr=False)
    open_metrics: bool = False  # serve /metrics without the token (scrapers on a trusted network)
    backend: str = "reference"  # engine.backends.registry name
    dp_rank: int | None = None  # lockstep backends (deepinfer): the one DP rank this process serves
    expert_parallel: int = 0  # reference: N > 1 rank processes, experts split; deepinfer: EP size (0 = dp)


class Worker:
    """The backend's ranks (``engine.backends``), their engine loop, and the aiohttp app around them."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id or f"{config.role}-{config.port}-{uuid.uuid4().hex[:6]}"
        self.registry = CollectorRegistry()
        self.draining = False
        self.ready = False
        ctx = BackendContext(
            model_dir=config.model_dir,
            role=config.role,
            dp=config.dp,
            dp_rank=config.dp_rank,
            expert_parallel=config.expert_parallel,
            dtype=config.dtype,
            device=config.device,
            served_model_name=config.served_model_name,
            engine=config.engine,
        )
        self.backend = build_backend(config.backend, ctx, self.registry)
        self.store = self.backend.store
        self.events = self.backend.events or (self.store.events if self.store is not None else None)
        self.fingerprint = self.backend.fingerprint
        self.loop = EngineLoop(list(self.backend.ranks), self.worker_id, lockstep=self.backend.lockstep)

    # ---- handlers ---------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.draining:
            return _error(ErrorCode.UNAVAILABLE, "worker is draining", headers={"Retry-After": "1"})
        try:
            req = GenerateRequest.from_dict(check_generate(json.loads(await request.read())))
        except RecursionError:
            return _error(ErrorCode.INVALID_REQUEST, "bad request: JSON nested too deeply")
        except (ValueError, KeyError, TypeError) as exc:
            return _error(ErrorCode.INVALID_REQUEST, f"bad request: {exc}")
        if not self.loop.alive:
            return _error(ErrorCode.UNAVAILABLE, "the engine stopped")
        sink: asyncio.Queue = asyncio.Queue()
        self.loop.submit(req, sink)
        first = await sink.get()
        if first.finish_reason == "error" and not first.token_ids:  # nothing streamed yet: an HTTP error
            return _error(first.error_code or ErrorCode.ENGINE_ERROR, first.error or "the engine failed the request")
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        event = first
        try:
            while True:
                await resp.write((json.dumps(event.to_dict(), separators=(",", ":")) + "\n").encode())
                if event.finished:
                    break
                event = await sink.get()
                while not event.finished and not sink.empty():  # coalesce a backlog into one write
                    nxt = sink.get_nowait()
                    event.token_ids.extend(nxt.token_ids)
                    if event.logprobs is not None and nxt.logprobs:
                        event.logprobs.extend(nxt.logprobs)
                    if nxt.finished:
                        event.finish_reason, event.error, event.error_code = nxt.finish_reason, nxt.error, nxt.error_code
                        event.num_prompt_tokens = nxt.num_prompt_tokens or event.num_prompt_tokens
                        event.num_cached_tokens = nxt.num_cached_tokens or event.num_cached_tokens
        except ConnectionResetError:  # the client went away (a normal event, not an error): stop computing for it
            self.loop.abort(req.request_id)
            return resp
        except asyncio.CancelledError:
            self.loop.abort(req.request_id)
            raise
        await resp.write_eof()
        return resp

    async def abort(self, request: web.Request) -> web.Response:
        try:
            rid = str(json.loads(await request.read())["request_id"])
        except (ValueError, KeyError, TypeError, RecursionError):
            return _error(ErrorCode.INVALID_REQUEST, 'body must be {"request_id": ...}')
        self.loop.abort(rid)
        return web.json_response({"ok": True})

    async def load(self, _: web.Request) -> web.Response:
        report = LoadReport(
            worker_id=self.worker_id,
            role=self.config.role,
            ranks=self.loop.rank_loads(),
            draining=self.draining,
            block_size=self.backend.unit_tokens,
            model=self.config.served_model_name,
            fingerprint=self.fingerprint,
            max_model_len=self.config.engine.max_model_len,
        ).to_dict()
        return web.json_response(report)

    async def health(self, _: web.Request) -> web.Response:
        if not self.loop.alive:
            return web.json_response({"status": "engine_dead"}, status=503)
        if self.loop.stalled(self.config.stall_timeout_s):
            return web.json_response({"status": "engine_stalled"}, status=503)
        if self.draining or not self.ready:
            return web.json_response({"status": "draining" if self.draining else "starting"}, status=503)
        return web.json_response({"status": "ok", "worker_id": self.worker_id, "role": self.config.role})

    async def kv_events(self, request: web.Request) -> web.Response:
        """The store's KV events after ``since``; with ``snapshot=1`` the units held now as
        ``stored`` events instead (for a poller that got ``complete: false``)."""
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return _error(ErrorCode.INVALID_REQUEST, "since must be an integer")
        if self.events is None:
            return web.json_response({"seq": 0, "events": [], "complete": True})
        batch = self.events.snapshot() if request.query.get("snapshot") == "1" else self.events.since(since)
        if request.query.get("format") == KV_ROWS_FORMAT:
            return web.json_response({"seq": batch.seq, "rows": [e.to_row() for e in batch.events], "complete": batch.complete})
        return web.json_response({"seq": batch.seq, "events": [e.to_dict() for e in batch.events], "complete": batch.complete})

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- lifecycle --------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.config.advertise_url or f"{self.config.auth.tls.scheme}://{self.config.host}:{self.config.port}"

    async def _announce(self, verb: str, body: dict) -> None:
        """POST ``/register`` or ``/deregister`` to every configured router (best effort, retried)."""
        import aiohttp

        connector = aiohttp.TCPConnector(ssl=self.config.auth.client_ssl or True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=5), headers=self.config.auth.headers()) as session:
            for router in self.config.register:
                for attempt in range(5):
                    try:
                        async with session.post(f"{router.rstrip('/')}/{verb}", json=body) as resp:
                            if resp.status < 500:
                                log.info("%s with %s: %s", verb, router, resp.status)
                                break
                    except (TimeoutError, aiohttp.ClientError) as exc:
                        log.warning("%s with %s failed (%s), attempt %d", verb, router, exc, attempt + 1)
                    await asyncio.sleep(0.2 * 2**attempt)

    @web.middleware
    async def _authorize(self, request: web.Request, handler) -> web.StreamResponse:
        open_paths = ("/health", "/metrics") if self.config.open_metrics else ("/health",)
        if request.path not in open_paths and not self.config.auth.allows(request.headers.get("Authorization")):
            return web.json_response({"error": "missing or wrong internal token"}, status=401)
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20, middlewares=[self._authorize] if self.config.auth.enabled else [])
        app.router.add_post("/internal/generate", self.generate)
        app.router.add_post("/internal/abort", self.abort)
        app.router.add_get("/load", self.load)
        app.router.add_get("/health", self.health)
        app.router.add_get("/kv_events", self.kv_events)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def serve(self) -> int:
        """Serve until SIGTERM/SIGINT (drain, exit status 0) or the engine thread's death
        (status 1, at once: nothing in flight can finish)."""
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port, ssl_context=self.config.auth.server_ssl)
        await site.start()
        stop = asyncio.Event()
        aloop = asyncio.get_running_loop()
        self.loop.on_death = lambda: aloop.call_soon_threadsafe(stop.set)
        self.loop.start()
        self.ready = True
        log.info("worker %s (%s, dp=%d) on %s:%d", self.worker_id, self.config.role, self.config.dp, self.config.host, self.config.port)
        await self._announce("register", {"url": self.url, "role": self.config.role})
        for sig in (signal.SIGTERM, signal.SIGINT):
            aloop.add_signal_handler(sig, stop.set)
        await stop.wait()
        self.draining = True  # refuse new work, let running requests finish
        await self._announce("deregister", {"url": self.url, "drain": self.loop.alive})
        if not self.loop.alive:  # nothing in flight can finish: no drain, no wait for handlers
            log.critical("worker %s exits: its engine thread died", self.worker_id)
            self.backend.close()
            return 1
        deadline = aloop.time() + self.config.drain_timeout
        while self.loop.alive and self.loop.in_flight() and aloop.time() < deadline:
            await asyncio.sleep(0.05)
        await runner.cleanup()
        self.loop.stop()
        self.backend.close()
        return 0


def _error(code: ErrorCode, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """An HTTP error answer: the code's status, ``deepserve.protocol.error_body``."""
    return web.json_response(error_body(code, message), status=code.status, headers=headers)


def run_worker(config: WorkerConfig) -> None:
    """Load the model and serve until SIGTERM/SIGINT (then drain and exit)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not Path(config.model_dir).is_dir():
        raise SystemExit(f"model directory {config.model_dir} does not exist")
    config.auth.check_bind(config.host, "deepserve engine")
    if sys.platform == "win32":  # uvloop (cheaper socket writes per streamed token) is a dependency elsewhere
        run = asyncio.run
    else:
        import uvloop

        run = uvloop.run
    try:
        worker = Worker(config)
    except EngineError as exc:  # a backend that cannot start here, a bad checkpoint: say so, no traceback
        raise SystemExit(f"deepserve engine: {exc}") from exc
    status = run(worker.serve())
    if status:
        raise SystemExit(status)

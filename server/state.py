"""``Gateway``: everything a request handler needs, built once in the app's lifespan.

Stored as ``app.state.gateway``; no module globals. Handlers reach it as
``request.app.state.gateway``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Coroutine

from server.config import GatewayConfig
from server.engine_client import EngineClient
from server.limits import Admission, RateLimiter, authenticate, read_body
from server.metrics import GatewayMetrics
from server.model import ModelCatalog
from server.render_pool import RenderPool
from server.response_store import MemoryResponseStore, ResponseStore

log = logging.getLogger(__name__)

HealthProbe = Callable[[], Awaitable[bool]]


@dataclass
class Gateway:
    config: GatewayConfig
    catalog: ModelCatalog
    engine: EngineClient
    metrics: GatewayMetrics
    api_keys: frozenset[str]
    limiter: RateLimiter
    admission: Admission
    responses: ResponseStore  # stored Responses (store, previous_response_id, background)
    render: RenderPool  # conversion and tokenisation of large bodies, off the event loop
    health_probe: HealthProbe | None = None
    metrics_sources: list[tuple[str, str]] = field(default_factory=list)  # (worker name, /metrics URL)
    metrics_ssl: ssl.SSLContext | None = None  # the internal plane's client context (mTLS), for https sources
    background: dict[str, asyncio.Task[Any]] = field(default_factory=dict)  # response id -> its run here
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    @classmethod
    def build(
        cls,
        config: GatewayConfig,
        engine: EngineClient,
        *,
        catalog: ModelCatalog | None = None,
        metrics: GatewayMetrics | None = None,
        health_probe: HealthProbe | None = None,
        metrics_sources: list[tuple[str, str]] | None = None,
        metrics_ssl: ssl.SSLContext | None = None,
        responses: ResponseStore | None = None,
    ) -> Gateway:
        admission = Admission(config.max_concurrent_requests, config.max_queued_requests, config.queue_timeout_s)
        metrics = metrics or GatewayMetrics()
        if catalog is None:
            catalog = ModelCatalog.load(config)
        elif config.max_model_len is not None and config.max_model_len != catalog.context_len:
            catalog = replace(catalog, context_len=config.max_model_len)
        metrics.track_admission(lambda: admission.running, lambda: admission.queued)
        return cls(
            config=config,
            catalog=catalog,
            engine=engine,
            metrics=metrics,
            api_keys=config.all_api_keys(),
            limiter=RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm, per_key=config.key_limits()),
            admission=admission,
            responses=responses or MemoryResponseStore(config.response_store()),
            render=RenderPool(config.render_threads, config.render_inline_bytes),
            health_probe=health_probe,
            metrics_sources=list(metrics_sources or []),
            metrics_ssl=metrics_ssl,
        )

    # ---- per-request steps (each raises a GatewayError) ---------------------------------------
    def authenticate(self, request: Any) -> str:
        """The rate-limit key: the API key, or the client address when authentication is off."""
        key = authenticate(request.headers, self.api_keys)
        if key is not None:
            return key
        client = request.client
        return client.host if client else "anonymous"

    async def read_body(self, request: Any) -> bytes:
        return await read_body(request.headers, request.stream(), self.config.max_body_bytes, self.config.body_timeout_s)

    # ---- background work that must outlive a cancelled handler --------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` detached (an engine abort after a disconnect, a background response);
        errors are logged, not raised."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %r", task.exception())

    async def drain_tasks(self, timeout_s: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

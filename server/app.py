"""The FastAPI application: wiring only (routes in ``server/routes/``, state in ``server/state.py``).

``create_app(config, engine_client)`` returns the app; its lifespan builds the ``Gateway`` state
(tokenizer, limits, metrics) on ``app.state.gateway`` and closes the engine client on shutdown.
Only the public API is routed: the workers' ``/internal/*``, ``/load`` and ``/kv_events`` have
no route here, so they are unreachable through the gateway (404).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, AsyncContextManager, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from kvstore.config import KVStoreConfig
from server.config import GatewayConfig
from server.engine_client import EngineClient
from server.engine_limit import ContextProbe, learn
from server.errors import GatewayError, InvalidRequest, NotFound
from server.metrics import GatewayMetrics, route_label
from server.model import ModelCatalog
from server.request_id import RequestIdMiddleware
from server.response_store_redis import open_response_store
from server.routes import chat, completions, health, messages, metrics, models, responses, tokens
from server.state import Gateway, HealthProbe

log = logging.getLogger(__name__)


def create_app(
    config: GatewayConfig,
    engine_client: EngineClient,
    *,
    catalog: ModelCatalog | None = None,
    gateway_metrics: GatewayMetrics | None = None,
    health_probe: HealthProbe | None = None,
    metrics_sources: list[tuple[str, str]] | None = None,
    metrics_ssl: ssl.SSLContext | None = None,
    lifecycle: Callable[[], AsyncContextManager[Any]] | None = None,
    kv: KVStoreConfig | None = None,
    context_probe: ContextProbe | None = None,
) -> FastAPI:
    """The gateway app over ``engine_client`` (a Router, a WorkerClient, or a test double).

    ``catalog``: a pre-loaded ``ModelCatalog`` (tests share one; default: loaded from ``config``).
    ``health_probe``: awaited by ``/health`` (``deepserve up`` checks its workers).
    ``metrics_sources``: ``[(worker name, metrics URL)]`` merged into ``/metrics`` (fetched with
    ``metrics_ssl``, the internal plane's client context, when it runs mTLS).
    ``lifecycle``: entered in the lifespan, inside the server's event loop (start/stop the engine
    client there: a Router's background tasks and HTTP sessions belong to that loop). The
    caller owns ``engine_client``; without ``lifecycle`` the app neither starts nor closes it.
    ``kv``: the KV store's settings (``KVStoreConfig.from_env()`` in a process): their Redis holds
    the stored Responses when ``config.responses_store`` says so (``server/response_store_redis.py``).
    ``context_probe``: the engine's context length, asked until known (``server/engine_limit.py``).
    """
    gm = gateway_metrics or GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = open_response_store(config.responses_store, config.response_store(), kv or KVStoreConfig(), config.responses_redis_prefix)
        gw = Gateway.build(
            config, engine_client, catalog=catalog, metrics=gm,
            health_probe=health_probe, metrics_sources=metrics_sources, metrics_ssl=metrics_ssl, responses=store,
        )
        app.state.gateway = gw
        async with AsyncExitStack() as stack:
            if lifecycle is not None:
                await stack.enter_async_context(lifecycle())
            learning = asyncio.get_running_loop().create_task(learn(gw, context_probe)) if context_probe else None
            try:
                yield
            finally:
                if learning is not None:
                    learning.cancel()
                await gw.drain_tasks()
                gw.render.close()
                await gw.responses.close()

    app = FastAPI(
        title="deepserve gateway",
        version="0.1.0",
        description="OpenAI- and Anthropic-compatible API for DeepSeek V4 / V4.1",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    for module in (chat, completions, responses, messages, models, health, metrics, tokens):
        app.include_router(module.router)
    _install_error_handlers(app, gm)
    app.add_middleware(RequestMetricsMiddleware, metrics=gm)
    app.add_middleware(RequestIdMiddleware)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"], allow_headers=["*"],
            expose_headers=["x-request-id"],
        )
    return app


def _flavor(request: Request) -> str:
    return "anthropic" if request.url.path.startswith("/v1/messages") else "openai"


def error_response(exc: GatewayError, flavor: str = "openai") -> Response:
    return Response(exc.body(flavor), status_code=exc.status, headers=exc.headers, media_type="application/json")


def _install_error_handlers(app: FastAPI, gm: GatewayMetrics) -> None:
    async def gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        gm.reject(exc.reject_reason)
        return error_response(exc, _flavor(request))

    async def validation_error(request: Request, exc: Exception) -> Response:
        errors = getattr(exc, "errors", lambda: [])()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "path", "query")]
        message = f"Invalid value for '{'.'.join(loc)}': {first.get('msg', 'invalid')}" if loc else "Invalid request."
        return await gateway_error(request, InvalidRequest(message, param=".".join(loc) or None))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            err: GatewayError = NotFound(f"Invalid URL ({request.method} {request.url.path})", code=None)
        else:
            err = GatewayError(str(exc.detail), status=exc.status_code, type="invalid_request_error")
        return await gateway_error(request, err)

    async def client_gone(request: Request, exc: Exception) -> Response:
        gm.reject("client_disconnect")
        return Response(status_code=499)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        gm.reject("server_error")
        return error_response(GatewayError("The server had an error while processing your request."), _flavor(request))

    app.add_exception_handler(GatewayError, gateway_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(Exception, server_error)


class RequestMetricsMiddleware:
    """Pure ASGI (no per-request task or body copy): counts answers by route and status, and
    times them until the last byte."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.observe_request(route_label(scope["path"]), status, time.perf_counter() - start)

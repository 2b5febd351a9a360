"""``deepserve router``: the router as its own HTTP service, for several gateways to share.

It speaks the worker protocol (``engine/protocol.py``), so a gateway points one client at either
a worker or a router: ``POST /internal/generate`` (NDJSON ``TokenEvent`` stream),
``POST /internal/abort``, ``GET /load`` (the whole cluster as one rank), ``GET /health``,
``GET /kv_events`` (always empty: a router holds no KV), ``GET /metrics``. Membership:
``POST /register {"url", "role"?}``, ``POST /deregister {"worker_id" | "url", "drain"?}``,
``POST /drain {"worker_id" | "url", "draining"?}``, ``GET /workers``.

Built on ``aiohttp.web`` rather than FastAPI + uvicorn: for a proxy whose handlers are a few
lines, aiohttp's server adds less per request (measured in ``bench/router_bench.py --servers``).
A request whose whole answer is one event (non-streaming clients, ``max_tokens=1``) is answered
with a plain ``Content-Length`` body; otherwise the events are streamed as they come. Errors
raised before the first event become JSON errors: ``{"error": {"message", "type", "code"}}``
with the ``RouterError``'s status and, for overload, a ``Retry-After`` header.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from engine.protocol import GenerateRequest, SamplingParams
from router.config import RouterConfig
from router.errors import Overloaded, RouterError
from router.router import Router
from router.worker_client import dumps, loads

log = logging.getLogger(__name__)

ROUTER = web.AppKey("router", Router)
_NDJSON = "application/x-ndjson"


def _error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "router_error" if status >= 500 else "invalid_request_error", "code": code}}
    return web.Response(status=status, body=dumps(body), content_type="application/json", headers=headers)


def _router_error(exc: RouterError) -> web.Response:
    headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if isinstance(exc, Overloaded) else None
    return _error(exc.status, str(exc), exc.code, headers)


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = loads(await request.read())
    except ValueError:
        raise web.HTTPBadRequest(text="body is not JSON") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="body must be a JSON object")
    return body


def parse_generate(d: dict[str, Any]) -> GenerateRequest:
    """``GenerateRequest.from_dict`` without re-building the token lists: JSON already gave the
    ints; their type is checked (a bad request must be refused here, not fail on a worker and
    count against that worker's health)."""
    prompt = d["prompt_token_ids"]
    if not isinstance(prompt, list) or not prompt or set(map(type, prompt)) != {int}:
        raise ValueError("prompt_token_ids must be a non-empty list of integer token ids")
    out = d.get("output_token_ids") or []
    if not isinstance(out, list) or (out and set(map(type, out)) != {int}):
        raise ValueError("output_token_ids must be a list of integer token ids")
    return GenerateRequest(
        request_id=str(d["request_id"]),
        prompt_token_ids=prompt,
        sampling=SamplingParams.from_dict(d.get("sampling") or {}),
        priority=int(d.get("priority", 0)),
        output_token_ids=out,
        prefill_only=bool(d.get("prefill_only", False)),
        dp_rank=d.get("dp_rank"),
        session_key=d.get("session_key"),
        arrival_time=float(d.get("arrival_time") or time.time()),
    )


async def generate(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    try:
        req = parse_generate(await _json(request))
    except (KeyError, ValueError, TypeError) as exc:
        return _error(400, f"invalid request: {exc}", "invalid_request")
    events = router.generate(req)
    try:
        first = await anext(events)
    except StopAsyncIteration:
        return _error(500, "empty stream", "router_error")
    except RouterError as exc:
        return _router_error(exc)
    except (ValueError, TypeError) as exc:  # e.g. token ids that are not integers
        return _error(400, f"invalid request: {exc}", "invalid_request")
    if first.finish_reason is not None:  # the whole answer: no streaming needed
        await events.aclose()
        return web.Response(body=dumps(first.to_dict()) + b"\n", content_type=_NDJSON)
    resp = web.StreamResponse(headers={"Content-Type": _NDJSON})
    try:
        await resp.prepare(request)
        await resp.write(dumps(first.to_dict()) + b"\n")
        async for ev in events:
            await resp.write(dumps(ev.to_dict()) + b"\n")
        await resp.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client went away; aborting %s", req.request_id)
        raise
    finally:
        await events.aclose()  # on disconnect: aborts the request on its worker
    return resp


async def abort(request: web.Request) -> web.Response:
    body = await _json(request)
    found = await request.app[ROUTER].abort(str(body.get("request_id", "")))
    return web.json_response({"aborted": found})


async def load(request: web.Request) -> web.Response:
    return web.Response(body=dumps(request.app[ROUTER].load_report().to_dict()), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    ok = request.app[ROUTER].healthy()
    return web.json_response({"status": "ok" if ok else "no_worker"}, status=200 if ok else 503)


async def kv_events(request: web.Request) -> web.Response:
    return web.json_response({"seq": 0, "events": []})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[ROUTER].metrics.render(), content_type="text/plain", charset="utf-8")


async def register(request: web.Request) -> web.Response:
    body = await _json(request)
    if "url" not in body:
        return _error(400, "missing 'url'", "invalid_request")
    if body.get("role") not in (None, "prefill", "decode", "mixed"):
        return _error(400, f"role must be prefill, decode or mixed, not {body['role']!r}", "invalid_request")
    try:
        worker_id = await request.app[ROUTER].add_worker(str(body["url"]), body.get("role"))
    except RouterError as exc:
        return _router_error(exc)
    return web.json_response({"worker_id": worker_id})


async def deregister(request: web.Request) -> web.Response:
    body = await _json(request)
    try:
        await request.app[ROUTER].remove_worker(str(body.get("worker_id") or body.get("url", "")), drain=bool(body.get("drain", True)))
    except RouterError as exc:
        return _router_error(exc)
    return web.json_response({"ok": True})


async def drain(request: web.Request) -> web.Response:
    body = await _json(request)
    try:
        request.app[ROUTER].drain(str(body.get("worker_id") or body.get("url", "")), bool(body.get("draining", True)))
    except RouterError as exc:
        return _router_error(exc)
    return web.json_response({"ok": True})


async def workers(request: web.Request) -> web.Response:
    return web.json_response({"workers": [w.describe() for w in request.app[ROUTER].registry.workers()]})


def build_app(config: RouterConfig, *, router: Router | None = None) -> web.Application:
    """The service's app; the router is started and stopped with it."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ROUTER] = router or Router(config)

    async def lifespan(app: web.Application):
        await app[ROUTER].start()
        yield
        await app[ROUTER].stop()

    app.cleanup_ctx.append(lifespan)
    app.router.add_post("/internal/generate", generate)
    app.router.add_post("/internal/abort", abort)
    app.router.add_get("/load", load)
    app.router.add_get("/health", health)
    app.router.add_get("/kv_events", kv_events)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/register", register)
    app.router.add_post("/deregister", deregister)
    app.router.add_post("/drain", drain)
    app.router.add_get("/workers", workers)
    return app


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed (faster sockets and callbacks), else asyncio's."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def serve(config: RouterConfig) -> None:
    """Run the service until interrupted."""
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    # handler_cancellation: a client that disconnects cancels its handler at once, which closes
    # the router's stream and aborts the request on its worker (not only at the next write).
    web.run_app(build_app(config), host=config.host, port=config.port, access_log=None, print=None, loop=loop, handler_cancellation=True)

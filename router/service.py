"""``deepserve router``: the router as its own HTTP service, for several gateways to share.

It speaks the worker protocol (``deepserve/protocol/messages.py``), so a gateway points one client at either
a worker or a router: ``POST /internal/generate`` (NDJSON ``TokenEvent`` stream),
``POST /internal/abort``, ``GET /load`` (the whole cluster as one rank), ``GET /health``,
``GET /kv_events`` (always empty: a router holds no KV), ``GET /metrics``. Membership:
``POST /register {"url", "role"?}``, ``POST /deregister {"worker_id" | "url", "drain"?}``,
``POST /drain {"worker_id" | "url", "draining"?}``, ``GET /workers``.

Served through the ``router.serving`` seam (``RouterConfig.server``): by default
``router.http_server`` (``asyncio.Protocol`` + ``httptools``) rather than aiohttp, because for a
proxy whose handlers are a few lines the framework was a third of the router's CPU per request
(``bench/router_bench.py``); ``--server aiohttp`` runs the same handlers on the library. The worker's NDJSON lines are passed through as received
(``Router.stream``), not decoded into events and encoded again. The client's request body is
parsed once (orjson) into the typed ``GenerateRequest`` (``parse_body``), and that request is
what goes on to the worker, encoded with the router's fields (``dp_rank``, ``prefill_only``).
A request whose whole answer is one event (non-streaming clients, ``max_tokens=1``) is answered
with a plain ``Content-Length`` body; otherwise the events are streamed (chunked) as they come.
A client that disconnects cancels its handler, which closes the router's stream and aborts the
request on its worker.
Errors raised before the first event become ``deepserve.protocol.error_body`` JSON errors
(``{"error": {"message", "type", "code"}}``) with the ``RouterError``'s code and its status and,
for overload, a ``Retry-After`` header; a worker's code is passed on as it came.

With an internal token (``deepserve.internal_auth``) every route but ``/health`` (and
``/metrics`` with ``open_metrics``) needs it, and ``/register`` is taken only for the caller's
own address (``register_check_address``) and never for a worker id a live worker holds; without
one the router listens on loopback only. Sampling settings are type-checked
(``deepserve.protocol.validate``) before they are memoised.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import ipaddress
import logging
import signal
import sys
import time
from typing import Any, get_args
from urllib.parse import urlsplit

from deepserve.internal_auth import InternalAuth
from deepserve.protocol import ErrorCode, GenerateRequest, OutputConstraint, Role, SamplingParams, error_body
from deepserve.protocol.validate import check_fields
from router.config import RouterConfig
from router.errors import RegistrationRefused, RouterError
from router.serving import Response, ServerOptions, ServerRequest as Request, make_server
from router.router import Router
from router.worker_client import dumps, loads

log = logging.getLogger(__name__)

_NDJSON = b"application/x-ndjson"
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


def _error(code: ErrorCode, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(error_body(code, message)), code.status, headers=headers)


# The HTTP server's own refusals that have an ``ErrorCode``; the others (401, 405, 408, 413) carry
# an HTTP-level code string that is none, and a client classes them by their status.
_SERVER_CODES = {400: ErrorCode.INVALID_REQUEST, 404: ErrorCode.NOT_FOUND, 500: ErrorCode.INTERNAL, 503: ErrorCode.OVERLOADED}
_HTTP_CODES = {401: "unauthorized", 405: "method_not_allowed", 408: "request_timeout", 413: "body_too_large"}


def _server_error(status: int, message: str) -> Response:
    if status in _SERVER_CODES:
        return _error(_SERVER_CODES[status], message)
    body = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error", "code": _HTTP_CODES.get(status)}}
    return Response(dumps(body), status)


def _router_error(exc: RouterError) -> Response:
    headers = None if exc.retry_after is None else {"Retry-After": str(max(1, round(exc.retry_after)))}
    return _error(exc.code, str(exc), headers)


def _json_ok(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status)


class BadRequest(ValueError):
    pass


def _body(raw: bytes) -> dict[str, Any]:
    try:
        body = loads(raw)
    except ValueError:
        raise BadRequest("body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def parse_body(raw: bytes) -> GenerateRequest:
    """The generate body ``raw``, parsed once (orjson) into the typed request (``parse_generate``)."""
    return parse_generate(_body(raw), raw)


def _token_ids(ids: Any, raw: bytes, name: str, empty_ok: bool) -> list[int]:
    """``ids`` (the body's field ``name``) if it is a list of integers: ``sum`` refuses strings,
    lists and nulls, and its result is an int only when no float was summed; only a body with a
    JSON boolean in it (which ``sum`` takes for 0/1) gets the check of each element's type."""
    if isinstance(ids, list) and (ids or empty_ok):
        if not ids:
            return ids
        try:
            ok = type(sum(ids)) is int
        except TypeError:
            ok = False
        if ok and (not raw or b"true" in raw or b"false" in raw):
            ok = set(map(type, ids)) == {int}
        if ok:
            return ids
    raise ValueError(f"{name} must be a {'' if empty_ok else 'non-empty '}list of integer token ids")


@functools.lru_cache(maxsize=1024)
def _sampling_of(text: bytes) -> SamplingParams:
    """The settings whose JSON text is ``text``, built once per distinct text (clients send the
    same few again and again; building the frozen dataclass, 14 fields and their checks, costs
    2 µs). Exact for settings parsed from a JSON body: JSON has no NaN or infinity."""
    return _build_sampling(loads(text))


def _build_sampling(d: dict[str, Any]) -> SamplingParams:
    check_fields(SamplingParams, d, "sampling")
    kw = {k: v for k, v in d.items() if k in _SAMPLING_FIELDS}
    if "stop_token_ids" in kw:
        kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    if kw.get("constraint") is not None:
        kw["constraint"] = OutputConstraint.from_dict(kw["constraint"])
    return SamplingParams(**kw)


def _sampling(d: dict[str, Any]) -> SamplingParams:
    """``SamplingParams.from_dict`` with the field checks, memoised by the settings' JSON text
    (``_sampling_of``); settings orjson cannot encode (an integer beyond 64 bits) are built each time."""
    if not isinstance(d, dict):
        raise ValueError("sampling must be an object")
    try:
        text = dumps(d)
    except (TypeError, ValueError):
        return _build_sampling(d)
    return _sampling_of(text)


def parse_generate(d: dict[str, Any], raw: bytes = b"") -> GenerateRequest:
    """``GenerateRequest.from_dict`` without re-building the token lists: JSON already gave the
    ints; their type is checked (a bad request must be refused here, not fail on a worker and
    count against that worker's health). ``raw``: the JSON body ``d`` came from, if any."""
    prompt = _token_ids(d["prompt_token_ids"], raw, "prompt_token_ids", empty_ok=False)
    out = _token_ids(d.get("output_token_ids") or [], raw, "output_token_ids", empty_ok=True)
    # positional (request_id, prompt, sampling, priority, output, prefill_only, dp_rank,
    # session_key, arrival_time): the keyword call cost 0.3 µs more
    return GenerateRequest(
        str(d["request_id"]),
        prompt,
        _sampling(d.get("sampling") or {}),
        int(d.get("priority", 0)),
        out,
        bool(d.get("prefill_only", False)),
        d.get("dp_rank"),
        d.get("session_key"),
        float(d.get("arrival_time") or time.time()),
    )


class RouterService:
    """The router behind its HTTP surface (module docstring). ``start()`` starts the router and
    listens; ``stop()`` stops both. ``router``: a prepared router (tests); by default one is
    built from ``config``; ``auth``: the internal token, required from callers and sent to
    the workers."""

    def __init__(self, config: RouterConfig, *, router: Router | None = None, auth: InternalAuth | None = None) -> None:
        self.config = config
        self.auth = auth or InternalAuth()
        self.router = router or Router(config, auth=self.auth)
        routes = {
            (b"POST", "/internal/generate"): self.generate,
            (b"POST", "/internal/abort"): self.abort,
            (b"GET", "/load"): self.load,
            (b"GET", "/health"): self.health,
            (b"GET", "/kv_events"): self.kv_events,
            (b"GET", "/metrics"): self.metrics,
            (b"POST", "/register"): self.register,
            (b"POST", "/deregister"): self.deregister,
            (b"POST", "/drain"): self.drain,
            (b"GET", "/workers"): self.workers,
        }
        self.server = make_server(config.server, routes, ServerOptions(
            error_response=_server_error, read_timeout_s=config.read_timeout_s, max_connections=config.max_connections,
            auth=self.auth, open_paths=frozenset({"/health", "/metrics"} if config.open_metrics else {"/health"}),
        ))

    async def start(self, host: str | None = None, port: int | None = None, *, reuse_port: bool = False) -> None:
        await self.router.start()
        await self.server.start(host or self.config.host, self.config.port if port is None else port, reuse_port=reuse_port)

    async def stop(self) -> None:
        await self.server.stop()
        await self.router.stop()

    @property
    def port(self) -> int:
        return self.server.port

    # ---- the hot route ------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response | None:
        try:
            req = parse_body(request.body)
        except (KeyError, ValueError, TypeError) as exc:
            return _error(ErrorCode.INVALID_REQUEST, f"invalid request: {exc}")
        events = self.router.stream(req)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            return _error(ErrorCode.INTERNAL, "empty stream")
        except RouterError as exc:
            return _router_error(exc)
        except (ValueError, TypeError) as exc:  # e.g. token ids that are not integers
            return _error(ErrorCode.INVALID_REQUEST, f"invalid request: {exc}")
        try:
            if first.finished:  # the whole answer: no streaming needed
                await anext(events, None)  # let the stream end (cheaper than closing it)
                return Response(first.line + b"\n", 200, _NDJSON)
            out = request.stream(200, _NDJSON)
            await out.write(first.line + b"\n")
            async for ev in events:
                await out.write(ev.line + b"\n")
            out.end()
            return None
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client went away; aborting %s", req.request_id)
            raise
        finally:
            if events.ag_frame is not None:  # not run to its end (e.g. a disconnect): closing it
                await events.aclose()  # aborts the request on its worker

    # ---- the rest -----------------------------------------------------------------------------
    async def abort(self, request: Request) -> Response:
        try:
            body = _body(request.body)
        except BadRequest as exc:
            return _error(ErrorCode.INVALID_REQUEST, str(exc))
        return _json_ok({"aborted": await self.router.abort(str(body.get("request_id", "")))})

    async def load(self, request: Request) -> Response:
        return _json_ok(self.router.load_report().to_dict())

    async def health(self, request: Request) -> Response:
        """200 while the router can serve (a worker is available), with how many of its workers are."""
        workers = self.router.registry.workers()
        up = sum(w.available for w in workers)
        return _json_ok({"status": "ok" if up else "no_worker", "available": up, "workers": len(workers)}, 200 if up else 503)

    async def kv_events(self, request: Request) -> Response:
        return _json_ok({"seq": 0, "events": []})

    async def metrics(self, request: Request) -> Response:
        return Response(self.router.metrics.render(), 200, b"text/plain; version=0.0.4; charset=utf-8")

    async def register(self, request: Request) -> Response:
        try:
            body = _body(request.body)
        except BadRequest as exc:
            return _error(ErrorCode.INVALID_REQUEST, str(exc))
        if "url" not in body:
            return _error(ErrorCode.INVALID_REQUEST, "missing 'url'")
        if body.get("role") not in (None, *get_args(Role)):
            return _error(ErrorCode.INVALID_REQUEST, f"role must be prefill, decode or mixed, not {body['role']!r}")
        if not str(body["url"]).startswith(self.auth.tls.scheme + "://"):  # the plane's TLS decides the scheme
            return _error(ErrorCode.INVALID_REQUEST, f"a worker's url is {self.auth.tls.scheme}://host:port on this plane")
        try:
            if self.config.register_check_address:
                await _check_own_address(str(body["url"]), request.peer)
            worker_id = await self.router.add_worker(str(body["url"]), body.get("role"))
        except RouterError as exc:
            return _router_error(exc)
        return _json_ok({"worker_id": worker_id})

    async def deregister(self, request: Request) -> Response:
        try:
            body = _body(request.body)
            await self.router.remove_worker(str(body.get("worker_id") or body.get("url", "")), drain=bool(body.get("drain", True)))
        except BadRequest as exc:
            return _error(ErrorCode.INVALID_REQUEST, str(exc))
        except RouterError as exc:
            return _router_error(exc)
        return _json_ok({"ok": True})

    async def drain(self, request: Request) -> Response:
        try:
            body = _body(request.body)
            self.router.drain(str(body.get("worker_id") or body.get("url", "")), bool(body.get("draining", True)))
        except BadRequest as exc:
            return _error(ErrorCode.INVALID_REQUEST, str(exc))
        except RouterError as exc:
            return _router_error(exc)
        return _json_ok({"ok": True})

    async def workers(self, request: Request) -> Response:
        return _json_ok({"workers": [w.describe() for w in self.router.registry.workers()]})


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


async def _check_own_address(url: str, peer: str) -> None:
    """``RegistrationRefused`` unless the host of ``url`` resolves to the caller's address ``peer``
    (a worker registers itself, not some other address)."""
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        host = ""
    if not host:
        raise RegistrationRefused(f"cannot read a host in {url!r}")
    caller = _ip(peer)
    addrs = {_ip(host)} if _ip(host) is not None else set()
    if not addrs:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None)
        except OSError as exc:
            raise RegistrationRefused(f"cannot resolve {host!r}: {exc}") from None
        addrs = {_ip(info[4][0]) for info in infos}
    if caller is None or caller not in addrs:
        raise RegistrationRefused(f"a worker registers its own address: {host} is not the caller ({peer or 'unknown'})")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop (faster sockets and callbacks); uvloop is a dependency everywhere but Windows."""
    if sys.platform == "win32":
        return asyncio.new_event_loop()
    import uvloop

    return uvloop.new_event_loop()


async def _serve(config: RouterConfig, auth: InternalAuth) -> None:
    service = RouterService(config, auth=auth)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    # What exists now (modules, config, workers) lives as long as the process: keep it out of
    # every collection; and collect the young generation every 20,000 net allocations instead
    # of 700 (a request allocates and frees dozens of containers, and builds no cycles): the
    # collector cost 2-8 µs per request at the default thresholds (bench/router_bench.py).
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)
    try:
        await stop.wait()
    finally:
        await service.stop()


def serve(config: RouterConfig, auth: InternalAuth | None = None) -> None:
    """Run the service until SIGINT or SIGTERM (refused beyond loopback without ``auth``)."""
    auth = auth or InternalAuth()
    auth.check_bind(config.host, "deepserve router")
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_serve(config, auth))
    finally:
        loop.close()

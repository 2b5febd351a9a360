"""The ``aiohttp`` server (``router.serving``): the router's handlers on aiohttp's low-level server.

The library does the HTTP/1.1 (parsing, keep-alive, chunked bodies and answers, backpressure,
cancelling a handler whose client went away: ``handler_cancellation``); this module adds what
``router.serving`` asks of every server: the exact route table, the internal token, the body
limit, the read deadline, the connection limit, and the service's error bodies.

The read deadline (as ``http1``'s): a request's head and body must be in within
``read_timeout_s`` of its first byte. aiohttp has no head deadline (its keep-alive timeout closes
idle connections, silently), so each connection is aiohttp's own protocol with a clock
(``_Connection``): its first byte starts it, ``_handle`` stops it, and a periodic sweep answers a
head that is late 408 and closes the connection. A request that arrives while a handler runs is
timed from that handler's end: it waited on us, not on its client.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Any, Literal

from aiohttp import web, web_protocol, web_server

from router.serving import Response, Routes, ServerOptions

log = logging.getLogger(__name__)

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Connection(web_protocol.RequestHandler):
    """aiohttp's protocol for one connection, with the clock of the request being received."""

    __slots__ = ("_now", "head_since", "phase")

    def __init__(self, manager: web_server.Server, *, loop: asyncio.AbstractEventLoop, **kw: Any) -> None:
        super().__init__(manager, loop=loop, **kw)
        self._now = loop.time
        self.head_since = 0.0  # loop time of the first byte of a request not yet in ``_handle``; 0 = none
        # "body": ``_handle`` reads a body (the bytes are its own); "handler": its route runs
        self.phase: Literal["idle", "body", "handler"] = "idle"

    def data_received(self, data: bytes) -> None:
        if data and not self.head_since and self.phase != "body":
            self.head_since = self._now()
        super().data_received(data)

    def late(self, cutoff: float) -> bool:
        """A request's first byte came before ``cutoff`` and its head is still not in. Only while
        no handler runs and every answer is out, so that the 408 is the connection's next bytes."""
        return self.phase == "idle" and 0.0 < self.head_since < cutoff and self.transport is not None \
            and self.transport.get_write_buffer_size() == 0


class _Refused(Exception):
    """A request the server answers itself (``status``), closing its connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Writer:
    """A chunked answer in progress: prepared on its first write (aiohttp finishes it when the
    handler returns)."""

    __slots__ = ("_raw", "resp")

    def __init__(self, raw: web.BaseRequest, resp: web.StreamResponse) -> None:
        self._raw, self.resp = raw, resp

    async def write(self, data: bytes) -> None:
        if not self.resp.prepared:
            await self.resp.prepare(self._raw)
        if data:
            await self.resp.write(data)  # ConnectionResetError once the client went away

    def end(self) -> None:
        """Nothing to do: aiohttp writes the last chunk when the handler returns."""


class _Request:
    """``router.serving.ServerRequest`` over an aiohttp request whose body was read."""

    __slots__ = ("_raw", "method", "path", "query", "body", "writer")

    def __init__(self, raw: web.BaseRequest, method: bytes, path: str, query: str, body: bytes) -> None:
        self._raw, self.method, self.path, self.query, self.body = raw, method, path, query, body
        self.writer: _Writer | None = None

    @property
    def peer(self) -> str:
        return self._raw.remote or ""

    @property
    def headers(self) -> dict[str, str]:
        # from the raw bytes, as latin-1 (http1's decoding: aiohttp's own is UTF-8 with surrogates)
        return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self._raw.raw_headers}

    def stream(self, status: int = 200, content_type: bytes = b"application/x-ndjson", headers: dict[str, str] | None = None) -> _Writer:
        resp = web.StreamResponse(status=status, headers={"Content-Type": content_type.decode("latin-1"), **(headers or {})})
        self.writer = _Writer(self._raw, resp)
        return self.writer


def _answer(resp: Response, close: bool = False) -> web.Response:
    out = web.Response(body=resp.body, status=resp.status, headers={"Content-Type": resp.content_type.decode("latin-1"), **(resp.headers or {})})
    if close:
        out.force_close()
    return out


def _raw_answer(resp: Response) -> bytes:
    """``resp`` as the bytes of an answer that closes its connection (for the sweep, which has no
    aiohttp request to answer)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (resp.headers or {}).items())
    head = (f"HTTP/1.1 {resp.status} {HTTPStatus(resp.status).phrase}\r\nContent-Type: {resp.content_type.decode('latin-1')}\r\n"
            f"{extra}Content-Length: {len(resp.body)}\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + resp.body


class AiohttpServer:
    """Serves ``routes`` on one listening socket through aiohttp, within ``options``
    (``router.serving`` has the contract and ``ServerOptions``)."""

    def __init__(self, routes: Routes, options: ServerOptions = ServerOptions()) -> None:
        self.routes = routes
        self.paths = {p for _, p in routes}
        self.options = options
        self.error_response = options.error_response
        self.auth = options.guard
        self._http: web_server.Server | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int, *, backlog: int = 1024, reuse_port: bool = False) -> None:
        loop = self._loop = asyncio.get_running_loop()
        http = self._http = web_server.Server(self._handle, handler_cancellation=True)

        def connection() -> _Connection:
            return _Connection(
                http, loop=loop, keepalive_timeout=self.options.keepalive_s, access_log=None,
                lingering_time=0,  # a refused body is not read on: the connection closes after the answer
            )

        self._listener = await loop.create_server(
            connection, host, port, backlog=backlog, reuse_address=True, reuse_port=reuse_port or None, ssl=self.options.ssl,
        )
        self._sweeper = loop.call_later(self.options.read_timeout_s / 2, self._sweep)

    def _sweep(self) -> None:
        """Answer 408 and close each connection whose request head is late (``_Connection.late``)."""
        cutoff = self._loop.time() - self.options.read_timeout_s
        for conn in self._http.connections:
            if isinstance(conn, _Connection) and conn.late(cutoff):
                resp = self.error_response(408, f"request not received within {self.options.read_timeout_s:g}s")
                conn.transport.write(_raw_answer(resp))
                conn.force_close()  # the transport sends what it holds, then closes
        self._sweeper = self._loop.call_later(self.options.read_timeout_s / 2, self._sweep)

    @property
    def port(self) -> int:
        assert self._listener is not None, "not started"
        return self._listener.sockets[0].getsockname()[1]

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop listening, let running handlers finish within ``grace_s``, then cancel them."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._listener is not None:
            self._listener.close()
        if self._http is not None:
            await self._http.shutdown(grace_s)
        if self._listener is not None:
            await self._listener.wait_closed()

    async def _handle(self, raw: web.BaseRequest) -> web.StreamResponse:
        conn: _Connection = raw.protocol  # type: ignore[assignment]
        started = conn.head_since or self._loop.time()
        conn.head_since, conn.phase = 0.0, "body"
        try:
            return await self._serve(raw, conn, started)
        finally:
            conn.phase = "idle"
            if conn.head_since:  # the next request came while this one was served
                conn.head_since = self._loop.time()

    async def _serve(self, raw: web.BaseRequest, conn: _Connection, started: float) -> web.StreamResponse:
        """``raw``'s answer; its first byte came at loop time ``started``."""
        path, _, query = raw.raw_path.partition("?")
        method = raw.method.encode()
        try:
            if len(self._http.connections) > self.options.max_connections:
                raise _Refused(503, f"over {self.options.max_connections} connections")
            if raw.content_length is not None and raw.content_length > self.options.max_body:
                raise _Refused(413, f"body over {self.options.max_body} bytes")
            try:
                async with asyncio.timeout_at(started + self.options.read_timeout_s):
                    body = await self._body(raw)
            except TimeoutError:
                raise _Refused(408, f"request not received within {self.options.read_timeout_s:g}s") from None
        except _Refused as exc:
            return _answer(self.error_response(exc.status, str(exc)), close=True)
        conn.phase = "handler"
        handler = self.routes.get((method, path))
        if self.auth is not None and path not in self.options.open_paths and not self.auth.allows(raw.headers.get("Authorization")):
            return _answer(self.error_response(401, "missing or wrong internal token"))
        if handler is None:
            return _answer(self.error_response(405 if path in self.paths else 404, f"no route {raw.method} {path}"))
        req = _Request(raw, method, path, query, body)
        try:
            resp = await handler(req)
        except Exception:
            log.exception("handler for %s %s failed", raw.method, path)
            if req.writer is not None and req.writer.resp.prepared:  # the head went out: cut the answer
                raise
            return _answer(self.error_response(500, "internal error"))
        if resp is not None:
            return _answer(resp)
        if req.writer is None:  # a handler must answer
            return _answer(self.error_response(500, "no answer"))
        return req.writer.resp

    async def _body(self, raw: web.BaseRequest) -> bytes:
        """The whole body (``_Refused`` 413 past ``max_body``), after a ``100 Continue`` if asked."""
        if raw.headers.get("Expect", "").lower() == "100-continue":
            await raw.writer.write(_CONTINUE)
        parts, size = [], 0
        while chunk := await raw.content.readany():
            size += len(chunk)
            if size > self.options.max_body:
                raise _Refused(413, f"body over {self.options.max_body} bytes")
            parts.append(chunk)
        return b"".join(parts)

"""A small HTTP/1.1 server on ``asyncio.Protocol`` + ``httptools``: the router service's front
(the ``http1`` implementation of ``router.serving``; ``router.aiohttp_server`` is the library one).

Why not aiohttp.web: profiling ``deepserve router`` at concurrency 32 (py-spy,
``bench/router_bench.py``) put a third of its CPU in aiohttp's server machinery (request and
response objects, header multidicts, payload writers, per-request tasks and weakrefs) for routes
whose shape never varies. This module does only what the service needs:

- **Routing**: an exact ``(method, path)`` table (the query string is kept apart); 404 for an
  unknown path, 405 for a known path with another method.
- **Requests**: parsed by ``httptools`` (C, llhttp). Bodies with ``Content-Length`` or
  ``Transfer-Encoding: chunked``; a body over ``max_body`` is answered 413 and the connection
  closed; ``Expect: 100-continue`` is answered before the body is read. A malformed request is
  answered 400 and the connection closed.
- **Keep-alive and pipelining**: requests on one connection are handled one at a time in arrival
  order (answers cannot interleave); while more than ``_MAX_PIPELINED`` wait, reading pauses.
  Connections idle longer than ``keepalive_s`` are closed by a periodic sweep (no timer per
  request).
- **Answers**: a handler returns a ``Response`` (one ``transport.write`` with
  ``Content-Length``), or calls ``request.stream(...)`` and writes chunks
  (``Transfer-Encoding: chunked``) with backpressure: ``await writer.write(...)`` waits while
  the transport's buffer is over its high-water mark (``pause_writing``/``resume_writing``).
- **Disconnects**: a client that goes away cancels its running handler at once (as aiohttp's
  ``handler_cancellation=True``), so a streaming handler's ``finally`` aborts upstream work.
- **Limits**: a request whose head and body are not all in within ``read_timeout_s`` of its
  first byte is answered 408 and its connection closed (the same sweep); beyond
  ``max_connections`` open connections a new one is answered 503 and closed.
- **Credential**: with ``auth`` set, every path but ``open_paths`` needs its token in
  ``Authorization`` (401 otherwise; the header is picked out while parsing, as Content-Length).

One task per connection runs the handlers, and waits for the connection's next request between
them (a task per request cost ~1 µs more: the task object, its coroutine and the loop's
bookkeeping of live tasks); nothing else is allocated per request beyond the ``Request`` object,
its body and the future the idle task waits on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from http import HTTPStatus

import httptools

from router.serving import Handler, Response, ServerOptions

log = logging.getLogger(__name__)

_MAX_PIPELINED = 16  # queued requests on one connection before reading pauses
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _head(status: int, content_type: bytes, extra: dict[str, str] | None, keep_alive: bool) -> bytes:
    if not extra:
        return _plain_head(status, content_type, keep_alive)
    h = _plain_head(status, content_type, True) + "".join(f"{k}: {v}\r\n" for k, v in extra.items()).encode("latin-1")
    return h if keep_alive else h + b"Connection: close\r\n"


@functools.lru_cache(maxsize=256)
def _plain_head(status: int, content_type: bytes, keep_alive: bool) -> bytes:
    """A head without extra headers: the usual ones are built once."""
    h = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\n" % (status, _REASONS.get(status, b"Unknown"), content_type)
    return h if keep_alive else h + b"Connection: close\r\n"


class StreamWriter:
    """A chunked answer in progress (``Request.stream``)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    async def write(self, data: bytes) -> None:
        """Send one chunk; waits while the client reads slower than we write."""
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("client went away")
        if data:
            conn.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        if conn.write_paused:
            await conn.drain()

    def end(self) -> None:
        if not self._conn.closed:
            self._conn.transport.write(b"0\r\n\r\n")


class Request:
    """One parsed request. ``headers``: lower-case names (decoded when first read; the hot
    route reads none); ``body``: the whole (de-chunked) body."""

    __slots__ = ("method", "path", "query", "_raw_headers", "_headers", "body", "keep_alive", "_conn", "streaming", "authorization")

    def __init__(
        self, conn: _Connection, method: bytes, path: str, query: str, headers: dict[str, str] | list[tuple[bytes, bytes]], body: bytes, keep_alive: bool,
        authorization: bytes | None = None,
    ) -> None:
        self._conn = conn
        self.method = method
        self.path = path
        self.query = query
        self._raw_headers, self._headers = (headers, None) if isinstance(headers, list) else ([], headers)
        self.body = body
        self.keep_alive = keep_alive
        self.streaming = False
        self.authorization = authorization

    @property
    def peer(self) -> str:
        """The client's IP address ("" if unknown)."""
        transport = self._conn.transport
        info = transport.get_extra_info("peername") if transport is not None else None
        return str(info[0]) if info else ""

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            self._headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self._raw_headers}
        return self._headers

    def stream(self, status: int = 200, content_type: bytes = b"application/x-ndjson", headers: dict[str, str] | None = None) -> StreamWriter:
        """Start a chunked answer; the handler then returns ``None``."""
        self.streaming = True
        conn = self._conn
        if not conn.closed:
            conn.transport.write(_head(status, content_type, headers, self.keep_alive) + b"Transfer-Encoding: chunked\r\n\r\n")
        return StreamWriter(conn)


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their handlers one at a time, in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.write_paused = False
        self.read_paused = False
        self._drain: asyncio.Future | None = None
        self.pending: deque[Request] = deque()
        self.task: asyncio.Task | None = None  # runs the handlers (see _run)
        self.next: asyncio.Future | None = None  # set while that task waits for a request
        self.last_active = 0.0
        self.dead = False  # a request was refused: parse nothing more
        self.refusal: Response | None = None  # its answer, sent after the earlier requests' ones
        # the request being parsed (_begin resets them)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []  # as received (Request.headers decodes)
        self._length = b""  # its Content-Length, Expect and Authorization values
        self._expect = b""
        self._auth: bytes | None = None
        self.reading_since = 0.0  # loop time of the first byte of a request not yet complete; 0 = none
        self._body: list[bytes] = []
        self._size = 0

    # ---- transport callbacks -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.server.connections) >= self.server.options.max_connections:
            self.dead = True
            self._send(self.server.error_response(503, "too many connections"), False)
            transport.close()
            return
        self.server.connections.add(self)
        self.last_active = self.server.loop.time()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.pending.clear()
        if self.task is not None:
            self.task.cancel()  # the client is gone: stop its handler (and the work upstream)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("client went away"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("client went away")
        if self._drain is None:
            self._drain = self.server.loop.create_future()
        await self._drain

    def data_received(self, data: bytes) -> None:
        if self.dead:
            return
        if not self.reading_since:
            self.reading_since = self.server.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed request: {exc}")

    # ---- parser callbacks ----------------------------------------------------------------------
    # No on_message_begin: the parser calls only the callbacks the protocol has, and each call
    # from C costs ~0.15 µs; on_message_complete resets the parse state for the next request.
    def _begin(self) -> None:
        self._url = b""
        self._headers = []
        self._length = self._expect = b""
        self._auth = None
        self.reading_since = 0.0
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # Kept as bytes: decoding and lower-casing every header cost ~0.8 µs per request, and
        # the server itself reads two (picked by their name's length first).
        self._headers.append((name, value))
        if len(name) == 14 and name.lower() == b"content-length":
            self._length = value
        elif len(name) == 6 and name.lower() == b"expect":
            self._expect = value
        elif len(name) == 13 and name.lower() == b"authorization":
            self._auth = value

    def on_headers_complete(self) -> None:
        if self.dead:
            return
        cl = self._length
        if cl and cl.isdigit() and int(cl) > self.server.options.max_body:
            self._refuse(413, f"body over {self.server.options.max_body} bytes")
            raise httptools.HttpParserCallbackError("body too large")  # stop parsing this buffer
        if self._expect and self._expect.lower() == b"100-continue" and not self.pending and not self.busy:
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.server.options.max_body:
            self._refuse(413, f"body over {self.server.options.max_body} bytes")
            raise httptools.HttpParserCallbackError("body too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.dead:
            return
        url = self._url
        q = url.find(b"?")
        path, query = (url[:q], url[q + 1 :]) if q >= 0 else (url, b"")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        p = self.parser
        req = Request(self, p.get_method(), path.decode("latin-1"), query.decode("latin-1"), self._headers, body, p.should_keep_alive(), self._auth)
        self._begin()
        if self.next is not None and not self.next.done():  # the connection's task waits for it
            self.next.set_result(req)
            self.next = None
        elif self.task is None:
            self.task = self.server.loop.create_task(self._run(req))
        else:
            self.pending.append(req)
            if len(self.pending) > _MAX_PIPELINED and not self.read_paused:
                self.read_paused = True
                self.transport.pause_reading()

    # ---- handling ------------------------------------------------------------------------------
    def _refuse(self, status: int, message: str) -> None:
        """Answer an unparseable / refused request and close once written (after earlier answers)."""
        if self.dead:
            return
        self.dead = True
        resp = self.server.error_response(status, message)
        if not self.busy:
            self._send(resp, False)
            self.transport.close()
        else:
            self.refusal = resp  # after the running handler and the requests queued before it

    @property
    def busy(self) -> bool:
        """A handler runs (or its answer is being sent): the connection is not idle."""
        return self.task is not None and self.next is None

    def _send(self, resp: Response, keep_alive: bool) -> None:
        body = resp.body
        head = _head(resp.status, resp.content_type, resp.headers, keep_alive) if resp.headers else _plain_head(resp.status, resp.content_type, keep_alive)
        self.transport.write(b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body))

    async def _run(self, req: Request) -> None:
        server = self.server
        while True:
            keep = req.keep_alive
            try:
                handler = server.routes.get((req.method, req.path))
                if server.auth is not None and req.path not in server.options.open_paths and not server.auth.allows(req.authorization):
                    resp = server.error_response(401, "missing or wrong internal token")
                elif handler is None:
                    resp = server.error_response(405 if req.path in server.paths else 404, f"no route {req.method.decode()} {req.path}")
                else:
                    resp = await handler(req)
                if self.closed:
                    return
                if resp is not None:
                    self._send(resp, keep)
                elif not req.streaming:  # a handler must answer
                    self._send(server.error_response(500, "no answer"), keep)
            except asyncio.CancelledError:
                if self.closed:
                    return  # the client went away (connection_lost cancelled us)
                raise
            except Exception:  # noqa: BLE001 (one bad request must not kill the connection's loop)
                log.exception("handler for %s %s failed", req.method.decode(), req.path)
                if self.closed:
                    return
                if req.streaming:  # the head went out: the answer cannot be completed
                    self.transport.close()
                    return
                self._send(server.error_response(500, "internal error"), keep)
            if not keep:
                self.transport.close()
                return
            self.last_active = server.loop.time()
            if self.pending:
                req = self.pending.popleft()
                if self.read_paused and len(self.pending) <= _MAX_PIPELINED // 2:
                    self.read_paused = False
                    self.transport.resume_reading()
                continue
            if self.refusal is not None:
                self._send(self.refusal, False)
                self.transport.close()
                return
            if self.closed:
                return
            self.next = server.loop.create_future()  # on_message_complete sets it
            try:
                req = await self.next
            except asyncio.CancelledError:
                self.next = None
                if self.closed:
                    return  # the client went away, or the server closed the idle connection
                raise


class HttpServer:
    """Serves ``routes`` (``{(b"POST", "/path"): handler}``) on one listening socket, within
    ``options`` (``router.serving.ServerOptions``: limits, error bodies, internal token)."""

    def __init__(self, routes: dict[tuple[bytes, str], Handler], options: ServerOptions = ServerOptions()) -> None:
        self.routes = routes
        self.paths = {p for _, p in routes}
        self.options = options
        self.error_response = options.error_response
        self.auth = options.guard
        self.connections: set[_Connection] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int, *, backlog: int = 1024, reuse_port: bool = False) -> None:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True, reuse_port=reuse_port or None, ssl=self.options.ssl,
        )
        self._sweeper = self.loop.call_later(self._sweep_every, self._sweep)

    @property
    def _sweep_every(self) -> float:
        return min(self.options.keepalive_s, self.options.read_timeout_s) / 2

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        return self._server.sockets[0].getsockname()[1]

    def _sweep(self) -> None:
        """Close keep-alive connections idle for more than ``keepalive_s``, and those whose
        request has been arriving for more than ``read_timeout_s`` (408)."""
        now = self.loop.time()
        cutoff, slow = now - self.options.keepalive_s, now - self.options.read_timeout_s
        for c in list(self.connections):
            if c.reading_since and c.reading_since < slow and not c.dead:
                c._refuse(408, f"request not received within {self.options.read_timeout_s:g}s")
            elif not c.busy and not c.pending and c.last_active < cutoff and not c.reading_since:
                c.transport.close()
        self._sweeper = self.loop.call_later(self._sweep_every, self._sweep)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop listening, close idle connections, give running handlers ``grace_s``, then cancel."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            if not c.busy:
                c.transport.close()
        tasks = [c.task for c in self.connections if c.busy]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        for c in list(self.connections):
            c.transport.close()
        if self._server is not None:
            await self._server.wait_closed()

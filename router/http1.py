"""The ``http1`` transport (``router.transport``): a minimal HTTP/1.1 client for the one hot
call, ``POST /internal/generate`` with NDJSON back.

Why not aiohttp here: profiling the router service at concurrency 32 (py-spy, ``bench/router_bench.py``)
put ~21% of its CPU in aiohttp's client machinery (request objects, payload registry, tracing
hooks, stream readers) for a call whose shape never varies. This module does just that call on
``asyncio.Protocol`` connections kept alive in a per-worker pool: one ``transport.write`` per
request, the answer parsed in ``data_received`` straight into complete NDJSON lines, one await
per batch of lines. Everything else the router says to a worker (``/load``, ``/health``,
``/kv_events``, ``/internal/abort``) stays on aiohttp.

Answers may be ``Content-Length`` or ``Transfer-Encoding: chunked``. A connection goes back to the
pool only after a complete answer; a caller that stops early closes it (the worker sees the
disconnect). A request on a *reused* connection that dies before any answer byte is sent again
once on a fresh connection (the worker may have closed it as idle at the same moment).
Errors and deadlines are the seam's (``router.transport``): one sweep per pool, every half
second while requests are open, checks the deadlines (no timer per request or per line).
"""

from __future__ import annotations

import asyncio
from ssl import SSLContext
from urllib.parse import urlsplit

from router.transport import ConnectError, Deadlines, DeadlineError, ProtocolError, StatusError


_MAX_BUFFERED_LINES = 4096  # pause reading beyond this (a consumer slower than its worker)


class _Conn(asyncio.Protocol):
    """One keep-alive connection; parses one answer at a time into ``lines``."""

    def __init__(self) -> None:
        # The loop, kept: asyncio.get_running_loop() per wait cost a getpid() system call each
        # time (CPython checks the loop's process), one per request under strace.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.recycle: Http1Pool | None = None  # the pool to go back to once the answer ends
        self.last_data = 0.0  # loop time of the request's send or its answer's latest bytes
        self._reset()

    def _reset(self) -> None:
        self.recycle = None
        self.buf = b""
        self.lines: list[bytes] = []
        self.status = 0  # 0 until the head is parsed
        self.got_bytes = False
        self.chunked = False
        self.remaining = -1  # Content-Length bytes still to come
        self.chunk_left = -1  # bytes left in the current chunk (+2 for its CRLF); -1: size line next
        self.partial = b""  # an NDJSON line cut by a packet boundary
        self.done = False
        self.keep_alive = True
        self.error: Exception | None = None
        self.waiter: asyncio.Future | None = None
        self.paused = False

    # ---- protocol callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.done and self.error is None:
            self.error = ProtocolError(f"connection lost: {exc}" if exc else "connection closed before the answer ended")
        self._wake()

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_data = self.loop.time()
        self.buf = self.buf + data if self.buf else data
        try:
            self._parse()
        except (ValueError, IndexError) as exc:
            self.error = ProtocolError(f"malformed answer: {exc}")
            self.transport.close()
        if len(self.lines) > _MAX_BUFFERED_LINES and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    # ---- parsing -------------------------------------------------------------------------
    def _parse(self) -> None:
        if not self.status:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            self.buf = self.buf[end + 4 :]
            sp = head.index(b" ")
            self.status = int(head[sp + 1 : sp + 4])
            # The three headers read, found in the lower-cased head (one pass each in C, not a
            # split and a partition per header line: ~1 µs less per answer).
            low = head.lower() + b"\r\n"
            i = low.find(b"\r\ncontent-length:")
            if i >= 0:
                self.remaining = int(low[i + 17 : low.index(b"\r\n", i + 17)])
            i = low.find(b"\r\ntransfer-encoding:")
            if i >= 0 and b"chunked" in low[i + 20 : low.index(b"\r\n", i + 20)]:
                self.chunked = True
            i = low.find(b"\r\nconnection:")
            if i >= 0 and low[i + 13 : low.index(b"\r\n", i + 13)].strip() == b"close":
                self.keep_alive = False
            if not self.chunked and self.remaining < 0:
                self.keep_alive = False  # body ends at connection close
        if self.chunked:
            self._parse_chunked()
        else:
            self._body(self.buf)
            if self.remaining >= 0:
                self.remaining -= len(self.buf)
                if self.remaining <= 0:
                    self._finish()
            self.buf = b""

    def _parse_chunked(self) -> None:
        buf, pos, n = self.buf, 0, len(self.buf)
        while True:
            if self.chunk_left < 0:  # a chunk-size line comes next
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    break
                size = int(buf[pos:nl].split(b";", 1)[0], 16)
                if size == 0:  # the last chunk, then one CRLF (we send no TE: no trailers)
                    if n - (nl + 2) < 2:
                        break  # keep the size line; parse again when the CRLF is here
                    self.buf = buf[nl + 4 :]
                    self._finish()
                    return
                pos = nl + 2
                self.chunk_left = size + 2  # the chunk's data and its CRLF
            if pos >= n:
                break
            take = min(self.chunk_left, n - pos)
            content = min(take, self.chunk_left - 2)
            if content > 0:
                self._body(buf[pos : pos + content])
            pos += take
            self.chunk_left -= take
            if self.chunk_left == 0:
                self.chunk_left = -1
        self.buf = buf[pos:]

    def _body(self, data: bytes) -> None:
        if not data:
            return
        if self.status != 200:
            self.partial += data
            return
        if self.partial:
            data = self.partial + data
        parts = data.split(b"\n")
        self.partial = parts.pop()
        for line in parts:
            if line:
                self.lines.append(line)

    def _finish(self) -> None:
        if self.status == 200 and self.partial.strip():
            self.lines.append(self.partial)
            self.partial = b""
        self.done = True
        pool, self.recycle = self.recycle, None
        if pool is not None:  # released before its end arrived (see Http1Pool.release)
            pool.release(self)

    # ---- caller side ---------------------------------------------------------------------
    async def read(self) -> list[bytes] | None:
        """The NDJSON lines received since the last call (at least one), or ``None`` once the
        answer is complete; raises ``ProtocolError`` if the connection fails first."""
        while True:
            lines = self.take()
            if lines:
                return lines
            if self.done:
                return None
            if self.error is not None:
                raise self.error
            await self.wait()

    def take(self) -> list[bytes]:
        """The NDJSON lines received since the last call, possibly none (``read`` without
        waiting: a plain function)."""
        lines = self.lines
        if lines:
            self.lines = []
            if self.paused:
                self.resume()
        return lines

    def wait(self) -> asyncio.Future:
        """A future set once more of the answer (or an error) is in: await it. (A plain
        function, not a coroutine: one frame less per wait.)"""
        w = self.waiter = self.loop.create_future()
        return w

    def resume(self) -> None:
        if self.paused and len(self.lines) < _MAX_BUFFERED_LINES // 2:
            self.paused = False
            self.transport.resume_reading()


class Http1Pool:
    """Keep-alive connections to one ``http://host:port`` (``https://`` with ``ssl``, the plane's
    client context): a ``router.transport.Transport``; ``request`` is the only call."""

    def __init__(
        self, url: str, deadlines: Deadlines = Deadlines(), *, max_idle: int = 256, headers: dict[str, str] | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        u = urlsplit(url)
        if u.scheme != ("https" if ssl is not None else "http") or not u.hostname:
            raise ValueError(f"http1 pool needs an {'https' if ssl is not None else 'http'}://host:port URL, got {url!r}")
        self.host, self.port = u.hostname, u.port or (443 if ssl is not None else 80)
        self.ssl = ssl
        self.deadlines = deadlines
        self.max_idle = max_idle
        self.suspect = False  # set by the caller while the worker looks hung (see the module docstring)
        self._busy: set[_Conn] = set()  # connections with a request in progress
        self._sweeper: asyncio.TimerHandle | None = None
        self._idle: list[_Conn] = []
        self._host_header = f"{self.host}:{self.port}".encode()
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode("latin-1")  # e.g. the internal token
        self._heads: dict[str, bytes] = {}  # request head up to the Content-Length value, per path

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Conn, self.host, self.port, ssl=self.ssl), self.deadlines.connect_s)
        except (TimeoutError, OSError) as exc:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {exc!r}") from exc
        return conn

    async def _acquire(self) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
        conn = await self._connect()
        conn.reused = False
        return conn

    def release(self, conn: _Conn, complete: bool = False) -> None:
        """Take ``conn`` back: kept for reuse after a complete answer, else closed (the worker
        sees the disconnect). ``complete``: the caller saw the answer's last event, and only the
        end of the body (e.g. the last empty chunk, often a packet of its own) may be missing:
        the connection goes back to the pool when it arrives instead of being closed."""
        self._busy.discard(conn)
        if conn.keep_alive and not conn.closed and conn.error is None and len(self._idle) < self.max_idle:
            if conn.done:
                conn._reset()
                self._idle.append(conn)
                return
            if complete and conn.status == 200 and not conn.lines and not conn.partial:
                conn.recycle = self
                return
        conn.transport.close()

    def _watch(self, conn: _Conn) -> None:
        conn.last_data = conn.loop.time()
        self._busy.add(conn)
        if self._sweeper is None:
            self._sweeper = conn.loop.call_later(0.5, self._sweep)

    def _sweep(self) -> None:
        """Fail the requests that passed a deadline (module docstring)."""
        self._sweeper = None
        if not self._busy:
            return
        loop = next(iter(self._busy)).loop
        now = loop.time()
        for conn in list(self._busy):
            limit = self.deadlines.limit(bool(conn.status), self.suspect)
            if conn.closed or conn.done or now - conn.last_data <= limit:
                continue
            self._busy.discard(conn)
            conn.error = DeadlineError(f"{self.host}:{self.port} sent nothing for {limit:g}s")
            conn.transport.abort()
            conn._wake()
        self._sweeper = loop.call_later(0.5, self._sweep)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in self._idle:
            conn.transport.close()
        self._idle.clear()

    async def request(self, path: str, body: bytes) -> _Conn:
        """POST ``body`` (JSON) to ``path``; the connection once a 200 answer's head is in.

        Read the answer with ``await conn.read()``; hand the connection back with
        ``release(conn)`` whatever happened (it is kept only after a complete answer). Raises
        ``ConnectError``, ``ProtocolError``, or ``StatusError`` (non-200, after its body).
        """
        head = self._heads.get(path)
        if head is None:
            head = self._heads[path] = b"POST %s HTTP/1.1\r\nHost: %s\r\n%sContent-Type: application/json\r\nContent-Length: " % (path.encode(), self._host_header, self._extra)
        req = b"%s%d\r\n\r\n%s" % (head, len(body), body)
        idle = self._idle
        conn = idle.pop() if idle else None  # _acquire's usual case, without its coroutine
        if conn is None or conn.closed:
            conn = await self._acquire()
        else:
            conn.reused = True
        conn.transport.write(req)
        self._watch(conn)
        while not conn.status and conn.error is None:
            await conn.wait()
        if conn.error is not None and conn.reused and not conn.got_bytes and not isinstance(conn.error, DeadlineError):
            self._busy.discard(conn)
            conn.transport.close()  # a stale keep-alive connection: once more on a fresh one
            conn = await self._connect()
            conn.transport.write(req)
            self._watch(conn)
            while not conn.status and conn.error is None:
                await conn.wait()
        if conn.status == 200:
            return conn
        try:
            while not conn.done and conn.error is None:
                await conn.wait()
            if conn.status:
                raise StatusError(conn.status, conn.partial)
            raise conn.error
        finally:
            self.release(conn)

"""``router.serving``: one contract, run against every server (``http1`` ours, ``aiohttp`` the
library's): routing, keep-alive, chunked bodies both ways, the limits, the internal token,
handler failures, and a client that goes away mid-stream cancelling its handler. The router
service on each server is covered too (a real ``RouterService`` over a fake worker)."""

from __future__ import annotations

import asyncio

import pytest

from deepserve.internal_auth import InternalAuth
from router.serving import SERVERS, Response, ServerOptions, ServerRequest, make_server

pytestmark = pytest.mark.parametrize("kind", SERVERS)

_MIB = b"z" * (1 << 20)


def _error(status: int, message: str) -> Response:
    return Response(b'{"error":"%s"}' % message.encode(), status)


def _server(kind: str, state: dict, *, max_body: int = 1 << 20, read_timeout_s: float = 5.0, max_connections: int = 64, auth: InternalAuth | None = None):
    async def echo(req: ServerRequest) -> Response:
        return Response(b"%s %s %s %d" % (req.method, req.path.encode(), req.query.encode(), len(req.body)), content_type=b"text/plain",
                        headers={"X-Peer": req.peer, "X-Seen": req.headers.get("x-probe", "")})

    async def stream(req: ServerRequest) -> None:
        out = req.stream(200, b"application/x-ndjson", {"X-Kind": "lines"})
        state["started"].set()
        try:
            for i in range(int(_param(req, "n", "1000"))):
                await out.write(b'{"i":%d}\n' % i)
                await asyncio.sleep(0.005)
            out.end()
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise
        finally:
            state["finally"] = True

    async def boom(req: ServerRequest) -> Response:
        raise RuntimeError("boom")

    async def silent(req: ServerRequest) -> None:
        return None

    async def slow(req: ServerRequest) -> Response:
        await asyncio.sleep(float(_param(req, "s", "0.05")))
        return Response(req.body)

    async def headers(req: ServerRequest) -> Response:
        return Response(b"%s|%s" % (req.headers["x-trace"].encode(), req.headers.get("content-type", "-").encode()))

    async def flood(req: ServerRequest) -> None:
        out = req.stream()
        for _ in range(64):  # 64 MiB: far beyond any socket buffer
            await out.write(_MIB)
            state["written"] = state.get("written", 0) + 1
        out.end()

    routes = {(b"POST", "/echo"): echo, (b"GET", "/echo"): echo, (b"GET", "/stream"): stream, (b"GET", "/boom"): boom,
              (b"GET", "/silent"): silent, (b"GET", "/health"): echo, (b"POST", "/slow"): slow, (b"POST", "/headers"): headers,
              (b"GET", "/flood"): flood}
    return make_server(kind, routes, ServerOptions(error_response=_error, max_body=max_body, read_timeout_s=read_timeout_s,
                                                   max_connections=max_connections, auth=auth, open_paths=frozenset({"/health"})))


def _param(req, name: str, default: str) -> str:
    """The query parameter ``name`` of ``req`` (``default`` when absent)."""
    return dict(p.partition("=")[::2] for p in req.query.split("&") if p).get(name, default)


async def _read(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-case headers, body) of one answer, de-chunked; a ``100 Continue`` is skipped."""
    while True:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ")[1])
        if status != 100:
            break
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return status, headers, body
        body += (await reader.readexactly(size + 2))[:-2]


def _run(kind: str, fn, **kw) -> dict:
    state: dict = {"started": asyncio.Event(), "cancelled": False, "finally": False}

    async def main() -> None:
        state["started"] = asyncio.Event()
        server = _server(kind, state, **kw)
        await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                await asyncio.wait_for(fn(server, reader, writer, state), 10)
            finally:
                writer.close()
        finally:
            await server.stop(grace_s=1.0)

    asyncio.run(main())
    return state


def test_routes_keep_alive_and_headers(kind):
    async def body(server, reader, writer, state):
        for i in range(5):
            payload = b"x" * i
            writer.write(b"POST /echo?a=%d HTTP/1.1\r\nHost: x\r\nX-Probe: seen\r\nContent-Length: %d\r\n\r\n%s" % (i, len(payload), payload))
            status, headers, data = await _read(reader)
            assert (status, data) == (200, b"POST /echo a=%d %d" % (i, i))
            assert headers["content-type"] == "text/plain" and headers["x-seen"] == "seen" and headers["x-peer"] == "127.0.0.1"
            assert headers.get("connection", "keep-alive").lower() == "keep-alive"
        writer.write(b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, data = await _read(reader)
        assert status == 404 and b"no route" in data
        writer.write(b"DELETE /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, data = await _read(reader)
        assert status == 405 and data.startswith(b'{"error"')

    _run(kind, body)


def test_pipelined_requests_answered_in_order(kind):
    async def body(server, reader, writer, state):
        # the first handler is the slowest: answers must still come back in request order
        reqs = b"".join(b"POST /slow?s=%s HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n%d" % (s, i) for i, s in enumerate([b"0.05", b"0.01", b"0"]))
        writer.write(reqs + b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert [(await _read(reader))[2] for _ in range(4)] == [b"0", b"1", b"2", b"GET /echo  0"]

    _run(kind, body)


def test_handler_reads_headers_lower_cased(kind):
    async def body(server, reader, writer, state):
        writer.write(b"POST /headers HTTP/1.1\r\nHost: x\r\nX-Trace: Ab\xe9\r\nCONTENT-TYPE: text/plain\r\nContent-Length: 0\r\n\r\n")
        assert (await _read(reader))[2] == "Ab\xe9|text/plain".encode()

    _run(kind, body)


def test_connection_close_and_http10(kind):
    async def body(server, reader, writer, state):
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, headers, _ = await _read(reader)
        assert status == 200 and headers.get("connection") == "close"
        assert await reader.read() == b""

    _run(kind, body)

    async def body10(server, reader, writer, state):
        writer.write(b"GET /echo HTTP/1.0\r\n\r\n")
        assert (await _read(reader))[0] == 200
        assert await reader.read() == b""

    _run(kind, body10)


def test_chunked_request_body_and_expect_continue(kind):
    async def body(server, reader, writer, state):
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        assert (await _read(reader))[::2] == (200, b"POST /echo  11")
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"abc")
        assert (await _read(reader))[::2] == (200, b"POST /echo  3")

    _run(kind, body)


def test_body_over_the_limit_is_413_and_closes(kind):
    async def body(server, reader, writer, state):
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n")
        status, headers, data = await _read(reader)
        assert status == 413 and headers.get("connection") == "close" and data.startswith(b'{"error"')
        assert await reader.read() == b""

    _run(kind, body, max_body=1000)


def test_chunked_body_over_the_limit_is_413(kind):
    async def body(server, reader, writer, state):
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + (b"400\r\n" + b"y" * 1024 + b"\r\n") * 2)
        assert (await _read(reader))[0] == 413
        assert await reader.read() == b""

    _run(kind, body, max_body=1500)


def test_slow_body_is_408(kind):
    async def body(server, reader, writer, state):
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        status, _, data = await _read(reader)
        assert status == 408 and data.startswith(b'{"error"')

    _run(kind, body, read_timeout_s=0.3)


def test_slow_head_is_408_and_closes(kind):
    async def body(server, reader, writer, state):
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        status, headers, data = await _read(reader)
        assert status == 408 and headers.get("connection") == "close" and data.startswith(b'{"error"')
        assert await reader.read() == b""

    _run(kind, body, read_timeout_s=0.3)


def test_deadline_counts_from_the_first_byte(kind):
    async def body(server, reader, writer, state):
        # each piece comes within the deadline of the one before, the whole request does not
        for piece in (b"POST /echo HTTP/1.1\r\n", b"Host: x\r\n", b"Content-Length: 1\r\n\r\n"):
            writer.write(piece)
            await asyncio.sleep(0.2)
        writer.write(b"a")
        assert (await _read(reader))[0] == 408

    _run(kind, body, read_timeout_s=0.3)


def test_idle_keep_alive_connection_is_not_a_slow_request(kind):
    async def body(server, reader, writer, state):
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read(reader))[0] == 200
        await asyncio.sleep(0.8)  # idle for over two deadlines, under keep-alive
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read(reader))[0] == 200

    _run(kind, body, read_timeout_s=0.3)


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET /echo HTTP/1.1\r\nHost x\r\n\r\n", b"POST /echo HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
                                 b"GET / HTTP/9.9 extra\r\n\r\n"])
def test_malformed_request_is_400_and_closes(kind, raw):
    async def body(server, reader, writer, state):
        writer.write(raw)
        assert (await _read(reader))[0] == 400
        assert await reader.read() == b""  # and closed

    _run(kind, body)


def test_internal_token(kind):
    auth = InternalAuth("s3cret")

    async def body(server, reader, writer, state):
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read(reader))[0] == 401
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n\r\n")
        assert (await _read(reader))[0] == 401
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n\r\n")
        assert (await _read(reader))[0] == 200
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # an open path
        assert (await _read(reader))[0] == 200

    _run(kind, body, auth=auth)


def test_connections_over_the_limit_are_503(kind):
    async def body(server, reader, writer, state):
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read(reader))[0] == 200  # the first connection is in
        r2, w2 = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            w2.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _read(r2))[0] == 503
            assert await r2.read() == b""
        finally:
            w2.close()
        writer.close()  # a closed connection frees its place
        for _ in range(100):
            r3, w3 = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                w3.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
                if (await _read(r3))[0] == 200:
                    return
            finally:
                w3.close()
            await asyncio.sleep(0.01)
        raise AssertionError("the closed connection's place was never freed")

    _run(kind, body, max_connections=1)


def test_handler_failures_are_500_and_the_connection_lives(kind):
    async def body(server, reader, writer, state):
        writer.write(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read(reader))[0] == 500
        writer.write(b"GET /silent HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read(reader))[0] == 500
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read(reader))[0] == 200

    _run(kind, body)


def test_streamed_answer_is_chunked(kind):
    async def body(server, reader, writer, state):
        writer.write(b"GET /stream?n=5 HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, data = await _read(reader)
        assert status == 200 and headers["transfer-encoding"] == "chunked" and headers["x-kind"] == "lines"
        assert headers["content-type"] == "application/x-ndjson"
        assert data == b"".join(b'{"i":%d}\n' % i for i in range(5))
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")  # still usable
        assert (await _read(reader))[0] == 200

    state = _run(kind, body)
    assert state["finally"] and not state["cancelled"]


def test_client_going_away_cancels_the_stream(kind):
    async def body(server, reader, writer, state):
        writer.write(b"GET /stream?n=100000 HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        writer.close()
        for _ in range(300):
            if state["finally"]:
                break
            await asyncio.sleep(0.01)

    state = _run(kind, body)
    assert state["cancelled"] and state["finally"]


def test_slow_reader_backpressure_pauses_the_writer(kind):
    async def body(server, reader, writer, state):
        writer.write(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.3)  # read nothing: the handler must be waiting, not buffering 64 MiB
        assert state.get("written", 0) < 16
        status, _, data = await _read(reader)
        assert status == 200 and len(data) == 64 * len(_MIB)

    _run(kind, body)

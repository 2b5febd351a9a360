"""``router.http_server``: keep-alive, pipelining, chunked bodies, limits, malformed requests,
streaming with a client that goes away."""

from __future__ import annotations

import asyncio

import pytest

from router.http_server import HttpServer, Request, Response


def _param(req, name: str, default: str) -> str:
    """The query parameter ``name`` of ``req`` (``default`` when absent)."""
    return dict(p.partition("=")[::2] for p in req.query.split("&") if p).get(name, default)


async def _echo(req: Request) -> Response:
    return Response(b"%s %s %s %d" % (req.method, req.path.encode(), req.query.encode(), len(req.body)), content_type=b"text/plain")


async def _slow(req: Request) -> Response:
    await asyncio.sleep(float(_param(req, "s", "0.05")))
    return Response(req.body)


async def _boom(req: Request) -> Response:
    raise RuntimeError("boom")


def _server(extra: dict | None = None, **kw) -> tuple[HttpServer, dict]:
    state: dict = {"started": asyncio.Event(), "cancelled": False, "finally": False}

    async def stream(req: Request) -> None:
        out = req.stream(200, b"application/x-ndjson")
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

    routes = {(b"POST", "/echo"): _echo, (b"GET", "/echo"): _echo, (b"POST", "/slow"): _slow, (b"GET", "/stream"): stream, (b"GET", "/boom"): _boom}
    routes.update(extra or {})
    return HttpServer(routes, **kw), state


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ")[1])
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


def run(coro_fn, **kw):
    async def main():
        server, state = _server(**kw)
        await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                await coro_fn(server, state, reader, writer)
            finally:
                writer.close()
        finally:
            await server.stop(grace_s=1.0)

    asyncio.run(main())


def test_keep_alive_many_requests_one_connection():
    async def body(server, state, reader, writer):
        for i in range(50):
            payload = b"x" * i
            writer.write(b"POST /echo?a=%d HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (i, len(payload), payload))
            status, headers, data = await _read_response(reader)
            assert status == 200 and data == b"POST /echo a=%d %d" % (i, i)
            assert "connection" not in headers
        assert len(server.connections) == 1

    run(body)


def test_pipelined_requests_answered_in_order():
    async def body(server, state, reader, writer):
        # the first handler is the slowest: answers must still come back in request order
        reqs = b"".join(b"POST /slow?s=%s HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n%d" % (s, i) for i, s in enumerate([b"0.05", b"0.01", b"0"]))
        writer.write(reqs + b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        got = [(await _read_response(reader))[2] for _ in range(4)]
        assert got == [b"0", b"1", b"2", b"GET /echo  0"]

    run(body)


def test_chunked_request_body():
    async def body(server, state, reader, writer):
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        status, _, data = await _read_response(reader)
        assert status == 200 and data == b"POST /echo  11"

    run(body)


def test_body_over_the_limit_is_413_and_closes():
    async def body(server, state, reader, writer):
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n")
        status, headers, _ = await _read_response(reader)
        assert status == 413 and headers.get("connection") == "close"
        assert await reader.read() == b""  # closed

    run(body, max_body=1000)


def test_chunked_body_over_the_limit_is_413():
    async def body(server, state, reader, writer):
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b"y" * 1024 + b"\r\n" + b"400\r\n" + b"y" * 1024 + b"\r\n")
        status, _, _ = await _read_response(reader)
        assert status == 413
        assert await reader.read() == b""

    run(body, max_body=1500)


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET /echo HTTP/1.1\r\nHost x\r\n\r\n", b"POST /echo HTTP/1.1\r\nContent-Length: abc\r\n\r\n", b"GET / HTTP/9.9 extra\r\n\r\n"])
def test_malformed_request_is_400_and_closes(raw):
    async def body(server, state, reader, writer):
        writer.write(raw)
        status, headers, _ = await _read_response(reader)
        assert status == 400 and headers.get("connection") == "close"
        assert await reader.read() == b""

    run(body)


def test_malformed_request_after_a_good_one_keeps_order():
    async def body(server, state, reader, writer):
        writer.write(b"POST /slow?s=0.05 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok" + b"NOT HTTP AT ALL\r\n\r\n")
        assert (await _read_response(reader))[:1] == (200,)
        assert (await _read_response(reader))[0] == 400
        assert await reader.read() == b""

    run(body)


def test_unknown_path_404_wrong_method_405_and_handler_error_500():
    async def body(server, state, reader, writer):
        writer.write(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read_response(reader))[0] == 404
        writer.write(b"DELETE /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read_response(reader))[0] == 405
        writer.write(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read_response(reader))[0] == 500
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")  # the connection survived all three
        assert (await _read_response(reader))[0] == 200

    run(body)


def test_connection_close_and_http10():
    async def body(server, state, reader, writer):
        writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, headers, _ = await _read_response(reader)
        assert status == 200 and headers.get("connection") == "close"
        assert await reader.read() == b""

    run(body)

    async def body10(server, state, reader, writer):
        writer.write(b"GET /echo HTTP/1.0\r\n\r\n")
        assert (await _read_response(reader))[0] == 200
        assert await reader.read() == b""

    run(body10)


def test_expect_100_continue():
    async def body(server, state, reader, writer):
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"abc")
        assert (await _read_response(reader))[2] == b"POST /echo  3"

    run(body)


def test_streaming_answer_is_chunked():
    async def body(server, state, reader, writer):
        writer.write(b"GET /stream?n=3 HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, data = await _read_response(reader)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert data == b'{"i":0}\n{"i":1}\n{"i":2}\n'

    run(body)


def test_client_disconnect_mid_stream_cancels_the_handler():
    async def body(server, state, reader, writer):
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        await reader.readline()
        await state["started"].wait()
        writer.close()
        for _ in range(100):
            if state["finally"]:
                break
            await asyncio.sleep(0.01)
        assert state["cancelled"] and state["finally"]
        assert not server.connections

    run(body)


def test_slow_reader_backpressure_pauses_the_writer():
    big = b"z" * (1 << 20)
    progress = {"written": 0}

    async def flood(req: Request) -> None:
        out = req.stream()
        for _ in range(64):  # 64 MiB: far beyond any socket buffer
            await out.write(big)
            progress["written"] += 1
        out.end()

    async def body(server, state, reader, writer):
        writer.write(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.3)  # read nothing: the handler must be waiting, not buffering 64 MiB
        assert progress["written"] < 16
        total = 0
        await reader.readuntil(b"\r\n\r\n")
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            total += len(await reader.readexactly(size + 2)) - 2
        assert total == 64 * len(big)

    run(body, extra={(b"GET", "/flood"): flood})


def test_handler_reads_headers_lower_cased():
    async def headers(req: Request) -> Response:
        return Response(b"%s|%s" % (req.headers["x-trace"].encode(), req.headers.get("content-type", "-").encode()))

    async def body(server, state, reader, writer):
        writer.write(b"POST /h HTTP/1.1\r\nHost: x\r\nX-Trace: Ab\xe9\r\nCONTENT-TYPE: text/plain\r\nContent-Length: 0\r\n\r\n")
        assert (await _read_response(reader))[2] == "Ab\xe9|text/plain".encode()

    run(body, extra={(b"POST", "/h"): headers})

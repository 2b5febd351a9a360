"""The ``router.transport`` contract, run against every implementation (ours and the library's).

A scripted loopback server answers with byte pieces sent as separate packets (cuts anywhere:
inside the head, a chunk-size line, a line, the final CRLF), so both transports see the same
bytes; through ``WorkerClient`` (what the router uses) and through the transport itself.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from deepserve.protocol import GenerateRequest
from router.errors import WorkerRejected, WorkerUnavailable
from router.transport import TRANSPORTS, ConnectError, Deadlines, DeadlineError, ProtocolError, StatusError, post_lines
from router.worker_client import WorkerClient

pytestmark = [pytest.mark.parametrize("kind", TRANSPORTS), pytest.mark.timeout(30)]


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


class Scripted:
    """A loopback server: each connection reads requests and answers with ``script(path, n)``:
    a list of byte pieces (floats: a pause of that many seconds) sent with tiny pauses, or None
    to drop the connection. ``disconnects``: connections the client closed mid-answer."""

    def __init__(self, script) -> None:
        self.script = script
        self.connections = 0
        self.requests = 0
        self.disconnects = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(n)
                self.requests += 1
                pieces = self.script(head.split(b" ")[1].decode(), self.requests)
                if pieces is None:
                    break
                for p in pieces:
                    if isinstance(p, float):
                        await asyncio.sleep(p)
                        continue
                    if p == b"CLOSE":
                        raise ConnectionResetError
                    if writer.is_closing() or reader.at_eof():
                        self.disconnects += 1
                        raise ConnectionResetError
                    writer.write(p)
                    await writer.drain()
                    await asyncio.sleep(0.002)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


HEAD_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
LINE1 = b'{"request_id":"r","token_ids":[1]}\n'
LINE2 = b'{"request_id":"r","token_ids":[2],"finish_reason":"length"}\n'


async def tokens(client: WorkerClient) -> list[int]:
    return [t async for ev in client.generate(GenerateRequest("r", [1, 2])) for t in ev.token_ids]


def run(coro):
    return asyncio.run(coro)


def test_chunked_stream_split_anywhere_and_keep_alive(kind):
    raw = HEAD_CHUNKED + chunked(LINE1, LINE2)
    cuts = [5, 40, len(HEAD_CHUNKED) + 1, len(HEAD_CHUNKED) + 10, len(raw) - 3, len(raw) - 1]
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
    server = Scripted(lambda path, n: pieces)

    async def main():
        async with server as url:
            c = WorkerClient(url, transport=kind)
            assert await tokens(c) == [1, 2]
            assert await tokens(c) == [1, 2]
            await c.close()
        assert server.connections == 1 and server.requests == 2

    run(main())


def test_chunk_extensions_content_length_and_unterminated_last_line(kind):
    ext = HEAD_CHUNKED + b"%x;name=v\r\n%s\r\n0\r\n\r\n" % (len(LINE1 + LINE2), LINE1 + LINE2)
    body = LINE1 + LINE2.rstrip(b"\n")
    fixed = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    server = Scripted(lambda path, n: [ext] if n == 1 else [fixed])

    async def main():
        async with server as url:
            c = WorkerClient(url, transport=kind)
            assert await tokens(c) == [1, 2]
            assert await tokens(c) == [1, 2]
            await c.close()

    run(main())


def test_status_errors_and_truncation(kind):
    def script(path, n):
        if n == 1:
            return [b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy"]
        if n == 2:
            return [b"HTTP/1.1 400 Bad Request\r\nContent-Length: 3\r\n\r\nbad"]
        if n == 3:
            return [HEAD_CHUNKED + chunked(LINE1)]  # complete answer, but no finish event
        return [HEAD_CHUNKED + b"%x\r\n%s" % (len(LINE1), LINE1), b"CLOSE"]  # dies mid-body

    async def main():
        async with Scripted(script) as url:
            c = WorkerClient(url, transport=kind)
            with pytest.raises(WorkerUnavailable, match="503"):
                await tokens(c)
            with pytest.raises(WorkerRejected, match="bad"):
                await tokens(c)
            with pytest.raises(WorkerUnavailable, match="without a finish"):
                await tokens(c)
            with pytest.raises(WorkerUnavailable, match="connection"):
                await tokens(c)
            await c.close()

    run(main())


def test_status_error_carries_the_body(kind):
    async def main():
        async with Scripted(lambda path, n: [b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 9\r\n\r\n{\"x\": 1}\n"]) as url:
            c = WorkerClient(url, transport=kind)
            with pytest.raises(StatusError) as exc:
                await c.pool.request("/internal/generate", b"{}")
            assert exc.value.status == 503 and exc.value.body == b'{"x": 1}\n'
            await c.close()

    run(main())


def test_stale_keep_alive_connection_is_replaced(kind):
    ok = HEAD_CHUNKED + chunked(LINE1, LINE2)
    server = Scripted(lambda path, n: [ok] if n != 2 else None)  # drops the 2nd request unanswered

    async def main():
        async with server as url:
            c = WorkerClient(url, transport=kind)
            assert await tokens(c) == [1, 2]
            assert await tokens(c) == [1, 2]  # the reused connection died: sent again, fresh
            await c.close()
        assert server.connections == 2

    run(main())


def test_connect_refused_is_marked(kind):
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        c = WorkerClient(f"http://127.0.0.1:{port}", transport=kind)
        with pytest.raises(ConnectError):
            await c.pool.request("/internal/generate", b"{}")
        with pytest.raises(WorkerUnavailable) as exc:
            await tokens(c)
        assert exc.value.connect
        await c.close()

    run(main())


def test_early_release_closes_the_connection(kind):
    """A caller that stops reading (a client gone) releases the answer: the worker sees the
    disconnect, and the next request goes on a fresh connection."""
    many = [HEAD_CHUNKED, *[chunked(LINE1)[:-5] for _ in range(3)], 0.3, *[chunked(LINE1)[:-5] for _ in range(50)]]
    server = Scripted(lambda path, n: many if n == 1 else [HEAD_CHUNKED + chunked(LINE1, LINE2)])

    async def main():
        async with server as url:
            c = WorkerClient(url, transport=kind)
            answer = await c.pool.request("/internal/generate", b"{}")
            assert await answer.read()
            c.pool.release(answer)
            assert await tokens(c) == [1, 2]
            await asyncio.sleep(0.4)
            await c.close()
        assert server.connections == 2 and server.disconnects == 1

    run(main())


def _deadlines(**kw) -> Deadlines:
    return Deadlines(**{"first_byte_s": 30.0, "event_s": 30.0, "suspect_s": 30.0, **kw})


@pytest.mark.parametrize(
    "deadline,script",
    [
        ({"first_byte_s": 0.3}, [2.0, HEAD_CHUNKED + chunked(LINE2)]),  # no head in time
        ({"event_s": 0.3}, [HEAD_CHUNKED + chunked(LINE1)[:-5], 2.0, chunked(LINE2)]),  # silent mid-stream
    ],
)
def test_deadlines_fail_a_silent_worker(kind, deadline, script):
    async def main():
        async with Scripted(lambda path, n: script) as url:
            c = WorkerClient(url, transport=kind, deadlines=_deadlines(**deadline))
            t0 = time.monotonic()
            with pytest.raises(DeadlineError):
                async for _ in post_lines(c.pool, "/internal/generate", b"{}"):
                    pass
            assert time.monotonic() - t0 < 1.5  # the deadline, plus at most one sweep
            await c.close()

    run(main())


def test_suspect_shortens_the_wait_in_progress(kind):
    """A worker whose polls fail turns its transport ``suspect``: the streams already waiting on
    it get the suspect deadline from their latest bytes, not the long one."""
    script = [HEAD_CHUNKED + chunked(LINE1)[:-5], 5.0, chunked(LINE2)]

    async def main():
        async with Scripted(lambda path, n: script) as url:
            c = WorkerClient(url, transport=kind, deadlines=_deadlines(suspect_s=0.3))
            answer = await c.pool.request("/internal/generate", b"{}")
            assert await answer.read() == [LINE1.rstrip()]
            t0 = time.monotonic()
            asyncio.get_running_loop().call_later(0.1, setattr, c.pool, "suspect", True)
            with pytest.raises(DeadlineError):
                await answer.read()
            assert time.monotonic() - t0 < 1.5
            c.pool.release(answer)
            await c.close()

    run(main())


def test_a_lost_connection_is_a_protocol_error(kind):
    async def main():
        async with Scripted(lambda path, n: [HEAD_CHUNKED + chunked(LINE1)[:-5], b"CLOSE"]) as url:
            c = WorkerClient(url, transport=kind)
            answer = await c.pool.request("/internal/generate", b"{}")
            with pytest.raises(ProtocolError):
                while await answer.read() is not None:
                    pass
            c.pool.release(answer)
            await c.close()

    run(main())

"""WorkerClient and its raw HTTP/1.1 hot path, against a scripted loopback server."""

from __future__ import annotations

import asyncio
import json

import pytest

from deepserve.protocol import ErrorCode, GenerateRequest, OutputConstraint, SamplingParams, TokenEvent, error_body, parse_error_body
from router.errors import WorkerRejected, WorkerUnavailable
from router.http1 import ConnectError, DeadlineError, ProtocolError, StatusError
from router.worker_client import WorkerClient, encode_request, event_from_dict


def test_encode_request_equals_to_dict():
    req = GenerateRequest(
        "r1",
        [1, 2, 3],
        SamplingParams(max_tokens=5, stop_token_ids=(7,), constraint=OutputConstraint("json", "{}", (9,))),
        output_token_ids=[4],
        dp_rank=1,
        session_key="s",
    )
    assert json.loads(encode_request(req)) == json.loads(json.dumps(req.to_dict()))


@pytest.mark.parametrize(
    "d",
    [
        {"request_id": "a", "token_ids": [1, 2]},
        {"request_id": "a", "token_ids": [3], "finish_reason": "stop", "num_prompt_tokens": 9, "num_cached_tokens": 8, "worker_id": "w"},
        {"request_id": "a", "token_ids": [3], "logprobs": [[-0.5, [[3, -0.5], [4, -1.0]]]]},
        {"request_id": "a", "finish_reason": "error", "error": "boom"},
    ],
)
def test_event_from_dict_matches_protocol(d):
    assert event_from_dict(d) == TokenEvent.from_dict(d)


def _body(code: ErrorCode) -> bytes:
    return json.dumps(error_body(code, "why")).encode()


@pytest.mark.parametrize(
    "exc,cls,code",
    [
        (StatusError(503, _body(ErrorCode.ENGINE_FULL)), WorkerUnavailable, ErrorCode.ENGINE_FULL),
        (StatusError(400, _body(ErrorCode.CONTEXT_LENGTH_EXCEEDED)), WorkerRejected, ErrorCode.CONTEXT_LENGTH_EXCEEDED),
        (StatusError(502, _body(ErrorCode.ENGINE_ERROR)), WorkerUnavailable, ErrorCode.ENGINE_ERROR),
        (StatusError(400, b"bad"), WorkerRejected, ErrorCode.INVALID_REQUEST),  # no code: by status
        (StatusError(401, b"token"), WorkerUnavailable, ErrorCode.UNAVAILABLE),  # our token, not the request
        (StatusError(500, b"boom"), WorkerUnavailable, ErrorCode.UNAVAILABLE),
        (ConnectError("refused"), WorkerUnavailable, ErrorCode.UNAVAILABLE),
        (DeadlineError("silent"), WorkerUnavailable, ErrorCode.TIMEOUT),
        (ProtocolError("dropped"), WorkerUnavailable, ErrorCode.UNAVAILABLE),
        (ValueError("not JSON"), WorkerUnavailable, ErrorCode.ENGINE_ERROR),
    ],
)
def test_error_for_keeps_the_workers_code(exc, cls, code):
    err = WorkerClient("http://127.0.0.1:1").error_for(exc)
    assert type(err) is cls and err.code is code and err.retryable == (cls is WorkerUnavailable)
    if exc.__class__ is StatusError and parse_error_body(exc.body) is not None:
        assert str(err) == "why"  # the worker's message, not the HTTP text around it


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


class Scripted:
    """A loopback server: each connection reads requests and answers with ``script(path, n)``,
    a list of byte pieces sent with tiny pauses (so they arrive as separate packets), or None to
    drop the connection."""

    def __init__(self, script) -> None:
        self.script = script
        self.connections = 0
        self.requests = 0

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
                    writer.write(p)
                    await writer.drain()
                    await asyncio.sleep(0.002)
                if pieces and pieces[-1] == b"CLOSE":
                    break
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


def test_chunked_stream_split_anywhere_and_keep_alive():
    body = chunked(LINE1, LINE2)
    # bytes cut at awkward places: inside the head, the size line, a line, the final CRLF
    raw = HEAD_CHUNKED + body
    cuts = [5, 40, len(HEAD_CHUNKED) + 1, len(HEAD_CHUNKED) + 10, len(raw) - 3, len(raw) - 1]
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
    server = Scripted(lambda path, n: pieces)

    async def main():
        async with server as url:
            c = WorkerClient(url)
            assert await tokens(c) == [1, 2]
            assert await tokens(c) == [1, 2]
            await c.close()
        assert server.connections == 1 and server.requests == 2

    run(main())


def test_chunk_extensions_content_length_and_unterminated_last_line():
    ext = HEAD_CHUNKED + b"%x;name=v\r\n%s\r\n0\r\n\r\n" % (len(LINE1 + LINE2), LINE1 + LINE2)
    body = LINE1 + LINE2.rstrip(b"\n")
    fixed = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    server = Scripted(lambda path, n: [ext] if n == 1 else [fixed])

    async def main():
        async with server as url:
            c = WorkerClient(url)
            assert await tokens(c) == [1, 2]
            assert await tokens(c) == [1, 2]
            await c.close()

    run(main())


def test_status_errors_and_truncation():
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
            c = WorkerClient(url)
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


def test_stale_keep_alive_connection_is_replaced():
    ok = HEAD_CHUNKED + chunked(LINE1, LINE2)
    server = Scripted(lambda path, n: [ok] if n != 2 else None)  # drops the 2nd request unanswered

    async def main():
        async with server as url:
            c = WorkerClient(url)
            assert await tokens(c) == [1, 2]
            assert await tokens(c) == [1, 2]  # the reused connection died: sent again, fresh
            await c.close()
        assert server.connections == 2

    run(main())


def test_connect_refused_is_marked():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        c = WorkerClient(f"http://127.0.0.1:{port}")
        with pytest.raises(WorkerUnavailable) as exc:
            await tokens(c)
        assert exc.value.connect
        assert not await c.health()
        await c.close()

    run(main())

"""``router.http_server`` beyond the contract every server passes (``test_server_contract.py``):
what only ours does."""

from __future__ import annotations

import asyncio

from router.http_server import HttpServer
from router.serving import Response, ServerRequest
from tests.router.test_server_contract import _read


async def _slow(req: ServerRequest) -> Response:
    await asyncio.sleep(0.05)
    return Response(req.body)


def test_malformed_request_after_a_good_one_keeps_order():
    """The request before a malformed one in the same read is answered first (aiohttp's parser
    drops the whole read and answers only the 400)."""

    async def main():
        server = HttpServer({(b"POST", "/slow"): _slow})
        await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok" + b"NOT HTTP AT ALL\r\n\r\n")
            assert (await _read(reader))[::2] == (200, b"ok")
            status, headers, _ = await _read(reader)
            assert status == 400 and headers.get("connection") == "close"
            assert await reader.read() == b""
            writer.close()
        finally:
            await server.stop(grace_s=1.0)

    asyncio.run(asyncio.wait_for(main(), 10))

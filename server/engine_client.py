"""What the gateway needs from whatever runs generations: the ``EngineClient`` protocol.

The in-process ``router.router.Router`` (``deepserve up``), ``router.worker_client.WorkerClient``
(one worker or a remote router service) and test doubles all satisfy it. The gateway never
imports a concrete client except in ``make_engine_client`` and ``deepserve up``.

``HttpEngineClient`` is a small stand-in speaking the worker HTTP surface of ``engine.protocol``
(NDJSON over aiohttp); it is used only when the router package does not provide
``WorkerClient``.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Protocol, runtime_checkable

from engine.protocol import GenerateRequest, TokenEvent


@runtime_checkable
class EngineClient(Protocol):
    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's token events; the last one carries ``finish_reason``."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a running request and free its state (no error if it already finished)."""
        ...


class EngineHTTPError(Exception):
    """A worker answered ``/internal/generate`` with an error status."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        if retry_after is not None:
            self.retry_after = retry_after


class HttpEngineClient:
    """Talks to one engine worker (or router service) over its HTTP surface."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._connect_timeout_s = connect_timeout_s
        self._session = None

    def _client(self):
        import aiohttp  # imported lazily: the gateway may never need it

        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s)
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self._session

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        async with self._client().post(f"{self.url}/internal/generate", json=req.to_dict()) as resp:
            if resp.status != 200:
                text = (await resp.text())[:500]
                retry = 1.0 if resp.status in (429, 503) else None
                raise EngineHTTPError(resp.status, f"worker answered {resp.status}: {text}", retry)
            async for line in resp.content:
                if line.strip():
                    yield TokenEvent.from_dict(json.loads(line))

    async def abort(self, request_id: str) -> None:
        try:
            async with self._client().post(f"{self.url}/internal/abort", json={"request_id": request_id}) as resp:
                await resp.read()
        except OSError:
            pass  # the worker is gone: nothing left to abort

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def make_engine_client(url: str) -> EngineClient:
    """The router package's ``WorkerClient`` when present, else ``HttpEngineClient``."""
    try:
        from router.worker_client import WorkerClient
    except ImportError:
        return HttpEngineClient(url)
    return WorkerClient(url)

"""What the gateway needs from whatever runs generations: the ``EngineClient`` protocol.

The in-process ``router.router.Router`` (``deepserve up``), ``router.worker_client.WorkerClient``
(one worker or a remote router service) and test doubles all satisfy it. The gateway never
imports a concrete client except in ``make_engine_client`` and ``deepserve up``.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol, runtime_checkable

from deepserve.internal_auth import InternalAuth
from deepserve.protocol import GenerateRequest, TokenEvent


@runtime_checkable
class EngineClient(Protocol):
    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's token events; the last one carries ``finish_reason``."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a running request and free its state (no error if it already finished)."""
        ...


def make_engine_client(url: str, auth: InternalAuth | None = None) -> EngineClient:
    """The client of one engine worker or router service at ``url`` (``WorkerClient``),
    sending ``auth``'s internal token."""
    from router.worker_client import WorkerClient

    return WorkerClient(url, auth=auth)

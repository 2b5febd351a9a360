"""The seam between the router and a worker's hot call: ``POST`` a JSON body, read NDJSON back.

A ``Transport`` is a keep-alive connection pool to one worker URL with one call, ``request``:
it sends the body and returns the answer (``Answer``) once a 200 head is in, whose ``take``
(without waiting) and ``read`` (waiting) hand over the complete NDJSON lines received so far;
``release`` gives the answer back (its connection kept for reuse only after a complete answer).
Two implementations, picked by name (``RouterConfig.transport``, ``TRANSPORTS``), pass the same
contract tests (``tests/router/test_transport_contract.py``):

- ``http1`` (``router/http1.py``, the default): ``asyncio.Protocol`` connections parsed by hand,
  one write per request, lines split in ``data_received`` (the router's CPU per request: see
  docs/PERFORMANCE.md, "Router");
- ``aiohttp`` (``router/aiohttp_transport.py``): the library's client on the session the
  worker's control calls use.

The upstream read deadlines live here (``Deadlines``), so both implementations keep them: an
answer whose head has not come ``first_byte_s`` after the request was sent, or that brought
nothing for ``event_s`` after its head, fails with ``DeadlineError`` (its connection dropped),
as if the worker had died; while a transport is ``suspect`` (its worker's load polls fail: a hung
process) ``suspect_s`` bounds both. The errors every implementation raises: ``ConnectError``
(could not connect), ``ProtocolError`` (connection lost, malformed answer), ``DeadlineError``,
``StatusError`` (an answer other than 200, with its body); ``router.worker_client`` maps them to
router errors. A request whose reused connection dies before any answer byte is sent once more
on a fresh connection (the worker may have closed it as idle at the same moment).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from ssl import SSLContext
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import aiohttp


class HttpError(Exception):
    pass


class ConnectError(HttpError):
    pass


class ProtocolError(HttpError):
    pass


class DeadlineError(ProtocolError):
    """The worker sent nothing within a deadline (a hung or stopped process)."""


class StatusError(HttpError):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:500].decode(errors='replace')}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Deadlines:
    """How long an upstream call may take at each step (seconds; see the module docstring)."""

    connect_s: float = 2.0
    first_byte_s: float = 300.0
    event_s: float = 60.0
    suspect_s: float = 3.0

    def __post_init__(self) -> None:
        if min(self.connect_s, self.first_byte_s, self.event_s, self.suspect_s) <= 0:
            raise ValueError("deadlines must be > 0")

    def limit(self, head_in: bool, suspect: bool) -> float:
        """The silence allowed before the answer's head (``head_in`` False) or between its bytes."""
        limit = self.event_s if head_in else self.first_byte_s
        return min(limit, self.suspect_s) if suspect else limit


class Answer(Protocol):
    """A 200 answer being read (``Transport.request``)."""

    def take(self) -> list[bytes]:
        """The NDJSON lines received since the last call, possibly none (no waiting)."""

    async def read(self) -> list[bytes] | None:
        """The lines received since the last call (at least one), or None once the answer is
        complete; raises ``ProtocolError`` (``DeadlineError``) if it fails first."""


class Transport(Protocol):
    """Keep-alive connections to one worker (module docstring). ``suspect``: set by the registry
    while the worker's polls fail; it shortens the deadlines of the answers in progress too."""

    suspect: bool

    async def request(self, path: str, body: bytes) -> Answer:
        """POST ``body`` (JSON) to ``path``; the answer once its 200 head is in. Raises
        ``ConnectError``, ``ProtocolError`` or ``StatusError`` (after reading its body)."""

    def release(self, answer: Answer, complete: bool = False) -> None:
        """Take ``answer`` back, whatever happened: its connection is kept after a complete
        answer, else closed (the worker sees the disconnect). ``complete``: the caller saw the
        last event and only the body's end may be missing (kept once that arrives)."""

    def close(self) -> None:
        """Close the idle connections and stop the deadline checks."""


def make_transport(
    kind: str, url: str, deadlines: Deadlines, *, headers: dict[str, str] | None = None, ssl: SSLContext | None = None,
    session: Callable[[], aiohttp.ClientSession] | None = None,
) -> Transport:
    """The transport ``kind`` (``TRANSPORTS``) to ``url``; ``headers`` go on every request (the
    internal token), ``ssl`` is the plane's client context for ``https://`` URLs, ``session``
    gives the aiohttp session a library transport sends on."""
    if kind == "http1":
        from router.http1 import Http1Pool

        return Http1Pool(url, deadlines, headers=headers, ssl=ssl)
    if kind == "aiohttp":
        from router.aiohttp_transport import AiohttpTransport

        if session is None:
            raise ValueError("the aiohttp transport needs a session")
        return AiohttpTransport(url, deadlines, session, headers=headers)
    raise ValueError(f"unknown transport {kind!r}: one of {', '.join(TRANSPORTS)}")


TRANSPORTS = ("http1", "aiohttp")


async def post_lines(transport: Transport, path: str, body: bytes) -> AsyncIterator[bytes]:
    """``transport.request`` as an iterator of the answer's NDJSON lines."""
    answer = await transport.request(path, body)
    complete = False
    try:
        while (lines := await answer.read()) is not None:
            for line in lines:
                yield line
        complete = True
    finally:
        transport.release(answer, complete)

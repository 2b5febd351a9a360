"""The router service's HTTP server seam: what a handler sees, what a server must do.

Two implementations, picked by name (``RouterConfig.server``, ``SERVERS``), pass the same
contract tests (``tests/router/test_server_contract.py``):

- ``http1`` (``router/http_server.py``, the default): ``asyncio.Protocol`` + ``httptools``, for
  the router's CPU per request (docs/PERFORMANCE.md, "Router");
- ``aiohttp`` (``router/aiohttp_server.py``): aiohttp's low-level server under the same handlers.

A handler gets a ``ServerRequest`` and returns a ``Response`` (one body with ``Content-Length``),
or calls ``request.stream(...)``, writes chunks to the ``StreamWriter`` and returns ``None``.
Either server routes an exact ``(method, path)`` table (404 unknown path, 405 other method),
answers a body over ``max_body`` 413, a request (head and body) not in within ``read_timeout_s``
of its first byte 408 (an idle keep-alive connection is not a request), beyond
``max_connections`` open connections 503, a missing internal token 401 (every path but
``open_paths``), a handler's exception 500 (or a cut connection once streaming), and cancels a
handler whose client went away. Its own refusals' bodies come from ``error_response``. Both are
built the same way: ``(routes, ServerOptions(...))``.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from deepserve.internal_auth import InternalAuth


class Response:
    """A complete answer: status, body, content type, extra headers."""

    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, body: bytes = b"", status: int = 200, content_type: bytes = b"application/json", headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers


class StreamWriter(Protocol):
    """A chunked answer in progress."""

    async def write(self, data: bytes) -> None:
        """Send one chunk; waits while the client reads slower than we write; ``ConnectionResetError``
        once the client went away."""

    def end(self) -> None:
        """The answer is complete."""


class ServerRequest(Protocol):
    """One request as a handler sees it (``headers``: lower-case names; ``body``: all of it)."""

    method: bytes
    path: str
    query: str
    body: bytes

    @property
    def peer(self) -> str:
        """The client's IP address ("" if unknown)."""

    @property
    def headers(self) -> dict[str, str]: ...

    def stream(self, status: int = 200, content_type: bytes = b"application/x-ndjson", headers: dict[str, str] | None = None) -> StreamWriter:
        """Start a chunked answer; the handler then returns ``None``."""


Handler = Callable[[ServerRequest], Awaitable["Response | None"]]
Routes = dict[tuple[bytes, str], Handler]


def plain_error(status: int, message: str) -> Response:
    """A refusal's body as plain text (``ServerOptions.error_response`` unless told otherwise)."""
    return Response(message.encode(), status, b"text/plain; charset=utf-8")


@dataclass(frozen=True)
class ServerOptions:
    """What a server is told beside its routes (the module docstring says what each one does).
    ``auth`` (an ``InternalAuth`` with a token) guards every path but ``open_paths``; with the
    plane's TLS on (``auth.tls``) the socket serves TLS and requires client certificates."""

    error_response: Callable[[int, str], Response] = plain_error  # bodies of the server's own refusals
    max_body: int = 64 * 1024 * 1024  # bytes
    keepalive_s: float = 75.0  # an idle keep-alive connection is closed after this
    read_timeout_s: float = 30.0  # a request's head and body must be in within this of its first byte
    max_connections: int = 4096
    auth: InternalAuth | None = None
    open_paths: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if min(self.max_body, self.keepalive_s, self.read_timeout_s, self.max_connections) <= 0:
            raise ValueError(f"server limits must be positive: {self}")

    @property
    def guard(self) -> InternalAuth | None:
        """``auth`` when it holds a token (then every path but ``open_paths`` needs it), else None."""
        return self.auth if self.auth is not None and self.auth.enabled else None

    @property
    def ssl(self) -> ssl.SSLContext | None:
        """What the listening socket serves with: the plane's mTLS when on, else None (plain TCP)."""
        return self.auth.server_ssl if self.auth is not None else None


class Server(Protocol):
    """Serves ``Routes`` on one listening socket (module docstring), within its ``options``."""

    options: ServerOptions

    async def start(self, host: str, port: int, *, backlog: int = 1024, reuse_port: bool = False) -> None: ...

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop listening, give running handlers ``grace_s``, then cancel them."""

    @property
    def port(self) -> int: ...


SERVERS = ("http1", "aiohttp")


def make_server(kind: str, routes: Routes, options: ServerOptions) -> Server:
    """The server ``kind`` (``SERVERS``) for ``routes``."""
    if kind == "http1":
        from router.http_server import HttpServer

        return HttpServer(routes, options)
    if kind == "aiohttp":
        from router.aiohttp_server import AiohttpServer

        return AiohttpServer(routes, options)
    raise ValueError(f"unknown server {kind!r}: one of {', '.join(SERVERS)}")

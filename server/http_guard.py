"""The gateway's HTTP protocol: uvicorn's, plus a header-read deadline and a connection cap.

uvicorn has neither: a client that opens a connection and sends half a request line holds its
socket (and a file descriptor) for as long as it likes, so a few thousand such clients exhaust
the process. ``guarded_http`` subclasses uvicorn's own protocol (``AutoHTTPProtocol``: httptools
when installed, else h11) so that
- a connection must complete its request headers ``header_timeout_s`` after it opened, or after
  its previous response completed (keep-alive); else it gets ``408`` and is closed. The deadline is
  absolute: trickling bytes does not extend it. Once the headers are in, the body and the answer
  are governed by the gateway's own deadlines (``body_timeout_s``, ``request_timeout_s``);
- at most ``max_connections`` connections are open; one beyond that gets ``503`` (with
  ``Retry-After``) and is closed at once, before anything is read from it.
Each refusal is reported to ``on_reject`` (``"header_timeout"`` or ``"connection_cap"``; the
gateway counts them in ``deepserve_http_rejected``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from uvicorn.protocols.http.auto import AutoHTTPProtocol


def _answer(status: str, message: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}}).encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


TIMED_OUT = _answer("408 Request Timeout", "The request headers were not received in time.")
BUSY = _answer("503 Service Unavailable", "Too many open connections. Please retry.", "retry-after: 1\r\n")


def guarded_http(header_timeout_s: float, max_connections: int, on_reject: Callable[[str], None] | None = None) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``; see the module docstring."""
    report = on_reject or (lambda reason: None)

    class GuardedHTTP(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                report("connection_cap")
                transport.write(BUSY)
                transport.close()
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers have the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # a request is in progress: its headers arrived in time
            if not self.transport.is_closing():
                report("header_timeout")
                self.transport.write(TIMED_OUT)
                self.transport.close()

    return GuardedHTTP

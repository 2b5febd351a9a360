"""The gateway's header-read deadline and connection cap (server/http_guard.py), over real
sockets on loopback against the uvicorn server the gateway runs."""

from __future__ import annotations

import socket
import time
from typing import Any, Iterator

import httpx
import pytest

from server.app import create_app
from server.config import GatewayConfig
from server.metrics import GatewayMetrics
from tests.server.conftest import MODEL, serve
from tests.server.fake_engine import FakeEngine


@pytest.fixture
def guarded(catalog) -> Iterator[Any]:
    """``guarded(**config)`` -> (base URL, (host, port)) of a gateway served with its HTTP guard."""
    import contextlib

    stack = contextlib.ExitStack()

    def make(**config: Any) -> tuple[str, tuple[str, int]]:
        cfg = GatewayConfig(served_model_names=(MODEL,), **config)
        gm = GatewayMetrics(process_metrics=False)
        http = cfg.uvicorn_options(on_reject=gm.reject)["http"]
        url = stack.enter_context(serve(create_app(cfg, FakeEngine(), catalog=catalog, gateway_metrics=gm), http=http))
        host, port = url.removeprefix("http://").split(":")
        return url, (host, int(port))

    with stack:
        yield make


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes (or ``timeout``)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except OSError:  # timed out, or reset after the server closed
        pass
    return out


def _rejected(url: str, reason: str) -> float:
    """``deepserve_http_rejected_total{reason=...}`` from the gateway's /metrics."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'deepserve_http_rejected_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no deepserve_http_rejected_total for {reason!r}")


def test_half_sent_headers_get_408_and_the_connection_closed(guarded) -> None:
    url, addr = guarded(header_timeout_s=0.3)
    with socket.create_connection(addr) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        answer = _read_all(sock, 5)
        elapsed = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408") and 0.25 < elapsed < 3
    assert httpx.get(url + "/health").status_code == 200  # complete requests are served as before
    assert _rejected(url, "header_timeout") == 1.0


def test_trickled_headers_do_not_extend_the_deadline(guarded) -> None:
    _, addr = guarded(header_timeout_s=0.4)
    with socket.create_connection(addr) as sock:
        t0 = time.monotonic()
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.02)
            if time.monotonic() - t0 > 1.5:
                break
        answer = _read_all(sock, 3)
    assert closed or answer.startswith(b"HTTP/1.1 408")


def test_a_keep_alive_connection_must_send_its_next_headers_in_time(guarded) -> None:
    _, addr = guarded(header_timeout_s=0.5)
    with socket.create_connection(addr) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next request, half sent
        assert _read_all(sock, 5).startswith(b"HTTP/1.1 408")


def test_connections_beyond_the_cap_get_503(guarded) -> None:
    url, addr = guarded(max_connections=2, header_timeout_s=30)
    held = [socket.create_connection(addr) for _ in range(2)]
    try:
        time.sleep(0.2)  # the server has accepted both
        with socket.create_connection(addr) as extra:
            answer = _read_all(extra, 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while httpx.get(url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(url + "/health").status_code == 200
    assert _rejected(url, "connection_cap") >= 1.0  # the refused one (and any /health poll while full)

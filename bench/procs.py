"""Starting and stopping the local processes a benchmark needs (fake workers, routers)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 2xx; raise if ``proc`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if 200 <= r.status < 300:
                    return
        except Exception as exc:  # noqa: BLE001 (not up yet)
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s: {last}")


def start(cmd: Sequence[str], health_url: str | None, log: str | Path | None = None, timeout: float = 30.0,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own process group; wait for ``health_url`` when given."""
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below once the child has it)
    proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    if log:
        out.close()  # type: ignore[union-attr]
    if health_url:
        try:
            wait_http(health_url, timeout, proc)
        except Exception:
            stop(proc)
            raise
    return proc


def stop(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM the process group we started, SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)
    except ProcessLookupError:
        pass


def fake_worker_cmd(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "bench.fake_openai_worker", "--port", str(port), *args]

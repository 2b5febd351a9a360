"""Fixtures for router tests: FAKE worker processes on loopback (tests/router/fake_worker.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


class FakeProc:
    """One fake worker subprocess; ``url`` once it printed its port."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.router.fake_worker", "--port", "0", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), f"fake worker did not start: {line!r}"
        self.port = int(line.split()[1])
        self.url = f"{'https' if '--tls' in args else 'http'}://127.0.0.1:{self.port}"

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def spawn():
    """``spawn("--worker-id", "a", ...)`` starts a fake worker; all are killed after the test."""
    procs: list[FakeProc] = []

    def _spawn(*args: str) -> FakeProc:
        p = FakeProc(*args)
        procs.append(p)
        return p

    yield _spawn
    for p in procs:
        p.stop()

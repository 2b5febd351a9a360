"""Real engine worker processes on loopback, for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from deepserve.internal_auth import InternalAuth

TOKEN = "integration-test-internal-token"  # every worker started here requires it
AUTH = InternalAuth(TOKEN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerProcess:
    """One ``deepserve engine`` OS process."""

    role: str
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def start_workers(model_dir: Path, kv_dir: Path, roles: list[str], log_dir: Path, timeout: float = 120.0, extra: tuple[str, ...] = (), tiers: str = "memory,fs") -> list[WorkerProcess]:
    """Start one worker per role (by default sharing a filesystem KV tier); wait until all are healthy."""
    env = dict(os.environ, DEEPSERVE_KV_TIERS=tiers, DEEPSERVE_KV_FS_DIR=str(kv_dir), DEEPSERVE_KV_FS_FSYNC="false", DEEPSERVE_INTERNAL_TOKEN=TOKEN)
    workers = []
    for i, role in enumerate(roles):
        port = free_port()
        log = open(log_dir / f"worker-{role}-{port}.log", "w")
        cmd = [sys.executable, "-m", "deepserve.cli", "engine", "--model", str(model_dir), "--role", role, "--port", str(port),
               "--worker-id", f"{role}-{i}-{port}", "--dtype", "float32", "--max-num-seqs", "32", *extra]
        workers.append(WorkerProcess(role, port, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)))
    deadline = time.monotonic() + timeout
    for w in workers:
        while not w.healthy():
            if w.proc.poll() is not None or time.monotonic() > deadline:
                for x in workers:
                    x.terminate()
                raise RuntimeError(f"worker {w.role}:{w.port} did not start; see {log_dir}")
            time.sleep(0.2)
    return workers

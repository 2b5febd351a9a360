"""The soak benchmark's stack and its faults: a real valkey Redis tier and ``deepserve up`` (gateway,
in-process router, a prefill and two decode workers it supervises) as OS processes on loopback.

Faults act on those processes: SIGKILL of a worker (``up`` restarts it), SIGSTOP then SIGCONT of a
decode worker, SIGKILL of Redis then a restart on its port. Each returns when the stack is whole
again, so the caller can time the fault's window. ``sample()`` reads every process's RSS and open
file descriptors (psutil).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.localredis import LocalRedisServer
from bench.procs import free_port, start, stop, wait_http


@dataclass(frozen=True)
class StackOptions:
    """What the soak starts: ``work_dir`` holds the checkpoint (made when ``model_dir`` is None),
    the KV files and the logs."""

    work_dir: Path
    model_dir: Path | None = None
    prefill_workers: int = 1
    decode_workers: int = 2
    startup_timeout_s: float = 600.0


@dataclass(frozen=True)
class Worker:
    role: str
    port: int
    pid: int

    @property
    def name(self) -> str:
        return f"{self.role}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 (down, hung or still starting)
        return False


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class SoakStack:
    """Started by ``start()``, stopped by ``stop()``; ``url`` is the gateway's base URL."""

    def __init__(self, opts: StackOptions) -> None:
        self.opts = opts
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.redis = LocalRedisServer()
        self.up: subprocess.Popen | None = None
        self.model = ""

    def checkpoint(self) -> Path:
        if self.opts.model_dir is not None:
            return self.opts.model_dir
        target = self.opts.work_dir / "tiny-v4"
        if not (target / "config.json").is_file():
            subprocess.run([sys.executable, "-m", "deepserve.cli", "make-tiny-model", "--out", str(target)], check=True)
        return target

    def start(self) -> None:
        self.opts.work_dir.mkdir(parents=True, exist_ok=True)
        model = self.checkpoint()
        self.redis.start()
        env = {
            "DEEPSERVE_KV_TIERS": "memory,redis",
            "DEEPSERVE_KV_REDIS_URL": self.redis.url,
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [
            sys.executable, "-m", "deepserve.cli", "up", "--model", str(model), "--port", str(self.port),
            "--prefill-workers", str(self.opts.prefill_workers), "--decode-workers", str(self.opts.decode_workers),
            "--dtype", "float32", "--cache-dir", str(self.opts.work_dir / "cache"),
            "--engine-arg=--max-num-seqs", "--engine-arg=32",
        ]
        self.up = start(cmd, None, log=self.opts.work_dir / "up.log", env=env)
        wait_http(self.url + "/health", self.opts.startup_timeout_s, self.up)
        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:
            self.model = json.loads(r.read())["data"][0]["id"]

    def stop(self) -> None:
        if self.up is not None:
            stop(self.up, timeout=30)
        self.redis.stop()

    # ---- the processes -------------------------------------------------------------------------
    def workers(self) -> list[Worker]:
        """The engine workers ``up`` runs now (a restarted one has a new pid, the same port)."""
        assert self.up is not None
        out = []
        for child in psutil.Process(self.up.pid).children():
            try:
                args = child.cmdline()
            except psutil.Error:
                continue
            if "engine" in args and "--role" in args:
                out.append(Worker(args[args.index("--role") + 1], int(args[args.index("--port") + 1]), child.pid))
        return sorted(out, key=lambda w: w.name)

    def pick(self, role: str, turn: int) -> Worker:
        of_role = [w for w in self.workers() if w.role == role]
        return of_role[turn % len(of_role)]

    def wait_whole(self, timeout_s: float = 300.0) -> None:
        """Until every worker of ``up`` answers /health (a restarted one is back)."""
        want = self.opts.prefill_workers + self.opts.decode_workers
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ws = self.workers()
            if len(ws) == want and all(healthy(w.url) for w in ws):
                return
            time.sleep(0.5)
        raise TimeoutError(f"the stack was not whole again within {timeout_s:g}s")

    # ---- faults (each blocks until the stack is whole again) -----------------------------------
    def kill_worker(self, role: str, turn: int) -> str:
        w = self.pick(role, turn)
        os.kill(w.pid, signal.SIGKILL)
        while _running(w.pid):
            time.sleep(0.05)
        time.sleep(1.0)  # ``up`` notices within its poll and restarts it after its backoff
        self.wait_whole()
        return w.name

    def stop_worker(self, role: str, turn: int, hold_s: float) -> str:
        w = self.pick(role, turn)
        os.kill(w.pid, signal.SIGSTOP)
        time.sleep(hold_s)
        os.kill(w.pid, signal.SIGCONT)
        self.wait_whole()
        return w.name

    def bounce_redis(self, down_s: float) -> str:
        self.redis.kill()
        time.sleep(down_s)
        self.redis.start()
        return f"redis:{self.redis.port}"

    # ---- resources -----------------------------------------------------------------------------
    def sample(self) -> dict[str, dict[str, float]]:
        """{process name: {rss_mb, fds}} for the gateway (``up``) and each worker."""
        assert self.up is not None
        procs = [("gateway", self.up.pid)] + [(w.name, w.pid) for w in self.workers()]
        out = {}
        for name, pid in procs:
            try:
                p = psutil.Process(pid)
                out[name] = {"rss_mb": round(p.memory_info().rss / 2**20, 1), "fds": p.num_fds(), "pid": pid}
            except psutil.Error:
                continue
        return out

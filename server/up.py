"""``deepserve up``: the embedded all-in-one stack for a laptop or a CI box.

1. The checkpoint: ``--model DIR``, else ``<cache>/tiny-v4`` (cache = ``$DEEPSERVE_CACHE_DIR`` or
   ``~/.cache/deepserve``), created on first run by ``deepserve make-tiny-model`` (written to a
   temporary directory and renamed, under a file lock, so a killed or concurrent run never
   leaves half a checkpoint).
2. Engine workers as child OS processes, ``deepserve engine --model DIR --role mixed|prefill|decode
   --port P`` on free loopback ports, so each shows up in ``ps`` as its own engine. They share the
   embedded KV store through ``DEEPSERVE_KV_TIERS=memory,fs`` and ``DEEPSERVE_KV_FS_DIR=<cache>/kv``
   (values already in the environment win). Linux: each child gets SIGTERM if this process dies
   (``PR_SET_PDEATHSIG``), so even a SIGKILLed ``up`` leaves no orphans.
3. Once every worker answers ``/health`` 200, the in-process ``router.Router`` over them and the
   gateway on ``--host``/``--port`` (127.0.0.1:8000). ``/health`` is 200 while the stack can
   serve (a worker that decodes is available), also with a worker down; ``/metrics`` carries the
   gateway's, the router's and every worker's metrics.
4. The internal plane's token: the one in the environment (``deepserve.internal_auth``), else
   a fresh one, given to the workers in theirs and used by the router. With mTLS files
   (``--internal-tls-*`` or the environment, ``deepserve.internal_tls``) the workers serve https
   and require client certificates; the router and the health checks present the same one.
5. Supervision: a worker process that exits is started again on its port (backoff from
   ``restart_backoff_s``, doubling to 30 s while it keeps dying within a minute); the router's
   poller sees it come back.
6. Ctrl-C / SIGTERM: the gateway stops accepting, the workers get SIGTERM (they drain), and any
   still alive after ``--shutdown-timeout`` seconds get SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

from deepserve.protocol import Role
from deepserve.internal_auth import ENV_TOKEN, InternalAuth, generate_token
from deepserve.internal_tls import InternalTLS
from server.config import GatewayConfig

log = logging.getLogger("deepserve.up")


@dataclass(frozen=True)
class UpOptions:
    """What ``deepserve up`` starts (the gateway's own settings are a ``GatewayConfig``)."""

    cache_dir: Path
    model_dir: Path | None = None  # None: <cache_dir>/tiny-v4, created on first run
    mixed_workers: int = 1  # used when no prefill/decode workers are asked for
    prefill_workers: int = 0
    decode_workers: int = 0
    dp: int | None = None
    dtype: str | None = None
    device: str | None = None
    max_model_len: int | None = None  # the gateway's context length, passed to every worker too
    served_model_name: str | None = None  # the workers' model_name metric label (default: the checkpoint's name)
    startup_timeout_s: float = 600.0
    shutdown_timeout_s: float = 15.0
    restart_backoff_s: float = 1.0  # first delay before a dead worker is started again
    engine_args: tuple[str, ...] = ()  # passed through to every `deepserve engine`

    def __post_init__(self) -> None:
        if (self.prefill_workers > 0) != (self.decode_workers > 0):
            raise ValueError("--prefill-workers and --decode-workers go together (both > 0)")
        if self.mixed_workers < 0 or self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("worker counts must be >= 0")
        if not self.roles():
            raise ValueError("at least one worker is needed")

    @staticmethod
    def default_cache_dir(env: dict[str, str] | None = None) -> Path:
        env = dict(os.environ) if env is None else env
        return Path(env.get("DEEPSERVE_CACHE_DIR") or Path.home() / ".cache" / "deepserve")

    @property
    def checkpoint(self) -> Path:
        return self.model_dir or self.cache_dir / "tiny-v4"

    def roles(self) -> list[Role]:
        if self.prefill_workers:
            return ["prefill"] * self.prefill_workers + ["decode"] * self.decode_workers
        return ["mixed"] * self.mixed_workers


# ---- child processes ------------------------------------------------------------------------------
def deepserve_command() -> list[str]:
    """How to run ``deepserve`` from this interpreter (the console script when installed)."""
    script = Path(sys.executable).parent / "deepserve"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("deepserve")
    return [found] if found else [sys.executable, "-m", "deepserve.cli"]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_checkpoint(opts: UpOptions) -> Path:
    """The checkpoint directory, made with ``deepserve make-tiny-model`` when missing."""
    target = opts.checkpoint
    if opts.model_dir is not None:
        if not (target / "config.json").is_file():
            raise SystemExit(f"deepserve up: {target} has no config.json")
        return target
    with _file_lock(opts.cache_dir / ".tiny-v4.lock"):
        if (target / "config.json").is_file():
            return target
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("creating the tiny checkpoint in %s (first run)", target)
        subprocess.run([*deepserve_command(), "make-tiny-model", "--out", str(tmp)], check=True)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    return target


@dataclass
class WorkerProcess:
    name: str
    role: Role
    port: int
    proc: subprocess.Popen[bytes]
    restarts: int = 0
    started: float = field(default_factory=time.monotonic)
    next_start: float = 0.0  # monotonic time of the planned restart (0: none planned)
    backoff_s: float = 0.0
    scheme: str = "http"  # https when the internal plane runs mTLS

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class WorkerSet:
    """The engine worker processes of one ``up``; ``supervise()`` restarts those that exit,
    ``stop()`` leaves none behind."""

    opts: UpOptions
    model_dir: Path
    auth: InternalAuth = field(default_factory=lambda: InternalAuth(generate_token()), repr=False)
    workers: list[WorkerProcess] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _supervisor: threading.Thread | None = None

    def worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[ENV_TOKEN] = self.auth.token
        env.update(self.auth.tls.env())
        env.setdefault("DEEPSERVE_KV_TIERS", "memory,fs")
        env.setdefault("DEEPSERVE_KV_FS_DIR", str(self.opts.cache_dir / "kv"))
        Path(env["DEEPSERVE_KV_FS_DIR"]).mkdir(parents=True, exist_ok=True)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def command(self, role: Role, port: int) -> list[str]:
        # --open-metrics: the gateway's /metrics (open) merges theirs; they listen on loopback only
        cmd = [*deepserve_command(), "engine", "--model", str(self.model_dir), "--role", role, "--port", str(port), "--open-metrics"]
        o = self.opts
        name = o.served_model_name or self.model_dir.resolve().name  # the gateway's first name by default
        cmd += ["--served-model-name", name]
        for flag, value in (("--dp", o.dp), ("--dtype", o.dtype), ("--device", o.device), ("--max-model-len", o.max_model_len)):
            if value is not None:
                cmd += [flag, str(value)]
        return cmd + list(self.opts.engine_args)

    def start(self) -> None:
        env = self.worker_env()
        counts: dict[str, int] = {}
        for role in self.opts.roles():
            index = counts.get(role, 0)
            counts[role] = index + 1
            port = free_port()
            log.info("starting %s-%d on port %d", role, index, port)
            proc = self._spawn(role, port, env)
            self.workers.append(WorkerProcess(f"{role}-{index}", role, port, proc, scheme=self.auth.tls.scheme))

    def _spawn(self, role: Role, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
        cmd = self.command(role, port)
        log.debug("%s", " ".join(cmd))
        return subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def supervise(self, interval_s: float = 0.5) -> None:
        """Watch the workers from a daemon thread until ``stop()``; restart any that exits."""
        self._supervisor = threading.Thread(target=self._watch, args=(interval_s,), name="up-supervisor", daemon=True)
        self._supervisor.start()

    def _watch(self, interval_s: float) -> None:
        env = self.worker_env()
        while not self._stopping.wait(interval_s):
            for w in self.workers:
                if not w.alive() and not self._stopping.is_set():
                    self._restart(w, env)

    def _restart(self, w: WorkerProcess, env: dict[str, str]) -> None:
        now = time.monotonic()
        if not w.next_start:  # just found dead: plan the restart
            quick = now - w.started < 60.0  # died soon after its last start: back off further
            w.backoff_s = min(30.0, w.backoff_s * 2) if quick and w.backoff_s else self.opts.restart_backoff_s
            w.next_start = now + w.backoff_s
            log.warning("%s exited with status %s; restarting it in %.1fs", w.name, w.proc.returncode, w.backoff_s)
            return
        if now < w.next_start:
            return
        w.proc = self._spawn(w.role, w.port, env)
        w.started = now
        w.restarts += 1
        w.next_start = 0.0
        log.info("%s restarted (restart %d)", w.name, w.restarts)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.workers)
        while pending:
            for w in list(pending):
                if not w.alive():
                    raise RuntimeError(f"engine worker {w.name} exited with status {w.proc.returncode} during startup")
                if http_ok(w.url + "/health", ssl=self.auth.client_ssl):
                    log.info("%s healthy on %s", w.name, w.url)
                    pending.remove(w)
            if pending:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine workers not healthy after {timeout_s:g}s: {[w.name for w in pending]}")
                time.sleep(0.25)

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(5)
        for w in self.workers:
            if w.alive():
                w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.opts.shutdown_timeout_s
        for w in self.workers:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit after SIGTERM; killing it", w.name)
                w.proc.kill()
                w.proc.wait()
        self.workers.clear()


def http_ok(url: str, timeout_s: float = 1.0, ssl: Any = None) -> bool:
    """Whether ``url`` answers 200 (``ssl``: the plane's client context for https)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=ssl) as resp:
            return resp.status == 200
    except Exception:
        return False


# ---- the engine client over the workers -----------------------------------------------------------
def build_engine(workers: WorkerSet, registry: Any) -> tuple[Any, Any, Any]:
    """(engine client, lifecycle, health probe): the in-process Router over the workers."""
    by_role: dict[str, tuple[str, ...]] = {
        role: tuple(w.url for w in workers.workers if w.role == role) for role in ("mixed", "prefill", "decode")
    }
    from router.config import RouterConfig
    from router.metrics import RouterMetrics
    from router.router import Router

    config = RouterConfig.from_env(worker=by_role["mixed"], prefill=by_role["prefill"], decode=by_role["decode"])
    router = Router(config, metrics=RouterMetrics(registry), auth=workers.auth)

    @contextlib.asynccontextmanager
    async def router_life() -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    async def router_health() -> bool:
        """Whether the stack can serve: a worker that decodes (mixed or decode) is available."""
        return any(w.available and w.role in ("mixed", "decode") for w in router.registry.workers())

    return router, router_life, router_health


# ---- main -----------------------------------------------------------------------------------------
def run_up(opts: UpOptions, gateway: GatewayConfig, *, access_log: bool = False, tls: InternalTLS | None = None) -> int:
    """Run the stack until SIGTERM or Ctrl-C; ``tls``: the internal plane's mTLS files (default:
    from the environment)."""
    import uvicorn

    from kvstore.config import KVStoreConfig
    from server.app import create_app
    from server.metrics import GatewayMetrics

    if not port_is_free(gateway.host, gateway.port):
        raise SystemExit(f"deepserve up: {gateway.host}:{gateway.port} is already in use")
    model_dir = ensure_checkpoint(opts)
    given = InternalAuth.resolve(tls=tls)
    workers = WorkerSet(opts, model_dir, auth=given if given.enabled else InternalAuth(generate_token(), given.tls))

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        workers.start()
        workers.wait_healthy(opts.startup_timeout_s)
        workers.supervise()
        gm = GatewayMetrics()
        engine, lifecycle, health = build_engine(workers, gm.registry)
        config = GatewayConfig(**{**gateway.__dict__, "model_dir": str(model_dir)})
        app = create_app(
            config, engine, gateway_metrics=gm, health_probe=health, lifecycle=lifecycle,
            metrics_sources=[(w.name, w.url + "/metrics") for w in workers.workers], metrics_ssl=workers.auth.client_ssl,
            kv=KVStoreConfig.from_env(workers.worker_env()),  # the workers' KV settings: their Redis, if any
        )
        log.info("deepserve up: gateway on http://%s:%d (%d workers)", config.host, config.port, len(workers.workers))
        server = uvicorn.Server(uvicorn.Config(app, access_log=access_log, **config.uvicorn_options(on_reject=gm.reject)))
        asyncio.run(server.serve())
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        workers.stop()
        signal.signal(signal.SIGTERM, previous)

"""The engine thread: steps every DP rank's engine backend and hands events to asyncio.

HTTP handlers never touch an engine directly. They post commands (add, abort) to an inbox; this
thread applies them between steps, steps each rank that has work, and delivers each
``TokenEvent`` to the request's asyncio queue with ``call_soon_threadsafe``. torch releases the
GIL inside its kernels, so the event loop stays responsive while the model runs.

Failure containment: a command that fails fails its own request only (whatever it raises);
a step that raises fails the requests of that rank (a bug or a device fault: which sequence
caused it is unknown) and the thread goes on. Should the thread itself die, every open request
gets an error event, ``alive`` turns False and ``on_death`` is called, so the worker can report
unhealthy and exit for its supervisor to restart it. ``beat`` is the time of the thread's last
turn, for ``stalled``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from deepserve.protocol import CodedError, ErrorCode, GenerateRequest, RankLoad, TokenEvent
from engine.backends.base import EngineBackend

log = logging.getLogger(__name__)


@dataclass
class _Add:
    rank: int
    request: GenerateRequest
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


def refusal(request: GenerateRequest, exc: Exception) -> TokenEvent:
    """The error event of a request that ``add_request`` refused with ``exc``."""
    if isinstance(exc, CodedError):  # ours: says what is wrong
        message, code = str(exc), exc.code
    elif isinstance(exc, ValueError):  # a request field the engine refuses
        message, code = str(exc), ErrorCode.INVALID_REQUEST
    else:
        log.error("adding request %s failed", request.request_id, exc_info=exc)
        message, code = "the engine could not take the request", ErrorCode.ENGINE_ERROR
    return TokenEvent(request.request_id, finish_reason="error", error=message, num_prompt_tokens=len(request.prompt_token_ids), error_code=code)


class EngineLoop:
    """Owns the engine backends (the DP ranks this process serves) and the thread that steps them.

    ``lockstep``: the ranks are processes stepping together (``engine.backends.base``): each rank's
    ``step`` is called on every turn, work or not, so an idle rank joins the group's step.
    """

    def __init__(
        self, cores: list[EngineBackend], worker_id: str, on_death: Callable[[], None] | None = None, lockstep: bool = False
    ) -> None:
        self.cores = cores
        self.lockstep = lockstep
        self.worker_id = worker_id
        self.on_death = on_death  # called (on the engine thread) if the thread dies
        self.death: BaseException | None = None
        self.beat = time.monotonic()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop, int]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- called from the event loop ---------------------------------------------------
    def pick_rank(self, requested: int | None) -> int:
        """Index of the requested DP rank if this process serves it, else of the least loaded one."""
        loads = self.rank_loads()
        for i, load in enumerate(loads):
            if load.dp_rank == requested:
                return i
        return min(range(len(loads)), key=lambda i: (loads[i].running + loads[i].waiting, loads[i].queued_tokens))

    def submit(self, request: GenerateRequest, sink: asyncio.Queue) -> None:
        rank = self.pick_rank(request.dp_rank)
        self._inbox.put(_Add(rank, request, sink, asyncio.get_running_loop()))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def in_flight(self) -> int:
        return len(self._sinks)

    @property
    def alive(self) -> bool:
        """The thread runs (or has not been started yet) and has not died."""
        return self.death is None and (self._thread.is_alive() or self._thread.ident is None)

    def stalled(self, after_s: float) -> bool:
        """The thread has work but has not come round for ``after_s`` seconds (a hung step)."""
        return time.monotonic() - self.beat > after_s and any(c.has_work() for c in self.cores)

    def rank_loads(self) -> list[RankLoad]:
        return [c.load() for c in self.cores]

    # ---- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._steps()
        except BaseException as exc:  # noqa: BLE001 (the thread must not vanish silently)
            log.critical("engine thread died", exc_info=True)
            self.death = exc
            for rid in list(self._sinks):
                try:
                    self._deliver(TokenEvent(rid, finish_reason="error", error="the engine stopped", error_code=ErrorCode.ENGINE_ERROR))
                except Exception:  # noqa: BLE001 (tell every other request, whatever this one does)
                    log.exception("could not fail request %s", rid)
            if self.on_death is not None:
                self.on_death()

    def _steps(self) -> None:
        while not self._stop.is_set():
            self.beat = time.monotonic()
            self._drain_inbox()
            busy = False
            for core in self.cores:
                local = core.has_work()
                if not (local or self.lockstep):
                    continue
                busy = busy or local
                try:
                    events = core.step()
                except Exception as exc:  # a bug or device fault: fail the rank's requests, keep serving
                    log.exception("engine step failed: %s", exc)
                    events = self._fail_all(core, "engine step failed")
                for ev in events:
                    self._deliver(ev)
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                rid = cmd.request.request_id
                try:
                    if rid in self._sinks:
                        raise InvalidRequestError(f"duplicate request id {rid!r}")
                    self._sinks[rid] = (cmd.sink, cmd.loop, cmd.rank)
                    self.cores[cmd.rank].add_request(cmd.request)
                except Exception as exc:  # noqa: BLE001 (one request's failure is that request's)
                    self._sinks.pop(rid, None)
                    cmd.loop.call_soon_threadsafe(cmd.sink.put_nowait, refusal(cmd.request, exc))
            else:
                entry = self._sinks.get(cmd.request_id)
                if entry is not None:
                    try:
                        self.cores[entry[2]].abort_request(cmd.request_id)
                    except Exception:  # noqa: BLE001
                        log.exception("aborting request %s failed", cmd.request_id)

    def _deliver(self, ev: TokenEvent) -> None:
        entry = self._sinks.get(ev.request_id)
        if entry is None:
            return
        if ev.finished:
            del self._sinks[ev.request_id]
        ev.worker_id = self.worker_id
        sink, loop, _ = entry
        try:
            loop.call_soon_threadsafe(sink.put_nowait, ev)
        except RuntimeError:  # event loop closed during shutdown
            pass

    def _fail_all(self, core: EngineBackend, message: str) -> list[TokenEvent]:
        events = []
        for rid in core.request_ids():
            core.abort_request(rid)
            events.append(TokenEvent(rid, finish_reason="error", error=message, error_code=ErrorCode.ENGINE_ERROR))
        core.step()  # flush the abort events of the failed sequences
        return events

"""Grammar compiles in child processes, so a compile that runs past its time can be killed.

xgrammar cannot cancel a compile, and some grammars take minutes (a 16,000-repeat ``pattern``
takes ~15 s just to build), so a thread would burn a core for as long as the grammar wants. Each
of the pool's ``processes`` dispatcher threads owns one child process (spawned, not forked: the
engine process runs torch's threads), started on first use and stopped after ``idle_s`` without
work. A child builds its own xgrammar compiler from the serialised ``TokenizerInfo``, runs at
``nice`` (below the engine thread), and answers each job with the compiled grammar in xgrammar's
JSON serialisation, which the parent reads back against its own ``TokenizerInfo`` (milliseconds).
A job without an answer after ``timeout_s`` gets its child killed (the next job starts a fresh
one) and fails with ``InvalidConstraintError``; so does a job whose child died. Starting a child
(seconds on a loaded host: a fresh interpreter and the vocabulary's compiler) is not the job's
compile, and neither is the time a job waits behind other jobs (a hostile grammar holds a child for
up to ``timeout_s``): its ``CompileFuture`` says how long it was queued and while a child is starting
for it and how long that took, so a waiting request's own deadline leaves both out
(``engine/runtime/engine_core.py``) and one client's slow grammar never fails another's.

``compile_grammar`` is the compile itself, one function for every constraint kind.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import xgrammar as xgr

from deepserve.protocol.json_schema import SchemaError, enforceable_schema
from engine.sampling.dsml import DsmlVersion, parse_tools, tool_call_structural_tag
from engine.sampling.errors import InvalidConstraintError

log = logging.getLogger(__name__)

Job = tuple[str, str, bool]  # (kind, spec, compact)


@dataclass(frozen=True)
class CompileSettings:
    """How grammars are built: the DSML spelling, the whitespace cap, xgrammar's threads per compile."""

    dsml_version: DsmlVersion = "v4"
    json_max_whitespace: int | None = 16
    max_threads: int = 2


def compile_grammar(compiler: xgr.GrammarCompiler, job: Job, settings: CompileSettings) -> xgr.CompiledGrammar:
    """Compile one constraint (raises ``InvalidConstraintError``)."""
    kind, spec, compact = job
    try:
        if kind == "json":
            # no schema: JSON mode (OpenAI's json_object), a JSON object as OpenAI answers it
            spec = enforceable_schema(json.loads(spec), strict=False) if spec else '{"type": "object"}'
            if compact:
                return compiler.compile_json_schema(spec, any_whitespace=False, separators=(",", ":"))
            return compiler.compile_json_schema(spec, max_whitespace_cnt=settings.json_max_whitespace)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "ebnf":
            return compiler.compile_grammar(spec)
        if kind in ("tool_call", "tool_call_required", "tool_call_forced"):
            tag = tool_call_structural_tag(
                _audited_tools(spec), required=kind != "tool_call", version=settings.dsml_version,
                max_whitespace=settings.json_max_whitespace, open_block=kind == "tool_call_forced",
            )
            return compiler.compile_structural_tag(tag)
    except InvalidConstraintError:
        raise
    except SchemaError as e:
        raise InvalidConstraintError(f"invalid {kind} constraint: {e} (at {e.location or 'the top level'})") from e
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse/compile errors
        raise InvalidConstraintError(f"invalid {kind} constraint: {e}") from e
    raise InvalidConstraintError(f"unknown constraint kind {kind!r}")


def _audited_tools(spec: str) -> str:
    """The tool list with each tool's parameters through the schema audit (``SchemaError``)."""
    tools = [
        {"type": "function", "function": {"name": name, "parameters": json.loads(enforceable_schema(params, strict=False))}}
        for name, params in parse_tools(spec)
    ]
    return json.dumps(tools)


def _child(conn: Connection, tokenizer_info_json: str, settings: CompileSettings, nice: int) -> None:
    """A child process: compile jobs from ``conn`` until it closes; ``(ok, grammar JSON | error)``."""
    os.nice(nice)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=settings.max_threads)
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, compile_grammar(compiler, job, settings).serialize_json()))
        except InvalidConstraintError as e:
            conn.send((False, str(e)))


class CompileFuture(Future):
    """A compile's future, with the time queued behind other jobs and the child start-up spent on it
    (neither is the grammar's own compile time)."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted = time.monotonic()
        self.dispatched = 0.0  # when a dispatcher took it (0: still queued)
        self.starting = False  # a child process is starting for this job now
        self.startup_s = 0.0  # seconds a child took to start for this job
        self._starting_since = 0.0

    def wait_excused(self, now: float) -> float:
        """Seconds of this job's wait that were queueing or child start-up (``now``: ``time.monotonic()``)."""
        queued = (self.dispatched or now) - self.submitted
        return queued + self.startup_s + (now - self._starting_since if self.starting else 0.0)

    def start_child(self) -> None:
        self._starting_since = time.monotonic()
        self.starting = True

    def child_started(self) -> None:
        self.startup_s += time.monotonic() - self._starting_since
        self.starting = False


class _Worker:
    """One child process and its end of the pipe."""

    def __init__(self, info_json: str, settings: CompileSettings, nice: int, startup_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(child_end, info_json, settings, nice), daemon=True, name="grammar-compile")
        self.process.start()
        child_end.close()
        if not self.conn.poll(startup_s) or self.conn.recv() != "ready":
            self.stop()
            raise InvalidConstraintError(f"the grammar compiler did not start within {startup_s:g}s")

    def stop(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class CompilePool:
    """Compiles on child processes with a per-compile deadline (see the module docstring)."""

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        settings: CompileSettings,
        *,
        processes: int = 1,
        timeout_s: float = 10.0,
        nice: int = 10,
        idle_s: float = 120.0,
        startup_s: float = 120.0,
    ) -> None:
        if processes < 1 or timeout_s <= 0:
            raise ValueError("a compile pool needs >= 1 process and a positive timeout")
        self.tokenizer_info = tokenizer_info
        self.settings = settings
        self.timeout_s = timeout_s
        self._nice, self._idle_s, self._startup_s = nice, idle_s, startup_s
        self._jobs: queue.SimpleQueue[tuple[Job, CompileFuture]] = queue.SimpleQueue()
        self._processes = processes
        self._threads: list[threading.Thread] = []
        self._info_json: str | None = None
        self._lock = threading.Lock()

    def submit(self, job: Job) -> CompileFuture:
        """Queue a compile; its future fails with ``InvalidConstraintError``."""
        fut = CompileFuture()
        with self._lock:
            if not self._threads:  # first use: serialise the vocabulary once, start the dispatchers
                self._info_json = self.tokenizer_info.serialize_json()
                for i in range(self._processes):
                    t = threading.Thread(target=self._dispatch, name=f"grammar-dispatch-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
        self._jobs.put((job, fut))
        return fut

    def _dispatch(self) -> None:
        worker: _Worker | None = None
        while True:
            try:
                job, fut = self._jobs.get(timeout=self._idle_s)
            except queue.Empty:
                if worker is not None:  # idle: give the memory back
                    worker.stop()
                    worker = None
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            fut.dispatched = time.monotonic()
            try:
                if worker is None:
                    fut.start_child()
                    try:
                        worker = _Worker(self._info_json or "", self.settings, self._nice, self._startup_s)
                    finally:
                        fut.child_started()
                worker.conn.send(job)
                answered = worker.conn.poll(self.timeout_s)
                reply = worker.conn.recv() if answered else None
            except InvalidConstraintError as e:
                fut.set_exception(e)
                continue
            except (EOFError, OSError) as e:  # the child died (out of memory, killed)
                log.warning("grammar compiler process died: %s", e)
                reply, answered = None, True
            if reply is None:
                if worker is not None:
                    worker.stop()
                worker = None
                why = f"did not compile within {self.timeout_s:g}s" if not answered else "crashed the grammar compiler"
                fut.set_exception(InvalidConstraintError(f"the {job[0]} constraint {why}"))
            elif reply[0]:
                fut.set_result(xgr.CompiledGrammar.deserialize_json(reply[1], self.tokenizer_info))
            else:
                fut.set_exception(InvalidConstraintError(reply[1]))

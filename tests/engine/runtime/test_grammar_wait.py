"""A request waits in the scheduler while its grammar compiles off the engine thread."""

from __future__ import annotations

import json
import time

from engine.errors import InvalidRequestError
from deepserve.protocol import GenerateRequest, OutputConstraint, SamplingParams
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from tests.engine.runtime.helpers import prompt

# xgrammar takes seconds to build this schema's grammar (superlinear in the repeat count).
SLOW = OutputConstraint("json", json.dumps({"type": "string", "pattern": "[a-z]{16000}"}))  # ~13 s to build, far past the 3 s deadline


def _drive(engine, until: float) -> dict[str, tuple[float, str | None, str | None]]:
    """Step until no work or ``until``; per request (time of finish, finish reason, error)."""
    done: dict[str, tuple[float, str | None, str | None]] = {}
    t0 = time.monotonic()
    while engine.has_work() and time.monotonic() - t0 < until:
        for ev in engine.step():
            if ev.finished:
                done[ev.request_id] = (time.monotonic() - t0, ev.finish_reason, ev.error)
    return done


def test_slow_grammar_does_not_stall_other_requests_and_times_out(tiny_model, tiny_model_dir) -> None:
    engine = build_engine(tiny_model_dir, EngineConfig(grammar_timeout_s=3.0), model=tiny_model)
    engine.add_request(GenerateRequest("warm", prompt(12, 0), SamplingParams(max_tokens=4, temperature=0.0)))
    _drive(engine, until=60.0)  # the first steps compile the CPU prefill and decode loops
    added = time.monotonic()  # the grammar's deadline runs from here
    engine.add_request(GenerateRequest("slow", prompt(12, 1), SamplingParams(max_tokens=8, constraint=SLOW)))
    engine.add_request(GenerateRequest("plain", prompt(12, 2), SamplingParams(max_tokens=4, temperature=0.0)))
    assert engine.num_waiting == 2
    lag = time.monotonic() - added  # _drive's clock starts this much later
    done = _drive(engine, until=30.0)
    plain_at, plain_reason, _ = done["plain"]
    slow_at, slow_reason, slow_error = done["slow"]
    assert plain_reason == "length" and plain_at < 2.0  # finished while the grammar compiled (~40 ms alone)
    assert slow_reason == "error" and "did not compile within 3s" in slow_error
    startup = engine.sampler.grammars.submit(SLOW).startup_s  # the compile process's start: not counted
    assert 3.0 + startup <= slow_at + lag + 0.01 and slow_at < 5.0 + startup  # 10 ms for the clocks' own reads
    assert not engine.seqs and not engine.scheduler.waiting


def test_request_starts_once_its_grammar_compiles(tiny_model, tiny_model_dir) -> None:
    engine = build_engine(tiny_model_dir, EngineConfig(), model=tiny_model)
    regex = OutputConstraint("regex", "[a-c]{3}")
    engine.add_request(GenerateRequest("r", prompt(12, 3), SamplingParams(max_tokens=8, seed=1, constraint=regex)))
    tokens: list[int] = []
    reason = None
    for _ in range(5000):
        if not engine.has_work():
            break
        for ev in engine.step():
            tokens += ev.token_ids
            reason = ev.finish_reason or reason
    assert reason == "stop" and 2 <= len(tokens) <= 4  # 3 letters (1-3 tokens) + EOS


def test_invalid_grammar_fails_the_request_only(tiny_model, tiny_model_dir) -> None:
    engine = build_engine(tiny_model_dir, EngineConfig(), model=tiny_model)
    bad = OutputConstraint("json", json.dumps({"type": "array", "uniqueItems": True}))
    engine.add_request(GenerateRequest("ok", prompt(12, 5), SamplingParams(max_tokens=3)))
    try:  # refused at once when the compile already failed, else by an error event
        engine.add_request(GenerateRequest("bad", prompt(12, 4), SamplingParams(max_tokens=8, constraint=bad)))
        refused = None
    except InvalidRequestError as exc:
        refused = str(exc)
    done = _drive(engine, until=30.0)
    error = refused if refused is not None else done["bad"][2]
    assert "uniqueItems" in error
    assert done["ok"][1] == "length"

"""A request's grammar deadline leaves out the start-up of the compile process (a fresh interpreter
and the vocabulary's compiler: seconds on a loaded host), so the first structured request after an
engine starts, or after the pool went idle, is not refused for it."""

from __future__ import annotations

import time

from deepserve.protocol import GenerateRequest, OutputConstraint, SamplingParams
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from engine.sampling.compile_pool import CompileFuture
from tests.engine.runtime.helpers import prompt


def test_future_excuses_the_child_startup_only() -> None:
    fut = CompileFuture()
    fut.dispatched = fut.submitted  # taken at once: no queueing (excused too, see test_compile_pool)
    assert fut.wait_excused(time.monotonic()) == 0.0
    fut.start_child()
    time.sleep(0.05)
    assert fut.wait_excused(time.monotonic()) >= 0.05  # still starting: all of it so far
    fut.child_started()
    done = fut.startup_s
    time.sleep(0.02)
    assert done >= 0.05 and fut.wait_excused(time.monotonic()) == done  # the compile itself counts


def test_first_constraint_compiles_under_a_deadline_shorter_than_the_startup(tiny_model, tiny_model_dir) -> None:
    # 0.2 s: well below a spawned child's start-up (its interpreter alone), above a 3-letter regex's compile
    engine = build_engine(tiny_model_dir, EngineConfig(grammar_timeout_s=0.2), model=tiny_model)
    engine.add_request(GenerateRequest("r", prompt(12, 3), SamplingParams(max_tokens=8, seed=1, constraint=OutputConstraint("regex", "[a-c]{3}"))))
    reason = error = None
    deadline = time.monotonic() + 120
    while engine.has_work() and time.monotonic() < deadline:
        for ev in engine.step():
            if ev.finished:
                reason, error = ev.finish_reason, ev.error
        time.sleep(0.005)
    assert reason == "stop", error

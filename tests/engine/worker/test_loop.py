"""EngineLoop failure containment over a real tiny EngineCore behind the reference backend (CPU, fp32).

A request whose admission raises anything fails alone; should the thread die (here: a step
that raises and an abort that raises while its requests are failed), every open request gets an
error event, ``alive`` turns False and ``on_death`` runs, so the worker can report it.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.model.loader import load_model
from deepserve.protocol import GenerateRequest, SamplingParams
from engine.runtime.builder import build_engine
from engine.backends.reference.backend import ReferenceBackend
from engine.runtime.config import EngineConfig
from engine.worker.loop import EngineLoop

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32", progress=False)


@pytest.fixture()
def core(tiny_model_dir, model):
    """One rank of the reference backend (what the worker's loop steps)."""
    return ReferenceBackend(build_engine(tiny_model_dir, EngineConfig(static_decode=False), model=model))


def _req(rid: str, n: int = 8) -> GenerateRequest:
    return GenerateRequest(rid, list(range(3, 30)), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


async def _collect(sink: asyncio.Queue) -> tuple[list[int], str | None, str | None]:
    tokens = []
    while True:
        ev = await asyncio.wait_for(sink.get(), 30)
        tokens += ev.token_ids
        if ev.finished:
            return tokens, ev.finish_reason, ev.error


def test_a_failing_admission_fails_only_its_request(core, monkeypatch) -> None:
    real_add = core.add_request

    def add(req: GenerateRequest) -> None:
        if req.request_id == "poison":
            raise TypeError("unhashable type: 'dict' (deep inside a library)")
        real_add(req)

    monkeypatch.setattr(core, "add_request", add)
    loop = EngineLoop([core], "w")

    async def main() -> None:
        loop.start()
        sinks = {rid: asyncio.Queue() for rid in ("a", "poison", "b")}
        for rid, sink in sinks.items():
            loop.submit(_req(rid), sink)
        results = {rid: await _collect(sink) for rid, sink in sinks.items()}
        assert results["poison"] == ([], "error", "the engine could not take the request")
        assert results["a"][1] == results["b"][1] == "length" and len(results["a"][0]) == 8
        assert loop.alive
        loop.stop()

    asyncio.run(main())


def test_a_dead_engine_thread_fails_open_requests_and_reports_itself(core, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    died = threading.Event()
    loop = EngineLoop([core], "w", on_death=died.set)

    async def main() -> None:
        loop.start()
        sink: asyncio.Queue = asyncio.Queue()
        loop.submit(_req("victim", 10_000), sink)
        first = await asyncio.wait_for(sink.get(), 30)  # running: now break the step and its cleanup
        assert not first.finished
        monkeypatch.setattr(core, "step", broken)
        monkeypatch.setattr(core, "abort_request", broken)
        _, reason, error = await _collect(sink)
        assert (reason, error) == ("error", "the engine stopped")
        assert died.wait(5)
        assert not loop.alive

    asyncio.run(main())


def test_stalled_means_work_but_no_turn(core) -> None:
    loop = EngineLoop([core], "w")
    assert loop.alive and not loop.stalled(0.0)  # not started, no work
    core.add_request(_req("x"))
    loop.beat -= 10
    assert loop.stalled(5.0) and not loop.stalled(60.0)

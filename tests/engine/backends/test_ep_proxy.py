"""The worker side of ``deepserve engine --ep N`` (``engine/backends/reference/ep_group.py``) over a
real pipe, the rank end played by a thread: commands go down, token events, load, KV events
(with the rank's ``dp_rank``) and hand-offs come up; a rank that went away fails the proxy; bad
flag combinations are refused before any process starts."""

from __future__ import annotations

import multiprocessing as mp
import threading
from dataclasses import replace

import pytest

from deepserve.protocol import GenerateRequest, KVEvent, RankLoad, SamplingParams, TokenEvent
from engine.backends.base import BackendContext, Handoff
from engine.backends.reference.ep_group import RankProxy, build_expert_parallel
from engine.backends.reference.ep_rank import AbortCmd, AddCmd, RankReport
from engine.errors import EngineError
from engine.runtime.config import EngineConfig, SpeculativeConfig
from kvstore.events import KVEventLog


def _rank(conn, seen: list) -> None:
    """A rank: answers an add with two token events in two reports, records the rest."""
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        seen.append(cmd)
        if isinstance(cmd, AddCmd):
            rid = cmd.request.request_id
            busy = RankLoad(dp_rank=1, running=1, waiting=0, queued_tokens=3, state_usage=0.1)
            conn.send(RankReport([TokenEvent(rid, [5])], busy, [KVEvent("stored", ["k1"], "memory", dp_rank=1)]))
            idle = RankLoad(dp_rank=1, running=0, waiting=0, queued_tokens=0, state_usage=0.0)
            conn.send(RankReport([TokenEvent(rid, [6], finish_reason="length")], idle, handoffs=[Handoff(rid, "units", ("k1",), 128, 6)]))
        elif cmd == "quit":
            conn.close()
            return


def test_rank_proxy_moves_commands_and_reports() -> None:
    mine, theirs = mp.Pipe()
    seen: list = []
    thread = threading.Thread(target=_rank, args=(theirs, seen), daemon=True)
    thread.start()
    log = KVEventLog()
    proxy = RankProxy(1, mine, thread, log)  # type: ignore[arg-type]  (a thread stands in for the process)
    assert not proxy.has_work() and proxy.load().dp_rank == 1
    proxy.add_request(GenerateRequest("r1", [3, 4, 5], SamplingParams(max_tokens=2)))
    assert proxy.has_work() and proxy.request_ids() == ["r1"]
    tokens: list[int] = []
    for _ in range(500):
        for ev in proxy.step():
            tokens += ev.token_ids
        if not proxy.has_work():
            break
    assert tokens == [5, 6]
    assert proxy.load().running == 0
    assert [(e.keys, e.dp_rank) for e in log.since(0).events] == [(["k1"], 1)]
    assert proxy.handoff("r1") == Handoff("r1", "units", ("k1",), 128, 6) and proxy.handoff("r1") is None
    assert proxy.abort_request("r1") is False  # finished: unknown
    proxy.add_request(GenerateRequest("r2", [3], SamplingParams(max_tokens=2)))
    assert proxy.abort_request("r2") is True
    mine.send("quit")
    thread.join(5)
    with pytest.raises(EngineError, match="rank 1 exited"):
        for _ in range(500):
            proxy.step()
    with pytest.raises(EngineError, match="rank 1 exited"):
        proxy.add_request(GenerateRequest("r3", [3], SamplingParams(max_tokens=1)))
    assert any(isinstance(c, AbortCmd) and c.request_id == "r2" for c in seen)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"dp": 3}, "each expert-parallel rank is one DP rank"), ({"engine": replace(EngineConfig(), speculative=SpeculativeConfig())}, "speculative")],
)
def test_ep_flag_combinations_refused_before_start(tmp_path, change, message) -> None:
    ctx = replace(BackendContext(model_dir=str(tmp_path), expert_parallel=2), **change)
    with pytest.raises(EngineError, match=message):
        build_expert_parallel(ctx, None)

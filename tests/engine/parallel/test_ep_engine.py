"""The expert-parallel engine on CPU: 2 rank processes over gloo (the ranks of ``deepserve engine
--device cpu --ep 2``) give exactly the greedy tokens of one plain engine, prompts on both ranks,
mixed lengths, a chunked prefill, late arrivals, and a rank with no requests joining every step.
Slow (two spawned processes, ~40 s on a loaded 2-core box); the worker side's protocol is in the
default suite (``tests/engine/backends/test_ep_proxy.py``)."""

from __future__ import annotations

import pytest

from engine.runtime.builder import build_engine
from tests.engine.parallel.ep_engine_ranks import CONFIG, PLAN, request, spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory, small_windows_model_dir) -> list[dict]:
    return spawn(tmp_path_factory.mktemp("ep-engine"), small_windows_model_dir)


@pytest.fixture(scope="module")
def plain_tokens(small_windows_model_dir) -> dict[str, list[int]]:
    """The one-process engine (all experts, host slot decode) on every request of the plan."""
    core = build_engine(small_windows_model_dir, CONFIG)
    vocab = core.model.config.vocab_size
    for plan in PLAN.values():
        for reqs in plan.values():
            for rid, n, _ in reqs:
                core.add_request(request(rid, n, vocab))
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for ev in core.step():
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
    return tokens


def test_ep_engine_tokens_equal_one_process(ep_run, plain_tokens) -> None:
    got = {**ep_run[0]["tokens"], **ep_run[1]["tokens"]}
    assert got == plain_tokens
    assert sorted(ep_run[1]["tokens"]) == ["m3", "m4", "m5"]  # rank 1 served its own requests
    for r in ep_run:
        assert r["local_experts"] > 0 and r["static_steps"] > 0  # experts split; decode through the EP slots


def test_ep_engine_idle_rank_keeps_the_group_stepping(ep_run, plain_tokens) -> None:
    rank0, rank1 = ep_run
    assert {k: rank0["tokens"][k] for k in ("i0", "i1")} == {k: plain_tokens[k] for k in ("i0", "i1")}
    assert rank0["idle_steps"] == rank1["idle_steps"]
    assert rank1["idle_joined_idle"] >= 6  # rank 1, with no sequence, ran every step of rank 0's

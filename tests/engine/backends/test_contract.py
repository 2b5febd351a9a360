"""The engine backend contract (engine/backends/base.py), run on every backend that runs here:
the reference engine on the tiny checkpoint and the DeepInfer adapter over the stand-in of
DeepInfer's Python surface (see conftest.py; DeepInfer itself needs SM100)."""

from __future__ import annotations

import pytest

from deepserve.protocol import GenerateRequest, RankLoad, SamplingParams, TokenEvent
from engine.backends.base import EngineBackend
from engine.errors import InvalidRequestError
from kvstore.keys import chain_keys

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(2, 302))  # 300 tokens: two whole 128-token units and a tail


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def drive(backend: EngineBackend, steps: int = 400) -> dict[str, list[TokenEvent]]:
    """Step until the backend has no work; every request's events in order."""
    events: dict[str, list[TokenEvent]] = {}
    for _ in range(steps):
        for ev in backend.step():
            events.setdefault(ev.request_id, []).append(ev)
        if not backend.has_work():
            return events
    raise AssertionError("the backend kept having work")


def tokens(events: list[TokenEvent]) -> list[int]:
    return [t for ev in events for t in ev.token_ids]


def test_a_request_streams_its_tokens_and_finishes_once_with_its_counts(make) -> None:
    b = make("mixed").backend
    b.add_request(GenerateRequest("a", PROMPT[:40], greedy(5)))
    assert b.has_work() and b.request_ids() == ["a"]
    evs = drive(b)["a"]
    assert len(tokens(evs)) == 5 and all(len(ev.token_ids) <= 1 for ev in evs)
    assert [ev.finish_reason for ev in evs if ev.finished] == ["length"] and evs[-1].finished
    first = next(ev for ev in evs if ev.token_ids)
    assert first.num_prompt_tokens == evs[-1].num_prompt_tokens == 40
    assert first.num_cached_tokens == evs[-1].num_cached_tokens == 0
    assert b.request_ids() == [] and not b.has_work()


def test_requests_are_independent_of_their_batch(make) -> None:
    alone = make("mixed").backend
    alone.add_request(GenerateRequest("x", PROMPT[:50], greedy(4)))
    expect = tokens(drive(alone)["x"])
    b = make("mixed").backend
    b.add_request(GenerateRequest("x", PROMPT[:50], greedy(4)))
    b.add_request(GenerateRequest("y", PROMPT[10:90], greedy(6)))
    got = drive(b)
    assert tokens(got["x"]) == expect and len(tokens(got["y"])) == 6


def test_abort_ends_a_running_request_with_no_token_after_it(make) -> None:
    b = make("mixed").backend
    b.add_request(GenerateRequest("long", PROMPT[:30], greedy(200)))
    seen: list[TokenEvent] = []
    while not any(ev.token_ids for ev in seen):
        seen += b.step()
    assert b.abort_request("long") is True
    assert b.abort_request("long") is False  # unknown now
    rest = drive(b).get("long", [])
    assert [ev.finish_reason for ev in rest] == ["abort"] and not tokens(rest)
    assert rest[0].num_prompt_tokens == 30 and not b.has_work()


def test_abort_before_any_step(make) -> None:
    b = make("mixed").backend
    b.add_request(GenerateRequest("q", PROMPT[:30], greedy(3)))
    assert b.abort_request("q")
    assert [(ev.finish_reason, ev.token_ids) for ev in drive(b)["q"]] == [("abort", [])]


def test_bad_requests_are_refused_at_add(make) -> None:
    b = make("mixed").backend
    b.add_request(GenerateRequest("dup", PROMPT[:10], greedy(2)))
    with pytest.raises(InvalidRequestError):
        b.add_request(GenerateRequest("dup", PROMPT[:10], greedy(2)))
    with pytest.raises(InvalidRequestError):
        b.add_request(GenerateRequest("empty", [], greedy(2)))
    with pytest.raises(InvalidRequestError):
        b.add_request(GenerateRequest("huge", PROMPT[:10], greedy(1_000_000)))


def test_a_prefill_stores_its_units_and_a_repeat_reports_them_cached(make) -> None:
    made = make("mixed")
    b = made.backend
    b.add_request(GenerateRequest("one", PROMPT, greedy(4)))
    first = drive(b)["one"]
    keys = chain_keys(PROMPT, 128, made.fingerprint)[:2]
    batch = made.store.events.since(0)
    stored = {k for ev in batch.events if ev.kind == "stored" and ev.dp_rank == 0 for k in ev.keys}
    assert set(keys) <= stored  # the KV events the router polls name the prompt's units
    b.add_request(GenerateRequest("two", PROMPT, greedy(4)))
    again = drive(b)["two"]
    assert tokens(again) == tokens(first)  # resumed from the store, the same continuation
    assert again[-1].num_cached_tokens == 256 and again[-1].num_prompt_tokens == 300
    assert next(ev for ev in again if ev.token_ids).num_cached_tokens == 256


def test_a_prefill_only_request_leaves_a_handoff(make) -> None:
    made = make("prefill")
    b = made.backend
    b.add_request(GenerateRequest("p", PROMPT, greedy(8), prefill_only=True))
    evs = drive(b)["p"]
    assert tokens(evs) == [evs[-1].token_ids[-1]] and evs[-1].finish_reason == "length"
    h = b.handoff("p")
    assert h is not None and h.request_id == "p" and h.first_token == evs[-1].token_ids[-1]
    assert 0 < h.num_tokens <= len(PROMPT) and h.keys
    assert all(made.store.contains(k) for k in h.keys)
    assert b.handoff("p") is None  # taken once


def test_the_load_report_counts_the_rank(make) -> None:
    b = make("mixed").backend
    idle = b.load()
    assert isinstance(idle, RankLoad) and idle.dp_rank == 0 and idle.running == idle.waiting == 0
    b.add_request(GenerateRequest("r", PROMPT[:20], greedy(50)))
    while not any(ev.token_ids for ev in b.step()):
        pass
    busy = b.load()
    assert busy.running == 1 and busy.waiting == 0 and 0.0 <= busy.state_usage <= 1.0
    drive(b)
    b.step()
    assert b.load().running == 0

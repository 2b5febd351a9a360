"""The DeepInfer adapter over the stand-in of DeepInfer's Python surface (deepinfer_standin.py —
a stand-in, not DeepInfer, which needs SM100): the prefill→decode hand-off between a PROMPT and a
COMPLETION engine, prefix hits across engines sharing a store, the zero-overhead-scheduling lag,
abort with a token in flight, and what the hooks report."""

from __future__ import annotations

import pytest
import torch

from deepserve.protocol import GenerateRequest, SamplingParams, TokenEvent
from engine.backends.base import BackendContext
from engine.backends.deepinfer.records import handoff_key
from engine.backends.registry import build_backend
from engine.errors import EngineError, InvalidRequestError
from kvstore import KVStoreConfig, build_store
from kvstore.store import TieredStore
from tests.engine.backends.conftest import make_standin

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(2, 302))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(backend, *reqs: GenerateRequest) -> dict[str, list[TokenEvent]]:
    for r in reqs:
        backend.add_request(r)
    out: dict[str, list[TokenEvent]] = {}
    for _ in range(400):
        for ev in backend.step():
            out.setdefault(ev.request_id, []).append(ev)
        if not backend.has_work():
            return out
    raise AssertionError("still working")


def tokens(evs: list[TokenEvent]) -> list[int]:
    return [t for ev in evs for t in ev.token_ids]


@pytest.fixture()
def store() -> TieredStore:
    return build_store(KVStoreConfig(tiers=("memory",)))


def colocated(n: int = 8, prompt: list[int] = PROMPT) -> list[int]:
    return tokens(run(make_standin("mixed", build_store(KVStoreConfig(tiers=("memory",)))).backend, GenerateRequest("c", prompt, greedy(n)))["c"])


@pytest.mark.parametrize("length", [300, 256, 5])
def test_prefill_then_decode_equals_one_mixed_engine(store, length: int) -> None:
    prompt = PROMPT[:length]
    prefill = make_standin("prefill", store).backend
    first = run(prefill, GenerateRequest("r", prompt, greedy(8), prefill_only=True))["r"]
    assert first[-1].finish_reason == "length" and len(tokens(first)) == 1
    handoff = prefill.handoff("r")
    assert handoff.kind == "record" and handoff.num_tokens == length
    decode = make_standin("decode", store).backend
    rest = run(decode, GenerateRequest("r", prompt, greedy(8), output_token_ids=tokens(first)))["r"]
    assert tokens(first) + tokens(rest) == colocated(8, prompt)  # every byte of the hand-off arrived
    assert rest[-1].finish_reason == "length" and rest[-1].num_prompt_tokens == length


def test_a_damaged_handoff_changes_the_continuation(store) -> None:
    """The check above is sensitive: one byte of the dropped (YOCO consumer) windows altered."""
    prefill = make_standin("prefill", store).backend
    first = tokens(run(prefill, GenerateRequest("r", PROMPT, greedy(8), prefill_only=True))["r"])
    key = prefill.handoff("r").keys[-1]
    record = store.get(key)
    state = record.tensors["state"].clone()
    layout = prefill.hooks.bridge.layout
    state[layout.swa_stored_layers * 134 * 528 + 528 * (299 % 134) + 9] ^= 1  # a consumer layer's row of token 299
    store.remove(key)  # the store never overwrites a key in place
    store.put(key, record.header, {"state": state, "blocks": record.tensors["blocks"]})
    decode = make_standin("decode", store).backend
    rest = tokens(run(decode, GenerateRequest("r", PROMPT, greedy(8), output_token_ids=first))["r"])
    assert first + rest != colocated(8)


def test_a_decode_engine_without_a_handoff_fails_the_request(store) -> None:
    decode = make_standin("decode", store).backend
    with pytest.raises(EngineError, match="no prefill hand-off record"):
        decode.add_request(GenerateRequest("x", PROMPT, greedy(4), output_token_ids=[7]))
    with pytest.raises(InvalidRequestError):
        decode.add_request(GenerateRequest("y", PROMPT, greedy(4)))  # a decode stage brings its first token


def test_roles_take_only_their_stage(store) -> None:
    with pytest.raises(InvalidRequestError):
        make_standin("prefill", store).backend.add_request(GenerateRequest("a", PROMPT, greedy(4)))
    with pytest.raises(InvalidRequestError):
        make_standin("mixed", store).backend.add_request(GenerateRequest("b", PROMPT, greedy(4), prefill_only=True))


def test_unsupported_sampling_is_refused_at_add(store) -> None:
    b = make_standin("mixed", store).backend
    with pytest.raises(InvalidRequestError, match="min_p, repetition_penalty"):
        b.add_request(GenerateRequest("s", PROMPT, SamplingParams(min_p=0.1, repetition_penalty=1.2)))
    assert not b.has_work()


def test_a_prefix_stored_by_one_engine_is_a_hit_on_another(store) -> None:
    expect = colocated(6)
    run(make_standin("mixed", store).backend, GenerateRequest("a", PROMPT, greedy(2)))
    other = make_standin("mixed", store, dp_rank=1).backend
    evs = run(other, GenerateRequest("b", PROMPT + [], greedy(6)))["b"]
    assert tokens(evs) == expect and evs[-1].num_cached_tokens == 256
    assert other.hooks.bridge.counts["prefix_hits"] == 1
    longer = PROMPT + [9, 8, 7] * 50  # 450 tokens: the 2 stored units hit, the rest is computed
    evs = run(other, GenerateRequest("c", longer, greedy(4)))["c"]
    assert evs[-1].num_cached_tokens == 256 and tokens(evs) == colocated(4, longer)


def test_decode_snapshots_are_stored_at_unit_boundaries(store) -> None:
    b = make_standin("mixed", store).backend
    run(b, GenerateRequest("d", PROMPT[:200], greedy(70)))  # decode crosses token 256
    assert b.hooks.bridge.counts["snapshots"] == 2  # prompt end (128) and the decode boundary (256)
    hit = make_standin("mixed", store).backend
    prompt = PROMPT[:200] + [5] * 80
    evs = run(hit, GenerateRequest("e", prompt, greedy(3)))["e"]
    assert evs[-1].num_cached_tokens in (128, 256)


def test_zero_overhead_scheduling_lags_one_step_and_flushes(store) -> None:
    b = make_standin("mixed", store).backend
    b.add_request(GenerateRequest("z", PROMPT[:40], greedy(2)))
    assert b.step() == []  # the prompt step's token comes back with the next step
    second = b.step()
    assert [ev.token_ids for ev in second] and second[0].num_prompt_tokens == 40
    rest = [ev for _ in range(3) for ev in b.step()]
    assert [ev.finish_reason for ev in rest if ev.finished] == ["length"] and not b.has_work()


def test_a_token_in_flight_after_abort_is_dropped(store) -> None:
    b = make_standin("mixed", store).backend
    b.add_request(GenerateRequest("a", PROMPT[:40], greedy(100)))
    b.step()
    b.step()  # one token delivered, the next one in flight
    assert b.abort_request("a")
    after = [ev for _ in range(3) for ev in b.step()]
    assert [(ev.finish_reason, ev.token_ids) for ev in after] == [("abort", [])]


def test_the_hooks_report_into_deepinfers_log_and_load(store) -> None:
    b = make_standin("prefill", store).backend
    run(b, GenerateRequest("p", PROMPT, greedy(3), prefill_only=True))
    line = b.engine.build_extra_metrics_log()
    assert "handoffs_sent=1" in line and "snapshots=1" in line and "units=2" in line
    assert b.engine.scheduler.running == [] and len(b.engine.scheduler.free_states) == 6  # shipped and freed
    assert b.load().running == 0 and b.engine.get_num_pendings() == 0
    assert store.contains(handoff_key(b.hooks.bridge.fingerprint, "p"))


def test_the_deepinfer_factory_needs_deepinfer(tiny_model_dir) -> None:
    """Here DeepInfer cannot be imported: the registry's factory says so (and imported nothing)."""
    with pytest.raises(EngineError, match="needs DeepInfer"):
        build_backend("deepinfer", BackendContext(model_dir=str(tiny_model_dir)), registry=None)
    with pytest.raises(EngineError, match="--dp-rank"):
        build_backend("deepinfer", BackendContext(model_dir=str(tiny_model_dir), dp=8), registry=None)
    with pytest.raises(EngineError, match="unknown engine backend"):
        build_backend("vllm", BackendContext(model_dir=str(tiny_model_dir)), registry=None)
    assert isinstance(torch.__version__, str)

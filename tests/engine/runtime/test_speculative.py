"""Speculative decoding through the engine: greedy output is token for token the output without it."""

from __future__ import annotations

from functools import partial

import pytest
from prometheus_client import CollectorRegistry

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.errors import CheckpointError
from engine.model.loader import load_model
from engine.model.tiny_mtp import TrainConfig, sentence
from engine.runtime.config import SpeculativeConfig

from helpers import (
    check_kv_resume_stays_exact, check_opted_out_never_drafted, check_preemption_resumes_exactly, check_seeded_sampling, prompt, run,
    spec_counts, spec_engine,
)


@pytest.fixture(scope="module")
def trained(trained_mtp_model_dir):
    return trained_mtp_model_dir, load_model(trained_mtp_model_dir, dtype="float32", progress=False)


def _engine(ckpt, model, k: int | None, **kw):
    """An engine (speculative with ``k`` MTP drafts, or not) and the registry of its metrics."""
    return spec_engine(ckpt, model, None if k is None else SpeculativeConfig("mtp", k), **kw)


def _counts(reg: CollectorRegistry) -> dict[str, float]:
    return spec_counts(reg, 4)


def _requests(lang: TrainConfig) -> list[GenerateRequest]:
    """Mixed lengths, inside the language and in random tokens (the trained model's continuation
    enters the language after one token); 100 + 40 and 240 + 40 tokens cross the 128-token units
    (an HCA window closes inside a verify)."""
    prompts = [sentence(lang, 1003, 3), prompt(100, 1), prompt(230, 2) + sentence(lang, 1040, 10), prompt(7, 3)]
    return [GenerateRequest(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]


def test_greedy_tokens_equal_without_speculation_k_1_2_3(trained) -> None:
    ckpt, model = trained
    lang = TrainConfig()
    base = run(_engine(ckpt, model, None)[0], _requests(lang))
    for k in (1, 2, 3):
        engine, reg = _engine(ckpt, model, k)
        out = run(engine, _requests(lang))
        assert {r: (o.tokens, o.finish_reason) for r, o in out.items()} == {r: (o.tokens, o.finish_reason) for r, o in base.items()}, k
        c = _counts(reg)
        assert c["num_draft_tokens"] <= k * c["num_drafts"] and c["per_pos"] == c["num_accepted_tokens"]
        assert c["num_accepted_tokens"] > 0.5 * c["num_draft_tokens"] > 0, c  # acceptance well above zero
        assert engine.static is not None and engine.static.steps > 0  # decoding sequences verify in the host slots


@pytest.mark.parametrize(("ckpt_fixture", "lengths"), [
    ("small_windows_model_dir", (5, 17, 30)),
    pytest.param("tiny_model_dir", (120,), marks=pytest.mark.slow),
])
def test_random_mtp_rejects_and_stays_exact_across_windows(request: pytest.FixtureRequest, ckpt_fixture: str, lengths: tuple[int, ...]) -> None:
    """An untrained MTP layer: rejections everywhere, so rewinds cross every kind of window close
    (window 16, CSA 4, HCA 8; and the 128-token HCA units of the default tiny model)."""
    ckpt = request.getfixturevalue(ckpt_fixture)
    model = load_model(ckpt, dtype="float32", progress=False)
    reqs = lambda: [GenerateRequest(f"s{n}", prompt(n, n), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for n in lengths]  # noqa: E731
    base = run(_engine(ckpt, model, None)[0], reqs())
    engine, reg = _engine(ckpt, model, 3)
    out = run(engine, reqs())
    assert {r: o.tokens for r, o in out.items()} == {r: o.tokens for r, o in base.items()}
    c = _counts(reg)
    assert c["num_drafts"] > 0 and c["num_accepted_tokens"] < c["num_draft_tokens"]
    assert engine.static is not None and engine.static.steps > 0  # the rewinds ran in the host slots


def test_stop_rules_apply_per_accepted_token_and_budget_limits_drafts(trained) -> None:
    ckpt, model = trained
    lang = TrainConfig()
    text = sentence(lang, 1010, 20)
    stop_at = text[12]  # reached inside an accepted run
    reqs = lambda: [  # noqa: E731
        GenerateRequest("stop", text[:4], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop_at,))),
        GenerateRequest("len", text[:4], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)),
    ]
    base = run(_engine(ckpt, model, None)[0], reqs())
    assert base["stop"].tokens == text[4:13] and base["stop"].finish_reason == "stop" and len(base["len"].tokens) == 7
    for budget in (2048, 3):  # 3: two decoding sequences share 3 tokens a step, drafts cut to fit
        engine, reg = _engine(ckpt, model, 3, max_num_batched_tokens=budget)
        out = run(engine, reqs())
        assert {r: (o.tokens, o.finish_reason) for r, o in out.items()} == {r: (o.tokens, o.finish_reason) for r, o in base.items()}
        assert _counts(reg)["num_accepted_tokens"] > 0


@pytest.mark.parametrize("temperature", [1.0, 8.0])
def test_sampled_requests_give_the_plain_samplers_tokens_for_every_seed(trained, temperature: float) -> None:
    ckpt, model = trained
    check_seeded_sampling(partial(_engine, ckpt, model), sentence(TrainConfig(), 1020, 6), temperature, seeds=12, k=3, positions=3, distinct=6)


def test_opted_out_requests_are_never_drafted(trained) -> None:
    ckpt, model = trained
    check_opted_out_never_drafted(partial(_engine, ckpt, model), sentence(TrainConfig(), 1020, 6), k=2)


def test_speculative_config_is_validated(trained, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="only 'mtp'"):
        SpeculativeConfig("eagle", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_json('{"method": "mtp", "num_speculative_tokens": 0}')
    assert SpeculativeConfig.from_json('{"method": "mtp", "num_speculative_tokens": 3}') == SpeculativeConfig("mtp", 3)
    ckpt, model = trained
    monkeypatch.setattr(model, "mtp", {})  # restored after the test: the model is the module's
    with pytest.raises(CheckpointError, match="no MTP layer"):
        _engine(ckpt, model, 2)


def test_kv_store_resume_mid_conversation_stays_exact(trained) -> None:
    ckpt, model = trained
    check_kv_resume_stays_exact(partial(_engine, ckpt, model), model, k=3, acceptance=0.5)


@pytest.mark.slow  # the grammar's compile is most of it
def test_structured_output_with_speculation_gives_the_plain_tokens(trained) -> None:
    """A grammar advances per accepted token (a draft it forbids is just rejected)."""
    from deepserve.protocol import OutputConstraint

    ckpt, model = trained
    constraint = OutputConstraint("regex", r"(yes|no)-[a-c]{3,6}")
    reqs = lambda: [  # noqa: E731
        GenerateRequest(f"g{s}", sentence(TrainConfig(), 1000 + s, 6), SamplingParams(max_tokens=16, temperature=1.0, seed=s, constraint=constraint))
        for s in range(4)
    ]
    base = run(_engine(ckpt, model, None)[0], reqs())
    engine, reg = _engine(ckpt, model, 2)
    out = run(engine, reqs())
    assert {r: (o.tokens, o.finish_reason) for r, o in out.items()} == {r: (o.tokens, o.finish_reason) for r, o in base.items()}
    assert all(o.finish_reason == "stop" for o in out.values()) and _counts(reg)["num_drafts"] > 0


def test_preempted_speculative_sequences_resume_exactly(trained) -> None:
    ckpt, model = trained
    check_preemption_resumes_exactly(partial(_engine, ckpt, model), model, k=3)


def test_no_draft_is_fed_past_max_tokens(trained) -> None:
    """7 tokens at k = 3: the prefill's token, a verify of 3 drafts (4 tokens), then room for 2
    tokens only, so 1 draft — 4 drafts in all, not 6."""
    ckpt, model = trained
    engine, reg = _engine(ckpt, model, 3)
    out = run(engine, [GenerateRequest("m", sentence(TrainConfig(), 1030, 5), SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))])
    assert len(out["m"].tokens) == 7 and _counts(reg)["num_draft_tokens"] == 4

"""``logit_bias`` and ``min_tokens`` in the sampler (CPU, no grammar), and their wire form."""

from __future__ import annotations

import pytest
import torch

from deepserve.protocol import SamplingParams
from engine.sampling import Sampler, SamplerConfig
from engine.sampling.sampler import DeviceLogits

V = 256
EOS = 7


def sampler() -> Sampler:
    return Sampler(SamplerConfig(V, (EOS,), seed=0))


def test_positive_bias_makes_a_token_win_greedy_and_random():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    s = sampler()
    states = [
        s.new_state(SamplingParams(temperature=0.0, logit_bias=((42, 100.0),)), [1]),
        s.new_state(SamplingParams(temperature=1.0, seed=3, logit_bias=((42, 100.0),)), [1]),
    ]
    assert s.sample(logits, states).token_ids.tolist() == [42, 42]


def test_negative_bias_bans_the_argmax_and_touches_only_its_row():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(-1).tolist()
    s = sampler()
    states = [
        s.new_state(SamplingParams(temperature=0.0, logit_bias=((best[0], -100.0),)), [1]),
        s.new_state(SamplingParams(temperature=0.0), [1]),
    ]
    out = s.sample(logits.clone(), states).token_ids.tolist()
    assert out[0] != best[0] and out[0] == logits[0].topk(2).indices[1].item()
    assert out[1] == best[1]


def test_min_tokens_holds_eos_and_stop_ids_back_then_lets_them_end():
    s = sampler()
    st = s.new_state(SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, stop_token_ids=(9,)), [1])
    reasons, tokens = [], []
    for _ in range(4):
        logits = torch.zeros(1, V)
        logits[0, EOS], logits[0, 9], logits[0, 50] = 10.0, 9.0, 1.0
        out = s.sample(logits, [st])
        tokens.append(out.token_ids.item())
        reasons.append(out.finish_reasons[0])
    assert tokens == [50, 50, 50, EOS] and reasons == [None, None, None, "stop"]


def test_min_tokens_counts_resumed_output():
    s = sampler()
    st = s.new_state(SamplingParams(temperature=0.0, max_tokens=10, min_tokens=2), [1], output_token_ids=[50, 51])
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    assert s.sample(logits, [st]).finish_reasons == ["stop"]


def test_rules_disable_the_plain_greedy_shortcut():
    """A source's argmax cannot see a bias: such rows must get their logits made."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(4))
    s = sampler()
    st = s.new_state(SamplingParams(temperature=0.0, logit_bias=((5, 100.0),)), [1])
    assert not st.plain_greedy
    assert s.sample(DeviceLogits(logits), [st]).token_ids.tolist() == [5]


def test_wire_round_trip_and_validation():
    p = SamplingParams(max_tokens=8, min_tokens=2, logit_bias=[[3, 1.5], (4, -2)])  # lists, as JSON gives them
    assert p.logit_bias == ((3, 1.5), (4, -2.0))
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)

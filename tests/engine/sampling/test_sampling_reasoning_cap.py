"""The reasoning cap in the sampler: ``reasoning_end_id`` forced once ``max_reasoning_tokens``
output tokens are out with the reasoning still open; never when it closed by itself."""

from __future__ import annotations

import pytest
import torch

from deepserve.protocol import SamplingParams
from engine.sampling import Sampler, SamplerConfig
from engine.sampling.sampler import DeviceLogits

V = 256
EOS, END = 7, 9  # END: the thinking-end token


def _run(params: SamplingParams, steps: int, favour: int = 50, resumed: tuple[int, ...] = ()) -> list[int]:
    """Tokens of ``steps`` samples whose logits always favour ``favour`` (END is unlikely)."""
    s = Sampler(SamplerConfig(V, (EOS,), seed=0))
    st = s.new_state(params, [1], output_token_ids=resumed)
    out = []
    for _ in range(steps):
        logits = torch.randn(1, V, generator=torch.Generator().manual_seed(len(out)))
        logits[0, END] = -20.0
        logits[0, favour] = 20.0
        out.append(s.sample(DeviceLogits(logits), [st]).token_ids.item())
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_end_token_is_forced_at_the_cap_then_sampling_is_free(temperature: float) -> None:
    p = SamplingParams(max_tokens=20, temperature=temperature, seed=1, max_reasoning_tokens=3, reasoning_end_id=END)
    out = _run(p, 6)
    assert out[:3] == [50, 50, 50] and out[3] == END and out[4:] == [50, 50]


def test_a_reasoning_that_ended_by_itself_is_not_forced_again() -> None:
    p = SamplingParams(max_tokens=20, temperature=0.0, max_reasoning_tokens=2, reasoning_end_id=END)
    assert _run(p, 4, favour=END)[0] == END  # closed at step 0
    assert END not in _run(p, 3, resumed=(END, 50, 51))  # resumed after it closed: free


def test_without_a_cap_nothing_is_forced_and_the_fields_go_together() -> None:
    assert END not in _run(SamplingParams(max_tokens=20, temperature=0.0), 6)
    with pytest.raises(ValueError):
        SamplingParams(max_reasoning_tokens=3)
    assert SamplingParams.from_dict(SamplingParams(max_reasoning_tokens=3, reasoning_end_id=END).to_dict()).max_reasoning_tokens == 3

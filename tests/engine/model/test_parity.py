"""Parity with transformers' DeepseekV4ForCausalLM (fp32, CPU): same checkpoint, same logits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.model.hf_cache import from_dynamic_cache, to_dynamic_cache  # noqa: E402
from engine.model.loader import load_model  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module", params=["tiny_model_dir", "small_windows_model_dir"])
def pair(request: pytest.FixtureRequest):
    model_dir = request.getfixturevalue(request.param)
    ours = load_model(model_dir, dtype="float32", progress=False)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return ours, hf


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 129280, (n,), generator=g).tolist()


def _hf_logits(hf, ids: list[int], cache=None) -> torch.Tensor:
    with torch.no_grad():
        out = hf(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return out.logits[0].float()


def test_one_shot_prefill(pair) -> None:
    ours, hf = pair
    ids = _ids(300, 1)
    got = ours([(ours.new_state(), ids)], logits="all")
    assert (got - _hf_logits(hf, ids)).abs().max().item() <= TOL


def test_prefill_split_mid_window(pair) -> None:
    ours, hf = pair
    ids = _ids(290, 2)
    ref = _hf_logits(hf, ids)
    st = ours.new_state()
    parts = [ours([(st, ids[a:b])], logits="all") for a, b in ((0, 37), (37, 133), (133, 134), (134, 290))]
    assert (torch.cat(parts) - ref).abs().max().item() <= TOL


def test_decode_300_steps_crosses_boundaries(pair) -> None:
    """Greedy-free check: feed fixed tokens one by one, comparing each step to transformers' cache."""
    ours, hf = pair
    ids = _ids(340, 3)
    st = ours.new_state()
    cache = transformers.DynamicCache(config=hf.config)
    worst = (ours([(st, ids[:30])]) - _hf_logits(hf, ids[:30], cache)[-1:]).abs().max().item()
    for t in range(30, 340):
        a = ours([(st, ids[t : t + 1])])[0]
        b = _hf_logits(hf, ids[t : t + 1], cache)[-1]
        worst = max(worst, (a - b).abs().max().item())
    assert worst <= TOL


def test_mixed_length_batch_matches_single(pair) -> None:
    ours, hf = pair
    prompts = [_ids(n, 10 + n) for n in (5, 130, 47, 260)]
    states = [ours.new_state() for _ in prompts]
    batched = ours(list(zip(states, prompts)))  # (4, V) last-token logits
    for i, p in enumerate(prompts):
        assert (batched[i] - _hf_logits(hf, p)[-1]).abs().max().item() <= TOL
    # then a decode step of all four together, each at its own position
    nxt = [[int(batched[i].argmax())] for i in range(len(prompts))]
    step = ours(list(zip(states, nxt)))
    for i, p in enumerate(prompts):
        assert (step[i] - _hf_logits(hf, p + nxt[i])[-1]).abs().max().item() <= TOL


def test_state_export_import_dynamic_cache(pair) -> None:
    ours, hf = pair
    ids = _ids(203, 4)
    cont = _ids(25, 5)
    ref = _hf_logits(hf, ids + cont)[len(ids) :]
    # ours -> transformers
    st = ours.new_state()
    ours([(st, ids)])
    cache = to_dynamic_cache(ours, st, hf.config)
    assert (_hf_logits(hf, cont, cache) - ref).abs().max().item() <= TOL
    # transformers -> ours
    cache = transformers.DynamicCache(config=hf.config)
    _hf_logits(hf, ids, cache)
    st2 = from_dynamic_cache(ours, cache, ids)
    assert (ours([(st2, cont)], logits="all") - ref).abs().max().item() <= TOL

"""V4.1 verify + rewind: feeding ``t, d1..dk`` then rewinding to the accepted prefix leaves the state
(and the next logits) of feeding only the accepted tokens — across a compressor group closing, a
128-token unit boundary and the engram history."""

from __future__ import annotations

import pytest
import torch

from engine.model.v41.config import V41Config
from engine.model.v41.loader import load_v41_model, to_internal_name
from engine.model.v41.model import DeepseekV41ForCausalLM
from engine.model.v41.rewind import mark, rewind
from engine.model.v41.state import V41SequenceState
from engine.model.v41.tiny import TINY_V41, random_v41_state_dict

from tests.engine.model.v41.conftest import fixture_case


@pytest.fixture(scope="module")
def tiny() -> DeepseekV41ForCausalLM:
    model = DeepseekV41ForCausalLM(V41Config.from_dict(TINY_V41), torch.float32)
    model.load_state_dict({to_internal_name(k): v for k, v in random_v41_state_dict(model, 0).items()})
    return model.eval()


@pytest.fixture(scope="module")
def engram() -> DeepseekV41ForCausalLM:
    ckpt, _ = fixture_case("engram")
    return load_v41_model(ckpt, dtype="float32")


def assert_same(a: V41SequenceState, b: V41SequenceState) -> None:
    assert (a.num_tokens, a.token_ids, a.engram, a.decoder_from) == (b.num_tokens, b.token_ids, b.engram, b.decoder_from)
    assert len(a.windows) == len(b.windows) and all(torch.equal(x, y) for x, y in zip(a.windows, b.windows))
    assert a.sources.keys() == b.sources.keys()
    for i, s in a.sources.items():
        t = b.sources[i]
        assert torch.equal(s.rows, t.rows) and torch.equal(s.buf_kv, t.buf_kv) and torch.equal(s.buf_gate, t.buf_gate), i
        assert (s.keys is None) == (t.keys is None) and (s.keys is None or torch.equal(s.keys, t.keys)), i


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(("model_name", "prompt_len", "fed", "keep"), [
    ("tiny", 125, 6, 0),  # the whole verify rejected (t itself is always kept by the caller; 0 is the bound)
    ("tiny", 125, 6, 2),  # stops before the 128 boundary, rejected tokens cross it
    ("tiny", 125, 6, 4),  # crosses the 128-token unit, closes a ratio-2 group, leaves the next one open
    ("tiny", 126, 5, 3),  # lands exactly on the boundary
    ("tiny", 30, 4, 4),  # all kept: nothing to undo
    ("engram", 20, 5, 2),  # the engram n-gram history follows the kept tokens
    ("engram", 21, 4, 1),
])  # fmt: skip
def test_rewind_equals_feeding_only_the_accepted_tokens(request, model_name: str, prompt_len: int, fed: int, keep: int) -> None:
    model = request.getfixturevalue(model_name)
    vocab = 40 if model_name == "engram" else 2000
    ids = _prompt(prompt_len + fed, prompt_len, vocab)
    prompt, verify = ids[:prompt_len], ids[prompt_len:]
    state = model.new_state()
    model([(state, prompt)])
    ref = state.clone()
    m = mark(state)
    rows = model([(state, verify)], logits="taps")  # the verify forward the speculative step runs
    assert rows.shape == (fed, 1 + len(model.config.dspark_target_layer_ids), model.config.hidden_size)
    rewind(model, state, m, keep)
    if keep:
        model([(ref, verify[:keep])])
    assert_same(state, ref)
    nxt = [7]
    assert torch.equal(model([(state, nxt)]), model([(ref, nxt)]))


def test_taps_rows_are_the_hidden_states_of_every_token(tiny: DeepseekV41ForCausalLM) -> None:
    """Column 0 of a ``"taps"`` forward is ``"hidden_all"``'s row, the others each target layer's
    mean input stream (a hook on the layer sees the same)."""
    ids = _prompt(20, 1, 2000)
    seen: dict[int, torch.Tensor] = {}
    hooks = [tiny.model.layers[i].register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0].mean(dim=1)))
             for i in tiny.config.dspark_target_layer_ids]  # fmt: skip
    try:
        rows = tiny([(tiny.new_state(), ids)], logits="taps")
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(rows[:, 0], tiny([(tiny.new_state(), ids)], logits="hidden_all"))
    for j, i in enumerate(tiny.config.dspark_target_layer_ids):
        torch.testing.assert_close(rows[:, j + 1], seen[i], rtol=0, atol=1e-6)

"""``engine/model/rewind.py``: a rewound state equals the state that only ever saw the kept tokens."""

from __future__ import annotations

import pytest
import torch

from engine.model.loader import load_model
from engine.model.rewind import mark, rewind
from engine.model.state import SequenceState


@pytest.fixture(scope="module")
def small_windows(small_windows_model_dir):
    """CSA rate 4, HCA rate 8, window 16: a short run closes every kind of window."""
    return load_model(small_windows_model_dir, progress=False)


def _assert_same(a: SequenceState, b: SequenceState) -> None:
    assert (a.num_tokens, a.token_ids) == (b.num_tokens, b.token_ids)
    for la, lb in zip(a.layers, b.layers):
        assert la.swa.shape == lb.swa.shape
        torch.testing.assert_close(la.swa, lb.swa, rtol=1e-4, atol=1e-4)
        for ca, cb in ((la.comp, lb.comp), (la.index, lb.index)):
            if ca is None:
                assert cb is None
                continue
            for name in ("rows", "buf_kv", "buf_gate", "overlap_kv", "overlap_gate"):
                ta, tb = getattr(ca, name), getattr(cb, name)
                assert (ta is None) == (tb is None), name
                if ta is not None:
                    torch.testing.assert_close(ta, tb, rtol=1e-4, atol=1e-4, msg=name)
            assert ca.windows == cb.windows and ca.journal is None


@pytest.mark.parametrize("prompt_len", [6, 13, 30])
def test_rewind_matches_feeding_only_the_kept_tokens(small_windows, prompt_len: int) -> None:
    model = small_windows
    gen = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(2, 5000, (prompt_len + 4,), generator=gen).tolist()
    prompt, run = ids[:prompt_len], ids[prompt_len:]
    for keep in range(len(run) + 1):
        spec = model.new_state()
        model([(spec, prompt)])
        m = mark(spec)
        model([(spec, run)], logits="all")
        rewind(model, spec, m, keep)
        plain = model.new_state()
        model([(plain, prompt)])
        if keep:
            model([(plain, run[:keep])])
        _assert_same(spec, plain)
        nxt = [ids[0]]  # the next step's logits agree too
        torch.testing.assert_close(model([(spec, nxt)]), model([(plain, nxt)]), rtol=1e-4, atol=1e-3)

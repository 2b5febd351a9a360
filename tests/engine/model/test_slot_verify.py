"""Verify steps in the slot decoders: ``1 + k`` tokens per slot in one step, then ``accept``.

Against plain one-token steps of a second decoder holding the same states: every kept offset's
hidden state is the plain step's at that position, and after each ``accept`` (kept counts drawn at
random, rejected offsets fed wrong tokens) the exported state is the one the kept tokens alone
leave; on the small-windows checkpoint (window 16, CSA 4, HCA 8) the runs cross every kind of
window close, including closes by rejected offsets.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.model.host_decode import HostDecoder
from engine.model.loader import load_model
from engine.model.static_decode import StaticDecoder
from tests.engine.model.test_static_decode import assert_states_close, prefilled

LENGTHS = [1, 3, 6, 15, 16, 30]


@pytest.fixture(scope="module")
def small(small_windows_model_dir):
    return load_model(small_windows_model_dir, dtype="float32", progress=False)


def _pair(model, kind: str, width: int, max_tokens: int) -> tuple[StaticDecoder, StaticDecoder]:
    make = {
        "host": lambda w: HostDecoder(model, 8, max_tokens, verify_width=w),
        "host-eager": lambda w: HostDecoder(model, 8, max_tokens, compiled=False, verify_width=w),
        "static": lambda w: StaticDecoder(model, 8, max_tokens, use_graphs=False, verify_width=w),
    }[kind]
    return make(1), make(width)


def run_verify(model, kind: str, width: int, rounds: int, seed: int, lengths: list[int] = LENGTHS) -> float:
    """``rounds`` verify steps of all slots against plain steps; the worst hidden-state difference."""
    rng = random.Random(seed)
    plain, spec = _pair(model, kind, width, max(lengths) + rounds * width + 8)
    slots = [7 - i for i in range(len(lengths))]
    for st, s in zip(prefilled(model, lengths, seed), slots):
        plain.load(s, st.clone())
        spec.load(s, st)
    truth = {s: [rng.randrange(2, 129280) for _ in range(rounds * width + 1)] for s in slots}
    fed = dict.fromkeys(slots, 0)
    worst = 0.0
    for _ in range(rounds):
        kept = [rng.randint(1, width) for _ in slots]
        rows = [[truth[s][fed[s] + j] if j < k else rng.randrange(2, 129280) for j in range(width)] for s, k in zip(slots, kept)]
        hidden, streams = spec.verify(slots, rows)
        assert hidden.shape[:2] == (len(slots), width) and streams.shape[:3] == (len(slots), width, model.config.hc_mult)
        want = [[] for _ in slots]
        for j in range(width):  # the plain decoder steps each slot through its kept tokens
            who = [i for i, k in enumerate(kept) if j < k]
            if not who:
                break
            out = plain.step([slots[i] for i in who], [rows[i][j] for i in who])
            for i, h in zip(who, out):
                want[i].append(h.clone())
        got = hidden if plain.output == "hidden" else model.head.logits(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:2], -1)
        for i, k in enumerate(kept):
            worst = max(worst, (got[i, :k] - torch.stack(want[i])).abs().max().item())
        spec.accept(kept)
        for s, k in zip(slots, kept):
            fed[s] += k
    for s in slots:
        assert_states_close(plain.export(s), spec.export(s), 1e-5)
    return worst


@pytest.mark.parametrize("kind", ["host", "host-eager", "static"])
@pytest.mark.parametrize("width", [2, 4])
def test_verify_equals_plain_steps_and_rewinds_exactly(small, kind: str, width: int) -> None:
    worst = run_verify(small, kind, width, rounds=6, seed=width)
    assert worst <= (1e-5 if kind != "static" else 1e-4), worst  # static: logits


def test_verify_crosses_the_128_token_hca_window(tiny_model_dir) -> None:
    """The default tiny model (window 128, HCA 128): slots at 124-127 tokens verify 4 at a time,
    so the HCA window closes inside the run, kept or rejected."""
    model = load_model(tiny_model_dir, dtype="float32", progress=False)
    assert run_verify(model, "host", 4, rounds=3, seed=3, lengths=[124, 125, 126, 127]) <= 1e-5


def test_verify_refuses_what_it_cannot_hold(small) -> None:
    dec = HostDecoder(small, 2, 24, verify_width=3)
    st = prefilled(small, [20], 0)[0]
    dec.load(0, st)
    with pytest.raises(ValueError, match="tokens per slot"):
        dec.verify([0], [[5, 6]])
    dec.verify([0], [[5, 6, 7]])
    dec.accept([3])  # 23 tokens: no room for 3 more
    with pytest.raises(ValueError, match="no room"):
        dec.verify([0], [[5, 6, 7]])
    with pytest.raises(ValueError, match="compression rate"):
        HostDecoder(small, 2, 24, verify_width=5)  # CSA rate 4: two closes in one run

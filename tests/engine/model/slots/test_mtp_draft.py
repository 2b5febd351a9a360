"""``slots.mtp_draft.SlotDrafter`` against the general path's ``mtp.Drafter``, fp32 on the CPU.

Sequences of mixed lengths are prefilled (their MTP windows fed on the general path), then copies
of those windows go into the slot pool; each round feeds both the same verify columns (the main
model's real streams and tokens) with kept counts drawn at random, and both propose ``k`` drafts:
the drafts must be identical and the windows the same (exported back to the general layout). On
the small-windows checkpoint (window 16) the rounds wrap the ring; a window that starts past
position 0 (a KV-store hit) and a sequence moved out of its slot and into another are included.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from engine.model.loader import load_model
from engine.model.mtp import Drafter, MTPLayer
from engine.model.slots.mtp_draft import SlotDrafter

# (prefill length, first fed position): 40 and 3 start at 0; 9 starts at 25 (the entries before it
# were a KV-store hit and never fed), 30 crosses the 16-token window at once
SEQS = [(40, 0), (3, 0), (9, 25), (30, 0)]


@pytest.fixture(scope="module")
def small(small_windows_model_dir):
    model = load_model(small_windows_model_dir, dtype="float32", progress=False)
    return model, MTPLayer.from_model(model)


@pytest.fixture(scope="module")
def trained(trained_mtp_model_dir):
    model = load_model(trained_mtp_model_dir, dtype="float32", progress=False)
    return model, MTPLayer.from_model(model)


def run_drafts(model, layer: MTPLayer, k: int, rounds: int, seed: int, compiled: bool) -> tuple[int, int]:
    """``rounds`` draft steps of the slot drafter beside the general path (module docstring);
    asserts equal drafts and windows; → (drafts compared, rounds)."""
    rng = random.Random(seed)
    width = k + 1
    general = Drafter(model, layer)
    slot = SlotDrafter(model, layer, max_slots=6, k=k, compiled=compiled)
    slots = [5, 1, 3, 0]
    tokens, streams, states, fed = [], [], [], []
    with torch.inference_mode():
        for n, first in SEQS:
            ids = [rng.randrange(2, 129280) for _ in range(first + n + rounds * width + 2)]
            tokens.append(ids)
            streams.append(model([(model.new_state(), ids[:-1])], logits="streams"))  # (L, hc, H) of every position
            st = general.new_state()
            general.feed([st], [streams[-1][first : first + n]], [ids[first + 1 : first + n + 1]], [first])
            states.append(st)
            fed.append(first + n)
    mirror = [copy.deepcopy(st) for st in states]
    for s, st in zip(slots, mirror):
        slot.pool.load(s, st)
    compared = 0
    for r in range(rounds):
        if r == rounds // 2:  # sequence 2 leaves its slot and comes back in slot 2
            slot.pool.export(slots[2], mirror[2])
            slots[2] = 2
            slot.pool.load(2, mirror[2])
        kept = [rng.randint(1, width) for _ in SEQS]
        cols = torch.stack([streams[i][fed[i] : fed[i] + width] for i in range(len(SEQS))])  # (n, width, hc, H)
        nxt = [tokens[i][fed[i] + 1 : fed[i] + 1 + kept[i]] for i in range(len(SEQS))]
        last = general.feed(states, [cols[i, : kept[i]] for i in range(len(SEQS))], nxt, fed)
        want = general.propose(states, last, k)
        got = slot.draft(slots, cols, nxt)
        assert got == want, (r, kept)
        compared += sum(len(d) for d in want)
        for i, c in enumerate(kept):
            fed[i] += c
    for s, st, mine in zip(slots, states, mirror):
        slot.pool.export(s, mine)
        assert mine.next_pos == st.next_pos and mine.slot is None
        torch.testing.assert_close(mine.window.swa, st.window.swa, rtol=1e-5, atol=1e-5)
    return compared, rounds


@pytest.mark.parametrize("k", [1, 2, 3])
def test_slot_drafts_equal_the_general_paths(small, k: int) -> None:
    compared, _ = run_drafts(*small, k=k, rounds=8, seed=k, compiled=True)
    assert compared == 8 * k * len(SEQS)


def test_slot_drafts_eager_block_and_trained_model(small, trained) -> None:
    """The eager block (``DecoderLayer.blocks``) instead of the compiled one; and the trained
    checkpoint (window 128), whose drafts are the language's, not noise."""
    run_drafts(*small, k=3, rounds=4, seed=7, compiled=False)
    run_drafts(*trained, k=3, rounds=6, seed=8, compiled=True)


def test_slot_drafter_refuses_bad_input(small) -> None:
    model, layer = small
    slot = SlotDrafter(model, layer, max_slots=2, k=2)
    cols = torch.zeros(1, 3, model.config.hc_mult, model.config.hidden_size)
    with pytest.raises(ValueError, match="fed columns"):
        slot.draft([0], cols, [[]])  # no kept column
    with pytest.raises(ValueError, match="fed columns"):
        slot.draft([0], cols[:, :2], [[1]])  # streams of the wrong width
    with pytest.raises(ValueError, match="k < window"):
        SlotDrafter(model, layer, max_slots=2, k=model.config.sliding_window - 1)


_INTERPRETED = """
import sys
import torch
torch.set_num_threads(1)
from engine.model.loader import load_model
from engine.model.mtp import MTPLayer
from tests.engine.model.slots.test_mtp_draft import run_drafts
model = load_model(sys.argv[1], dtype="float32", progress=False)
print("ok", run_drafts(model, MTPLayer.from_model(model), k=3, rounds=3, seed=5, compiled=False))
"""


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.timeout(1200)
def test_slot_drafts_through_the_attention_kernel_under_the_interpreter(small_windows_model_dir) -> None:
    """The device path's attention (``kernels.decode_attention`` over the ring) run by Triton's
    CPU interpreter: the same drafts as the general path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[4]
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, str(small_windows_model_dir)], cwd=root, env=env, capture_output=True, text=True, timeout=1100, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]

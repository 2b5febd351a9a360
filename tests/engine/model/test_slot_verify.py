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


def _decoder(model, kind: str, width: int, max_tokens: int) -> StaticDecoder:
    if kind in ("static", "static-graphs"):
        return StaticDecoder(model, 8, max_tokens, use_graphs=kind == "static-graphs", verify_width=width)
    return HostDecoder(model, 8, max_tokens, compiled=kind == "host", verify_width=width)


def run_verify(model, kind: str, width: int, rounds: int, seed: int, lengths: list[int] = LENGTHS, reference: str | None = None) -> float:
    """``rounds`` verify steps of all slots (a ``kind`` decoder) against plain steps (a
    ``reference`` decoder, by default of the same kind); the worst difference of the hidden
    states (of the logits when the reference gives logits)."""
    rng = random.Random(seed)
    room = max(lengths) + rounds * width + 8
    plain, spec = _decoder(model, reference or kind, 1, room), _decoder(model, kind, width, room)
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


_INTERPRETED = """
import sys
import torch
torch.set_num_threads(1)
from engine.model.loader import load_model
from tests.engine.model.test_slot_verify import run_verify
model = load_model(sys.argv[1], dtype="float32", progress=False)
worst = run_verify(model, "static", 4, rounds=3, seed=5, lengths=[2, 6, 13], reference="host")
assert worst <= 1e-4, worst
print("ok", worst)
"""


@pytest.mark.slow  # the Triton interpreter: minutes
@pytest.mark.timeout(1200)
def test_fused_verify_under_the_triton_interpreter(small_windows_model_dir) -> None:
    """The fused (GPU) verify step's kernels run by Triton's CPU interpreter: offsets 2-13 + 4
    cross CSA and HCA closes and the window ring's wrap."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, str(small_windows_model_dir)], cwd=root, env=env, capture_output=True, text=True, timeout=1100, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("width", [2, 4])
def test_verify_on_cuda_in_graphs(small_windows_model_dir, width: int) -> None:
    """The CUDA verify step (one multi-query attention launch per layer, a graph per bucket and
    width; fp32) against plain graph steps, with rewinds: logits within 1e-4, states within 1e-5."""
    model = load_model(small_windows_model_dir, dtype="float32", device="cuda", progress=False)
    worst = run_verify(model, "static-graphs", width, rounds=6, seed=width)
    assert worst <= 1e-4, worst

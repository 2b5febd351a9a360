"""The slot decoders against the general path: the static (fixed-shape, CUDA-graph-capturable)
step and the host slot step (``HostDecoder``, the CPU default).

On CPU (fp32, no graphs): states prefilled by the general path at every kind of position are
loaded into slots; decode steps through either decoder give the general path's logits within
1e-4 and, exported back, the same states. The CUDA versions (graphs, bf16) are in test_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.model.host_decode import HostDecoder
from engine.model.loader import load_model
from engine.model.state import SequenceState
from engine.model.static_decode import StaticDecoder, bucket_for

TOL = 1e-4
LENGTHS = [0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 127, 128, 129, 255, 256, 300]


@pytest.fixture(scope="module", params=["tiny_model_dir", "small_windows_model_dir"])
def model(request: pytest.FixtureRequest):
    return load_model(
        request.getfixturevalue(request.param), dtype="float32", progress=False
    )


def _ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(2, 129280) for _ in range(n)]


def prefilled(model, lengths: list[int], seed: int) -> list[SequenceState]:
    rng = random.Random(seed)
    states = [model.new_state() for _ in lengths]
    chunks = [(st, _ids(n, rng)) for st, n in zip(states, lengths) if n]
    model(chunks)
    return states


def assert_states_close(a: SequenceState, b: SequenceState, tol: float) -> None:
    assert a.num_tokens == b.num_tokens and a.token_ids == b.token_ids
    for la, lb in zip(a.layers, b.layers):
        pairs = [(la.swa, lb.swa)]
        for ca, cb in ((la.comp, lb.comp), (la.index, lb.index)):
            if ca is None:
                continue
            assert ca.windows is None and cb.windows is None
            pairs += [
                (ca.rows, cb.rows),
                (ca.buf_kv, cb.buf_kv),
                (ca.buf_gate, cb.buf_gate),
            ]
            assert (ca.overlap_kv is None) == (cb.overlap_kv is None)
            if ca.overlap_kv is not None:
                pairs += [
                    (ca.overlap_kv, cb.overlap_kv),
                    (ca.overlap_gate, cb.overlap_gate),
                ]
        for x, y in pairs:
            assert x.shape == y.shape
            assert x.numel() == 0 or (x.float() - y.float()).abs().max().item() <= tol


def run_both(
    model,
    lengths: list[int],
    steps: int,
    seed: int,
    max_slots: int,
    use_graphs: bool = False,
    subsets: bool = True,
    host: bool = False,
    compiled: bool = True,
):
    """Decode ``steps`` tokens for every sequence through the general path and the static one
    (``host``: the host slot decoder, whose hidden states go through the model's head; its
    layers and attention through compiled loops when ``compiled``, else eager PyTorch).
    With ``subsets`` some steps feed only part of the slots (padded buckets, scratch rows)."""
    base = prefilled(model, lengths, seed)
    general = [s.clone() for s in base]
    if host:
        dec = HostDecoder(model, max_slots=max_slots, max_tokens=max(lengths) + steps + 8, compiled=compiled)
    else:
        dec = StaticDecoder(model, max_slots=max_slots, max_tokens=max(lengths) + steps + 8, use_graphs=use_graphs)
    slot_of = list(
        range(max_slots - len(lengths), max_slots)
    )  # not 0..n-1: slots are arbitrary
    for st, slot in zip(base, slot_of):
        dec.load(slot, st)
    rng = random.Random(seed + 1)
    worst = 0.0
    for t in range(steps):
        who = list(range(len(lengths)))
        if subsets and t % 3 == 2:
            who = sorted(rng.sample(who, max(1, len(who) // 3)))
        toks = [_ids(1, rng) for _ in who]
        want = model([(general[i], tok) for i, tok in zip(who, toks)])
        got = dec.step([slot_of[i] for i in who], [tok[0] for tok in toks])
        if host:
            got = model.head.logits(got)
        worst = max(
            worst, (want.float() - got.float().to(want.device)).abs().max().item()
        )
    return worst, general, [dec.export(s) for s in slot_of], dec


@pytest.mark.parametrize(("host", "compiled"), [(False, False), (True, True), (True, False)], ids=["static", "host", "host-eager"])
def test_static_decode_matches_general_path(model, host: bool, compiled: bool) -> None:
    """40 decode steps of 17 sequences at every kind of position (window, CSA and HCA boundaries,
    fresh sequences), some steps on a subset of slots: logits and exported states agree."""
    worst, general, exported, dec = run_both(
        model, LENGTHS, steps=40, seed=1, max_slots=20, host=host, compiled=compiled
    )
    if host and compiled:  # the compiled layers ran (numba is a dependency)
        assert all(w is not None for w in dec._layer_weights())
    assert worst <= TOL, worst
    for a, b in zip(general, exported):
        assert_states_close(a, b, TOL)


def test_host_slot_reuse_ignores_stale_state(model) -> None:
    """A slot freed by a long sequence and loaded with a short one: the ring entries, buffers,
    overlap and rows the long one left behind must not reach the new sequence's attention."""
    long, short = prefilled(model, [300, 2], seed=5)
    dec = HostDecoder(model, max_slots=2, max_tokens=400)
    dec.load(0, long)
    rng = random.Random(6)
    for _ in range(10):
        dec.step([0], _ids(1, rng))
    dec.free(0)
    dec.load(0, short)
    general = short.clone()
    worst = 0.0
    for _ in range(20):  # crosses CSA windows 0 and 1 (the first has no previous window)
        tok = _ids(1, rng)
        want = model([(general, tok)])
        with torch.inference_mode():
            worst = max(worst, (want - model.head.logits(dec.step([0], tok))).abs().max().item())
    assert worst <= TOL, worst
    assert_states_close(general, dec.export(0), TOL)


def test_load_export_roundtrip(model) -> None:
    states = prefilled(model, [0, 5, 130, 301], seed=3)
    dec = StaticDecoder(model, max_slots=4, max_tokens=320, use_graphs=False)
    for i, st in enumerate(states):
        dec.load(i, st)
    for i, st in enumerate(states):
        assert_states_close(st, dec.export(i), 0.0)


def test_load_rejects_replay_and_full_states(model) -> None:
    st = prefilled(model, [40], seed=4)[0]
    dec = StaticDecoder(model, max_slots=2, max_tokens=40, use_graphs=False)
    with pytest.raises(ValueError):
        dec.load(0, st)  # no room left
    dec = StaticDecoder(model, max_slots=2, max_tokens=64, use_graphs=False)
    comp = next(ls.comp for ls in st.layers if ls.comp is not None)
    comp.windows = 0
    with pytest.raises(ValueError):
        dec.load(0, st)


def test_buckets() -> None:
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 33, 64)] == [1, 2, 4, 8, 16, 64, 64]
    with pytest.raises(ValueError):
        bucket_for(10_000)


_INTERPRETED = """
import random, sys
import torch
torch.set_num_threads(1)
from engine.model.loader import load_model
from tests.engine.model.test_static_decode import assert_states_close, run_both
model = load_model(sys.argv[1], dtype="float32", progress=False)
lens, steps = [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3])
worst, general, exported, _ = run_both(model, lens, steps=steps, seed=1, max_slots=8)
assert worst <= 1e-4, worst
for a, b in zip(general, exported):
    assert_states_close(a, b, 1e-4)
print("ok", worst)
"""


@pytest.mark.parametrize(
    "lens,steps",
    [
        # default run: a fresh slot; 6→9 closes CSA (4) and HCA (8) windows; 42→45 closes a CSA window past the wrapped 16-token ring, the indexer selecting
        # (slow, as every Triton-interpreter run: about a minute on a 2-core AVX2 box; the GPU suite runs these kernels natively)
        pytest.param("0,6,42", 3, marks=pytest.mark.slow),
        pytest.param("0,3,4,7,9,17,40", 6, marks=pytest.mark.slow),  # every boundary case, longer
    ],
)
def test_static_decode_triton_kernels_under_interpreter(
    small_windows_model_dir, lens: str, steps: int
) -> None:
    """The same comparison with the step's Triton kernels (decode attention, indexer, pooling,
    mHC) run by Triton's CPU interpreter, so their integration is checked without a GPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[3]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(root),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, str(small_windows_model_dir), lens, str(steps)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-3000:]
    )


def test_host_warm_up_leaves_no_trace(model) -> None:
    """``HostDecoder.warm_up`` runs its throwaway sequences through the last two slots and frees
    them: a sequence loaded there afterwards decodes as on the general path."""
    dec = HostDecoder(model, max_slots=3, max_tokens=400)
    dec.warm_up()
    assert dec.num_tokens == [0, 0, 0] and dec.token_ids == [[], [], []]
    (seq,) = prefilled(model, [37], seed=9)
    general = seq.clone()
    dec.load(2, seq)
    rng = random.Random(10)
    worst = 0.0
    for _ in range(12):
        tok = _ids(1, rng)
        want = model([(general, tok)])
        with torch.inference_mode():
            worst = max(worst, (want - model.head.logits(dec.step([2], tok))).abs().max().item())
    assert worst <= TOL, worst

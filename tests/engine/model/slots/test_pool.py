"""``SlotPool`` (the slot state mechanism) and the ``SlotDecoder`` interface the V4 decoders meet.

fp32 on CPU: general-path states at aligned and unaligned lengths load into slots and export back
bit-exact; ``free`` forgets a slot; a replay state and one without room are refused.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.host_decode import HostDecoder
from engine.model.loader import load_model
from engine.model.slots import SlotDecoder, SlotPool, VerifyingSlotDecoder
from engine.model.static_decode import StaticDecoder
from tests.engine.model.test_static_decode import assert_states_close, prefilled


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32", progress=False)


def test_roundtrip_exact_and_free(model) -> None:
    states = prefilled(model, [0, 5, 130, 301], seed=7)
    pool = SlotPool(model, max_slots=4, max_tokens=320)
    for i, st in enumerate(states):
        pool.load(i, st)
    assert pool.num_tokens == [0, 5, 130, 301]
    for i, st in enumerate(states):
        assert_states_close(st, pool.export(i), 0.0)
    pool.free(2)
    assert pool.num_tokens[2] == 0 and pool.token_ids[2] == []
    assert pool.export(2).num_tokens == 0


def test_refuses_full_and_replay_states(model) -> None:
    st = prefilled(model, [40], seed=8)[0]
    with pytest.raises(ValueError):
        SlotPool(model, max_slots=1, max_tokens=40).load(0, st)
    with pytest.raises(ValueError):
        SlotPool(model, max_slots=1, max_tokens=64).load(1, st)  # slot out of range
    next(ls.comp for ls in st.layers if ls.comp is not None).windows = 0
    with pytest.raises(ValueError):
        SlotPool(model, max_slots=1, max_tokens=64).load(0, st)


def test_nbytes_counts_every_state_tensor(model) -> None:
    pool = SlotPool(model, max_slots=2, max_tokens=256)
    want = 0
    for lp in pool.layers:
        want += lp.swa.nbytes
        for cp in (lp.comp, lp.index):
            if cp is not None:
                want += sum(t.nbytes for t in (cp.rows, cp.buf_kv, cp.buf_gate, cp.overlap_kv, cp.overlap_gate) if t is not None)
    assert pool.nbytes() == want > 0


def test_v4_decoders_meet_the_interface(model) -> None:
    for dec in (
        StaticDecoder(model, max_slots=2, max_tokens=64, use_graphs=False, verify_width=2),
        HostDecoder(model, max_slots=2, max_tokens=64, verify_width=2),
    ):
        assert isinstance(dec, SlotDecoder) and isinstance(dec, VerifyingSlotDecoder)
        assert dec.nbytes() == dec.slots.nbytes()
        st = prefilled(model, [9], seed=9)[0]
        dec.load(1, st)
        with torch.inference_mode():
            dec.step([1], [3])
        assert dec.num_tokens[1] == 10 and dec.slots.num_tokens[1] == 10

"""``engine/model/mtp.py``: the MTP layer's math, its window state, and chained drafting."""

from __future__ import annotations

import pytest
import torch

from engine.errors import CheckpointError
from engine.model.attention import SeqSlice
from engine.model.loader import load_model
from engine.model.mtp import Drafter, Entry, MTPLayer


@pytest.fixture(scope="module")
def model(small_windows_model_dir):
    return load_model(small_windows_model_dir, progress=False)


@pytest.fixture(scope="module")
def layer(model) -> MTPLayer:
    return MTPLayer.from_model(model)


def _streams(model, ids: list[int]) -> torch.Tensor:
    return model([(model.new_state(), ids)], logits="streams")  # (S, hc, H)


def _eager(model, layer: MTPLayer, streams: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
    """The reference formula over a whole run on a fresh window: ``e_proj(enorm(embed(t+1)))``
    broadcast over the streams plus ``h_proj(hnorm(h))`` per stream, the block, then the MTP's own
    hyper-head and norm (the head's input)."""
    e = layer.enorm(model.model.embed_tokens.weight[torch.tensor(next_ids)])  # (S, H)
    x = torch.stack([layer.e_proj(e) + layer.h_proj(layer.hnorm(streams[:, s])) for s in range(streams.shape[1])], dim=1)  # (S, hc, H)
    pos = torch.arange(len(next_ids))
    out = layer.block(x, torch.tensor(next_ids), pos, model.rotary["main"].cos_sin(pos, x.dtype), model.rotary["compress"],
                      [SeqSlice(layer.new_state(), 0, len(next_ids), 0)])  # fmt: skip
    return layer.norm(layer.hc_head(out))


@torch.inference_mode()
def test_forward_is_the_reference_formula_and_incremental_equals_one_shot(model, layer) -> None:
    ids = torch.randint(2, 9000, (41,), generator=torch.Generator().manual_seed(1)).tolist()  # past the 16-token window
    streams = _streams(model, ids[:-1])
    ref = _eager(model, layer, streams, ids[1:])  # (40, H)
    one = layer.hidden(layer(model, [Entry(layer.new_state(), 0, streams, ids[1:])]))
    torch.testing.assert_close(one, ref, rtol=1e-4, atol=1e-4)
    st, rows = layer.new_state(), []
    for a, b in ((0, 7), (7, 8), (8, 23), (23, 40)):
        rows.append(layer.hidden(layer(model, [Entry(st, a, streams[a:b], ids[a + 1 : b + 1])])))
    torch.testing.assert_close(torch.cat(rows), ref, rtol=1e-4, atol=1e-4)
    assert st.swa.shape[0] == model.config.sliding_window - 1


@torch.inference_mode()
def test_drafts_chain_on_the_layers_own_streams_and_leave_the_window(model, layer) -> None:
    drafter = Drafter(model, layer)
    prompts = [torch.randint(2, 9000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 20)]
    states = [drafter.new_state() for _ in prompts]
    next_tok = [77, 78]
    streams = [_streams(model, p) for p in prompts]
    last = drafter.feed(states, streams, [p[1:] + [t] for p, t in zip(prompts, next_tok)], [0, 0])
    windows = [st.window.swa for st in states]
    drafts = drafter.propose(states, last, 3)
    assert [st.window.swa for st in states] == windows  # chained entries dropped again
    for p, t, s, d in zip(prompts, next_tok, streams, drafts):
        # eager chain: recompute every entry from scratch, the MTP's output streams fed back
        h, nxt, want = s, p[1:] + [t], []
        for _ in range(3):
            st = layer.new_state()
            out = layer(model, [Entry(st, 0, h, nxt)])  # (S, hc, H)
            want.append(int(model.head.logits(layer.hidden(out[-1:])).argmax()))
            h, nxt = torch.cat([h, out[-1:]]), nxt + [want[-1]]
        assert d == want


def test_missing_mtp_weights_are_a_checkpoint_error(model) -> None:
    saved = model.mtp
    try:
        model.mtp = {}
        with pytest.raises(CheckpointError, match="no MTP layer"):
            MTPLayer.from_model(model)
        model.mtp = {k: v for k, v in saved.items() if "e_proj" not in k}
        with pytest.raises(CheckpointError, match="e_proj"):
            MTPLayer.from_model(model)
    finally:
        model.mtp = saved

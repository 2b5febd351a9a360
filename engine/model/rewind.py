"""Exact rewind of a V4 sequence state after a speculative verify rejected its last tokens.

``mark(state)`` before the verify forward records, per layer, the references of the mutable state
(the window ``swa``, each compressor's ``rows``, buffers, overlap and ``windows``) — the forward
never writes into those tensors, it replaces them — and turns on each compressor's ``journal`` of
its ``(kv, gate)`` projections. ``rewind(model, state, mark, keep)`` then leaves the state exactly as
if only the first ``keep`` of the fed tokens had been fed:

- window: the marked window plus the first ``keep`` new keys (the new keys are the last rows of
  the verified window, since a verify feeds fewer than ``W`` tokens), cut to ``W - 1``;
- compressors (CSA/HCA main and indexer): the marked state, then ``Compressor.update`` on the
  journal's first ``keep`` projections — the rows of windows the accepted tokens close (a 128-token
  HCA window or a CSA window closing inside the run), the buffers and the CSA overlap follow
  from the very ops of a normal forward; rows closed by rejected tokens never appear;
- token counts: ``num_tokens`` and ``token_ids`` cut back.

Cost per rewind: O(layers) references plus the compressor update of ``keep`` tokens (the same
``rows`` concatenation a normal forward does when a window closes); nothing O(sequence) is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.model.model import DeepseekV4ForCausalLM
from engine.model.state import CompressorState, SequenceState


@dataclass
class Mark:
    """References to a state's mutable parts at ``num_tokens`` (see module docstring)."""

    num_tokens: int
    num_ids: int
    swa: list[torch.Tensor]
    comp: list[CompressorState | None]
    index: list[CompressorState | None]


def mark(state: SequenceState) -> Mark:
    """Remember ``state`` before a verify forward and start the compressors' journals."""
    for ls in state.layers:
        for cs in (ls.comp, ls.index):
            if cs is not None:
                cs.journal = []
    snap = lambda cs: None if cs is None else replace(cs, journal=None)  # noqa: E731 - field references only
    return Mark(
        state.num_tokens,
        len(state.token_ids),
        [ls.swa for ls in state.layers],
        [snap(ls.comp) for ls in state.layers],
        [snap(ls.index) for ls in state.layers],
    )


def rewind(model: DeepseekV4ForCausalLM, state: SequenceState, m: Mark, keep: int) -> None:
    """Keep only the first ``keep`` tokens fed since ``m``; ends the journals."""
    fed = state.num_tokens - m.num_tokens
    assert 0 <= keep <= fed, f"keep {keep} of {fed} fed tokens"
    if keep == fed:
        _end_journals(state)
        return
    rotary = model.rotary["compress"]
    for layer, ls, swa, comp, index in zip(model.model.layers, state.layers, m.swa, m.comp, m.index):
        attn = layer.self_attn
        limit = attn.window - 1
        assert fed <= limit, f"a verify of {fed} tokens exceeds the window"
        new_keys = ls.swa[ls.swa.shape[0] - fed : ls.swa.shape[0] - fed + keep]  # (keep, D)
        ls.swa = torch.cat([swa, new_keys])[-limit:] if keep else swa
        for module, live, old in ((attn.compressor, ls.comp, comp), (attn.indexer, ls.index, index)):
            if live is None:
                continue
            assert module is not None and old is not None and live.journal is not None
            kv = torch.cat([j[0] for j in live.journal])  # (fed, proj)
            gate = torch.cat([j[1] for j in live.journal])
            assert kv.shape[0] == fed, "every fed token passes the compressor once"
            restored = replace(old, journal=None)
            if keep:
                module.update(restored, kv[:keep], gate[:keep], rotary)
            if live is ls.comp:
                ls.comp = restored
            else:
                ls.index = restored
    state.num_tokens = m.num_tokens + keep
    del state.token_ids[m.num_ids + keep :]


def _end_journals(state: SequenceState) -> None:
    for ls in state.layers:
        for cs in (ls.comp, ls.index):
            if cs is not None:
                cs.journal = None

"""Exact rewind of a DeepSeek-V4.1 sequence state after a speculative verify rejected its last tokens.

``mark(state)`` before the verify forward records the references of every mutable part of a
``V41SequenceState``: each layer's window ring, each KV source's compressed rows, indexer keys and
the open group's fp32 buffers, the engram n-gram history, the token count, the consumed ids and
``decoder_from``. The general-path forward never writes into those tensors (it replaces them:
``torch.cat`` / ``clone``), so the references are the state as it was, at no copy.

``rewind(model, state, mark, keep)`` leaves the state exactly as feeding only the first ``keep`` of
the verified tokens would: with all of them kept nothing happens; otherwise the marked state is put
back and the ``keep`` accepted tokens are fed again in one chunk. That is the state of feeding
those tokens by construction — window rings, a compressor group the accepted tokens close (or
leave open), the shared compressed rows and indexer keys, the engram history and the counts alike,
whatever mix of 128-token units and group boundaries the verify crossed; rows and groups closed by
rejected tokens never appear.

Cost: O(layers + sources) references per mark; a rewind that drops tokens costs a forward of the
``keep`` accepted tokens (a V4-style journal of the compressor projections, slicing the rest, would
avoid it: see the module's tests for the exactness bar such a change has to meet).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.model.v41.model import DeepseekV41ForCausalLM
from engine.model.v41.state import SourceState, V41SequenceState


@dataclass
class V41Mark:
    """References to a state's mutable parts at ``num_tokens`` (module docstring)."""

    num_tokens: int
    num_ids: int
    windows: list[torch.Tensor]
    sources: dict[int, SourceState]
    engram: list[int]
    decoder_from: int


def mark(state: V41SequenceState) -> V41Mark:
    """Remember ``state`` before a verify forward."""
    return V41Mark(
        state.num_tokens, len(state.token_ids), list(state.windows),
        {i: replace(s) for i, s in state.sources.items()}, list(state.engram), state.decoder_from,
    )  # fmt: skip


def rewind(model: DeepseekV41ForCausalLM, state: V41SequenceState, m: V41Mark, keep: int) -> None:
    """Keep only the first ``keep`` tokens fed since ``m`` (module docstring)."""
    fed = state.num_tokens - m.num_tokens
    assert 0 <= keep <= fed, f"keep {keep} of {fed} fed tokens"
    if keep == fed:
        return
    accepted = state.token_ids[m.num_ids : m.num_ids + keep]
    state.windows[:] = m.windows
    state.sources.clear()
    state.sources.update({i: replace(s) for i, s in m.sources.items()})
    state.engram, state.num_tokens, state.decoder_from = list(m.engram), m.num_tokens, m.decoder_from
    del state.token_ids[m.num_ids :]
    if accepted:
        model([(state, accepted)], logits="hidden")

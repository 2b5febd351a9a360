"""Decode steps through slot pools: the static, CUDA-graph decoder on GPU
(``engine/model/static_decode.py``; V4.1: ``engine/model/v41/slot_decode.py``), the host slot
decoder on CPU (``engine/model/host_decode.py``).

The general path serves every prefill chunk; a sequence whose next step feeds one token (decode)
moves into a ``StaticDecoder`` slot — its state is copied in once, then every decode step of all
slotted sequences is one fixed-shape step (one CUDA graph replay per batch bucket on GPU).
While a sequence sits in a slot its ``seq.state`` is ``None``: the slot holds the state, and
``export`` hands it back whenever something needs it (a KV-store save at a unit boundary, a
sequence that outgrows the slot's ``max_tokens``). Preemption, abort and finish free the slot.

Which sequences move: decode sequences whose state is in the normal compressor mode (not a
KV-replay state) and shorter than ``max_tokens``, while slots are free; the others keep the
general path, so the result of a step is the same either way (tests compare the two). A
speculative sequence (``engine/runtime/speculative.py``) moves in the same way once it decodes,
with room for ``verify_width`` tokens; its steps are ``verify`` + ``accept``.
"""

from __future__ import annotations

import torch

from engine.model.host_decode import HostDecoder
from engine.model.model import DeepseekV4ForCausalLM
from engine.model.state import SequenceState
from engine.model.static_decode import DECODE, DecodeTuning, StaticDecoder
from engine.model.v41.model import DeepseekV41ForCausalLM
from engine.model.v41.slot_decode import V41SlotDecoder
from engine.runtime.sequence import Sequence


class StaticRunner:
    """Slot bookkeeping between an ``EngineCore`` and one ``StaticDecoder``."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        max_slots: int,
        max_tokens: int,
        use_graphs: bool | None = None,
        tuning: DecodeTuning = DECODE,
        decoder: StaticDecoder | None = None,
        verify_width: int = 1,
    ) -> None:
        """``decoder``: one built already (an expert-parallel rank's ``EPDecoder``), else one made
        here; ``verify_width``: tokens per slot of its verify steps (speculative decoding: 1 + k)."""
        if decoder is not None:
            self.decoder = decoder
        elif isinstance(model, DeepseekV41ForCausalLM):  # V4.1: its own slot decoder (no verify steps)
            self.decoder = V41SlotDecoder(model, max_slots, max_tokens, use_graphs=use_graphs)  # type: ignore[assignment]
        elif model.device.type == "cpu" and not use_graphs and model.dtype == torch.float32:  # the host step is fp32
            self.decoder: StaticDecoder = HostDecoder(model, max_slots, max_tokens, verify_width=verify_width)
        else:
            self.decoder = StaticDecoder(model, max_slots, max_tokens, use_graphs=use_graphs, tuning=tuning, verify_width=verify_width)
        self.max_tokens = max_tokens
        self._free = list(range(max_slots - 1, -1, -1))
        self._slot: dict[int, int] = {}  # id(seq) -> slot
        self.steps = 0  # static steps run (tests and metrics read it)

    def warm_up(self) -> None:
        """Before the first request: compile the CPU decode step's kernels (``HostDecoder.warm_up``),
        or capture every bucket's CUDA graph (else each is captured on its first step)."""
        if isinstance(self.decoder, HostDecoder):
            self.decoder.warm_up()
        elif self.decoder.use_graphs:
            self.decoder.capture_graphs()

    def holds(self, seq: Sequence) -> bool:
        return id(seq) in self._slot

    def slot(self, seq: Sequence) -> int:
        """The slot a held ``seq`` is in (the speculative step keeps its MTP window in the same slot)."""
        return self._slot[id(seq)]

    def takes(self, seq: Sequence, n: int) -> bool:
        """Whether this step's ``n`` tokens of ``seq`` run here; moves ``seq`` into a slot (or out
        of one that is full) as needed."""
        slot = self._slot.get(id(seq))
        if slot is not None:
            if n == 1 and self.decoder.num_tokens[slot] < self.max_tokens:
                return True
            seq.state = self.release(seq)  # full slot (or not a decode step): back to the general path
            return False
        return n == 1 and self._move_in(seq, 1)

    def takes_verify(self, seq: Sequence) -> bool:
        """Whether this step's verify of ``seq`` (its next token and drafts, ``verify_width``
        tokens padded) runs here; moves ``seq`` into a slot, or out of one without room for it."""
        width = self.decoder.verify_width
        slot = self._slot.get(id(seq))
        if slot is not None:
            if self.decoder.num_tokens[slot] + width <= self.max_tokens:
                return True
            seq.state = self.release(seq)
            return False
        return width > 1 and self._move_in(seq, width)

    def _move_in(self, seq: Sequence, width: int) -> bool:
        """Load a decoding ``seq`` with room for ``width`` more tokens into a free slot."""
        if seq.remaining != 1 or not self._free or seq.state is None:
            return False
        if seq.state.num_tokens + width > self.max_tokens or not _normal_mode(seq.state, self.decoder):
            return False
        slot = self._free.pop()
        try:
            self.decoder.load(slot, seq.state)
        except ValueError:  # a state the slots cannot hold: it stays on the general path
            self._free.append(slot)
            return False
        self._slot[id(seq)] = slot
        seq.state = None
        return True

    @property
    def output(self) -> str:
        """What ``step`` returns: ``"logits"`` (GPU) or ``"hidden"`` states for the model's head (CPU)."""
        return self.decoder.output

    def step(self, seqs: list[Sequence]) -> torch.Tensor:
        """One decode token for each (slotted) sequence → float32 logits ``(len(seqs), V)``, a
        copy (the decoder's output buffer is reused by the next step), or the last hidden states
        ``(len(seqs), H)`` (``output``)."""
        slots = [self._slot[id(s)] for s in seqs]
        tokens = [s.tokens[s.num_computed] for s in seqs]
        self.steps += 1
        out = self.decoder.step(slots, tokens)
        return out.clone() if self.output == "logits" else out

    def verify(self, seqs: list[Sequence], rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``StaticDecoder.verify`` of the slotted ``seqs``: ``rows[i]`` is ``verify_width`` tokens
        (the next token, the drafts, padding) → hidden states ``(n, width, H)`` and final streams
        ``(n, width, hc, H)``; ``accept`` follows."""
        self.steps += 1
        return self.decoder.verify([self._slot[id(s)] for s in seqs], rows)

    def accept(self, kept: list[int]) -> None:
        """Each verified sequence keeps its first ``kept[i]`` tokens (``StaticDecoder.accept``)."""
        self.decoder.accept(kept)

    def export(self, seq: Sequence) -> SequenceState:
        """A copy of a slotted sequence's state (it stays in its slot)."""
        return self.decoder.export(self._slot[id(seq)])

    def release(self, seq: Sequence, keep_state: bool = True) -> SequenceState | None:
        """Free ``seq``'s slot; returns its state (or None with ``keep_state=False``)."""
        slot = self._slot.pop(id(seq), None)
        if slot is None:
            return None
        state = self.decoder.export(slot) if keep_state else None
        self.decoder.free(slot)
        self._free.append(slot)
        return state


def _normal_mode(state: SequenceState, decoder: StaticDecoder) -> bool:
    """The state can be loaded: every compressor has consumed exactly its complete windows
    (a V4.1 state: ``V41SlotDecoder.load`` refuses one it cannot hold)."""
    if not isinstance(state, SequenceState):
        return True
    n = state.num_tokens
    for layer, ls in zip(decoder.model.model.layers, state.layers):
        attn = layer.self_attn
        for comp, cs in ((attn.compressor, ls.comp), (attn.indexer, ls.index)):
            if comp is not None and (cs.windows is not None or cs.rows.shape[0] * comp.rate + cs.buf_kv.shape[0] != n):
                return False
    return True

"""``SlotDecoder``: what the runtime calls on a slot decoder (``engine.runtime.static_runner``,
``engine.runtime.speculative``, ``engine.parallel``).

A slot decoder keeps up to ``max_slots`` sequences of at most ``max_tokens`` tokens each in fixed,
preallocated slots, and steps any subset of them one token at a time. It is two parts, composed:

1. the *slot pool* (mechanism, ``slots.pool.SlotPool`` for V4): the per-layer state tensors,
   ``load`` of a general-path ``SequenceState`` after prefill, ``export`` back, ``free``,
   ``nbytes``, and each slot's ``num_tokens`` / ``token_ids``; no model math;
2. the *step* of one backend (CUDA graphs + Triton, host CPU, expert-parallel, V4.1), which reads
   and writes the pool's tensors with the model's reference math (``attention``, ``decode``,
   ``kernels.reference``) or with kernels tested against it. Tuning is a frozen config object
   given to the constructor (``static_decode.DecodeTuning``), never a module global.

Contract:
- ``load(slot, state)`` copies a normal-mode state in (``ValueError`` for a replay state or one
  with no room left); ``export(slot)`` returns a copy that continues exactly like the original;
  ``free(slot)`` forgets the slot (its tensors are overwritten by the next ``load``).
- ``step(slots, token_ids, bucket=None)`` feeds one token per listed slot (each slot once) and
  returns ``(n, V)`` float32 logits when ``output == "logits"`` or ``(n, H)`` final hidden states
  when ``output == "hidden"`` (for ``model.head``); the tensor may be a buffer the next step
  reuses. ``bucket`` forces a padded batch (expert-parallel ranks step together, maybe with 0 slots).
- ``verify(slots, token_rows)`` (``VerifyingSlotDecoder``; V4.1 has none yet) feeds ``verify_width`` tokens per slot → hidden ``(n, width, H)``
  and streams ``(n, width, hc, H)``; ``accept(kept)`` must follow and keeps the first ``kept[i]``
  tokens of slot ``i`` (undoing the rest) before those slots are stepped or exported again.
- ``capture_graphs()`` does any one-off capture or compilation now (a no-op where there is none),
  so the engine can measure free memory after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, TypeVar, runtime_checkable

import torch

StateT = TypeVar("StateT")  # the model family's general-path state (V4: ``state.SequenceState``)


@runtime_checkable
class SlotDecoder(Protocol[StateT]):
    """A slot pool and the step of one backend over it (module docstring)."""

    output: Literal["logits", "hidden"]
    max_slots: int
    max_tokens: int
    buckets: tuple[int, ...]  # padded batch sizes ``step`` may run (the largest is ``max_slots``)
    num_tokens: list[int]  # tokens in each slot

    def load(self, slot: int, state: StateT) -> None:
        """Copy a general-path state (after prefill) into ``slot``."""

    def export(self, slot: int) -> StateT:
        """``slot``'s state as a general-path ``SequenceState`` (copies)."""

    def free(self, slot: int) -> None:
        """Forget ``slot``'s sequence."""

    def nbytes(self) -> int:
        """Bytes held by the slot state tensors."""

    def step(self, slots: Sequence[int], token_ids: Sequence[int], bucket: int | None = None) -> torch.Tensor:
        """One token per listed slot → logits ``(n, V)`` or hidden states ``(n, H)`` (``output``)."""

    def capture_graphs(self) -> None:
        """Do any one-off capture or compilation now."""


@runtime_checkable
class VerifyingSlotDecoder(SlotDecoder[StateT], Protocol[StateT]):
    """A ``SlotDecoder`` that also runs speculative verify steps (``engine.runtime.speculative``)."""

    verify_width: int  # tokens per slot a ``verify`` feeds (1: no verify)

    def verify(self, slots: Sequence[int], token_rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``verify_width`` tokens per slot → hidden ``(n, width, H)``, streams ``(n, width, hc, H)``."""

    def accept(self, kept: Sequence[int]) -> None:
        """End the pending ``verify``: slot ``i`` keeps its first ``kept[i]`` tokens."""

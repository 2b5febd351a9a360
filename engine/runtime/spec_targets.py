"""What the speculative decoder (``engine/runtime/speculative.py``) needs of one model family.

A target runs the verify forward, gives the head's inputs of chosen verify rows, marks and rewinds
a sequence state, and carries the family's drafter (``new_state`` / ``feed`` / ``propose``, the
seam both drafters share):

- ``V4Target``: DeepSeek-V4 with its MTP layer (``method="mtp"``): verify rows are the final hc
  streams (``logits="streams"``), the head's input ``final_hidden`` of them, the rewind
  ``engine/model/rewind.py``, the drafter ``mtp.Drafter``; decoding sequences verify and draft
  in the engine's slot decoder (``slots``).
- ``V41Target``: DeepSeek-V4.1 with its DSpark draft layers (``method="dspark"``): verify rows
  are ``forward(logits="taps")``'s ``(1 + taps, H)`` per token (column 0 the head's input, the
  rest DSpark's target features), the rewind ``engine/model/v41/rewind.py`` (exact: it re-feeds
  the accepted tokens), the drafter ``DSparkDrafter`` (at most ``dspark_block_size`` drafts, the
  optional confidence cut-off); no slot verify (V4.1's slot decoder has none), so its
  speculative sequences stay on the general path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from engine.errors import CheckpointError
from engine.model import rewind as v4_rewind
from engine.model.model import DeepseekV4ForCausalLM
from engine.model.mtp import Drafter, MTPLayer
from engine.model.v41 import rewind as v41_rewind
from engine.model.v41.dspark import DSpark, DSparkDrafter
from engine.model.v41.model import DeepseekV41ForCausalLM
from engine.runtime.config import SpeculativeConfig


class SpecDrafter(Protocol):
    """The drafter seam of ``mtp.Drafter`` and ``DSparkDrafter``."""

    def new_state(self) -> Any: ...
    def feed(self, states: list[Any], rows: list[torch.Tensor], next_ids: list[list[int]], first_pos: list[int]) -> torch.Tensor: ...
    def propose(self, states: list[Any], last: torch.Tensor, k: int) -> list[list[int]]: ...


class SpecTarget(Protocol):
    """One family's verify forward, head rows, rewind and drafter (module docstring)."""

    model: Any
    drafter: SpecDrafter
    slots: bool  # decoding sequences verify (and draft) in the engine's slot decoder

    def forward(self, chunks: Sequence[tuple[Any, Sequence[int]]]) -> torch.Tensor: ...
    def head_input(self, rows: torch.Tensor) -> torch.Tensor: ...
    def mark(self, state: Any) -> Any: ...
    def rewind(self, state: Any, m: Any, keep: int) -> None: ...


class V4Target:
    """DeepSeek-V4: the MTP layer, final streams, slot verify (module docstring)."""

    slots = True

    def __init__(self, model: DeepseekV4ForCausalLM, config: SpeculativeConfig) -> None:
        if config.method != "mtp":
            raise CheckpointError(f"speculative method {config.method!r} drafts with DeepSeek-V4.1's DSpark layers; this DeepSeek-V4 checkpoint drafts with 'mtp'")
        self.model = model
        self.drafter = Drafter(model, MTPLayer.from_model(model))

    def forward(self, chunks: Sequence[tuple[Any, Sequence[int]]]) -> torch.Tensor:
        """Every fed token's final streams ``(N, hc, H)``."""
        return self.model(chunks, logits="streams")

    def head_input(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.final_hidden(rows)

    def mark(self, state: Any) -> v4_rewind.Mark:
        return v4_rewind.mark(state)

    def rewind(self, state: Any, m: v4_rewind.Mark, keep: int) -> None:
        v4_rewind.rewind(self.model, state, m, keep)


class V41Target:
    """DeepSeek-V4.1: the DSpark draft layers, ``taps`` rows, general path only (module docstring)."""

    slots = False

    def __init__(self, model: DeepseekV41ForCausalLM, config: SpeculativeConfig) -> None:
        if config.method != "dspark":
            raise CheckpointError(f"speculative method {config.method!r} drafts with DeepSeek-V4's MTP layer; this DeepSeek-V4.1 checkpoint drafts with 'dspark'")
        block = model.config.dspark_block_size
        if config.num_speculative_tokens > block:
            raise CheckpointError(f"num_speculative_tokens {config.num_speculative_tokens} exceeds this checkpoint's DSpark block (dspark_block_size {block})")
        self.model = model
        self.drafter = DSparkDrafter(model, DSpark.from_model(model), config.confidence_threshold)

    def forward(self, chunks: Sequence[tuple[Any, Sequence[int]]]) -> torch.Tensor:
        """Every fed token's ``(1 + taps, H)`` rows ``(N, 1 + taps, H)``."""
        return self.model(chunks, logits="taps")

    def head_input(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, 0]

    def mark(self, state: Any) -> v41_rewind.V41Mark:
        return v41_rewind.mark(state)

    def rewind(self, state: Any, m: v41_rewind.V41Mark, keep: int) -> None:
        v41_rewind.rewind(self.model, state, m, keep)


def target_for(model: Any, config: SpeculativeConfig) -> SpecTarget:
    """The family's target; ``CheckpointError`` when ``config`` does not fit the checkpoint."""
    if isinstance(model, DeepseekV4ForCausalLM):
        return V4Target(model, config)
    if isinstance(model, DeepseekV41ForCausalLM):
        return V41Target(model, config)
    raise CheckpointError(f"speculative decoding has no drafter for {type(model).__name__}")

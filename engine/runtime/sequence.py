"""A request inside the engine: its tokens, its model state and its sampling state."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from engine.model.mtp import DraftState
from engine.model.state import SequenceState
from deepserve.protocol import GenerateRequest, TokenLogprob
from engine.sampling import SamplingState


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. ``tokens`` = prompt + outputs; ``num_computed`` of them are in ``state``.

    A step feeds ``tokens[num_computed : num_computed + n]``; when that reaches the end, the
    model's last logits are sampled and the new token is appended.
    """

    request: GenerateRequest
    sampling: SamplingState | None  # None while its grammar compiles (``grammar``)
    tokens: list[int]
    num_prompt: int
    state: SequenceState | None = None
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens restored from the KV store
    status: Status = Status.WAITING
    block_ids: list[int] = field(default_factory=list)
    has_boundary: bool = False
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_preemptions: int = 0
    kv_checked: bool = False  # the KV store was searched for this sequence's prefix
    kv_load: Future | None = None  # the running KV-store lookup/load (not schedulable meanwhile)
    grammar: Future | None = None  # the output constraint compiling off the engine thread (not schedulable meanwhile)
    grammar_deadline: float = 0.0  # monotonic time by which the grammar must be ready
    snapshot_at: int | None = None  # a prefill chunk must end here (the prompt's last whole unit)
    saved_upto: int = 0  # tokens whose units are already in the KV store
    # one slot per prompt token while ``sampling.prompt_logprobs`` asks and the first token is not
    # out yet (``engine/runtime/prompt_logprobs.py``); handed to that token's event, then None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # speculative decoding (engine/runtime/speculative.py): drafts to verify after the next token
    # (fed only while that token is the one remaining), and the MTP layer's window
    draft_ids: list[int] = field(default_factory=list)
    draft: DraftState | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def remaining(self) -> int:
        """Tokens not yet fed to the model."""
        return len(self.tokens) - self.num_computed

    @property
    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: lower priority value first, then first come first served."""
        return (self.request.priority, self.arrival)

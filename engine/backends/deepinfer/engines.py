"""DeepInfer ``LLMEngine`` subclasses, one per role, with its empty hooks filled by deepserve.

``engine_classes(LLMEngine)`` builds them over the class it is given (DeepInfer's, imported by
the factory on an SM100 node; a stand-in in tests), so this module never imports ``deepinfer``.

Roles: ``mixed`` → ``EngineType.NORMAL``, ``prefill`` → ``PROMPT``, ``decode`` → ``COMPLETION``.
What each hook does (called by DeepInfer 0.1.0's ``LLMEngine.step`` / worker callbacks):

- ``init_pd_split`` (PROMPT/COMPLETION, during ``__init__``): bind the cache to the bridge and
  allocate ``copy_state`` (a copy of the state slots) and its event; NORMAL does it after init.
- ``post_schedule``: NORMAL, decode steps: store the prompt units of sequences whose prompt is
  computed (``num_cached_tokens`` reached its length) and not stored yet, reading the windows at
  its last whole unit through the extra-state ring.
- ``should_copy_state`` / ``do_copy_state`` (decode steps): a sequence standing on a unit
  boundary due for a decode snapshot gets its slot copied (DeepInfer's own ``do_copy_state``).
- ``do_save_kvcache`` (decode steps, after the copy's event): store those units + snapshots.
- ``pe_prepare_save_kvcache`` (prompt steps): a sequence that ended in its prompt step (its first
  token ended it) has its prompt stored before it is freed; ``pe_do_save_kvcache`` (PROMPT): drops
  the bookkeeping of those. Prompt units are stored once a prompt is complete, so no mid-prefill
  staging is needed.
- ``finalize_seq`` (NORMAL/COMPLETION): a prompt not stored yet is stored, then the sequence freed.
  (A sequence that finishes while its engine then goes idle is finalised at the next step.)
- ``process_output``: each ``RequestOutput`` pointer read into a ``RawOutput`` (pointers die at
  the next step); ``step`` calls it, as ``flush_inflight_reqs`` does.
- ``send_processed_prompts`` (PROMPT): each finished prompt in ``scheduler.running``: prompt units
  stored, the hand-off record shipped, the sequence taken out of ``running`` and freed.
- ``post_process_model_outputs``: refresh the rank's ``RankLoad`` (read on the engine thread only).
- ``get_num_pendings`` / ``build_extra_metrics_log``: + prompts not stored yet; the bridge's counters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.backends.base import Handoff, keep_recent
from engine.backends.deepinfer.bridge import CacheAccess, KVBridge, save_point
from engine.backends.deepinfer.layout import KVSTORE_GRAIN
from deepserve.protocol import RankLoad, Role

ENGINE_TYPES: dict[Role, str] = {"mixed": "NORMAL", "prefill": "PROMPT", "decode": "COMPLETION"}


@dataclass(frozen=True)
class RawOutput:
    """One ``RequestOutput`` copied out of DeepInfer's pool: one emitted token."""

    request_id: str
    token_id: int
    finished: bool
    finish_reason: str
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Hooks:
    """What the engine subclass shares with its backend (one engine thread touches it).

    ``tokens``: each live request's prompt + output tokens (the backend appends outputs).
    ``prompt_saved``: requests whose prompt units are stored (or not theirs to store: decode).
    """

    dp_rank: int
    bridge: KVBridge | None
    make_cache: Callable[[Any], CacheAccess]  # engine -> its cache access
    new_event: Callable[[], Any]  # torch.cuda.Event on a real node
    read_output: Callable[[int], RawOutput]  # RequestOutput pointer -> RawOutput
    snapshot_interval_units: int = 1  # decode snapshots every N units (0: none)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    prompt_len: dict[str, int] = field(default_factory=dict)
    prompt_saved: set[str] = field(default_factory=set)
    outputs: list[RawOutput] = field(default_factory=list)
    shipped: dict[str, Handoff] = field(default_factory=dict)
    load: RankLoad = field(default_factory=lambda: RankLoad(dp_rank=0))

    def forget(self, request_id: str) -> None:
        for d in (self.tokens, self.prompt_len):
            d.pop(request_id, None)
        self.prompt_saved.discard(request_id)
        if self.bridge is not None:
            self.bridge.forget(request_id)


def engine_classes(base: type) -> dict[Role, type]:
    """The ``mixed`` / ``prefill`` / ``decode`` subclasses of ``base`` (DeepInfer's ``LLMEngine``)."""

    class DeepserveEngine(base):  # type: ignore[misc, valid-type]
        """``LLMEngine`` with deepserve's hooks; construct with ``hooks=`` besides DeepInfer's arguments."""

        def __init__(self, *args: Any, hooks: Hooks, **kwargs: Any) -> None:
            self.deepserve = hooks  # set first: init_pd_split runs inside LLMEngine.__init__
            super().__init__(*args, **kwargs)
            if self.copy_state is None:  # NORMAL engines skip init_pd_split
                self._attach()

        def _attach(self) -> None:
            h = self.deepserve
            cache = h.make_cache(self)
            if h.bridge is not None:
                h.bridge.attach(cache)
            self.copy_state = torch.zeros_like(cache.states())  # (slots, state_slot_bytes) uint8
            self.copy_state_event = h.new_event()

        def _save_prompt(self, seq: Any) -> None:
            """Once ``seq``'s prompt is computed: store its whole units and the snapshot at its last
            unit before the end (windows read through the extra-state ring)."""
            h = self.deepserve
            rid = seq.request_id
            if rid in h.prompt_saved or rid not in h.prompt_len or seq.num_cached_tokens < h.prompt_len[rid]:
                return
            if h.bridge is not None:
                h.bridge.save(seq, h.tokens[rid], save_point(h.prompt_len[rid]))
            h.prompt_saved.add(rid)

        # ---- the hooks ------------------------------------------------------------------
        def init_pd_split(self) -> None:
            self._attach()

        def should_copy_state(self, seq: Any) -> bool:
            h = self.deepserve
            n, every = seq.num_cached_tokens, h.snapshot_interval_units
            if h.bridge is None or every <= 0 or n % KVSTORE_GRAIN or n <= seq.last_copy_state_token_idx:
                return False
            return (n // KVSTORE_GRAIN) % every == 0 and seq.request_id in h.tokens

        def do_save_kvcache(self, scheduled: list[Any], finished: list[Any]) -> None:
            h = self.deepserve
            if h.bridge is None:
                return
            for seq in scheduled + finished:
                at = seq.last_copy_state_token_idx
                if at > 0 and not at % KVSTORE_GRAIN and seq.request_id in h.tokens:
                    h.bridge.save(seq, h.tokens[seq.request_id], at, self.copy_state)

        def pe_prepare_save_kvcache(self, scheduled: list[Any], finished: list[Any]) -> None:
            for seq in finished:  # ended in its prompt step: store its prompt before it is freed
                self._save_prompt(seq)

        def finalize_seq(self, seq: Any) -> None:
            self._save_prompt(seq)
            self.deepserve.forget(seq.request_id)
            super().finalize_seq(seq)

        def process_output(self, output: Any) -> None:
            self.deepserve.outputs.extend(self.deepserve.read_output(int(ptr)) for ptr in output)

        def post_process_model_outputs(self) -> None:
            s = self.scheduler
            queued, _ = s.get_sum_prompt_len_waiting()
            total = max(self.cache_config.num_gpu_blocks, 1)
            usage = 1.0 - s.get_num_free_gpu_blocks() / total
            self.deepserve.load = RankLoad(self.deepserve.dp_rank, len(s.running), len(s.waiting), int(queued), usage)

        def get_num_pendings(self) -> int:
            h = self.deepserve
            return super().get_num_pendings() + len(h.prompt_len.keys() - h.prompt_saved)

        def build_extra_metrics_log(self) -> str | None:
            b = self.deepserve.bridge
            return None if b is None else "deepserve kv: " + ", ".join(f"{k}={v}" for k, v in b.counts.items())

        def step(self) -> Any:
            outputs = super().step()
            self.process_output(outputs)
            return outputs

    class MixedEngine(DeepserveEngine):
        """NORMAL: prefill and decode in one engine; prompt units stored once the prompt is done."""

        def post_schedule(self, scheduler_outputs: Any) -> None:
            if scheduler_outputs.prompt_run:
                return
            for seq in scheduler_outputs.scheduled_seqs:  # decoding: its prompt is done
                self._save_prompt(seq)

    class PrefillEngine(DeepserveEngine):
        """PROMPT: prefill only; each finished prompt leaves as a hand-off record."""

        def pe_do_save_kvcache(self, scheduled: list[Any], finished: list[Any]) -> None:
            for seq in finished:  # a PROMPT engine has no finalize_seq call
                self.deepserve.forget(seq.request_id)

        def send_processed_prompts(self) -> None:
            h = self.deepserve
            done = [s for s in self.scheduler.running if s.request_id in h.tokens]
            if not done:
                return
            names = {s.request_id for s in done}
            self.scheduler.running = [s for s in self.scheduler.running if s.request_id not in names]
            for seq in done:
                rid = seq.request_id
                prompt = h.tokens[rid][: h.prompt_len[rid]]
                self._save_prompt(seq)
                if h.bridge is not None:
                    keep_recent(h.shipped, rid, h.bridge.ship(seq, prompt, seq.last_output_token))
                self.scheduler.free_seq(seq)
            self.post_process_model_outputs()  # the load without the shipped prompts

    class DecodeEngine(DeepserveEngine):
        """COMPLETION: decode only (``stop_preempted_request``: it cannot recompute); its requests
        come in through ``DeepInferBackend``'s injection of a hand-off record."""

    return {"mixed": MixedEngine, "prefill": PrefillEngine, "decode": DecodeEngine}

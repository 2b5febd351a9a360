"""A STAND-IN for DeepInfer 0.1.0's ``LLMEngine`` Python surface — not DeepInfer.

DeepInfer cannot run here (its ``_C`` extension needs CUDA on SM100), so the adapter in
``engine/backends/deepinfer/`` is exercised against this imitation of the surface it uses, read
from the sdist (``engine/llm_engine.py``, ``worker/worker.py``, ``worker/cache_engine.py``,
``sampling_params.py``, ``_C/engine.pyi``). What it mimics:

- ``LLMEngine``: ``add_request(user_id, request_id, sampling_params, prompt_token_ids, ...,
  enqueue=True, chunk_checkpoints=None) -> Sequence | None``, ``abort_request``, ``step()``
  returning ``RequestOutput`` pointers (a ``uint64`` array), ``flush_inflight_reqs``,
  ``has_unfinished_requests``, ``get_num_pendings``, ``close``; attributes ``engine_type``,
  ``scheduler``, ``cache_config.num_gpu_blocks``, ``driver_worker.cache_engine.gpu_blocks`` /
  ``gpu_states``, ``copy_state`` / ``copy_state_event``; the base ``do_copy_state`` and
  ``finalize_seq`` (frees).
- The order ``step`` calls the hooks in: ``schedule`` → ``post_schedule`` → (decode steps)
  ``should_copy_state`` / ``do_copy_state`` → forward → ``pre_sampler_sync`` (``do_save_kvcache``
  on decode steps, ``pe_prepare_save_kvcache`` on prompt steps, ``finalize_seq`` of finished
  sequences on NORMAL/COMPLETION) → ``post_process`` (``pe_do_save_kvcache`` on prompt steps,
  outputs, ``post_process_model_outputs``, ``send_processed_prompts`` on PROMPT). NORMAL and
  COMPLETION engines use zero-overhead scheduling: a step returns the *previous* step's outputs;
  PROMPT engines return their own. ``init_pd_split`` runs inside ``__init__`` for PROMPT and
  COMPLETION. A PROMPT engine's finished prompts stay in ``scheduler.running`` until
  ``send_processed_prompts`` takes them.
- ``Sequence``: ``request_id``, ``state_id``, ``num_cached_tokens`` (tokens whose KV is ready;
  advanced after the forward here, where DeepInfer advances it optimistically at schedule time),
  ``cached_hit_tokens``, ``last_copy_state_token_idx``, ``last_output_token``, ``status``,
  ``chunk_checkpoints``, and ``block_table`` — which the 0.1.0 release does NOT expose; the
  stand-in has it as the optional patch in docs/DEEPINFER.md would.
- ``Scheduler``: ``running`` (settable), ``waiting``, ``add_sequence``, ``abort_sequence``,
  ``free_seq``, ``try_allocate_seq``, ``get_sum_prompt_len_waiting``, ``get_num_free_gpu_blocks``.
- ``select_state_slice_to_store`` / ``load_state_from_store_to_prefill_cache`` semantics over the
  byte layout of ``engine.backends.deepinfer.layout`` (rolling rings indexed by position).

The "model" is not a neural network: each token's KV rows are bytes derived from the token, its
position and the layer, written where DeepInfer's layout puts them (SWA ring rows per layer,
compressed and indexer rows per KV-source layer, a ratio-2 source's open group in its
compressor state), and the next token is a checksum of what the sequence's state and blocks hold
for the tokens so far. So a continuation is right only when every byte a record should carry
arrived. After a prefix hit the stand-in rebuilds the YOCO consumer windows from the tokens, as
DeepInfer's truncated prefill recomputes them.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.backends.deepinfer.layout import KVSTORE_GRAIN, SWA_ROW_BYTES, CacheLayout, DeepInferEnv, cache_layout
from engine.model.v41.config import V41Config

# A small V4.1-shaped config: layers 0 sliding, 1-2 ratio 2 (source 1), 3-5 ratio 1 (source 3,
# the first YOCO consumer), one MTP layer; real row widths (512-wide KV, 128-wide indexer keys).
STANDIN_CONFIG = V41Config(
    num_hidden_layers=6,
    compress_ratios=(0, 2, 2, 1, 1, 1),
    kv_source_layer_ids=(1, 3),
    index_source_layer_ids=(1, 3),
    candidate_source_layer_id=-1,
    num_nextn_predict_layers=1,
)
VOCAB = 1000
EOS = 1


class EngineType(enum.Enum):
    """Stand-in of ``deepinfer.engine.engine_type.EngineType``."""

    NORMAL = 0
    PROMPT = 1
    COMPLETION = 2


class SequenceStatus(enum.Enum):
    """Stand-in of ``deepinfer._C.engine.SequenceStatus`` (the members the adapter meets)."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5


class SamplingParams:
    """Stand-in of ``deepinfer.sampling_params.SamplingParams``: the same constructor."""

    def __init__(
        self,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        ignore_eos: bool = False,
        max_tokens: int = 16,
        logprobs: bool = False,
        prompt_logprobs: bool = False,
        top_logprobs: int = 0,
        first_n_token_no_eos: int = 0,
        eos_id: int = 0,
        so_args: dict | None = None,
        golden_token_ids: list[int] | None = None,
        seq_seed: int | None = None,
    ) -> None:
        if not 0.0 < top_p <= 1.0 or top_k < -1 or top_k == 0 or max_tokens < 1 or not 0 <= top_logprobs <= 1000:
            raise ValueError("invalid sampling parameters")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.ignore_eos, self.max_tokens, self.top_logprobs = ignore_eos, max_tokens, top_logprobs
        self.eos_id, self.so_args, self.seq_seed = eos_id, so_args, seq_seed


@dataclass(eq=False)
class Sequence:
    """Stand-in of ``deepinfer._C.engine.Sequence`` (plus the patched ``block_table``)."""

    request_id: str
    tokens: list[int]
    prompt_len: int
    sampling_params: SamplingParams
    status: SequenceStatus = SequenceStatus.WAITING
    state_id: int = -1
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    cached_hit_tokens: int = 0
    last_copy_state_token_idx: int = 0
    last_output_token: int = -1
    chunk_checkpoints: list[int] = field(default_factory=list)
    num_outputs: int = 0
    finish: str = ""

    def get_prompt_len(self) -> int:
        return self.prompt_len

    def get_len(self) -> int:
        return len(self.tokens)


class RequestOutputs:
    """Stand-in of ``RequestOutput``'s static getters over one engine's output pool."""

    def __init__(self) -> None:
        self._pool: dict[int, tuple[str, int, bool, str]] = {}
        self._next = 1

    def make(self, rid: str, token: int, finished: bool, reason: str) -> int:
        ptr, self._next = self._next, self._next + 1
        self._pool[ptr] = (rid, token, finished, reason)
        return ptr

    def release(self, ptrs: np.ndarray) -> None:
        for p in ptrs:
            self._pool.pop(int(p), None)

    def get_request_id(self, ptr: int) -> str:
        return self._pool[ptr][0]

    def get_token_id(self, ptr: int) -> int:
        return self._pool[ptr][1]

    def get_finished(self, ptr: int) -> bool:
        return self._pool[ptr][2]

    def get_finish_reason(self, ptr: int) -> str:
        return self._pool[ptr][3]

    def get_token_logprobs(self, ptr: int) -> float:
        return -0.5

    def get_top_token_ids(self, ptr: int) -> list[int]:
        return [self._pool[ptr][1]]

    def get_top_logprobs(self, ptr: int) -> list[float]:
        return [-0.5]


@dataclass
class SchedulerOutputs:
    """Stand-in of ``SchedulerOutputs``: what a step runs."""

    scheduled_seqs: list[Sequence]
    finished_seqs: list[Sequence]
    prompt_run: bool
    chunks: list[int]  # tokens fed per scheduled sequence


class Scheduler:
    """Stand-in of DeepInfer's C++ scheduler: prompt steps before decode steps, chunked prefill
    ending at ``chunk_checkpoints``, blocks and a state slot allocated per sequence."""

    def __init__(self, engine: StandInLLMEngine) -> None:
        self.e = engine
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.free_blocks = list(range(engine.num_blocks))
        self.free_states = list(range(engine.num_slots))

    def try_allocate_seq(self, seq: Sequence) -> bool:
        need = -(-(seq.prompt_len + seq.sampling_params.max_tokens + 1) // KVSTORE_GRAIN)
        if seq.state_id >= 0:
            return True
        if need > len(self.free_blocks) or not self.free_states:
            return False
        seq.block_table = [self.free_blocks.pop(0) for _ in range(need)]
        seq.state_id = self.free_states.pop(0)
        cache = self.e.driver_worker.cache_engine
        cache.gpu_blocks[seq.block_table] = 0
        cache.gpu_states[seq.state_id] = 0
        return True

    def add_sequence(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def free_seq(self, seq: Sequence) -> None:
        if seq.state_id >= 0:
            self.free_blocks.extend(seq.block_table)
            self.free_states.append(seq.state_id)
            seq.block_table, seq.state_id = [], -1
        self.running = [s for s in self.running if s is not seq]

    def abort_sequence(self, request_ids: list[str]) -> list[Sequence]:
        gone = [s for s in self.waiting + self.running if s.request_id in request_ids]
        for s in gone:
            s.status = SequenceStatus.FINISHED_ABORTED
            self.waiting = [w for w in self.waiting if w is not s]
            self.free_seq(s)
        return gone

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or [s for s in self.running if s.status == SequenceStatus.RUNNING])

    def get_sum_prompt_len_waiting(self) -> tuple[int, int]:
        return sum(s.prompt_len - s.num_cached_tokens for s in self.waiting), len(self.waiting)

    def get_num_free_gpu_blocks(self) -> int:
        return len(self.free_blocks)

    def schedule(self) -> SchedulerOutputs:
        finished, self.finished = self.finished, []
        kind = self.e.engine_type
        if self.waiting and kind != EngineType.COMPLETION:
            budget, out, chunks = self.e.max_num_batched_tokens, [], []
            for seq in list(self.waiting):
                if budget <= 0 or not self.try_allocate_seq(seq):
                    break
                start = seq.num_cached_tokens
                stops = [c for c in seq.chunk_checkpoints if c > start] + [seq.prompt_len]
                n = min(min(stops) - start, budget)
                budget -= n
                out.append(seq)
                chunks.append(n)
            if out:
                return SchedulerOutputs(out, finished, True, chunks)
        decoding = [s for s in self.running if s.status == SequenceStatus.RUNNING] if kind != EngineType.PROMPT else []
        return SchedulerOutputs(decoding, finished, False, [1] * len(decoding))


class CacheEngine:
    """Stand-in of ``driver_worker.cache_engine``: ``gpu_blocks`` / ``gpu_states`` (CPU here)."""

    def __init__(self, layout: CacheLayout, num_blocks: int, num_slots: int) -> None:
        self.gpu_blocks = torch.zeros(num_blocks, layout.block_bytes, dtype=torch.uint8)  # (blocks, block_bytes)
        self.gpu_states = torch.zeros(num_slots, layout.state_slot_bytes, dtype=torch.uint8)  # (slots, slot_bytes)


@dataclass
class _Worker:
    cache_engine: CacheEngine


class Event:
    """Stand-in of ``torch.cuda.Event`` (CPU work is done when issued)."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True)
class StandInConfig:
    """What the stand-in is built from (DeepInfer's four config objects, reduced)."""

    env: DeepInferEnv = DeepInferEnv(prefill_store_extra_state=True, yoco_truncation_mode="compact", yoco_keep_tokens=140)
    num_blocks: int = 48
    num_slots: int = 6
    max_num_batched_tokens: int = 256


@dataclass
class _CacheConfig:
    num_gpu_blocks: int


class StandInLLMEngine:
    """Stand-in of ``deepinfer.engine.llm_engine.LLMEngine`` (see the module docstring)."""

    def __init__(self, config: StandInConfig, log_stats: bool = False, engine_type: EngineType = EngineType.NORMAL) -> None:
        self.engine_type = engine_type
        self.layout = cache_layout(STANDIN_CONFIG, config.env)
        self.num_blocks, self.num_slots = config.num_blocks, config.num_slots
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.cache_config = _CacheConfig(config.num_blocks)
        self.driver_worker = _Worker(CacheEngine(self.layout, config.num_blocks, config.num_slots))
        self.outputs = RequestOutputs()
        self.scheduler = Scheduler(self)
        self.copy_state: torch.Tensor | None = None
        self.copy_state_event: Event | None = None
        self._inflight: np.ndarray | None = None  # zero-overhead scheduling: the previous step's outputs
        self._released: list[np.ndarray] = []
        if engine_type != EngineType.NORMAL:
            self.init_pd_split()

    # ---- the surface --------------------------------------------------------------------
    def add_request(
        self,
        user_id: str,
        request_id: str,
        sampling_params: SamplingParams,
        prompt_token_ids: np.ndarray,
        multi_modal_data: dict | None = None,
        arrival_time: float | None = None,
        extra: dict | None = None,
        enqueue: bool = True,
        chunk_checkpoints: list[int] | None = None,
    ) -> Sequence | None:
        if prompt_token_ids.size == 0:
            raise ValueError("prompt must not be empty")
        if prompt_token_ids.min() < 0 or prompt_token_ids.max() >= VOCAB:
            return None
        seq = Sequence(request_id, prompt_token_ids.tolist(), int(prompt_token_ids.size), sampling_params, chunk_checkpoints=list(chunk_checkpoints or []))
        if enqueue:
            self.scheduler.add_sequence(seq)
        return seq

    def abort_request(self, request_id: str | list[str]) -> tuple[int, int]:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        seqs = self.scheduler.abort_sequence(ids)
        return len(seqs), sum(s.get_len() for s in seqs)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_pendings(self) -> int:
        return self.scheduler.get_sum_prompt_len_waiting()[0]

    def flush_inflight_reqs(self) -> np.ndarray:
        out, self._inflight = (self._inflight if self._inflight is not None else np.empty(0, dtype=np.uint64)), None
        self.process_output(out)
        return out

    def close(self) -> None:
        pass

    @property
    def zero_overhead(self) -> bool:
        return self.engine_type != EngineType.PROMPT

    def step(self) -> np.ndarray:
        for ptrs in self._released:  # pointers stay valid until the next step
            self.outputs.release(ptrs)
        self._released = []
        so = self.scheduler.schedule()
        self.post_schedule(so)
        if not so.prompt_run and self.copy_state is not None:
            to_copy = [s for s in so.scheduled_seqs + so.finished_seqs if self.should_copy_state(s)]
            if to_copy:
                self.do_copy_state(to_copy)
                self.copy_state_event.record()
        sampled = self._forward(so)
        self.pre_sampler_sync(so)
        produced = self._process_outputs(so, sampled)  # the scheduler's state moves on at once
        if self.zero_overhead:
            out, self._inflight = (self._inflight if self._inflight is not None else np.empty(0, dtype=np.uint64)), produced
        else:
            out = produced
        self._post_process(so)
        self._released.append(out)
        return out

    # ---- DeepInfer's base implementations of the hooks ----------------------------------
    def do_copy_state(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.state_id != -1:
                self.copy_state[seq.state_id].copy_(self.driver_worker.cache_engine.gpu_states[seq.state_id])
                seq.last_copy_state_token_idx = seq.num_cached_tokens

    def init_pd_split(self) -> None:
        pass

    def finalize_seq(self, seq: Sequence) -> None:
        self.scheduler.free_seq(seq)

    def post_schedule(self, scheduler_outputs: SchedulerOutputs) -> None:
        pass

    def should_copy_state(self, seq: Sequence) -> bool:
        return False

    def do_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        pass

    def pe_prepare_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        pass

    def pe_do_save_kvcache(self, scheduled: list[Sequence], finished: list[Sequence]) -> None:
        pass

    def process_output(self, output: np.ndarray) -> None:
        pass

    def send_processed_prompts(self) -> None:
        pass

    def post_process_model_outputs(self) -> None:
        pass

    # ---- the step's insides -------------------------------------------------------------
    def pre_sampler_sync(self, so: SchedulerOutputs) -> None:
        if not so.prompt_run:
            self.do_save_kvcache(so.scheduled_seqs, so.finished_seqs)
        else:
            self.pe_prepare_save_kvcache(so.scheduled_seqs, so.finished_seqs)
        if self.engine_type != EngineType.PROMPT:
            for seq in so.finished_seqs:
                self.finalize_seq(seq)

    def _post_process(self, so: SchedulerOutputs) -> None:
        if so.prompt_run:
            self.pe_do_save_kvcache(so.scheduled_seqs, so.finished_seqs)
        self.post_process_model_outputs()
        if self.engine_type == EngineType.PROMPT:
            self.send_processed_prompts()

    def _forward(self, so: SchedulerOutputs) -> list[int | None]:
        """Write each fed token's KV bytes; the sampled token of sequences at their end (else None)."""
        sampled: list[int | None] = []
        for seq, n in zip(so.scheduled_seqs, so.chunks, strict=True):
            start = seq.num_cached_tokens
            if so.prompt_run:
                if start and start == seq.cached_hit_tokens:
                    self._replay_consumers(seq, start)  # YOCO truncated prefill: consumer windows again
                for p in range(start, start + n):
                    self._write(seq, p, seq.tokens[p])
                seq.num_cached_tokens = start + n
                sampled.append(self._digest(seq, start + n) if start + n == seq.prompt_len else None)
            else:
                self._write(seq, start, seq.last_output_token)
                seq.num_cached_tokens = start + 1
                sampled.append(self._digest(seq, start + 1))
        return sampled

    def _process_outputs(self, so: SchedulerOutputs, sampled: list[int | None]) -> np.ndarray:
        ptrs = []
        for seq, tok in zip(so.scheduled_seqs, sampled, strict=True):
            if not so.prompt_run:
                seq.tokens.append(seq.last_output_token)
            if tok is None:
                continue
            if so.prompt_run:
                self.scheduler.waiting = [w for w in self.scheduler.waiting if w is not seq]
                seq.status = SequenceStatus.RUNNING
                self.scheduler.running.append(seq)
            seq.last_output_token = tok
            seq.num_outputs += 1
            reason = ""
            if tok == EOS and not seq.sampling_params.ignore_eos:
                reason = "stop"
            elif seq.num_outputs >= seq.sampling_params.max_tokens:
                reason = "length"
            if reason:
                seq.status = SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_LENGTH_CAPPED
                self.scheduler.running = [s for s in self.scheduler.running if s is not seq]
                self.scheduler.finished.append(seq)
            ptrs.append(self.outputs.make(seq.request_id, tok, bool(reason), reason))
        return np.asarray(ptrs, dtype=np.uint64)

    # ---- the imitation model ------------------------------------------------------------
    def _ring_row(self, slot: torch.Tensor, layer: int, position: int) -> torch.Tensor:
        L = self.layout
        per_layer = -(-L.ring_kvstore * SWA_ROW_BYTES // 32) * 32
        base = layer * per_layer + (position % L.ring_kvstore) * SWA_ROW_BYTES
        return slot[base : base + SWA_ROW_BYTES]

    def _compress_state(self, slot: torch.Tensor) -> torch.Tensor:
        L = self.layout
        per_layer = -(-L.ring_kvstore * SWA_ROW_BYTES // 32) * 32
        start = L.swa_layers * per_layer
        return slot[start : start + L.compress_state_bytes]

    @staticmethod
    def _stamp(row: torch.Tensor, *values: int) -> None:
        row.zero_()
        row[: 8 * len(values)] = torch.tensor(values, dtype=torch.int64).view(torch.uint8)

    def _write(self, seq: Sequence, p: int, token: int) -> None:
        cache = self.driver_worker.cache_engine
        slot = cache.gpu_states[seq.state_id]
        for layer in range(self.layout.swa_layers):
            self._stamp(self._ring_row(slot, layer, p), layer, p, token)
        block = cache.gpu_blocks[seq.block_table[p // KVSTORE_GRAIN]]
        for r in self.layout.regions:
            ratio = KVSTORE_GRAIN // r.rows
            if (p + 1) % ratio == 0:
                row = (p % KVSTORE_GRAIN) // ratio
                self._stamp(block[r.offset + row * r.row_bytes : r.offset + (row + 1) * r.row_bytes], r.layer, p, token, ratio)
        self._stamp(self._compress_state(slot)[:64], p % 2, token if p % 2 == 0 else 0)  # a ratio-2 group's open half

    def _replay_consumers(self, seq: Sequence, start: int) -> None:
        slot = self.driver_worker.cache_engine.gpu_states[seq.state_id]
        for p in range(max(0, start - STANDIN_CONFIG.sliding_window), start):
            for layer in range(self.layout.swa_stored_layers, self.layout.swa_layers):
                self._stamp(self._ring_row(slot, layer, p), layer, p, seq.tokens[p])

    def _digest(self, seq: Sequence, n: int) -> int:
        """The next token after ``n`` tokens: a checksum of the windows, compressor state and blocks."""
        cache = self.driver_worker.cache_engine
        slot = cache.gpu_states[seq.state_id]
        crc = 0
        for p in range(max(0, n - STANDIN_CONFIG.sliding_window), n):
            for layer in range(self.layout.swa_layers):
                crc = zlib.crc32(self._ring_row(slot, layer, p).numpy().tobytes(), crc)
        crc = zlib.crc32(self._compress_state(slot)[:64].numpy().tobytes(), crc)
        for b in seq.block_table[: -(-n // KVSTORE_GRAIN)]:
            crc = zlib.crc32(cache.gpu_blocks[b].numpy().tobytes(), crc)
        return 2 + crc % (VOCAB - 2)  # never EOS: the tests choose when a request ends


class StandInCache:
    """``CacheAccess`` over the stand-in (what ``factory.EngineCache`` is over DeepInfer), with
    ``select_state_slice_to_store`` / ``load_state_from_store_to_prefill_cache`` semantics:
    rolling rings, the inference ring (window + backtracking) cut out of the kvstore ring."""

    def __init__(self, engine: StandInLLMEngine) -> None:
        self.e = engine
        self.layout = engine.layout

    def block_ids(self, seq: Sequence) -> list[int]:
        return list(seq.block_table)

    def block(self, block_id: int) -> torch.Tensor:
        return self.e.driver_worker.cache_engine.gpu_blocks[block_id]

    def states(self) -> torch.Tensor:
        return self.e.driver_worker.cache_engine.gpu_states

    def _inference_rows(self, slot: torch.Tensor, layers: range, position: int) -> torch.Tensor:
        L = self.layout
        per_layer = -(-L.ring_inference * SWA_ROW_BYTES // 32) * 32
        out = torch.zeros(len(layers), per_layer, dtype=torch.uint8)
        for i, layer in enumerate(layers):
            for p in range(max(0, position - L.ring_inference), position):
                j = (p % L.ring_inference) * SWA_ROW_BYTES
                out[i, j : j + SWA_ROW_BYTES] = self.e._ring_row(slot, layer, p)
        return out.view(-1)

    def stored_windows(self, state_cache: torch.Tensor, state_id: int, position: int) -> torch.Tensor:
        assert position % KVSTORE_GRAIN == 0
        return self._inference_rows(state_cache[state_id], range(self.layout.swa_stored_layers), position)

    def decode_state(self, state_id: int, position: int) -> torch.Tensor:
        L = self.layout
        slot = self.states()[state_id]
        swa = self._inference_rows(slot, range(L.swa_layers), position)
        out = torch.zeros(L.total_bytes_inference, dtype=torch.uint8)
        out[: swa.numel()] = swa
        out[swa.numel() : swa.numel() + L.compress_state_bytes] = self.e._compress_state(slot)
        return out

    def load_windows(self, state_id: int, position: int, windows: torch.Tensor) -> None:
        L = self.layout
        slot = self.states()[state_id]
        per_layer = -(-L.ring_inference * SWA_ROW_BYTES // 32) * 32
        rows = windows.view(L.swa_stored_layers, per_layer)
        for layer in range(L.swa_stored_layers):
            for p in range(max(0, position - L.ring_inference), position):
                j = (p % L.ring_inference) * SWA_ROW_BYTES
                self.e._ring_row(slot, layer, p).copy_(rows[layer, j : j + SWA_ROW_BYTES])

    def load_decode_state(self, state_id: int, state: torch.Tensor) -> None:
        L = self.layout
        assert L.ring_kvstore == L.ring_inference, "a decode engine's slot is in inference ring sizes"
        self.states()[state_id, : state.numel()].copy_(state)


"""Configuration of one engine (one DP rank's scheduler and state memory)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from deepserve.protocol import Role


_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "confidence_threshold")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` keys): ``method`` "mtp" drafts with a
    DeepSeek-V4 checkpoint's MTP layer, "dspark" with a DeepSeek-V4.1 checkpoint's DSpark draft
    layers; ``num_speculative_tokens`` drafts per step, verified in one forward;
    ``confidence_threshold`` (dspark only): cut each block before the first draft whose running
    product of confidences falls below it (variable-length verification; None: every draft)."""

    method: Literal["mtp", "dspark"] = "mtp"
    num_speculative_tokens: int = 1
    confidence_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.method not in ("mtp", "dspark"):
            raise ValueError(f"speculative method {self.method!r} is not supported (only 'mtp' or 'dspark')")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if self.confidence_threshold is not None:
            if self.method != "dspark":
                raise ValueError("confidence_threshold is a DSpark setting (method 'dspark'), not one of 'mtp'")
            if not 0 < self.confidence_threshold < 1:
                raise ValueError(f"confidence_threshold must be in (0, 1), got {self.confidence_threshold}")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON object, e.g. ``{"method": "mtp", "num_speculative_tokens": 3}`` or
        ``{"method": "dspark", "num_speculative_tokens": 5, "confidence_threshold": 0.5}``."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"--speculative-config takes a JSON object with {', '.join(map(repr, _SPECULATIVE_KEYS))}")
        unknown = sorted(set(raw) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(map(repr, unknown))} (it takes {', '.join(map(repr, _SPECULATIVE_KEYS))})")
        kinds = {"method": (str,), "num_speculative_tokens": (int,), "confidence_threshold": (int, float)}
        for key, value in raw.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, kinds[key])):
                raise ValueError(f"--speculative-config: {key} must be {' or '.join(t.__name__ for t in kinds[key])}, got {value!r}")
        method, n, threshold = (raw.get(key) for key in _SPECULATIVE_KEYS)
        return cls("mtp" if method is None else method, 1 if n is None else n, None if threshold is None else float(threshold))


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling limits and the state-memory budget of an engine.

    ``state_memory_bytes``: bytes for sequence state (blocks + boundary); on GPU the worker
    derives it from ``gpu_memory_utilization`` and free memory, on CPU it is given directly.
    ``snapshot_interval``: besides the prompt end and the output end, store a boundary snapshot
    every this many tokens (0 = off), in units of 128-token cache units.
    ``static_decode``: decode steps through slot pools (``engine/runtime/static_runner.py``: CUDA
    graphs on GPU, the host slot decoder on CPU); the slots' memory comes on top of the state
    budget. None (default) = on, falling back to the general path if the pools cannot be built.
    ``grammar_timeout_s``: how long a request waits for its output constraint to compile (off the
    engine thread; the start-up of a compile process is not counted); past it the request fails
    as invalid.
    ``speculative``: speculative decoding with the checkpoint's draft layers (V4's MTP, V4.1's
    DSpark: ``engine/runtime/speculative.py``); None = off.
    ``long_prefill_token_threshold``: the largest prefill chunk while other sequences share the
    step (vLLM's name; fair prefill); None = half of ``max_num_batched_tokens``.
    ``weights``: how a checkpoint's FP8 linears and FP4 experts are held: ``native`` as stored
    (``load_model(fp8=..., fp4_experts=True)``: the FP8 GEMM/GEMV and FP4 expert kernels, a quarter
    to a half of bf16's bytes), ``dequantized`` to the model dtype (the parity path), ``auto``
    native on CUDA when the checkpoint stores them, else dequantized.
    ``bounded_replay_tokens``: DeepSeek-V4.1 only, DeepInfer's YOCO ``KEEP_TOKENS``: a prefix
    resumed from block records without a snapshot replays its decoder (ratio-1) layers over only
    its last this many tokens (at least the window; approximate, ``engine/kv_units_v41.py``);
    0 = the exact full replay.
    ``load_format``: vLLM's: ``auto`` reads the checkpoint's weights, ``dummy`` draws random ones
    in the released V4-Flash layout on the device, from ``config.json`` alone (``engine.model.loader``).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 65536
    state_memory_bytes: int = 2 << 30
    gpu_memory_utilization: float = 0.9
    role: Role = "mixed"
    kv_cache: Literal["off", "read", "write", "readwrite"] = "readwrite"
    snapshot_interval_units: int = 0
    max_queue: int = 4096
    static_decode: bool | None = None  # decode through slot pools; None = on unless they cannot be built
    static_max_tokens: int = 8192  # tokens per static slot; longer sequences decode on the general path
    grammar_timeout_s: float = 10.0
    speculative: SpeculativeConfig | None = None
    long_prefill_token_threshold: int | None = None
    weights: Literal["auto", "native", "dequantized"] = "auto"
    bounded_replay_tokens: int = 0
    load_format: Literal["auto", "dummy"] = "auto"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be >= 1")
        if self.state_memory_bytes <= 0:
            raise ValueError("state_memory_bytes must be > 0")
        if not self.grammar_timeout_s > 0:
            raise ValueError("grammar_timeout_s must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.bounded_replay_tokens < 0:
            raise ValueError("bounded_replay_tokens must be >= 0 (0 = exact replay)")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, not {self.load_format!r}")
        if self.weights not in ("auto", "native", "dequantized"):
            raise ValueError(f"weights must be auto, native or dequantized, not {self.weights!r}")

    @property
    def prefill_chunk_cap(self) -> int:
        """The largest prefill chunk in a step shared with other sequences."""
        if self.long_prefill_token_threshold is not None:
            return min(self.long_prefill_token_threshold, self.max_num_batched_tokens)
        return max(1, self.max_num_batched_tokens // 2)

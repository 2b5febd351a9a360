"""Configuration of one engine (one DP rank's scheduler and state memory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deepserve.protocol import Role


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
    engine thread); past it the request fails as invalid.
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

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.state_memory_bytes <= 0:
            raise ValueError("state_memory_bytes must be > 0")
        if not self.grammar_timeout_s > 0:
            raise ValueError("grammar_timeout_s must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")

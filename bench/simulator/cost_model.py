"""Per-worker cost model of the simulator: how long prefill, KV loads, hand-offs and decode steps take.

All times in seconds. One worker is one DP group whose ranks step in lock-step, so a step lasts
as long as its busiest rank's share (``max`` over ranks below).

- **Prefill** of a chunk of ``n`` new tokens after ``p`` tokens already in the KV (cached or
  computed in earlier chunks)::

      n * prefill.per_token_s + n * (p + n / 2) * prefill.per_token_ctx_s

  (linear GEMM work plus attention over the context so far). A step computes at most
  ``prefill.max_batch_tokens`` tokens per rank (chunked prefill) and costs ``prefill.fixed_s``
  more. Cached tokens cost ``kv_load_s_per_token[tier]`` each to bring in (``memory`` = the
  rank's own HBM prefix cache); a tier slower than recomputing is treated as a miss.
- **Hand-off** (prefill pool -> decode pool): ``kv_transfer_fixed_s + prompt_tokens *
  kv_transfer_s_per_token``.
- **Decode step** of a worker whose busiest rank runs ``B`` sequences holding ``C`` context
  tokens::

      decode.fixed_s + decode.per_seq_s * B + decode.per_ctx_token_s * C

  A rank runs at most ``decode.max_batch`` sequences and ``decode.kv_capacity_tokens`` tokens of
  context; further sequences wait.
- **Caches**: each rank keeps an LRU prefix cache of ``cache.hbm_tokens_per_rank`` tokens in
  ``block_size``-token units; a cluster-wide store (tier ``cache.store_tier``, shared by every
  rank) of ``cache.store_tokens`` tokens when > 0.

The shipped default (``default_cost_model.json``) is an estimate at H200 scale for a 13B-active
MoE (DeepSeek V4 Flash), not a measurement; ``bench/simulator/fit.py`` replaces it with one fitted
from measured runs (see its docstring and docs/PERFORMANCE.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

DEFAULT_PATH = Path(__file__).with_name("default_cost_model.json")


@dataclass(frozen=True)
class PrefillCost:
    fixed_s: float = 0.004
    per_token_s: float = 6.0e-5
    per_token_ctx_s: float = 1.0e-10
    max_batch_tokens: int = 16384


@dataclass(frozen=True)
class DecodeCost:
    fixed_s: float = 0.012
    per_seq_s: float = 1.0e-4
    per_ctx_token_s: float = 2.0e-8
    max_batch: int = 128
    kv_capacity_tokens: int = 2_000_000


@dataclass(frozen=True)
class CacheModel:
    hbm_tokens_per_rank: int = 1_000_000
    store_tier: str = "fs"  # a shared tier (router.kv_index.SHARED_TIERS: redis, fs)
    store_tokens: int = 0  # 0 = no cluster-wide store


@dataclass(frozen=True)
class CostModel:
    prefill: PrefillCost = field(default_factory=PrefillCost)
    decode: DecodeCost = field(default_factory=DecodeCost)
    cache: CacheModel = field(default_factory=CacheModel)
    kv_load_s_per_token: dict = field(default_factory=lambda: {"memory": 0.0, "host": 2e-7, "ssd": 1e-6, "fs": 1.5e-6, "redis": 2e-6})
    kv_transfer_fixed_s: float = 0.002
    kv_transfer_s_per_token: float = 2.0e-7
    block_size: int = 128  # KV unit of the engine (and of the router's index)
    source: str = "default estimate"

    def __post_init__(self) -> None:
        assert self.block_size >= 1, "block_size must be >= 1"
        assert self.prefill.max_batch_tokens >= 1 and self.decode.max_batch >= 1, "batch limits must be >= 1"
        for name, v in (("prefill.per_token_s", self.prefill.per_token_s), ("decode.fixed_s", self.decode.fixed_s)):
            assert v >= 0, f"{name} must be >= 0"

    # ---- costs ---------------------------------------------------------------------------------
    def prefill_chunk_s(self, n: int, past: int) -> float:
        p = self.prefill
        return n * p.per_token_s + n * (past + n / 2) * p.per_token_ctx_s

    def load_s_per_token(self, tier: str) -> float:
        """Seconds per cached token loaded from ``tier``, capped at recomputing it."""
        return min(float(self.kv_load_s_per_token.get(tier, 0.0)), self.prefill.per_token_s)

    def decode_step_s(self, batch: int, context: int) -> float:
        d = self.decode
        return d.fixed_s + d.per_seq_s * batch + d.per_ctx_token_s * context

    def transfer_s(self, tokens: int) -> float:
        return self.kv_transfer_fixed_s + tokens * self.kv_transfer_s_per_token

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        def sub(klass, key):
            known = {f.name for f in fields(klass)}
            return klass(**{k: v for k, v in (d.get(key) or {}).items() if k in known})

        top = {k: d[k] for k in ("kv_load_s_per_token", "kv_transfer_fixed_s", "kv_transfer_s_per_token", "block_size", "source") if k in d}
        return cls(prefill=sub(PrefillCost, "prefill"), decode=sub(DecodeCost, "decode"), cache=sub(CacheModel, "cache"), **top)

    @classmethod
    def load(cls, path: str | Path | None = None) -> CostModel:
        return cls.from_dict(json.loads(Path(path or DEFAULT_PATH).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

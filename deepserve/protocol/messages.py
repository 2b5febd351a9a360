"""Typed messages between gateway, router and engine workers.

Everything that crosses a process boundary is one of these dataclasses, serialised as one JSON
object per line (NDJSON) over HTTP. The same wire protocol is spoken by an engine worker and by a
stand-alone router service, so a gateway talks to either through one client.

Worker HTTP surface (all JSON):
- ``POST /internal/generate``: body ``GenerateRequest.to_dict()``; answer: NDJSON stream of
  ``TokenEvent.to_dict()``, the last one carrying ``finish_reason``.
- ``POST /internal/abort``: body ``{"request_id": str}``.
- ``GET /load``: ``LoadReport.to_dict()``.
- ``GET /health``: 200 when accepting work, 503 while draining or starting.
- ``GET /kv_events?since=N``: ``{"seq": int, "events": [KVEvent.to_dict(), ...]}``; with
  ``&format=rows`` (what the router asks for): ``{"seq": int, "rows": [KVEvent.to_row(), ...]}``,
  the same events in order, each a JSON array (a third of the bytes, and far cheaper to encode
  and parse than an object per event). A worker that ignores ``format`` answers ``events``; a
  poller accepts either.
- ``GET /metrics``: Prometheus text.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from deepserve.protocol.errors import ErrorCode

ConstraintKind = Literal["json", "regex", "ebnf", "tool_call", "tool_call_required", "tool_call_forced"]
FinishReason = Literal["stop", "length", "abort", "error"]
Role = Literal["prefill", "decode", "mixed"]


@dataclass(frozen=True)
class OutputConstraint:
    """A grammar the sampled tokens must follow (xgrammar token masks).

    ``spec``: JSON schema (compact JSON; ``""`` = any JSON value) for ``json``, the pattern for
    ``regex``, the grammar for ``ebnf``, the Chat Completions tool list (JSON array) for the
    ``tool_call*`` kinds. ``trigger_token_ids``: when non-empty, generation is free until one of
    these tokens is sampled (the thinking-end token) and the grammar applies from then on.
    ``compact``: ``json`` output without whitespace outside strings, as OpenAI writes it (tool
    arguments keep their capped whitespace: xgrammar's tool formats cannot forbid it).
    """

    kind: ConstraintKind
    spec: str = ""
    trigger_token_ids: tuple[int, ...] = ()
    compact: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OutputConstraint:
        return cls(
            kind=d["kind"],
            spec=d.get("spec", ""),
            trigger_token_ids=tuple(d.get("trigger_token_ids", ())),
            compact=bool(d.get("compact", False)),
        )


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM/OpenAI semantics; 0 / 1.0 mean "off")."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # EOS and ``stop_token_ids`` cannot be sampled before this many output tokens (vLLM's rule).
    min_tokens: int = 0
    # (token id, bias) pairs added to the logits before penalties (OpenAI's ``logit_bias``);
    # normalised to a tuple of pairs, so JSON lists work too.
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    # vLLM's ``prompt_logprobs``: each prompt token's log probability (the first has none) with
    # this many best alternatives; None: off. Computed over the whole prompt (no prefix-cache hit).
    prompt_logprobs: int | None = None
    # The reasoning cap (Anthropic's ``thinking.budget_tokens``): once this many output tokens are
    # out and none was ``reasoning_end_id`` (``</think>``), that token is the only one allowed.
    # Set together; a capped request is never drafted (``speculative`` becomes False).
    max_reasoning_tokens: int | None = None
    reasoning_end_id: int | None = None
    constraint: OutputConstraint | None = None
    # False: never draft-and-verify this request on an engine with speculative decoding on
    # (the output is the same either way; this opts out of the extra work per step)
    speculative: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError("top_logprobs must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError("prompt_logprobs must be in [0, 20]")
        if (self.max_reasoning_tokens is None) != (self.reasoning_end_id is None):
            raise ValueError("max_reasoning_tokens and reasoning_end_id go together")
        if self.max_reasoning_tokens is not None:
            if self.max_reasoning_tokens < 0:
                raise ValueError("max_reasoning_tokens must be >= 0")
            object.__setattr__(self, "speculative", False)  # the speculative path has no logit rules

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        if self.constraint is not None:
            d["constraint"]["trigger_token_ids"] = list(self.constraint.trigger_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["stop_token_ids"] = tuple(kw.get("stop_token_ids", ()))
        if kw.get("constraint") is not None:
            kw["constraint"] = OutputConstraint.from_dict(kw["constraint"])
        return cls(**kw)


@dataclass
class GenerateRequest:
    """One generation request as the engine sees it: token ids in, token events out.

    ``output_token_ids``: tokens already produced elsewhere (a migrated request, or the first token
    a prefill worker produced); the engine continues after them and does not emit them again.
    ``prefill_only``: compute the prompt, persist its KV units to the store, emit the first token
    and finish (a prefill-pool worker). ``dp_rank``: the data-parallel rank the router picked.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    prefill_only: bool = False
    dp_rank: int | None = None
    session_key: str | None = None
    arrival_time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling": self.sampling.to_dict(),
            "priority": self.priority,
            "output_token_ids": list(self.output_token_ids),
            "prefill_only": self.prefill_only,
            "dp_rank": self.dp_rank,
            "session_key": self.session_key,
            "arrival_time": self.arrival_time,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerateRequest:
        return cls(
            request_id=str(d["request_id"]),
            prompt_token_ids=[int(t) for t in d["prompt_token_ids"]],
            sampling=SamplingParams.from_dict(d.get("sampling") or {}),
            priority=int(d.get("priority", 0)),
            output_token_ids=[int(t) for t in d.get("output_token_ids", [])],
            prefill_only=bool(d.get("prefill_only", False)),
            dp_rank=d.get("dp_rank"),
            session_key=d.get("session_key"),
            arrival_time=float(d.get("arrival_time", time.time())),
        )


@dataclass
class TokenLogprob:
    """Log probability of one sampled token and its top alternatives ``[(token_id, logprob)]``;
    ``rank``: the token's 1-based rank in the distribution (prompt logprobs; 0 = not computed)."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int = 0

    def to_row(self) -> list[Any]:
        """The wire form of a prompt logprob: ``[logprob, rank, [[token_id, logprob], ...]]``."""
        return [self.logprob, self.rank, self.top]

    @classmethod
    def from_row(cls, row: list[Any]) -> TokenLogprob:
        lp, rank, top = row
        return cls(float(lp), [(int(t), float(v)) for t, v in top], int(rank))


@dataclass
class TokenEvent:
    """New output tokens of one request (usually one per engine step). A request that fails
    ends with ``finish_reason="error"``, a human-readable ``error`` and its ``error_code``."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    worker_id: str | None = None
    # on the finishing event: seconds spent queued, to the first token, end to end, in the engine
    timing: dict[str, float] | None = None
    # on the first token's event, when ``sampling.prompt_logprobs`` asked: one entry per prompt
    # token, the first None (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error_code: ErrorCode | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"request_id": self.request_id, "token_ids": self.token_ids}
        if self.logprobs is not None:
            d["logprobs"] = [[lp.logprob, lp.top] for lp in self.logprobs]
        if self.finish_reason is not None:
            d["finish_reason"] = self.finish_reason
        if self.num_prompt_tokens:
            d["num_prompt_tokens"] = self.num_prompt_tokens
        if self.num_cached_tokens:
            d["num_cached_tokens"] = self.num_cached_tokens
        if self.error is not None:
            d["error"] = self.error
        if self.error_code is not None:
            d["error_code"] = self.error_code.value
        if self.worker_id is not None:
            d["worker_id"] = self.worker_id
        if self.timing is not None:
            d["timing"] = self.timing
        if self.prompt_logprobs is not None:
            d["prompt_logprobs"] = [None if lp is None else lp.to_row() for lp in self.prompt_logprobs]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenEvent:
        lps = d.get("logprobs")
        plps = d.get("prompt_logprobs")
        return cls(
            request_id=d["request_id"],
            token_ids=list(d.get("token_ids", [])),
            logprobs=None if lps is None else [TokenLogprob(lp, [(int(t), float(v)) for t, v in top]) for lp, top in lps],
            finish_reason=d.get("finish_reason"),
            num_prompt_tokens=int(d.get("num_prompt_tokens", 0)),
            num_cached_tokens=int(d.get("num_cached_tokens", 0)),
            error=d.get("error"),
            worker_id=d.get("worker_id"),
            timing=d.get("timing"),
            prompt_logprobs=None if plps is None else [None if r is None else TokenLogprob.from_row(r) for r in plps],
            error_code=None if d.get("error_code") is None else ErrorCode(d["error_code"]),
        )


@dataclass
class RankLoad:
    """Load of one data-parallel rank of a worker."""

    dp_rank: int
    running: int = 0
    waiting: int = 0
    queued_tokens: int = 0
    state_usage: float = 0.0


@dataclass
class LoadReport:
    """What ``GET /load`` answers: the worker's identity, role and per-rank load."""

    worker_id: str
    role: Role
    ranks: list[RankLoad]
    draining: bool = False
    block_size: int = 128
    model: str = ""
    fingerprint: str = ""  # KV unit key fingerprint (kvstore.keys.chain_keys), "" if no store
    max_model_len: int = 0  # the engine's context length (prompt + output tokens); 0: not reported

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoadReport:
        return cls(
            worker_id=d["worker_id"],
            role=d["role"],
            ranks=[RankLoad(**r) for r in d.get("ranks", [])],
            draining=bool(d.get("draining", False)),
            block_size=int(d.get("block_size", 128)),
            model=d.get("model", ""),
            fingerprint=d.get("fingerprint", ""),
            max_model_len=int(d.get("max_model_len", 0) or 0),
        )


@dataclass
class KVEvent:
    """A KV unit stored in or removed from a worker's reachable cache (for cache-aware routing).

    ``keys``: hex chained-hash keys of 128-token-aligned prefix units (kvstore.keys).
    ``tier``: where the unit lives (``"memory"``, ``"host"``, ``"ssd"``, ``"redis"``, ``"fs"``).
    """

    kind: Literal["stored", "removed"]
    keys: list[str]
    tier: str = "memory"
    dp_rank: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEvent:
        return cls(kind=d["kind"], keys=list(d["keys"]), tier=d.get("tier", "memory"), dp_rank=int(d.get("dp_rank", 0)))

    def to_row(self) -> list[Any]:
        """The compact wire form (``/kv_events?format=rows``): ``[op, dp_rank, tier, keys]``,
        ``op`` 1 for ``stored``, 0 for ``removed``."""
        return [KV_STORED if self.kind == "stored" else KV_REMOVED, self.dp_rank, self.tier, list(self.keys)]

    @classmethod
    def from_row(cls, row: list[Any]) -> KVEvent:
        op, dp_rank, tier, keys = row
        if op not in (KV_STORED, KV_REMOVED):
            raise ValueError(f"KV event op must be {KV_STORED} or {KV_REMOVED}, not {op!r}")
        return cls(kind="stored" if op == KV_STORED else "removed", keys=list(keys), tier=tier, dp_rank=int(dp_rank))


KV_STORED, KV_REMOVED = 1, 0  # ``KVEvent.to_row``'s op codes
KV_ROWS_FORMAT = "rows"  # ``GET /kv_events?format=``: answer ``rows`` (``KVEvent.to_row``)

"""The placement-policy interface: pure data in, one rank out.

"A router only decides which worker you should use; a separate piece sends you there." A policy
sees a ``RouteRequest`` (what is being placed) and the eligible ``RankView``s (the router's view
of each (worker_id, dp_rank)), and returns one of them. It does no I/O, so the same objects run
inside the live router and inside a trace-driven simulator that builds ``RankView``s of simulated
workers and mutates their load fields itself.

Load fields of a ``RankView`` come from two places: the worker's last ``/load`` report (running,
waiting, queued_tokens, state_usage: includes other routers' requests, but is up to one poll
interval old) and this router's own accounting (in_flight, in_flight_tokens,
pending_prefill_tokens: exact and instant, but blind to other routers). The derived measures below
take the larger of the two, so neither staleness nor a second router hides load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Protocol

from deepserve.protocol import Role
from router.config import PolicyConfig

RankKey = tuple[str, int]  # (worker_id, dp_rank)

# Context length assumed for a sequence the worker reports running but this router did not send
# (another router's), when estimating decode tokens.
ASSUMED_CONTEXT_TOKENS = 1024


class PrefixMatch(NamedTuple):
    """Leading KV units of a prompt found in the index: per rank (its own tiers) and shared.
    (A NamedTuple, as ``RouteRequest``: built for every request placed.)"""

    local: Mapping[RankKey, int]  # rank -> leading units reachable only from that rank
    shared: int = 0  # leading units in a shared tier (Redis / shared FS) any rank can load


class PrefixCache(Protocol):
    """What a ``RankView`` asks about cached prefixes (``router.kv_index.KVIndex`` implements it)."""

    def match(self, keys: Sequence[str]) -> PrefixMatch: ...


class RouteRequest(NamedTuple):
    """What a policy knows about the request being placed. (A NamedTuple: built for every
    request, it costs a third of a frozen dataclass's ~1 µs.)"""

    request_id: str
    num_prompt_tokens: int
    block_keys: tuple[str, ...] = ()  # kvstore.keys.chain_keys of the prompt (whole units)
    session_key: str | None = None
    priority: int = 0
    block_size: int = 128
    max_tokens: int = 16


@dataclass(slots=True, eq=False)
class RankView:
    """The router's view of one (worker_id, dp_rank). Policies read it and never mutate it."""

    worker_id: str
    dp_rank: int = 0
    role: Role = "mixed"
    dp_size: int = 1  # ranks in this worker's DP group (they step together when > 1)
    healthy: bool = True
    draining: bool = False
    # From the worker's /load report.
    running: int = 0
    waiting: int = 0
    queued_tokens: int = 0  # prompt tokens waiting for prefill
    state_usage: float = 0.0  # fraction of KV/state memory in use
    # This router's own accounting.
    in_flight: int = 0  # requests dispatched here, not yet finished
    in_flight_tokens: int = 0  # their context tokens (prompt + generated so far)
    pending_prefill_tokens: int = 0  # their prompt tokens whose first token has not come back
    cache: PrefixCache | None = field(default=None, repr=False)
    key: RankKey = field(init=False, repr=False)  # (worker_id, dp_rank), built once: read per request

    def __post_init__(self) -> None:
        self.key = (self.worker_id, self.dp_rank)

    @property
    def num_requests(self) -> int:
        """Requests on this rank: the larger of the worker's report and our own count."""
        reported = self.running + self.waiting
        return reported if reported > self.in_flight else self.in_flight

    @property
    def prefill_backlog(self) -> int:
        """Prompt tokens this rank must prefill before a new request's prompt."""
        q = self.queued_tokens
        return q if q > self.pending_prefill_tokens else self.pending_prefill_tokens

    @property
    def decode_tokens(self) -> int:
        """Context tokens of the sequences this rank decodes (its per-step attention/KV load)."""
        unseen = self.running - self.in_flight
        return self.in_flight_tokens + (unseen * ASSUMED_CONTEXT_TOKENS if unseen > 0 else 0)

    @property
    def token_load(self) -> int:
        return self.prefill_backlog + self.decode_tokens

    def cached_blocks(self, keys: Sequence[str]) -> int:
        """How many leading units of ``keys`` this rank holds in its own tiers."""
        if self.cache is None or not keys:
            return 0
        return self.cache.match(keys).local.get(self.key, 0)


class Policy(ABC):
    """A placement policy: one required method, optional hooks.

    ``select`` gets a non-empty sequence of eligible ranks (healthy, not draining, below the
    in-flight cap; the caller filters) and returns one of them. Hooks let stateful policies learn
    outcomes; the caller calls ``on_dispatch`` once the request is sent to the chosen rank and
    ``on_finish`` when it ends there (``ok=False`` on a worker failure).
    """

    name: ClassVar[str] = ""
    needs_block_keys: ClassVar[bool] = False  # True: the caller must fill RouteRequest.block_keys

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

    @abstractmethod
    def select(self, request: RouteRequest, candidates: Sequence[RankView]) -> RankView: ...

    def on_dispatch(self, request: RouteRequest, view: RankView) -> None:
        return None

    def on_finish(self, request: RouteRequest, view: RankView, ok: bool) -> None:
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

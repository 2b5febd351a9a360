"""Router configuration: frozen dataclasses, from defaults < ``DEEPSERVE_ROUTER_*`` env < CLI flags.

``RouterConfig`` is what ``Router`` and the router service receive; ``PolicyConfig`` is the part
a placement policy receives (and all that the trace-driven simulator needs to build one).
Environment variables are read here and nowhere else: ``DEEPSERVE_ROUTER_<FIELD>`` for every
field of either dataclass (e.g. ``DEEPSERVE_ROUTER_POLICY=least_load``,
``DEEPSERVE_ROUTER_TEMPERATURE=0.2``, ``DEEPSERVE_ROUTER_DECODE="http://a:1 http://b:2"``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.serving import SERVERS
from router.transport import TRANSPORTS, Deadlines

ENV_PREFIX = "DEEPSERVE_ROUTER_"


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the placement policies (each policy reads the ones it uses)."""

    # cache_aware: cost = prefill_weight * (prefill backlog + uncached prompt tokens)
    #                   + decode_weight * decode tokens (context of running sequences)
    # A prefill token costs a full forward pass, a decode-context token one KV read per step, so
    # decode tokens weigh less: on simulated multi-turn traces (bench/simulator, 4 workers) 0.2
    # beat 1.0 by 30-50% TTFT p50 and 4-7 points of cache hits (decode-heavy traces too).
    prefill_weight: float = 1.0
    decode_weight: float = 0.2
    # A unit found only in a shared tier (Redis, shared FS) must still be loaded: it saves this
    # fraction of its recompute cost; a unit in the rank's own memory saves all of it.
    shared_hit_weight: float = 0.7
    # 0 = always the cheapest rank; > 0 = softmax over normalised costs (spreads ties, hot keys).
    temperature: float = 0.0
    # Load guard (requests): a rank whose load exceeds the least-loaded rank's by more than
    # `balance_abs_threshold` AND by a factor `balance_rel_threshold` is not offered to cache
    # affinity; the least-loaded ranks always are.
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5
    # DP groups (ranks of one worker stepping together): a rank may take a request only while it
    # runs at most `dp_seq_slack` more sequences than the group's least busy rank ...
    dp_seq_slack: int = 1
    # ... and (cache_aware) holds at most this many more tokens than the group's lightest rank.
    dp_token_slack: int = 8192
    # session_affinity: consistent hashing with bounded load (a rank takes a session while its
    # load < factor * mean load + 1), `session_vnodes` ring points per rank.
    session_load_factor: float = 1.25
    session_vnodes: int = 64
    # Random source for power_of_two and temperature sampling; None = nondeterministic.
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.balance_rel_threshold < 1:
            raise ValueError("balance_rel_threshold must be >= 1")
        if not 0 <= self.shared_hit_weight <= 1:
            raise ValueError("shared_hit_weight must be in [0, 1]")
        if self.session_load_factor < 1:
            raise ValueError("session_load_factor must be >= 1")
        if self.dp_seq_slack < 0 or self.dp_token_slack < 0:
            raise ValueError("dp slacks must be >= 0")


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router (in-process or as a service) is configured with."""

    policy: str = "cache_aware"
    prefill_policy: str = ""  # "" = same as `policy`
    decode_policy: str = ""  # "" = same as `policy` (used for the decode and mixed pools)
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    # Static workers (more can self-register with POST /register).
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    worker: tuple[str, ...] = ()  # mixed-role workers
    # Prompts shorter than this are not worth a KV handoff: they skip the prefill pool.
    pd_min_prompt_tokens: int = 512
    # KV unit hashing; must equal the engine's (kvstore.keys.chain_keys arguments).
    block_size: int = 128
    fingerprint: str = ""
    # Failure handling.
    max_retries: int = 3  # re-dispatches of a request before its first token
    max_migrations: int = 3  # re-dispatches after tokens were streamed
    backoff_base_s: float = 0.02
    backoff_max_s: float = 1.0
    connect_timeout_s: float = 2.0
    # The hot call's transport (router.transport.TRANSPORTS): "http1" (ours) or "aiohttp".
    transport: str = "http1"
    # Upstream read deadlines (router.transport.Deadlines): a worker that sends no answer head within
    # `first_byte_timeout_s` (it answers once the first token is out: queueing and prefill
    # included), or nothing more for `event_timeout_s` mid-stream, is failed like a dead one
    # (retry or migration); `suspect_timeout_s` replaces the latter once the worker's load
    # polls fail too (a hung process: SIGSTOP, a wedged GIL).
    first_byte_timeout_s: float = 300.0
    event_timeout_s: float = 60.0
    suspect_timeout_s: float = 3.0
    breaker_failure_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    # Active checks.
    health_interval_s: float = 2.0
    load_interval_s: float = 0.5
    kv_events_interval_s: float = 0.5
    predicted_kv_ttl_s: float = 120.0  # how long the index trusts its own placements
    max_index_keys: int = 1_000_000
    # Admission: a rank accepts at most this many of our requests (0 = unbounded); beyond, the
    # request waits in a bounded priority queue; a full queue or a long wait is `Overloaded`.
    max_inflight_per_rank: int = 256
    max_queue: int = 1024
    queue_timeout_s: float = 30.0
    # Service.
    host: str = "127.0.0.1"
    port: int = 8100
    open_metrics: bool = False  # /metrics without the internal token
    register_check_address: bool = True  # POST /register only for the caller's own address
    read_timeout_s: float = 30.0  # a request's head and body must arrive within this
    # The service's HTTP server (router.serving.SERVERS): "http1" (ours) or "aiohttp".
    server: str = "http1"
    max_connections: int = 4096

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_retries < 0 or self.max_migrations < 0:
            raise ValueError("max_retries and max_migrations must be >= 0")
        if self.max_inflight_per_rank < 0 or self.max_queue < 0:
            raise ValueError("max_inflight_per_rank and max_queue must be >= 0")
        if self.breaker_failure_threshold < 1:
            raise ValueError("breaker_failure_threshold must be >= 1")
        if min(self.first_byte_timeout_s, self.event_timeout_s, self.suspect_timeout_s, self.read_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {self.transport!r}")
        if self.server not in SERVERS:
            raise ValueError(f"server must be one of {', '.join(SERVERS)}, not {self.server!r}")

    @property
    def deadlines(self) -> Deadlines:
        """The upstream call's deadlines (``router.transport``)."""
        return Deadlines(self.connect_timeout_s, self.first_byte_timeout_s, self.event_timeout_s, self.suspect_timeout_s)

    @property
    def prefill_policy_name(self) -> str:
        return self.prefill_policy or self.policy

    @property
    def decode_policy_name(self) -> str:
        return self.decode_policy or self.policy

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> RouterConfig:
        """Defaults, then ``DEEPSERVE_ROUTER_*`` variables, then ``overrides`` (non-None only)."""
        env = os.environ if environ is None else environ
        pol = _fields_from(PolicyConfig, env, overrides)
        top = _fields_from(cls, env, overrides, skip=frozenset({"policy_config"}))
        return cls(policy_config=PolicyConfig(**pol), **top)


def _fields_from(klass: type, env: Mapping[str, str], overrides: Mapping[str, Any], skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(klass):
        if f.name in skip:
            continue
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is not None:
            out[f.name] = _coerce(f, raw)
        if overrides.get(f.name) is not None:
            out[f.name] = _coerce(f, overrides[f.name])
    return out


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    kind = str(f.type)
    if "tuple" in kind:
        if isinstance(value, str):
            value = value.replace(",", " ").split()
        return tuple(value)
    if not isinstance(value, str):
        return value
    if kind.startswith("bool"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if kind.startswith("int"):
        return None if value.strip().lower() in ("", "none") else int(value)
    if kind.startswith("float"):
        return float(value)
    return value

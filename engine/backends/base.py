"""The engine backend interface: what a worker serves, whatever computes the tokens.

A worker process serves one ``BackendGroup``: the DP ranks it steps (``ranks``, each an
``EngineBackend``), the KV store whose events the router polls, the unit size and fingerprint
the router hashes prompts with, and how the ranks step:

- ``lockstep=False`` (the reference backend): every DP rank lives in this process; the engine
  thread steps each rank that has work, one after another.
- ``--ep N`` on the reference backend: the worker process serves ``N`` ranks, each a process of
  its own stepping in lockstep with the others (``reference/ep_group.py``, ``reference/ep_rank.py``);
  to this process they are ``lockstep=False`` proxies, and their KV events come in ``events``.
- ``lockstep=True`` (DeepInfer): each DP rank is its own process, and all ranks of the group
  step together (an MoE all-to-all needs every rank in every step; an idle rank runs a
  placeholder forward). Such a process serves one rank (``ranks`` has one entry whose
  ``load().dp_rank`` is its global rank) and the engine thread calls ``step()`` on every turn,
  work or not: the backend's ``step`` makes the group-wide collective decision (DeepInfer's
  ``has_unfinished_requests`` all-reduce) and runs a real or a placeholder step. Each rank
  process is its own worker on its own port; the router sees ``(worker, dp_rank)`` keys.

Per-rank contract (``EngineBackend``), every call made on the engine thread except
``has_work`` and ``load`` (cheap, local, callable from any thread):

- ``add_request(req)``: queue; raises ``InvalidRequestError`` (a 400, naming the field) for a
  request it cannot serve, ``CapacityError`` when full.
- ``abort_request(rid)``: stop it wherever it is; its ``finish_reason="abort"`` event comes from a
  later ``step``. False if unknown (finished already).
- ``step()``: the token events of one engine step. A backend whose outputs lag a step
  (DeepInfer's zero-overhead scheduling) returns each token on the step it becomes known; the
  events of one request stay in order and its last one carries ``finish_reason``, the prompt and
  cached-token counts (also on its first event).
- ``handoff(rid)``: after a ``prefill_only`` request finished, where its KV state now is
  (``Handoff``), taken once; None for other requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from deepserve.protocol import GenerateRequest, RankLoad, Role, TokenEvent
from engine.runtime.config import EngineConfig

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvstore.events import KVEventLog
    from kvstore.store import TieredStore

HandoffKind = Literal["units", "record"]


@dataclass(frozen=True)
class Handoff:
    """Where a finished prefill left the request's KV state for a decode worker.

    ``kind="units"``: the prompt's whole cache units are in the store (block records, a snapshot
    at ``num_tokens``); the decode side restores them and recomputes the tail itself (the
    reference backend). ``kind="record"``: one per-request record under ``keys[-1]`` holds the
    full decode-side state, the block rows and ``first_token`` (DeepInfer: a COMPLETION engine
    cannot prefill the tail). ``keys``: every store key the decode side reads, in order.
    """

    request_id: str
    kind: HandoffKind
    keys: tuple[str, ...]
    num_tokens: int
    first_token: int


class EngineBackend(Protocol):
    """One DP rank of an engine (see the module docstring for the contract)."""

    def add_request(self, req: GenerateRequest) -> None: ...

    def abort_request(self, request_id: str) -> bool: ...

    def step(self) -> list[TokenEvent]: ...

    def has_work(self) -> bool: ...

    def load(self) -> RankLoad: ...

    def request_ids(self) -> list[str]: ...

    def handoff(self, request_id: str) -> Handoff | None: ...


@dataclass(frozen=True)
class BackendContext:
    """What a backend factory gets from the worker's configuration."""

    model_dir: str
    role: Role = "mixed"
    dp: int = 1
    dp_rank: int | None = None  # lockstep backends: the global DP rank this process serves
    expert_parallel: int = 0  # reference: > 1 = that many rank processes (experts split); DeepInfer's EP size (0: = dp)
    dtype: str = "auto"
    device: str = "cpu"
    served_model_name: str = "deepseek-v4"
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass
class BackendGroup:
    """The ranks one worker process serves, and what the worker reports about them."""

    ranks: Sequence[EngineBackend]
    unit_tokens: int
    fingerprint: str = ""  # KV unit key fingerprint ("" without a store)
    store: TieredStore | None = None
    events: KVEventLog | None = None  # the KV events /kv_events serves (default: the store's)
    lockstep: bool = False
    close: Callable[[], None] = lambda: None


def keep_recent(table: dict[str, Handoff], key: str, value: Handoff, limit: int = 4096) -> None:
    """Remember ``value`` under ``key``, forgetting the oldest entries beyond ``limit`` (hand-offs
    nobody asked for)."""
    table[key] = value
    while len(table) > limit:
        del table[next(iter(table))]


BackendFactory = Callable[[BackendContext, "CollectorRegistry | None"], BackendGroup]

"""Placement: which pool a request goes through and which rank of it. Pure (no I/O).

Pools, by worker role:

- ``prefill`` ranks compute a prompt's KV, write it to the KV store and return the first token;
- ``decode`` ranks continue a request after its first token (loading the prompt's units from the
  store, or recomputing them);
- ``mixed`` ranks do both (colocated serving).

A request is *disaggregated* (stage ``prefill``, then ``decode``) when a prefill pool and a
decode-capable pool exist and its prompt has at least ``pd_min_prompt_tokens`` tokens: a short
prompt costs less to compute where it decodes than to hand its KV over. Otherwise it is
*colocated* on one rank of the mixed pool, or of the decode pool (a decode worker computes short
prompts itself), or, as a last resort, of the prefill pool.

``Placer`` is what both the live ``Router`` and a trace-driven simulator call: build ``Pools``
of ``RankView``s, ask ``first_stage``, then ``pick``; a ``Lease`` then books the request on the
chosen rank (in-flight requests and tokens) until it ends there.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from router.errors import NoWorkerAvailable
from router.policies.base import Policy, RankView, RouteRequest

Stage = Literal["prefill", "decode", "colocated"]


@dataclass(frozen=True)
class Pools:
    """Available ranks by role (healthy, not draining)."""

    prefill: Sequence[RankView] = ()
    decode: Sequence[RankView] = ()
    mixed: Sequence[RankView] = ()
    _stages: dict[Stage, tuple[RankView, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def for_stage(self, stage: Stage) -> tuple[RankView, ...]:
        """The stage's ranks; built once per ``Pools`` (the router keeps one per registry
        version). A tuple: shared by every request, and a policy may remember facts about it
        (``CacheAware`` does) for as long as it is passed the same one."""
        ranks = self._stages.get(stage)
        if ranks is None:
            if stage == "prefill":
                ranks = tuple(self.prefill)
            elif stage == "decode":
                ranks = (*self.decode, *self.mixed)
            else:
                ranks = (*self.mixed, *self.decode) or tuple(self.prefill)
            self._stages[stage] = ranks
        return ranks


class Placer:
    def __init__(self, policy: Policy, prefill_policy: Policy | None = None, *, pd_min_prompt_tokens: int = 512, max_inflight_per_rank: int = 0) -> None:
        self.policy = policy  # decode and colocated stages
        self.prefill_policy = prefill_policy or policy
        self.pd_min_prompt_tokens = pd_min_prompt_tokens
        self.max_inflight_per_rank = max_inflight_per_rank

    @property
    def needs_block_keys(self) -> bool:
        return self.policy.needs_block_keys or self.prefill_policy.needs_block_keys

    def policy_for(self, stage: Stage) -> Policy:
        return self.prefill_policy if stage == "prefill" else self.policy

    def first_stage(self, request: RouteRequest, pools: Pools) -> Stage:
        if pools.prefill and (pools.decode or pools.mixed) and request.num_prompt_tokens >= self.pd_min_prompt_tokens:
            return "prefill"
        return "colocated"

    def pick(self, stage: Stage, request: RouteRequest, pools: Pools, *, exclude: Collection[str] = (), capped: bool = True) -> RankView | None:
        """The rank for ``stage``; None when every candidate is at its in-flight cap.

        ``exclude``: worker ids that already failed this request; they are used again only when
        nothing else is left. Raises ``NoWorkerAvailable`` when the pool is empty.
        """
        cands = pools.for_stage(stage)
        if exclude:
            cands = [v for v in cands if v.worker_id not in exclude] or cands
        if not cands:
            raise NoWorkerAvailable(f"no available worker for the {stage} stage")
        cap = self.max_inflight_per_rank
        if capped and cap:
            for v in cands:
                if v.in_flight >= cap:  # rare: a new list only then
                    cands = [v for v in cands if v.in_flight < cap]
                    if not cands:
                        return None
                    break
        return self.policy_for(stage).select(request, cands)


class Lease:
    """This router's accounting of one request on one rank; ``release`` is idempotent."""

    __slots__ = ("view", "tokens", "pending", "done")

    def __init__(self, view: RankView, prompt_tokens: int, uncached_tokens: int) -> None:
        self.view, self.tokens, self.pending, self.done = view, prompt_tokens, uncached_tokens, False
        view.in_flight += 1
        view.in_flight_tokens += prompt_tokens
        view.pending_prefill_tokens += uncached_tokens

    def first_token(self) -> None:
        if self.pending:
            self.view.pending_prefill_tokens -= self.pending
            self.pending = 0

    def add_tokens(self, n: int) -> None:
        self.view.in_flight_tokens += n
        self.tokens += n

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.first_token()
            self.view.in_flight -= 1
            self.view.in_flight_tokens -= self.tokens

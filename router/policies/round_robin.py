"""Round-robin: workers in turn, the even rank inside each (the baseline every policy must beat)."""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import Policy, RankView, RouteRequest
from router.policies.dp import group_by_worker, pick_rank


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self._next = 0

    def select(self, request: RouteRequest, candidates: Sequence[RankView]) -> RankView:
        groups = list(group_by_worker(candidates).values())
        ranks = groups[self._next % len(groups)]
        self._next += 1
        return pick_rank(ranks, request.num_prompt_tokens, self.config.dp_seq_slack)

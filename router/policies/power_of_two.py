"""Power of two choices: sample two workers, keep the less loaded (then the even rank).

Near least-load quality with less herding when several routers act on the same stale loads: two
routers seldom sample the same pair, so they do not all pile onto the one idle worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.policies.base import Policy, RankView, RouteRequest
from router.policies.dp import group_by_worker, group_load, pick_rank


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self._rng = random.Random(self.config.seed)

    def select(self, request: RouteRequest, candidates: Sequence[RankView]) -> RankView:
        groups = list(group_by_worker(candidates).values())
        if len(groups) == 1:
            ranks = groups[0]
        else:
            a, b = self._rng.sample(groups, 2)
            ranks = a if group_load(a) <= group_load(b) else b
        return pick_rank(ranks, request.num_prompt_tokens, self.config.dp_seq_slack)

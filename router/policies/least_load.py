"""Least load: the worker whose ranks carry the fewest requests (then tokens) on average.

Load is ``RankView.num_requests`` (the larger of the worker's report and our own in-flight
count), so a burst between two ``/load`` polls is still spread. Inside a DP group the even rank
is chosen (``dp.pick_rank``).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import Policy, RankView, RouteRequest
from router.policies.dp import group_by_worker, group_load, pick_rank


class LeastLoad(Policy):
    name = "least_load"

    def select(self, request: RouteRequest, candidates: Sequence[RankView]) -> RankView:
        groups = group_by_worker(candidates).values()
        ranks = min(groups, key=group_load) if len(groups) > 1 else next(iter(groups))
        return pick_rank(ranks, request.num_prompt_tokens, self.config.dp_seq_slack)

"""Session affinity: consistent hashing of ``session_key`` onto ranks, with bounded load.

Each rank owns ``session_vnodes`` points on a hash ring; a session goes to the first rank
clockwise from its hash whose load is below ``ceil(session_load_factor * (total + 1) / n)``
(consistent hashing with bounded loads). So a session stays on one rank (its KV stays warm
there) while that rank is not overloaded, adding or removing a rank moves only ~1/n of sessions,
and no rank is ever more than the factor above the mean. Ranks, not workers, are hashed: in a
DP group the session's KV lives on one rank. Since a DP group steps together, a rank of one also
takes a session only while it is inside the group's even band (at most ``dp_seq_slack`` more
sequences than the group's least busy rank); otherwise the walk goes on. Requests without a
session key go to least load.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

from router.policies.base import Policy, RankKey, RankView, RouteRequest
from router.policies.least_load import LeastLoad


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class SessionAffinity(Policy):
    name = "session_affinity"

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self._fallback = LeastLoad(self.config)
        self._ring_for: tuple[RankKey, ...] = ()
        self._points: list[int] = []  # sorted ring positions
        self._owners: list[RankKey] = []  # rank owning each position

    def _ring(self, keys: tuple[RankKey, ...]) -> None:
        if keys == self._ring_for:
            return
        ring = sorted((_h64(f"{w}#{r}#{i}"), (w, r)) for w, r in keys for i in range(self.config.session_vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [k for _, k in ring]
        self._ring_for = keys

    def select(self, request: RouteRequest, candidates: Sequence[RankView]) -> RankView:
        if not request.session_key or len(candidates) == 1:
            return self._fallback.select(request, candidates)
        by_key = {v.key: v for v in candidates}
        self._ring(tuple(sorted(by_key)))
        total = sum(v.num_requests for v in candidates)
        cap = math.ceil(self.config.session_load_factor * (total + 1) / len(candidates))
        group_low: dict[str, int] = {}  # least busy rank of each DP group
        for v in candidates:
            if v.dp_size > 1:
                n = v.num_requests
                if n < group_low.get(v.worker_id, n + 1):
                    group_low[v.worker_id] = n
        slack = self.config.dp_seq_slack
        start = bisect.bisect_left(self._points, _h64(request.session_key))
        seen: set[RankKey] = set()
        n = len(self._points)
        for i in range(n):
            key = self._owners[(start + i) % n]
            if key in seen:
                continue
            seen.add(key)
            view = by_key[key]
            n = view.num_requests
            if n < cap and (view.dp_size == 1 or n <= group_low[view.worker_id] + slack):
                return view
            if len(seen) == len(by_key):
                break
        return self._fallback.select(request, candidates)

"""Data-parallel groups: ranks of one worker that step together.

With expert parallelism every DP rank of a worker runs each forward step in lock-step (the MoE
all-to-all is a barrier), so the group moves at the pace of its busiest rank: one rank with more
sequences or more context slows all of them. The router therefore places in two levels:

1. choose the *worker* by its group load (mean over ranks: a dp=4 worker has 4 ranks' capacity);
2. inside the worker, choose the rank that keeps the group even in *both* running sequences
   (each is one more token in every MoE step on that rank) and tokens (attention and prefill
   work), with ``pick_rank``:

   - only ranks running at most ``seq_slack`` more sequences than the least busy one qualify;
   - among them, the one that least increases the group's imbalance
     ``sum_r running_r^2 + (tokens_r / s)^2`` (``s``: the group's mean tokens per sequence, so the
     two terms are comparable). Adding a request of ``t`` tokens to rank r raises it by
     ``2 running_r + 1 + (2 tokens_r t + t^2) / s^2``, so the rank minimising
     ``running_r + tokens_r * t / s^2`` is chosen: a long prompt goes where tokens are fewest,
     a short one where sequences are fewest.

   Against adversarial skew (every 4th prompt 80x longer, lognormal or bimodal lengths;
   ``tests/router/test_policies.py``) this keeps the sequence spread within ``seq_slack + 1`` and
   the token spread within about one longest prompt, where round-robin over ranks puts every long
   prompt on one rank and "fewest sequences, then fewest tokens" drifts by many long prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.policies.base import RankView


def group_by_worker(candidates: Sequence[RankView]) -> dict[str, list[RankView]]:
    """Candidates per worker_id, in first-seen order."""
    groups: dict[str, list[RankView]] = {}
    for v in candidates:
        g = groups.get(v.worker_id)
        if g is None:
            groups[v.worker_id] = [v]
        else:
            g.append(v)
    return groups


def group_load(ranks: Sequence[RankView]) -> tuple[float, float]:
    """(mean requests, mean token load) per rank of a group: lower is less loaded."""
    n = len(ranks)
    return (sum(v.num_requests for v in ranks) / n, sum(v.token_load for v in ranks) / n)


def even_band(ranks: Sequence[RankView], seq_slack: int) -> list[RankView]:
    """Ranks running at most ``seq_slack`` more sequences than the group's least busy rank."""
    if len(ranks) == 1:
        return list(ranks)
    low = min(v.num_requests for v in ranks)
    return [v for v in ranks if v.num_requests <= low + seq_slack]


def pick_rank(ranks: Sequence[RankView], tokens: int, seq_slack: int = 1) -> RankView:
    """The rank of one group where a request of ``tokens`` keeps it most even (module docstring)."""
    if len(ranks) == 1:
        return ranks[0]
    seqs = sum(v.num_requests for v in ranks)
    s = sum(v.token_load for v in ranks) / seqs if seqs else 0.0
    if s <= 0:
        s = float(max(tokens, 1))
    w = tokens / (s * s)
    return min(even_band(ranks, seq_slack), key=lambda v: (v.num_requests + v.token_load * w, v.dp_rank))

"""Placement policies: pure selection over ``RankView``s (no I/O), one file per policy."""

from router.policies.base import Policy, PrefixCache, PrefixMatch, RankKey, RankView, RouteRequest
from router.policies.registry import POLICIES, create_policy, get_policy_class, policy_names

__all__ = [
    "POLICIES",
    "Policy",
    "PrefixCache",
    "PrefixMatch",
    "RankKey",
    "RankView",
    "RouteRequest",
    "create_policy",
    "get_policy_class",
    "policy_names",
]

"""Policy registry: name -> class. Add a policy by writing its file and listing it here."""

from __future__ import annotations

from router.config import PolicyConfig
from router.policies.base import Policy
from router.policies.cache_aware import CacheAware
from router.policies.least_load import LeastLoad
from router.policies.power_of_two import PowerOfTwo
from router.policies.round_robin import RoundRobin
from router.policies.session_affinity import SessionAffinity

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoad, PowerOfTwo, SessionAffinity, CacheAware)
}


def policy_names() -> list[str]:
    return sorted(POLICIES)


def get_policy_class(name: str) -> type[Policy]:
    try:
        return POLICIES[name.replace("-", "_")]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}") from None


def create_policy(name: str, config: PolicyConfig | None = None) -> Policy:
    """A fresh policy instance (policies keep per-instance state such as a round-robin cursor)."""
    return get_policy_class(name)(config)

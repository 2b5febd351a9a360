import pytest

from router.errors import NoWorkerAvailable
from router.placement import Lease, Placer, Pools
from router.policies import RankView, RouteRequest, create_policy


def placer(**kw) -> Placer:
    return Placer(create_policy("least_load"), pd_min_prompt_tokens=512, **kw)


def test_short_prompts_skip_the_prefill_pool():
    pools = Pools(prefill=[RankView("p", role="prefill")], decode=[RankView("d", role="decode")])
    p = placer()
    assert p.first_stage(RouteRequest("r", 2000), pools) == "prefill"
    assert p.first_stage(RouteRequest("r", 100), pools) == "colocated"
    assert p.pick("colocated", RouteRequest("r", 100), pools).worker_id == "d"
    assert p.first_stage(RouteRequest("r", 2000), Pools(prefill=pools.prefill)) == "colocated"


def test_exclusion_and_cap():
    a, b = RankView("a"), RankView("b")
    pools = Pools(mixed=[a, b])
    p = placer(max_inflight_per_rank=1)
    assert p.pick("colocated", RouteRequest("r", 10), pools, exclude={"a"}) is b
    assert p.pick("colocated", RouteRequest("r", 10), pools, exclude={"a", "b"}) in (a, b)  # nothing else left
    Lease(a, 10, 10), Lease(b, 10, 10)
    assert p.pick("colocated", RouteRequest("r", 10), pools) is None  # all full: queue
    assert p.pick("colocated", RouteRequest("r", 10), pools, capped=False) is not None
    with pytest.raises(NoWorkerAvailable):
        p.pick("colocated", RouteRequest("r", 10), Pools())


def test_lease_accounting_is_idempotent():
    v = RankView("a")
    lease = Lease(v, 100, 60)
    assert (v.in_flight, v.in_flight_tokens, v.pending_prefill_tokens) == (1, 100, 60)
    lease.first_token()
    lease.add_tokens(3)
    assert (v.in_flight_tokens, v.pending_prefill_tokens) == (103, 0)
    lease.release()
    lease.release()
    assert (v.in_flight, v.in_flight_tokens, v.pending_prefill_tokens) == (0, 0, 0)

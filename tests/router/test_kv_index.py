import pytest

from deepserve.protocol import KVEvent
from kvstore.keys import chain_keys
from router.kv_index import KVIndex


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_longest_leading_run_per_rank():
    idx = KVIndex()
    prompt = list(range(128 * 5))
    keys = tuple(chain_keys(prompt, 128, "fp"))
    idx.apply("a", [KVEvent("stored", list(keys[:3]), dp_rank=0)])
    idx.apply("a", [KVEvent("stored", list(keys), dp_rank=1)])
    idx.apply("b", [KVEvent("stored", list(keys[1:]))])  # no leading unit: no match
    m = idx.match(keys)
    assert m.local == {("a", 0): 3, ("a", 1): 5}
    assert idx.match(keys) is m  # memoised while nothing changes
    idx.apply("a", [KVEvent("removed", [keys[1]], dp_rank=1)])
    assert idx.match(keys).local == {("a", 0): 3, ("a", 1): 1}


def test_shared_tier_and_worker_removal():
    idx = KVIndex()
    keys = ("k1", "k2", "k3")
    idx.apply("a", [KVEvent("stored", ["k1", "k2"], tier="redis")])
    idx.apply("a", [KVEvent("stored", ["k1"], tier="memory")])
    m = idx.match(keys)
    assert m.shared == 2 and m.local == {("a", 0): 1}
    idx.remove_worker("a")
    assert idx.match(keys).local == {} and idx.match(keys).shared == 2


def test_predicted_entries_expire_but_confirmed_ones_stay():
    clock = Clock()
    idx = KVIndex(predicted_ttl_s=10, clock=clock)
    idx.add_predicted(("a", 0), ["k1", "k2"])
    idx.add_predicted(("b", 0), ["k1"])
    idx.apply("b", [KVEvent("stored", ["k1"])])
    clock.t = 11
    assert idx.match(("k1", "k2")).local == {("b", 0): 1}


def test_bounded_size_drops_least_recently_used():
    clock = Clock()
    idx = KVIndex(max_keys=3, predicted_ttl_s=10, clock=clock)
    for k in ["k1", "k2", "k3"]:
        idx.add_predicted(("a", 0), [k])
    version = idx._version
    idx.add_predicted(("a", 0), ["k1"])  # still fresh: nothing to do
    assert idx._version == version
    clock.t = 6
    idx.add_predicted(("a", 0), ["k1"])  # past half its TTL: refreshed, and moved to the end
    idx.add_predicted(("a", 0), ["k4"])  # evicts k2
    assert len(idx) == 3
    assert idx.match(("k1",)).local and not idx.match(("k2",)).local


# ---- fast paths: the same answers as the reference code -------------------------------------
def test_router_keys_equal_engine_keys():
    """The router's keys must be the engine's (``KVConnector.keys``), or no KV event matches: a
    prompt parsed off a request body (``parse_body``) and placed (``Router.route_request``) is
    hashed to the keys the engine gets from its id list, whatever the body's spacing."""
    import random
    from types import SimpleNamespace

    import orjson

    from engine.kv_connector import KVConnector
    from router.config import RouterConfig
    from router.router import Router
    from router.service import parse_body

    rng = random.Random(0)
    fp = "abc123-bfloat16"
    router = Router(RouterConfig(policy="cache_aware", fingerprint=fp))
    engine = SimpleNamespace(unit=128, fingerprint=fp)
    base = [rng.randrange(1, 200_000) for _ in range(700)]
    prompts = [base, base[:256], base[:128], base + [1, 2, 3] * 100, [0] + base[:300], [rng.randrange(0, 1 << 40) for _ in range(1000)], [7] * 127, [5] * 128]
    for p in prompts:
        want = KVConnector.keys(engine, p)
        raw = orjson.dumps({"request_id": "r", "prompt_token_ids": p})
        for body in (raw, raw.replace(b",", b", ")):
            assert list(router.route_request(parse_body(body)).block_keys) == want
    assert chain_keys(base, 128, "other") != chain_keys(base, 128, fp)


def _reference_match(idx: KVIndex, keys, now: float) -> dict:
    local: dict = {}
    alive = None
    for depth, k in enumerate(keys, 1):
        h = idx._holders.get(k)
        if not h:
            break
        alive = {r for r, e in h.items() if e > now} if alive is None else {r for r in alive if h.get(r, 0.0) > now}
        if not alive:
            break
        for r in alive:
            local[r] = depth
    return local


def test_match_equals_reference_walk():
    import random

    rng = random.Random(1)
    clock = Clock()
    keys = tuple(f"k{i}" for i in range(12))
    ranks = [("a", 0), ("a", 1), ("b", 0)]
    for trial in range(300):
        idx = KVIndex(predicted_ttl_s=10, clock=clock)
        clock.t = 0.0
        for r in ranks:
            n = rng.randrange(len(keys) + 1)
            held = list(keys[:n]) if rng.random() < 0.7 else rng.sample(keys, n)
            if rng.random() < 0.5:
                idx.add_predicted(r, held)
            else:
                idx.apply(r[0], [KVEvent("stored", held, dp_rank=r[1])])
        clock.t = rng.choice([0.0, 11.0])
        assert dict(idx.match(keys).local) == _reference_match(idx, keys, clock.t), trial


def test_apply_raw_equals_apply():
    evs = [
        KVEvent("stored", ["k1", "k2", "k3"]),
        KVEvent("stored", ["k1", "k2"], dp_rank=1),
        KVEvent("stored", ["k1", "k9"], tier="redis"),
        KVEvent("removed", ["k2"]),
        KVEvent("removed", ["k9"], tier="redis"),
    ]
    a, b = KVIndex(), KVIndex()
    a.apply("w", evs)
    b.apply_raw("w", [e.to_dict() for e in evs])
    assert a._holders == b._holders and list(a._holders) == list(b._holders) and a._shared == b._shared
    keys = ("k1", "k2", "k3")
    assert a.match(keys) == b.match(keys) == b.match(keys)
    version = b._version
    try:
        b.apply_raw("w", [{"kind": "stored", "keys": ["k7"]}, {"keys": ["k8"]}])  # malformed second event
    except KeyError:
        pass
    assert b._version > version  # what was applied is seen by the next match


def test_apply_rows_equals_apply():
    """The compact ``/kv_events?format=rows`` form gives the same index as the events, in the
    same order (random streams: stored and removed, ranks, local and shared tiers)."""
    import random

    rng = random.Random(7)
    keys = [f"k{i}" for i in range(10)]
    for trial in range(200):
        evs = [
            KVEvent(rng.choice(["stored", "stored", "removed"]), rng.sample(keys, rng.randrange(0, 4)), tier=rng.choice(["memory", "host", "redis", "fs"]), dp_rank=rng.randrange(3))
            for _ in range(rng.randrange(1, 12))
        ]
        rows = [e.to_row() for e in evs]
        assert [KVEvent.from_row(r) for r in rows] == evs
        a, b, c = KVIndex(), KVIndex(), KVIndex()
        a.apply("w", evs)
        b.apply_rows("w", orjson_roundtrip(rows))
        c.apply_raw("w", [e.to_dict() for e in evs])
        for x in (b, c):
            assert x._holders == a._holders and list(x._holders) == list(a._holders), trial
            assert x._shared == a._shared and list(x._shared) == list(a._shared), trial


def orjson_roundtrip(obj):
    from router.worker_client import dumps, loads

    return loads(dumps(obj))


def test_apply_rows_refuses_an_unknown_op():
    idx = KVIndex()
    version = idx._version
    with pytest.raises(ValueError):
        idx.apply_rows("w", [[1, 0, "memory", ["k1"]], [2, 0, "memory", ["k2"]]])
    assert "k1" in idx._holders and "k2" not in idx._holders and idx._version > version
    with pytest.raises(ValueError):
        KVEvent.from_row([2, 0, "memory", []])

from engine.protocol import KVEvent
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

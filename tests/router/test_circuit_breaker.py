from router.circuit_breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_opens_after_threshold_and_half_opens_after_cooldown():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=clock)
    b.record_failure()
    b.record_failure()
    assert b.state == "closed" and b.available
    b.record_failure()
    assert b.state == "open" and not b.available
    clock.t = 4.9
    assert b.state == "open"
    clock.t = 5.0
    assert b.state == "half_open" and b.available
    b.on_dispatch()  # the one probe is out
    assert not b.available
    b.record_success()
    assert b.state == "closed" and b.available


def test_a_probe_without_a_verdict_frees_its_slot_after_the_cooldown():
    """Found by the soak: a half-open worker whose probe request was aborted by its client (or
    refused as a client error) got neither a success nor a failure and stayed out for good."""
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5.0, clock=clock)
    b.trip()
    clock.t = 5.0
    b.on_dispatch()  # the probe goes out and never reports
    clock.t = 9.9
    assert b.state == "half_open" and not b.available
    clock.t = 10.0
    assert b.available  # probe again
    b.on_dispatch()
    b.record_success()
    assert b.state == "closed"


def test_success_resets_consecutive_failures():
    b = CircuitBreaker(failure_threshold=2, clock=Clock())
    b.record_failure()
    b.record_success()
    b.record_failure()
    assert b.state == "closed"


def test_failed_probe_reopens_with_longer_cooldown():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, max_cooldown_s=3.0, clock=clock)
    b.record_failure()
    clock.t = 1.0
    assert b.state == "half_open"
    b.on_dispatch()
    b.record_failure()
    assert b.state == "open"
    clock.t = 2.5
    assert b.state == "open"  # cooldown doubled to 2 s
    clock.t = 3.0
    assert b.state == "half_open"
    b.record_failure()
    clock.t = 3.0 + 2.9
    assert b.state == "open"  # capped at 3 s
    clock.t = 6.0
    assert b.state == "half_open"
    b.record_success()
    b.record_failure()
    clock.t = 7.0
    assert b.state == "half_open"  # cooldown back to base after closing


def test_trip_opens_immediately():
    b = CircuitBreaker(failure_threshold=5, clock=Clock())
    b.trip()
    assert b.state == "open"

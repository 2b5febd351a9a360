"""Token buckets, rate limits, admission queue, API keys and the body-size limit (pure parts)."""

from __future__ import annotations

import asyncio

import pytest

from server.errors import AuthenticationFailed, BodyTooLarge, Overloaded, RateLimited, RequestTimeout
from server.limits import Admission, RateLimiter, TokenBucket, authenticate, read_body


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_refill_and_wait():
    clock = Clock()
    b = TokenBucket(60, clock)  # 1 token / s, burst 60
    assert all(b.try_take() == 0.0 for _ in range(60))
    assert b.try_take() == pytest.approx(1.0)
    clock.t += 0.5
    assert b.try_take() == pytest.approx(0.5)
    clock.t += 0.5
    assert b.try_take() == 0.0
    b.charge(10)  # debt
    assert b.wait_positive() == pytest.approx(10.0, rel=1e-6)
    clock.t += 1000
    assert b.full


def test_rate_limiter_requests_and_tokens():
    clock = Clock()
    rl = RateLimiter(rpm=2, tpm=100, clock=clock)
    rl.admit("k")
    rl.admit("k")
    with pytest.raises(RateLimited) as info:
        rl.admit("k")
    assert info.value.type == "requests" and 0 < info.value.retry_after <= 30
    rl.admit("other")  # per key
    rl.charge("other", 150)
    with pytest.raises(RateLimited) as info:
        rl.admit("other")
    assert info.value.type == "tokens" and info.value.headers["Retry-After"] == "31"
    clock.t += 31
    rl.admit("other")


def test_per_key_limits():
    rl = RateLimiter(rpm=0, tpm=0, clock=Clock(), per_key={"small": (1, None), "big": (None, 5)})
    assert rl.enabled
    rl.admit("anyone")
    rl.admit("anyone")  # no global limit
    rl.admit("small")
    with pytest.raises(RateLimited):
        rl.admit("small")
    rl.charge("big", 10)
    with pytest.raises(RateLimited):
        rl.admit("big")


def test_authenticate():
    keys = frozenset({"sk-a"})
    assert authenticate({}, frozenset()) is None
    assert authenticate({"authorization": "Bearer sk-a"}, keys) == "sk-a"
    assert authenticate({"x-api-key": "sk-a"}, keys) == "sk-a"
    with pytest.raises(AuthenticationFailed):
        authenticate({}, keys)
    with pytest.raises(AuthenticationFailed) as info:
        authenticate({"authorization": "Bearer sk-wrong-key"}, keys)
    assert "sk-wrong-key" not in info.value.message


def test_admission_queue_fifo_timeout_and_full():
    async def go():
        adm = Admission(max_running=1, max_queued=1, timeout_s=0.2)
        await adm.acquire()
        waiter = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        assert adm.queued == 1
        with pytest.raises(Overloaded):  # queue full
            await adm.acquire()
        adm.release()  # slot handed to the waiter
        await waiter
        assert adm.running == 1 and adm.queued == 0
        with pytest.raises(Overloaded) as info:  # waits 0.2 s, then 503
            await adm.acquire()
        assert info.value.retry_after >= 1
        assert adm.queued == 0
        adm.release()
        assert adm.running == 0

    asyncio.run(go())


def test_admission_cancelled_waiter_leaves_no_trace():
    async def go():
        adm = Admission(1, 10, 5.0)
        await adm.acquire()
        w = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        w.cancel()
        with pytest.raises(asyncio.CancelledError):
            await w
        adm.release()
        assert adm.running == 0 and adm.queued == 0
        # cancelled just as the slot was handed over: the slot is passed on, not lost
        await adm.acquire()
        w = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        adm.release()
        w.cancel()
        try:
            await w
        except asyncio.CancelledError:
            pass
        else:
            adm.release()
        assert adm.running == 0 and adm.queued == 0

    asyncio.run(go())


async def _chunks(parts, seen):
    for p in parts:
        seen.append(p)
        yield p


def test_read_body_limits():
    async def go():
        seen: list[bytes] = []
        assert await read_body({}, _chunks([b"ab", b"cd"], seen), 10, 1.0) == b"abcd"
        with pytest.raises(BodyTooLarge):  # declared length: refused before reading anything
            await read_body({"content-length": "11"}, _chunks([b"x"], seen := []), 10, 1.0)
        assert seen == []
        with pytest.raises(BodyTooLarge):  # chunked: refused as soon as the limit is passed
            await read_body({}, _chunks([b"x" * 6] * 100, seen := []), 10, 1.0)
        assert len(seen) == 2

        async def slow():
            yield b"x"
            await asyncio.sleep(5)
            yield b"y"

        with pytest.raises(RequestTimeout):
            await read_body({}, slow(), 10, 0.05)

    asyncio.run(go())

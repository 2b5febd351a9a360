"""Protection of the engine: API keys, per-key rate limits, admission (bounded queue), body size.

- ``authenticate``: ``Authorization: Bearer KEY`` (OpenAI) or ``x-api-key: KEY`` (Anthropic).
- ``RateLimiter``: two token buckets per key, refilled continuously (global limits, or the key's
  own from the keys file). Requests per minute: a request
  takes one token or is refused (429 with ``Retry-After`` = time until one is back). Tokens per
  minute: a request is admitted while the bucket is positive; its prompt tokens are charged at
  admission and its completion tokens when it finishes, so the bucket may go into debt and the
  key waits it off (the count of a request's tokens is not known in advance).
- ``Admission``: at most ``max_running`` requests in the engine; up to ``max_queued`` more wait
  first-come first-served, each at most ``timeout_s``; beyond that 503 with ``Retry-After``.
- ``read_body``: refuses a declared ``Content-Length`` over the limit before reading, and counts
  bytes while reading (chunked bodies), so an oversized body is never buffered whole.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import AsyncIterable, Callable, Mapping

from server.errors import AuthenticationFailed, BodyTooLarge, Overloaded, RateLimited, RequestTimeout


# ---- API keys -------------------------------------------------------------------------------------
def authenticate(headers: Mapping[str, str], keys: frozenset[str]) -> str | None:
    """The caller's key (None when authentication is off); raises 401 when it is missing or wrong."""
    if not keys:
        return None
    auth = headers.get("authorization")
    key = None
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer":
            key = value.strip()
    if key is None:
        key = headers.get("x-api-key")
    if not key:
        raise AuthenticationFailed(
            "You didn't provide an API key. You need to provide your API key in an Authorization "
            "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            code=None,
        )
    if key not in keys:
        shown = key[:3] + "*" * 4 + key[-4:] if len(key) > 8 else "*" * len(key)
        raise AuthenticationFailed(f"Incorrect API key provided: {shown}.")
    return key


# ---- rate limits ----------------------------------------------------------------------------------
class TokenBucket:
    """``per_minute`` tokens per minute, burst up to ``per_minute``; the level may go negative."""

    __slots__ = ("capacity", "rate", "level", "stamp", "clock")

    def __init__(self, per_minute: float, clock: Callable[[], float] = time.monotonic) -> None:
        assert per_minute > 0, "a bucket needs a positive rate"
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # tokens per second
        self.level = self.capacity
        self.clock = clock
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def try_take(self, n: float = 1.0) -> float:
        """Take ``n`` tokens: 0.0 when taken, else the seconds until they would be available."""
        self._refill()
        n = min(n, self.capacity)
        if self.level >= n:
            self.level -= n
            return 0.0
        return (n - self.level) / self.rate

    def wait_positive(self) -> float:
        """0.0 when the level is positive, else the seconds until it is."""
        self._refill()
        return 0.0 if self.level > 0 else (-self.level + 1e-9) / self.rate

    def charge(self, n: float) -> None:
        self._refill()
        self.level -= n

    @property
    def full(self) -> bool:
        self._refill()
        return self.level >= self.capacity


class RateLimiter:
    """Per-key request and token buckets (0 = that limit is off); ``per_key`` overrides the
    global ``(rpm, tpm)`` for some keys (None in a pair: the global value)."""

    MAX_KEYS = 100_000  # unauthenticated callers are keyed by address; drop idle ones past this

    def __init__(
        self,
        rpm: int,
        tpm: int,
        clock: Callable[[], float] = time.monotonic,
        per_key: Mapping[str, tuple[int | None, int | None]] | None = None,
    ) -> None:
        self.rpm, self.tpm, self.clock = rpm, tpm, clock
        self.per_key = {k: (rpm if r is None else r, tpm if t is None else t) for k, (r, t) in (per_key or {}).items()}
        self._req: dict[str, TokenBucket] = {}
        self._tok: dict[str, TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm or any(r or t for r, t in self.per_key.values()))

    def limits(self, key: str) -> tuple[int, int]:
        return self.per_key.get(key, (self.rpm, self.tpm))

    def _bucket(self, table: dict[str, TokenBucket], key: str, per_minute: int) -> TokenBucket:
        bucket = table.get(key)
        if bucket is None:
            if len(table) >= self.MAX_KEYS:
                for k in [k for k, b in table.items() if b.full]:
                    del table[k]
            bucket = table[key] = TokenBucket(per_minute, self.clock)
        return bucket

    def admit(self, key: str) -> None:
        """Take one request token and check the token budget; 429 with Retry-After if not."""
        rpm, tpm = self.limits(key)
        if tpm:
            wait = self._bucket(self._tok, key, tpm).wait_positive()
            if wait > 0:
                raise RateLimited(
                    f"Rate limit reached for tokens per minute (TPM): limit {tpm}. "
                    f"Please try again in {wait:.1f}s.",
                    type="tokens",
                    retry_after=wait,
                )
        if rpm:
            wait = self._bucket(self._req, key, rpm).try_take(1)
            if wait > 0:
                raise RateLimited(
                    f"Rate limit reached for requests per minute (RPM): limit {rpm}. "
                    f"Please try again in {wait:.1f}s.",
                    type="requests",
                    retry_after=wait,
                )

    def charge(self, key: str, tokens: int) -> None:
        tpm = self.limits(key)[1]
        if tpm and tokens:
            self._bucket(self._tok, key, tpm).charge(tokens)


# ---- admission ------------------------------------------------------------------------------------
class Admission:
    """A counting semaphore with a bounded FIFO queue and a queue timeout (503 past either)."""

    def __init__(self, max_running: int, max_queued: int, timeout_s: float) -> None:
        self.max_running, self.max_queued, self.timeout_s = max_running, max_queued, timeout_s
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise Overloaded(
                f"The server is overloaded ({self.running} requests running, {len(self._waiters)} queued). "
                "Please retry later.",
                retry_after=1.0,
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot arrived just as we gave up: pass it on
            else:
                fut.cancel()
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise Overloaded(
                f"The server is overloaded: no capacity within {self.timeout_s:g}s. Please retry later.",
                retry_after=max(1.0, self.timeout_s / 4),
            ) from None

    def release(self) -> None:
        """Hand the slot to the oldest waiter, or free it."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the waiter; ``running`` is unchanged
                return
        self.running -= 1
        assert self.running >= 0, "admission released more often than acquired"


# ---- request body ---------------------------------------------------------------------------------
async def read_body(
    headers: Mapping[str, str], chunks: AsyncIterable[bytes], limit: int, timeout_s: float
) -> bytes:
    """The whole body, or 413 as soon as it exceeds ``limit`` bytes, or 408 after ``timeout_s``."""
    declared = headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise _too_large(limit)
        except ValueError:
            pass  # the server framework rejects malformed lengths itself
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                parts.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"The request body was not received within {timeout_s:g}s.") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"Request body too large: the maximum is {limit} bytes.")

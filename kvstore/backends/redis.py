"""Redis (or Valkey) as a shared hot tier and index, through the ``redis`` client.

Key layout under ``prefix`` (every key gets the same TTL, ``ttl_s``; ``None`` = no expiry)::

    {prefix}:v:{key}                 the value itself, when len(value) <= chunk_size
    {prefix}:m:{key}                 manifest of a chunked value: b"{nonce}:{chunks}:{length}"
    {prefix}:c:{key}:{nonce}:{i}     chunk i (chunk_size bytes, the last one shorter)

Chunking keeps each value well below Redis' 512 MB string limit and its client-output buffers,
and lets large records stream. A chunked write stores its chunks under a fresh random nonce first
and publishes the manifest last (``SET ... GET`` returns the manifest it replaced, whose chunks are
then deleted), so concurrent writers of one key never mix chunks; a reader that loses such a race
finds a chunk missing and reports a miss. Readers prefer the inline value, and writers order
their commands so a key is never briefly absent while being replaced.

Faults: a Redis that is down or slower than ``timeout_s`` turns every operation into a miss or a
no-op. The first failure logs one warning and opens a breaker for ``retry_after_s``, during which
operations return at once without touching the network; each failure is reported through
``on_error`` (the tier counts it). The first success afterwards logs that Redis is back.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.backends.base import Backend

log = logging.getLogger(__name__)
T = TypeVar("T")


class RedisBackend(Backend):
    """Values in a Redis-protocol server; see the module docstring for layout and faults."""

    kind = "redis"

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        *,
        prefix: str = "deepserve:kv",
        ttl_s: int | None = 3600,
        chunk_size: int = 4 << 20,
        connect_timeout_s: float = 0.25,
        timeout_s: float = 1.0,
        retry_after_s: float = 1.0,
        max_connections: int | None = None,
        password: str | None = None,
        tls_ca_file: str | None = None,
    ) -> None:
        """``password``: the server's (``AUTH``), when not in ``url``; ``tls_ca_file``: the CA
        that signs the server's certificate, for a ``rediss://`` URL."""
        super().__init__()
        if chunk_size <= 0:
            raise ValueError("chunk_size must be > 0")
        self.url = url
        self.prefix = prefix
        self.ttl_s = ttl_s or None
        self.chunk_size = chunk_size
        self.retry_after_s = retry_after_s
        self._client = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # the default retries with backoff: seconds of stall when down
            max_connections=max_connections,
            **({"password": password} if password else {}),
            **({"ssl_ca_certs": tls_ca_file} if tls_ca_file else {}),
        )
        self._down_until = 0.0
        self._down = False
        self._sizes: dict[str, int] = {}  # values this client stored and has not removed
        self._used = 0  # sum of _sizes
        self._lock = threading.Lock()

    # --- key names ---------------------------------------------------------------------------
    def _v(self, key: str) -> str:
        return f"{self.prefix}:v:{key}"

    def _m(self, key: str) -> str:
        return f"{self.prefix}:m:{key}"

    def _c(self, key: str, nonce: str, i: int) -> str:
        return f"{self.prefix}:c:{key}:{nonce}:{i}"

    @staticmethod
    def _parse_manifest(raw: bytes) -> tuple[str, int, int] | None:
        try:
            nonce, chunks, length = raw.decode().split(":")
            return nonce, int(chunks), int(length)
        except (UnicodeDecodeError, ValueError):
            return None

    def _chunk_keys(self, key: str, manifest: bytes | None) -> list[str]:
        parsed = self._parse_manifest(manifest) if manifest else None
        return [] if parsed is None else [self._c(key, parsed[0], i) for i in range(parsed[1])]

    # --- fault handling ----------------------------------------------------------------------
    def _call(self, op: str, fn: Callable[[], T], default: T) -> T:
        """Run ``fn`` unless the breaker is open; any Redis failure becomes ``default``."""
        if time.monotonic() < self._down_until:
            return default
        try:
            result = fn()
        except Exception as exc:  # redis.RedisError, OSError, and client-internal races on a dying socket
            self._down_until = time.monotonic() + self.retry_after_s
            if not self._down:
                self._down = True
                log.warning(
                    "redis at %s unavailable (%s: %s); serving misses until it answers again",
                    self.url,
                    type(exc).__name__,
                    exc,
                )
            self._report_error(op, exc)
            try:
                # Drop idle sockets to the dead/restarted server; in-use ones fail on their own.
                self._client.connection_pool.disconnect(inuse_connections=False)
            except Exception:
                pass
            return default
        if self._down:
            self._down = False
            log.warning("redis at %s is back", self.url)
        return result

    @property
    def available(self) -> bool:
        """False while the breaker is open after a failure."""
        return not self._down

    # --- reads -------------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []

        def run() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._v(k), self._m(k))
            return [n > 0 for n in pipe.execute()]

        return self._call("contains", run, [False] * len(keys))

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []

        def run() -> list[bytes | None]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.get(self._v(k))
                pipe.get(self._m(k))
            raw = pipe.execute()
            out: list[bytes | None] = []
            chunked: list[tuple[int, str, tuple[str, int, int]]] = []
            for i, k in enumerate(keys):
                value, manifest = raw[2 * i], raw[2 * i + 1]
                out.append(value)
                if value is None and manifest is not None:
                    parsed = self._parse_manifest(manifest)
                    if parsed is not None:
                        chunked.append((i, k, parsed))
            if chunked:
                pipe = self._client.pipeline(transaction=False)
                for _, k, (nonce, n, _) in chunked:
                    pipe.mget([self._c(k, nonce, j) for j in range(n)])
                for (i, _, (_, _, length)), parts in zip(chunked, pipe.execute()):
                    if all(p is not None for p in parts):
                        value = b"".join(parts)
                        out[i] = value if len(value) == length else None
            return out

        return self._call("get", run, [None] * len(keys))

    # --- writes ------------------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> bool:
        return self.put_many([(key, value)])[0]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        if not items:
            return []

        def run() -> list[bool]:
            ex = self.ttl_s
            # Round trip 1: chunks of large values, under fresh nonces nobody reads yet.
            manifests: dict[int, bytes] = {}
            pipe = self._client.pipeline(transaction=False)
            for i, (k, v) in enumerate(items):
                if len(v) > self.chunk_size:
                    nonce = secrets.token_hex(6)
                    mv = memoryview(v).cast("B")
                    n = (len(mv) + self.chunk_size - 1) // self.chunk_size
                    for j in range(n):
                        pipe.set(self._c(k, nonce, j), mv[j * self.chunk_size : (j + 1) * self.chunk_size], ex=ex)
                    manifests[i] = f"{nonce}:{n}:{len(mv)}".encode()
            if manifests:
                pipe.execute()
            # Round trip 2: publish. Inline: set the value, then drop any old manifest.
            # Chunked: set the manifest (getting the old one), then drop any old inline value.
            pipe = self._client.pipeline(transaction=False)
            for i, (k, v) in enumerate(items):
                if i in manifests:
                    pipe.set(self._m(k), manifests[i], ex=ex, get=True)
                    pipe.delete(self._v(k))
                else:
                    pipe.set(self._v(k), v, ex=ex)
                    pipe.getdel(self._m(k))
            res = pipe.execute()
            stale: list[str] = []
            for i, (k, _) in enumerate(items):
                old = res[2 * i] if i in manifests else res[2 * i + 1]
                if isinstance(old, bytes) and old != manifests.get(i):
                    stale += self._chunk_keys(k, old)
            if stale:
                self._client.delete(*stale)
            with self._lock:
                for k, v in items:
                    self._used += len(v) - self._sizes.get(k, 0)
                    self._sizes[k] = len(v)
            return [True] * len(items)

        return self._call("put", run, [False] * len(items))

    def remove(self, key: str) -> bool:
        def run() -> bool:
            pipe = self._client.pipeline(transaction=False)
            pipe.getdel(self._m(key))
            pipe.delete(self._v(key))
            manifest, n_inline = pipe.execute()
            chunks = self._chunk_keys(key, manifest)
            if chunks:
                self._client.delete(*chunks)
            with self._lock:
                self._used -= self._sizes.pop(key, 0)
            return bool(manifest) or n_inline > 0

        return self._call("remove", run, False)

    # --- pins: a pinned key loses its TTL until unpinned ---------------------------------------
    def _all_names(self, key: str) -> list[str]:
        return [self._v(key), self._m(key), *self._chunk_keys(key, self._client.get(self._m(key)))]

    def pin(self, key: str) -> None:
        super().pin(key)
        if self.ttl_s:
            self._call("pin", lambda: [self._client.persist(n) for n in self._all_names(key)], None)

    def unpin(self, key: str) -> None:
        super().unpin(key)
        if self.ttl_s and not self.is_pinned(key):
            ttl = self.ttl_s
            self._call("unpin", lambda: [self._client.expire(n, ttl) for n in self._all_names(key)], None)

    # --- listing -----------------------------------------------------------------------------
    def entries(self) -> Iterator[tuple[str, int]]:
        def run() -> list[tuple[str, int]]:
            out: list[tuple[str, int]] = []
            for tag in ("v", "m"):
                head = f"{self.prefix}:{tag}:"
                names = list(self._client.scan_iter(match=head + "*", count=1000))
                if not names:
                    continue
                pipe = self._client.pipeline(transaction=False)
                for name in names:
                    if tag == "v":
                        pipe.strlen(name)
                    else:
                        pipe.get(name)
                for name, r in zip(names, pipe.execute()):
                    key = name.decode()[len(head) :]
                    if tag == "v":
                        out.append((key, int(r)))
                    elif r is not None and (parsed := self._parse_manifest(r)) is not None:
                        out.append((key, parsed[2]))
            return out

        return iter(self._call("entries", run, []))

    def used_bytes(self) -> int:
        """Bytes this client stored and has not removed (TTL expiry and other writers unseen)."""
        return self._used

    def close(self) -> None:
        self._client.close()

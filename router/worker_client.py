"""Async HTTP client for one engine worker (or a router service: same protocol).

One ``aiohttp.ClientSession`` with a keep-alive connection pool is shared by every client of a
process (pass ``session``), so a request costs no TCP handshake. ``generate`` streams the
worker's NDJSON answer as ``TokenEvent``s: the body is read in whatever chunks arrive and split on
newlines (one await per chunk, not per line), and the common event shape (token ids, no
logprobs) is built directly instead of through ``TokenEvent.from_dict``.

Transport failures are translated here into ``router.errors``, keeping the ``ErrorCode`` of the
worker's error body (``deepserve.protocol.error_body``): ``WorkerRejected`` for a client-fault
code, ``WorkerUnavailable`` for the others. An answer without a code (not a deepserve worker, or
a proxy in between) is classed by its status: ``WorkerRejected`` (``invalid_request``) for a 4xx,
``WorkerUnavailable`` (``unavailable``) for a 5xx or 401/403/408/429 (our internal token refused:
the worker's or our configuration, not the request); could not connect or connection dropped:
``WorkerUnavailable`` (``connect=True`` when the worker could not be reached at all); a worker
that sent nothing within a deadline: ``WorkerUnavailable`` (``timeout``); a stream that ended
without a finish event, or a line that is not JSON: ``WorkerUnavailable`` (``engine_error``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import aiohttp
import orjson

from deepserve.internal_auth import InternalAuth
from deepserve.protocol import KV_ROWS_FORMAT, ErrorCode, GenerateRequest, LoadReport, TokenEvent, parse_error_body
from router.errors import WorkerRejected, WorkerUnavailable
from router.transport import ConnectError, Deadlines, DeadlineError, HttpError, StatusError, make_transport, post_lines

dumps = orjson.dumps  # bound directly: no Python frame per call
loads = orjson.loads


def encode_request(req: GenerateRequest) -> bytes:
    """The request's JSON body. orjson serialises the dataclass itself, which equals
    ``req.to_dict()`` (tests/router/test_worker_client.py checks) at a fraction of the cost of
    ``dataclasses.asdict``."""
    return orjson.dumps(req)


_JSON = {"Content-Type": "application/json"}
_NOT_THE_REQUESTS_FAULT = (401, 403, 408, 429)  # 4xx that another worker (or later) may not give


class KVEventsAnswer(NamedTuple):
    """A worker's ``/kv_events`` answer: the cursor for the next call, the events (as rows or as
    objects), and False in ``complete`` when the worker no longer had every asked-for event."""

    seq: int
    rows: list[list[Any]]
    events: list[dict[str, Any]]
    complete: bool


def event_from_dict(d: dict[str, Any]) -> TokenEvent:
    """``TokenEvent.from_dict`` with a fast path for the per-token case (no logprobs)."""
    if "logprobs" in d or "prompt_logprobs" in d:
        return TokenEvent.from_dict(d)
    return TokenEvent(
        d["request_id"],
        d.get("token_ids") or [],
        None,
        d.get("finish_reason"),
        d.get("num_prompt_tokens", 0),
        d.get("num_cached_tokens", 0),
        d.get("error"),
        d.get("worker_id"),
        error_code=None if d.get("error_code") is None else ErrorCode(d["error_code"]),
    )


def make_session(connect_timeout_s: float = 2.0, auth: InternalAuth | None = None) -> aiohttp.ClientSession:
    """A session whose pool keeps connections to every worker open (no per-host limit);
    ``auth``: the internal token, sent on every call, and the plane's client certificate."""
    tls = auth.client_ssl if auth is not None else None  # the plane's mTLS (https:// URLs), if on
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60.0, ttl_dns_cache=None, ssl=tls or True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
    # No cookie jar, no decompression: neither is used, both cost per request.
    headers = auth.headers() if auth is not None else None
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(), headers=headers)


class WorkerClient:
    """Client for the worker at ``url`` (``http://host:port``).

    ``generate`` goes over ``pool``, the ``router.transport.Transport`` named by ``transport``
    (the hot path, with the ``deadlines``); the control calls over the aiohttp session (a
    shared ``session`` must carry ``auth``'s header itself: ``make_session(auth=...)``).
    """

    def __init__(
        self, url: str, *, session: aiohttp.ClientSession | None = None, control_timeout_s: float = 2.0, auth: InternalAuth | None = None,
        deadlines: Deadlines = Deadlines(), transport: str = "http1",
    ) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._owns_session = session is None
        self._connect_timeout_s = deadlines.connect_s
        self._control_timeout = aiohttp.ClientTimeout(total=control_timeout_s)
        self.auth = auth or InternalAuth()
        self.pool = make_transport(transport, self.url, deadlines, headers=self.auth.headers(), ssl=self.auth.client_ssl, session=lambda: self.session)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = make_session(self._connect_timeout_s, self.auth)
        return self._session

    async def close(self) -> None:
        self.pool.close()
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's events; the last one has ``finish_reason`` set.

        Raises ``WorkerUnavailable`` / ``WorkerRejected``. Closing the iterator early closes the
        connection (the worker sees the disconnect); use ``abort`` to stop the request cleanly.
        """
        async for d in self.generate_dicts(encode_request(req)):
            yield event_from_dict(d)

    async def generate_dicts(self, body: bytes) -> AsyncIterator[dict[str, Any]]:
        """``generate`` at the dict level: a JSON request body in, event dicts out."""
        finished = False
        try:
            async for line in post_lines(self.pool, "/internal/generate", body):
                d = loads(line)
                if "finish_reason" in d:
                    finished = True
                yield d
        except (HttpError, ValueError) as exc:
            raise self.error_for(exc) from exc
        if not finished:
            raise WorkerUnavailable("stream ended without a finish event", self.url, code=ErrorCode.ENGINE_ERROR)

    def error_for(self, exc: Exception) -> WorkerRejected | WorkerUnavailable:
        """The router error for a failure of the generate call (``router.transport`` errors, or a
        line that is not JSON)."""
        if isinstance(exc, ConnectError):
            return WorkerUnavailable(str(exc), self.url, connect=True)
        if isinstance(exc, StatusError):
            return self.status_error(exc.status, exc.body)
        if isinstance(exc, DeadlineError):  # the worker went silent (hung, stopped)
            return WorkerUnavailable(str(exc), self.url, code=ErrorCode.TIMEOUT)
        if isinstance(exc, HttpError):  # a dropped connection
            return WorkerUnavailable(f"{type(exc).__name__}: {exc}", self.url)
        return WorkerUnavailable(f"{type(exc).__name__}: {exc}", self.url, code=ErrorCode.ENGINE_ERROR)

    def status_error(self, status: int, body: bytes) -> WorkerRejected | WorkerUnavailable:
        """The router error for an HTTP error answer (see the module docstring)."""
        wire = parse_error_body(body)
        if wire is not None:
            cls = WorkerRejected if wire.code.client_fault else WorkerUnavailable
            return cls(wire.message, self.url, code=wire.code)
        text = f"worker answered {status}: {body[:500].decode(errors='replace')}"
        if 400 <= status < 500 and status not in _NOT_THE_REQUESTS_FAULT:
            return WorkerRejected(text, self.url)
        return WorkerUnavailable(text, self.url)

    async def _raise_status(self, resp: aiohttp.ClientResponse) -> None:
        raise self.status_error(resp.status, await resp.read())

    async def _get_json(self, path: str) -> Any:
        try:
            async with self.session.get(self.url + path, timeout=self._control_timeout) as resp:
                if resp.status != 200:
                    await self._raise_status(resp)
                return loads(await resp.read())
        except aiohttp.ClientConnectorError as exc:
            raise WorkerUnavailable(f"cannot connect: {exc}", self.url, connect=True) from exc
        except (TimeoutError, aiohttp.ClientError, ConnectionError, ValueError) as exc:
            raise WorkerUnavailable(f"{type(exc).__name__}: {exc}", self.url) from exc

    async def abort(self, request_id: str) -> bool:
        """Ask the worker to stop ``request_id``; False when the worker could not be told."""
        try:
            async with self.session.post(
                self.url + "/internal/abort", data=dumps({"request_id": request_id}), headers=_JSON, timeout=self._control_timeout
            ) as resp:
                await resp.read()
                return resp.status < 300
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            return False

    async def load(self) -> LoadReport:
        return LoadReport.from_dict(await self._get_json("/load"))

    async def load_dict(self) -> dict[str, Any]:
        """The raw ``/load`` answer (keeps fields newer than ``LoadReport``, e.g. a fingerprint)."""
        return await self._get_json("/load")

    async def health(self) -> bool:
        """True when the worker answers 200 (accepting work); False on 503 or no answer."""
        try:
            async with self.session.get(self.url + "/health", timeout=self._control_timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            return False

    async def kv_events_raw(self, since: int = 0, *, snapshot: bool = False) -> KVEventsAnswer:
        """The worker's KV events after ``since`` (``snapshot``: the units it holds now, as
        stored events) as it sent them: either ``KVEvent.to_row`` rows (a worker that knows
        ``format=rows``) or ``KVEvent.to_dict`` objects (one that does not), the other list
        empty. ``KVIndex.apply_rows`` / ``apply_raw`` take them as they are: no ``KVEvent`` per
        event on the router's loop. A worker that omits ``complete`` sent every event."""
        query = "snapshot=1" if snapshot else f"since={since}"
        d = await self._get_json(f"/kv_events?{query}&format={KV_ROWS_FORMAT}")
        return KVEventsAnswer(int(d.get("seq", 0)), d.get("rows") or [], d.get("events") or [], bool(d.get("complete", True)))

"""The ``aiohttp`` transport (``router.transport``): the hot call on the library's client.

Requests go out on the ``aiohttp.ClientSession`` the worker's control calls use (its connector
keeps the connections alive); the answer is read with ``readany`` and split into NDJSON lines.
The deadlines are ``asyncio.timeout_at`` scopes, one per wait, measured from the request's send
or the answer's latest bytes; setting ``suspect`` moves the scopes of the waits in progress to
the suspect deadline at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

from router.transport import ConnectError, Deadlines, DeadlineError, ProtocolError, StatusError

_T = TypeVar("_T")
_JSON = {"Content-Type": "application/json"}


class _Answer:
    """One answer in progress: its response, the lines split off so far, the time of its latest
    bytes and the deadline scope of the wait in progress."""

    __slots__ = ("owner", "resp", "lines", "partial", "done", "last", "scope")

    def __init__(self, owner: AiohttpTransport, last: float) -> None:
        self.owner = owner
        self.resp: aiohttp.ClientResponse | None = None
        self.lines: list[bytes] = []
        self.partial = b""
        self.done = False
        self.last = last
        self.scope: asyncio.Timeout | None = None

    def take(self) -> list[bytes]:
        lines = self.lines
        if lines:
            self.lines = []
        return lines

    async def read(self) -> list[bytes] | None:
        while not self.lines:
            if self.done:
                return None
            data = await self.owner._within(self, self.resp.content.readany())
            if data:
                self._feed(data)
            else:
                self._end()
        return self.take()

    def _feed(self, data: bytes) -> None:
        if self.partial:
            data = self.partial + data
        parts = data.split(b"\n")
        self.partial = parts.pop()
        self.lines.extend(line for line in parts if line)

    def _end(self) -> None:
        self.done = True
        if self.partial.strip():
            self.lines.append(self.partial)
        self.partial = b""


class AiohttpTransport:
    """Requests to ``url`` on ``session()``'s connections (a ``router.transport.Transport``)."""

    def __init__(self, url: str, deadlines: Deadlines, session: Callable[[], aiohttp.ClientSession], *, headers: dict[str, str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.deadlines = deadlines
        self._session = session
        self._headers = {**_JSON, **(headers or {})}
        self._open: set[_Answer] = set()
        self._drains: set[asyncio.Task] = set()
        self._suspect = False

    @property
    def suspect(self) -> bool:
        return self._suspect

    @suspect.setter
    def suspect(self, value: bool) -> None:
        self._suspect = value
        if value:  # the waits in progress get the suspect deadline now, not on their next wait
            for a in self._open:
                if a.scope is not None and a.scope.when() is not None:
                    a.scope.reschedule(min(a.scope.when(), a.last + self.deadlines.suspect_s))

    async def _within(self, answer: _Answer, aw: Awaitable[_T]) -> _T:
        """``aw`` under the answer's current deadline; its bytes' time noted when it ends."""
        loop = asyncio.get_running_loop()
        limit = self.deadlines.limit(answer.resp is not None, self._suspect)
        try:
            async with asyncio.timeout_at(answer.last + limit) as scope:
                answer.scope = scope
                result = await aw
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise ConnectError(f"cannot connect to {self.url}: {exc!r}") from exc
        except TimeoutError:
            raise DeadlineError(f"{self.url} sent nothing for {self.deadlines.limit(answer.resp is not None, self._suspect):g}s") from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise ProtocolError(f"connection lost: {type(exc).__name__}: {exc}") from exc
        finally:
            answer.scope = None
        answer.last = loop.time()
        return result

    async def request(self, path: str, body: bytes) -> _Answer:
        loop = asyncio.get_running_loop()
        answer = _Answer(self, loop.time())
        self._open.add(answer)
        try:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.deadlines.connect_s)
            for attempt in (0, 1):
                try:
                    resp = await self._within(answer, self._session().post(self.url + path, data=body, headers=self._headers, timeout=timeout))
                    break
                except ProtocolError as exc:  # a stale keep-alive connection: once more, fresh
                    if attempt or isinstance(exc, DeadlineError) or not isinstance(exc.__cause__, aiohttp.ServerDisconnectedError):
                        raise
            answer.resp = resp
            if resp.status != 200:
                status, data = resp.status, await self._within(answer, resp.read())
                raise StatusError(status, data)
        except BaseException:
            self.release(answer)
            raise
        return answer

    def release(self, answer: _Answer, complete: bool = False) -> None:
        self._open.discard(answer)
        resp = answer.resp
        if resp is None:
            return
        if answer.done or resp.content.at_eof():
            resp.release()  # the answer is whole: the connection goes back to the pool
        elif complete:  # only the body's end may be missing: read it, then keep the connection
            task = asyncio.get_running_loop().create_task(self._drain(resp))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
        else:
            resp.close()  # the worker sees the disconnect

    async def _drain(self, resp: aiohttp.ClientResponse) -> None:
        try:
            async with asyncio.timeout(self.deadlines.event_s):
                await resp.read()
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            resp.close()
            return
        resp.release()

    def close(self) -> None:
        """Nothing of its own to close: the connections are the session's."""

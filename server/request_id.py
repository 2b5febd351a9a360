"""``X-Request-Id``: read from the client (or generated), echoed on the response, carried to the engine.

``RequestIdMiddleware`` (pure ASGI) puts the id in ``scope["state"]`` and adds the header to every
response it sends, errors included. ``ids(request, prefix)`` gives a handler its response id
(``prefix + id``, e.g. ``chatcmpl-<id>``) and the engine request id: the same when the gateway made
the id; with a random tail when the client sent it, since a client may reuse an id while the
first request still runs and the engine keys requests by id. Router and worker logs name the
engine id, so a client's id can be found there.
"""

from __future__ import annotations

import uuid
from typing import Any

from server.errors import InvalidRequest

HEADER = b"x-request-id"
MAX_LEN = 256


class RequestIdMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v for k, v in scope["headers"] if k == HEADER), None)
        client = sent.decode("latin-1") if sent is not None else None
        rid = client if client is not None else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["client_request_id"] = rid, client
        header = (b"x-request-id", rid.encode("latin-1"))

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


def ids(request: Any, prefix: str) -> tuple[str, str]:
    """(response id, engine request id) of this request; 400 for an unusable client id."""
    state = request.scope.get("state") or {}
    rid = state.get("request_id") or uuid.uuid4().hex
    client = state.get("client_request_id")
    if client is None:
        return prefix + rid, prefix + rid
    if not client or len(client) > MAX_LEN or not client.isprintable() or not client.isascii():
        raise InvalidRequest(f"Invalid X-Request-Id header: at most {MAX_LEN} printable ASCII characters.", param="X-Request-Id")
    return prefix + client, f"{prefix}{client}-{uuid.uuid4().hex[:8]}"

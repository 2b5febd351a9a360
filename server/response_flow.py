"""Stateful Responses: ``store``, ``previous_response_id`` and ``background`` for one request.

``ResponsesFlow`` is the ``AnswerHooks`` (``server/handler.py``) of a ``POST /v1/responses``:
- ``store`` (default true, as OpenAI): the finished response is kept in ``Gateway.responses``
  (``server/response_store.py``) with its conversation; ``store: false`` keeps nothing;
- ``previous_response_id``: the stored conversation (that response's input items, then its output
  items) goes before this request's ``input``; the previous ``instructions`` are not carried over
  (OpenAI's rule). Unknown, expired, deleted or another API key's id: 404; one still running: 400;
- ``background: true`` (needs ``store``; not with ``stream``: a 400 naming ``background``): the
  reply is the response at once with ``status: queued``; a task of this gateway runs it
  (``in_progress``, then ``completed`` / ``incomplete`` / ``failed``, or ``cancelled`` by
  ``POST /v1/responses/{id}/cancel``), and ``GET /v1/responses/{id}`` polls it. The run keeps its
  admission slot and ``request_timeout_s``. With a shared store a cancel or delete may come
  through another gateway: the run reads its record every ``poll_s`` and stops when it is
  cancelled or gone, and its own writes are conditional (``put(if_running=True)``), so they never
  undo that cancel or delete.
- ``parallel_tool_calls: false``: the answer keeps its first function_call item (streamed: the
  events of later calls are not sent and later items' ``output_index`` is renumbered), and the
  response reports ``parallel_tool_calls: false``.
Stored ids are unique even when the client sent ``X-Request-Id`` (a random tail is added). A
record keeps a digest of the API key, not the key (``owner_id``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import deepseek_recipe as dr
from starlette.responses import Response

from server.errors import GatewayError, InvalidRequest, NotFound
from server.extensions import bool_field
from server.first_call import FirstCallOnly, first_call_only
from server.handler import Answer, collect
from server.response_store import ResponseStore, StoredResponse, owner_id
from server.state import Gateway

_FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
_WITH_RESPONSE = _FINAL_EVENTS | {"response.created", "response.in_progress", "response.queued"}


def not_found(response_id: str, param: str | None = None) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param=param)


async def lookup(store: ResponseStore, response_id: str, key: str, param: str | None = None) -> StoredResponse:
    """The stored response ``key`` (the API key, or client address) may see; 404 otherwise."""
    entry = await store.get(response_id)
    if entry is None or entry.owner != owner_id(key):
        raise not_found(response_id, param)
    return entry


def _items(value: Any) -> list[Any]:
    """``input`` as a list of items (a text is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    raise InvalidRequest("Invalid type for 'input': expected a string or a list of input items.", param="input")


@dataclass
class ResponsesFlow:
    """One Responses request's use of the store; see the module docstring."""

    gw: Gateway
    key: str  # the API key (or client address) the stored response belongs to
    keep: bool = True
    background: bool = False
    previous_id: str | None = None
    history: list[Any] = field(default_factory=list)  # the input items after expansion
    added_bytes: int = 0  # the stored conversation's JSON put before the input
    rid: str = ""
    one_call: bool = False  # parallel_tool_calls: false (at most one function_call output item)
    _calls: FirstCallOnly = field(default_factory=FirstCallOnly)  # under one_call

    @classmethod
    async def read(cls, gw: Gateway, body: dict[str, Any], key: str) -> ResponsesFlow:
        """Validate ``store`` / ``background`` / ``previous_response_id`` (400 / 404 naming them)."""
        keep = bool_field(body, "store", True)
        background = bool_field(body, "background", False)
        if background and not keep:
            raise InvalidRequest("background mode requires 'store' to be true.", param="background")
        if background and body.get("stream") is True:
            raise InvalidRequest("background mode with 'stream' is not supported; poll GET /v1/responses/{id}.", param="background")
        previous_id = body.get("previous_response_id")
        history: list[Any] = []
        added = 0
        if previous_id is not None:
            if not isinstance(previous_id, str):
                raise InvalidRequest("Invalid type for 'previous_response_id': expected a string.", param="previous_response_id")
            previous = await lookup(gw.responses, previous_id, key, "previous_response_id")
            if previous.status not in ("completed", "incomplete"):
                raise InvalidRequest(
                    f"Previous response '{previous_id}' is {previous.status}; it cannot be continued.",
                    param="previous_response_id",
                )
            history = list(previous.history)
            added = len(json.dumps(history, ensure_ascii=False))
        flow = cls(gw, key, keep, background, previous_id, history + _items(body.get("input")), added)
        flow.one_call = not bool_field(body, "parallel_tool_calls", True)
        return flow

    # ---- AnswerHooks ------------------------------------------------------------------------------
    @property
    def unique_id(self) -> bool:
        return self.keep

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "input": self.history} if self.previous_id is not None else body

    async def finish(self, text: str) -> str:
        return await self._done(json.loads(text))

    async def event(self, name: str, text: str) -> str | None:
        if self.one_call and name not in _WITH_RESPONSE:
            return self._one_call_event(name, text)
        if name not in _WITH_RESPONSE:
            return text
        event = json.loads(text)
        if name in _FINAL_EVENTS:
            event["response"] = json.loads(await self._done(event["response"]))
        else:
            event["response"] = self._settings(event["response"])
        return json.dumps(event, ensure_ascii=False, separators=(",", ":"))

    def _one_call_event(self, name: str, text: str) -> str | None:
        """A streamed event under ``parallel_tool_calls: false``: those of a second function call
        are dropped (None), the later items' ``output_index`` renumbered."""
        event = json.loads(text)
        index = event.get("output_index")
        if not isinstance(index, int):
            return text
        sent = self._calls.index(index, name == "response.output_item.added", (event.get("item") or {}).get("type") == "function_call")
        if sent is None:
            return None
        if sent == index:
            return text
        event["output_index"] = sent
        return json.dumps(event, ensure_ascii=False, separators=(",", ":"))

    def _one_call_output(self, response: dict[str, Any]) -> dict[str, Any]:
        """``response`` with its first function_call output item only (``parallel_tool_calls: false``)."""
        output = first_call_only(response.get("output") or (), lambda item: isinstance(item, dict) and item.get("type") == "function_call")
        return {**response, "output": output, "parallel_tool_calls": False}

    async def _done(self, response: dict[str, Any]) -> str:
        """The finished response as sent, stored when asked (a background one only while its
        record is still running: not over a cancel or delete)."""
        if self.one_call:
            response = self._one_call_output(response)
        response = self._settings(response)
        if self.keep:
            await self._store(response, if_running=self.background)
        return json.dumps(response, ensure_ascii=False, separators=(",", ":"))

    def _settings(self, response: dict[str, Any]) -> dict[str, Any]:
        """``response`` reporting this request's store / background / previous_response_id."""
        return {**response, "store": self.keep, "background": self.background, "previous_response_id": self.previous_id}

    async def detach(self, answer: Answer) -> Response | None:
        if not self.background:
            return None
        self.rid = answer.rid
        queued = json.loads(dr.ResponsesResponse(answer.rid, answer.model, int(time.time()), 0, 0).to_json())
        entry = await self._store(self._settings({**queued, "status": "queued"}))
        task = self.gw.spawn(self._run(answer))
        self.gw.background[self.rid] = task
        task.add_done_callback(lambda _: self.gw.background.pop(self.rid, None))
        return Response(json.dumps(entry.response, ensure_ascii=False), media_type="application/json")

    # ---- the store --------------------------------------------------------------------------------
    async def _store(self, response: dict[str, Any], *, if_running: bool = False) -> StoredResponse:
        """Put ``response`` with the conversation it ends (``if_running``: only over a running record)."""
        self.rid = response["id"]
        entry = StoredResponse(self.rid, owner_id(self.key), response, self.history + list(response.get("output") or ()), len(self.history))
        await self.gw.responses.put(entry, if_running=if_running)
        return entry

    async def _set_status(self, status: str, error: dict[str, Any] | None = None) -> None:
        """The stored record's status, while it is still running."""
        entry = await self.gw.responses.get(self.rid)
        if entry is not None and entry.running:
            entry.response = {**entry.response, "status": status, **({"error": error} if error else {})}
            await self.gw.responses.put(entry, if_running=True)

    async def _run(self, answer: Answer) -> None:
        """The background run: the answer collected under the request deadline, then stored;
        stopped when its record is cancelled or deleted (here or through another gateway)."""
        try:
            await self._set_status("in_progress")
            async with asyncio.timeout(max(0.0, min(r.deadline for r in answer.runs) - time.perf_counter())):
                run = asyncio.ensure_future(collect(answer))  # finish() stores the result
                try:
                    while not run.done():
                        await asyncio.wait([run], timeout=self.gw.responses.config.poll_s)
                        if not run.done() and not await self._still_wanted():
                            run.cancel()
                    await run
                finally:
                    run.cancel()
        except TimeoutError:
            await self._set_status("failed", {"code": "timeout", "message": "The response did not finish in time."})
        except GatewayError as exc:
            await self._set_status("failed", {"code": exc.code or exc.type, "message": exc.message})
        except asyncio.CancelledError:
            await self._set_status("cancelled")
        finally:
            answer.close()

    async def _still_wanted(self) -> bool:
        """Whether the record is still running (not cancelled, deleted or expired meanwhile)."""
        entry = await self.gw.responses.get(self.rid)
        return entry is not None and entry.running


def input_items(entry: StoredResponse, limit: int, order: str, after: str | None) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: the conversation the response answered (earlier
    responses' items included, as OpenAI lists them), each with an id, as an OpenAI list page."""
    items = [_item_resource(item, entry.id, i) for i, item in enumerate(entry.history[: entry.inputs])]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"No input item with id '{after}' in response '{entry.id}'.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list", "data": page, "has_more": len(items) > limit,
        "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
    }


def _item_resource(item: Any, rid: str, i: int) -> dict[str, Any]:
    """An input item as OpenAI lists it: with an id and a status; a message's text as parts."""
    if not isinstance(item, dict):
        return {"id": f"item_{rid}_{i}", "type": "unknown", "value": item}
    out = {"id": f"msg_{rid}_{i}", "status": "completed", **item}
    if "role" in out and "type" not in out:
        out["type"] = "message"
    if out.get("type") == "message" and isinstance(out.get("content"), str):
        kind = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": kind, "text": out["content"]}]
    return out


async def cancel(gw: Gateway, entry: StoredResponse) -> dict[str, Any]:
    """``POST /v1/responses/{id}/cancel``: stop a background run; a finished one is returned as it
    is. The record turns ``cancelled`` at once; the run stops here, or, on another gateway, at its
    next look at the record."""
    if entry.response.get("background") is not True:
        raise InvalidRequest("Only responses created with background=true can be cancelled.", param="response_id")
    if entry.running:
        entry.response = {**entry.response, "status": "cancelled"}
        if not await gw.responses.put(entry, if_running=True):  # it finished meanwhile: as it is now
            return (await gw.responses.get(entry.id) or entry).response
        await stop_run(gw, entry.id)
    return entry.response


async def stop_run(gw: Gateway, response_id: str) -> None:
    """Cancel the background run of ``response_id`` when this gateway runs it, and wait for it."""
    task = gw.background.get(response_id)
    if task is not None:
        task.cancel()
        await asyncio.wait([task], timeout=5)

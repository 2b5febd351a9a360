"""``POST /v1/messages`` (Anthropic Messages API; errors are Anthropic-shaped).

``tool_choice.disable_parallel_tool_use: true`` (which deepseek-recipe does not read): the answer
keeps only its first ``tool_use`` block (``SingleToolUse``); streamed, the later tool_use blocks'
events are not sent and the blocks after them are renumbered, so the indices stay contiguous.
"""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe as dr
from fastapi import APIRouter, Request
from starlette.responses import Response

from server.first_call import FirstCallOnly, first_call_only
from server.handler import Answer, RecipeProtocol, serve_recipe
from server.inputs import prepare_messages
from server.schemas import ERROR_RESPONSES, MESSAGES, json_body

router = APIRouter()

MESSAGES_PROTOCOL = RecipeProtocol(
    route="/v1/messages",
    request_cls=dr.MessagesRequest,
    response_cls=dr.MessagesResponse,
    id_prefix="msg_",
    flavor="anthropic",
    prepare=lambda req, options: dr.MessagesRequest.chunk_generator,
    prepare_body=prepare_messages,
    named_events=True,
)

_BLOCK_EVENTS = ("content_block_start", "content_block_delta", "content_block_stop")


def single_tool_use(body: dict[str, Any]) -> bool:
    choice = body.get("tool_choice")
    return isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True


class SingleToolUse:
    """Answer hooks keeping the first ``tool_use`` block of a Messages answer only."""

    unique_id = False
    added_bytes = 0

    def __init__(self) -> None:
        self.calls = FirstCallOnly()

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    async def detach(self, answer: Answer) -> Response | None:
        return None

    async def finish(self, text: str) -> str:
        message = json.loads(text)
        message["content"] = first_call_only(message.get("content") or [], lambda block: block.get("type") == "tool_use")
        return json.dumps(message, ensure_ascii=False)

    async def event(self, name: str, text: str) -> str | None:
        if name not in _BLOCK_EVENTS:
            return text
        event = json.loads(text)
        index = event.get("index")
        sent = self.calls.index(index, name == "content_block_start", event.get("content_block", {}).get("type") == "tool_use")
        if sent is None:
            return None
        if sent == index:
            return text
        event["index"] = sent
        return json.dumps(event, ensure_ascii=False)


async def _hooks(body: dict[str, Any], key: str) -> SingleToolUse | None:
    return SingleToolUse() if single_tool_use(body) else None


@router.post("/v1/messages", openapi_extra=json_body(MESSAGES), responses=ERROR_RESPONSES)
async def create_message(request: Request) -> Response:
    """An Anthropic message; ``stream: true`` answers named events (``message_start`` ...)."""
    return await serve_recipe(request, MESSAGES_PROTOCOL, _hooks)

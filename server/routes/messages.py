"""``POST /v1/messages`` (Anthropic Messages API; errors are Anthropic-shaped)."""

from __future__ import annotations

import deepseek_recipe as dr
from fastapi import APIRouter, Request
from starlette.responses import Response

from server.handler import RecipeProtocol, serve_recipe
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


@router.post("/v1/messages", openapi_extra=json_body(MESSAGES), responses=ERROR_RESPONSES)
async def create_message(request: Request) -> Response:
    """An Anthropic message; ``stream: true`` answers named events (``message_start`` ...)."""
    return await serve_recipe(request, MESSAGES_PROTOCOL)

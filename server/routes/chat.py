"""``POST /v1/chat/completions`` (OpenAI Chat Completions, DeepSeek extensions included)."""

from __future__ import annotations

import deepseek_recipe as dr
from fastapi import APIRouter, Request
from starlette.responses import Response

from server.handler import RecipeProtocol, serve_recipe
from server.inputs import prepare_chat
from server.schemas import CHAT_COMPLETIONS, ERROR_RESPONSES, json_body
from server.sse import DONE

router = APIRouter()

CHAT = RecipeProtocol(
    route="/v1/chat/completions",
    request_cls=dr.ChatCompletionRequest,
    response_cls=dr.ChatCompletionResponse,
    id_prefix="chatcmpl-",
    flavor="openai",
    prepare=lambda req, options: dr.ChatCompletionRequest.chunk_generator,
    prepare_body=prepare_chat,
    done=DONE,
    chat=True,
)


@router.post("/v1/chat/completions", openapi_extra=json_body(CHAT_COMPLETIONS), responses=ERROR_RESPONSES)
async def chat_completions(request: Request) -> Response:
    """Chat completion; ``stream: true`` answers server-sent events ending with ``[DONE]``."""
    return await serve_recipe(request, CHAT)

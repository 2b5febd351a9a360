"""``POST /v1/responses`` (OpenAI Responses API; stateless: ``store`` is not supported)."""

from __future__ import annotations

from typing import Any

import deepseek_recipe as dr
from fastapi import APIRouter, Request
from starlette.responses import Response

from server.handler import MakeGenerator, RecipeProtocol, serve_recipe
from server.inputs import prepare_responses
from server.schemas import ERROR_RESPONSES, RESPONSES, json_body

router = APIRouter()


def _prepare(req: Any, options: Any) -> MakeGenerator:
    """Read the echoed settings and namespace tools before ``convert`` consumes the request."""
    echo = req.echo()
    namespaces = req.namespace_tool_map(options)

    def make(conv: Any, rid: str, model: str) -> Any:
        gen = dr.ResponsesRequest.chunk_generator(conv, rid, model).with_echo(echo)
        return gen.with_namespace_tool_map(namespaces) if namespaces else gen

    return make


RESPONSES_PROTOCOL = RecipeProtocol(
    route="/v1/responses",
    request_cls=dr.ResponsesRequest,
    response_cls=dr.ResponsesResponse,
    id_prefix="resp_",
    flavor="openai",
    prepare=_prepare,
    prepare_body=prepare_responses,
    named_events=True,
)


@router.post("/v1/responses", openapi_extra=json_body(RESPONSES), responses=ERROR_RESPONSES)
async def create_response(request: Request) -> Response:
    """A model response; ``stream: true`` answers named server-sent events (``response.*``)."""
    return await serve_recipe(request, RESPONSES_PROTOCOL)

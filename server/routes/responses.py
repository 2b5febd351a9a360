"""``/v1/responses`` (OpenAI Responses API): create, and the stored responses' ``GET``,
``DELETE`` and ``cancel`` (``server/response_flow.py``: store, previous_response_id, background)."""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe as dr
from fastapi import APIRouter, Request
from starlette.responses import Response

from server.errors import InvalidRequest
from server.handler import MakeGenerator, RecipeProtocol, serve_recipe
from server.inputs import prepare_responses
from server.response_flow import ResponsesFlow, cancel, input_items, lookup, not_found, stop_run
from server.schemas import ERROR_RESPONSES, RESPONSES, json_body
from server.state import Gateway

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


def _json(obj: dict[str, Any]) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), media_type="application/json")


def _query(request: Request, accepted: tuple[str, ...]) -> Any:
    """The query parameters, 400 naming the first one this server does not honour."""
    for name in request.query_params:
        if name not in accepted:
            raise InvalidRequest(f"Unrecognized query parameter: {name}", param=name, code="unknown_parameter")
    return request.query_params


@router.post("/v1/responses", openapi_extra=json_body(RESPONSES), responses=ERROR_RESPONSES)
async def create_response(request: Request) -> Response:
    """A model response; ``stream: true`` answers named server-sent events (``response.*``)."""
    gw: Gateway = request.app.state.gateway
    return await serve_recipe(request, RESPONSES_PROTOCOL, lambda body, key: ResponsesFlow.read(gw, body, key))


@router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def get_response(request: Request, response_id: str) -> Response:
    """A stored response (a background one: its status so far); 404 when unknown."""
    gw: Gateway = request.app.state.gateway
    owner = gw.authenticate(request)
    if _query(request, ("stream",)).get("stream", "false") != "false":
        raise InvalidRequest("Streaming a stored response is not supported; poll without 'stream'.", param="stream")
    return _json((await lookup(gw.responses, response_id, owner)).response)


@router.get("/v1/responses/{response_id}/input_items", responses=ERROR_RESPONSES)
async def list_input_items(request: Request, response_id: str) -> Response:
    """The input items of a stored response (``limit`` 1-100, default 20; ``order`` desc (default)
    or asc; ``after``: an item id); 404 when unknown."""
    gw: Gateway = request.app.state.gateway
    entry = await lookup(gw.responses, response_id, gw.authenticate(request))
    q = _query(request, ("limit", "order", "after"))
    limit = q.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise InvalidRequest("Invalid 'limit': an integer in [1, 100].", param="limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("Invalid 'order': asc or desc.", param="order")
    return _json(input_items(entry, int(limit), order, q.get("after")))


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def delete_response(request: Request, response_id: str) -> Response:
    """Delete a stored response (a running background one is cancelled); 404 when unknown."""
    gw: Gateway = request.app.state.gateway
    await lookup(gw.responses, response_id, gw.authenticate(request))
    if not await gw.responses.delete(response_id):  # deleted or expired meanwhile
        raise not_found(response_id)
    await stop_run(gw, response_id)
    return _json({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel", responses=ERROR_RESPONSES)
async def cancel_response(request: Request, response_id: str) -> Response:
    """Cancel a background response (``status: cancelled``); 404 when unknown."""
    gw: Gateway = request.app.state.gateway
    return _json(await cancel(gw, await lookup(gw.responses, response_id, gw.authenticate(request))))

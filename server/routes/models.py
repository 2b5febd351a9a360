"""``GET /v1/models`` and ``GET /v1/models/{model_id}``: the served model names.

Cards carry vLLM's extra keys too: ``root`` (the checkpoint directory the name serves, or the
canonical model name), ``parent`` (null) and ``max_model_len`` (the context length requests are
checked against).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from starlette.responses import Response

from server.errors import ModelNotFound
from server.schemas import ERROR_RESPONSES
from server.state import Gateway

router = APIRouter()


def _card(gw: Gateway, name: str) -> dict[str, object]:
    c = gw.catalog
    return {
        "id": name, "object": "model", "created": c.created, "owned_by": "deepserve",
        "root": c.root, "parent": None, "max_model_len": c.context_len,
    }


@router.get("/v1/models", responses=ERROR_RESPONSES)
async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    gw.authenticate(request)
    data = [_card(gw, name) for name in gw.catalog.served]
    return Response(json.dumps({"object": "list", "data": data}), media_type="application/json")


@router.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
async def get_model(model_id: str, request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    gw.authenticate(request)
    if model_id not in gw.catalog.served:
        raise ModelNotFound(f"The model `{model_id}` does not exist or you do not have access to it.", param="model")
    return Response(json.dumps(_card(gw, model_id)), media_type="application/json")

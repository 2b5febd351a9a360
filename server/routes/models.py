"""``GET /v1/models`` and ``GET /v1/models/{model_id}``: the served model names."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from starlette.responses import Response

from server.errors import ModelNotFound
from server.schemas import ERROR_RESPONSES
from server.state import Gateway

router = APIRouter()


def _card(name: str, created: int) -> dict[str, object]:
    return {"id": name, "object": "model", "created": created, "owned_by": "deepserve"}


@router.get("/v1/models", responses=ERROR_RESPONSES)
async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    gw.authenticate(request)
    data = [_card(name, gw.catalog.created) for name in gw.catalog.served]
    return Response(json.dumps({"object": "list", "data": data}), media_type="application/json")


@router.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
async def get_model(model_id: str, request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    gw.authenticate(request)
    if model_id not in gw.catalog.served:
        raise ModelNotFound(f"The model `{model_id}` does not exist or you do not have access to it.", param="model")
    return Response(json.dumps(_card(model_id, gw.catalog.created)), media_type="application/json")

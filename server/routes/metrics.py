"""``GET /metrics``: Prometheus text; in ``deepserve up`` also every worker's metrics.

Unauthenticated, like engine workers' ``/metrics`` (restrict it at the network level).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from server.metrics import fetch_texts, merge_exposition
from server.state import Gateway

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    if gw.metrics_sources:
        texts = await fetch_texts(gw.metrics_sources, ssl=gw.metrics_ssl)
        body = merge_exposition(gw.metrics.registry, texts)
    else:
        body = gw.metrics.render()
    return Response(body, media_type=CONTENT_TYPE_LATEST)

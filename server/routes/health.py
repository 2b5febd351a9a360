"""``GET /health``: 200 when the gateway can serve (in ``deepserve up``: all workers healthy).

Unauthenticated, for load balancers and orchestrator probes.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from server.state import Gateway

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    ok = True
    if gw.health_probe is not None:
        try:
            ok = bool(await gw.health_probe())
        except Exception:
            ok = False
    if ok:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503, headers={"Retry-After": "1"})

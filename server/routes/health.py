"""``GET /health`` (and vLLM's ``GET|POST /ping``): 200 when the gateway can serve (in
``deepserve up``: all workers healthy); ``GET /version``: the deepserve version.

Unauthenticated, for load balancers and orchestrator probes.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from server.state import Gateway

router = APIRouter()


@router.get("/version")
async def version() -> Response:
    try:
        v = package_version("deepserve")
    except PackageNotFoundError:
        v = "unknown"
    return JSONResponse({"version": v})


@router.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
async def ping(request: Request) -> Response:
    """vLLM's liveness probe: the same answer as ``/health``."""
    return await health(request)


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

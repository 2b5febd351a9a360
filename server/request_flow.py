"""The one request skeleton every generating route composes.

validate (``admit``: authenticate 401 -> body with its size and time limits 413/408 -> JSON
parsed once 400 -> known fields 400 -> model 404 -> a prompt that cannot fit whatever its tokens
400 -> rate limit 429) -> render (the route's own: deepseek-recipe for Chat / Responses /
Messages in ``server.handler``, token ids for ``/v1/completions``) -> generate (``start_run``
per engine request: admission 503, the token charge, the prompt metric) -> shape the answer
(the route's own) -> ``deliver`` (a client that left is 499; runs not handed to a stream or a
background run are closed). Failures are ``GatewayError``s, rendered by the app's handler.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from deepserve.protocol import GenerateRequest
from server.errors import InvalidRequest, ModelNotFound
from server.fields import check_fields
from server.generation import ClientDisconnected, Run
from server.metrics import _RouteMetrics
from server.size_check import check_prompt_size
from server.state import Gateway


def parse_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (400 ``invalid_json`` otherwise)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest(
            "We could not parse the JSON body of your request. The request body must be valid JSON.",
            code="invalid_json",
        ) from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise InvalidRequest("The JSON body of your request is nested too deeply.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return body


def check_model(gw: Gateway, body: dict[str, Any]) -> str:
    """The body's ``model``, one this gateway serves (400 / 404 otherwise)."""
    model = body.get("model")
    if model is None:
        raise InvalidRequest("You must provide a model parameter.", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise InvalidRequest("Invalid type for 'model': expected a string.", param="model", code="invalid_type")
    if model not in gw.catalog.served:
        raise ModelNotFound(f"The model `{model}` does not exist or you do not have access to it.", param="model")
    return model


@dataclass(frozen=True)
class Admitted:
    """A request past the shared checks: the caller, its body (raw and parsed once), its model."""

    gw: Gateway
    route: _RouteMetrics
    key: str  # the caller's API key (or address), for limits
    raw: bytes
    body: dict[str, Any]
    model: str
    started: float  # perf_counter at arrival

    async def start_run(self, greq: GenerateRequest, make_processor: Callable[[], Any], *, skip_ids: frozenset[int], keep_ids: bool) -> Run:
        """Admit one engine request (503 when the gateway is full) and its stream processor."""
        gw = self.gw
        await gw.admission.acquire()
        try:
            processor = make_processor()
        except BaseException:
            gw.admission.release()
            raise
        n = len(greq.prompt_token_ids)
        gw.limiter.charge(self.key, n)
        self.route.prompt.inc(n)
        return Run(gw, self.route, self.key, greq, processor, started=self.started, skip_ids=skip_ids, keep_ids=keep_ids)


async def read_object(request: Request) -> tuple[Gateway, str, bytes, dict[str, Any]]:
    """(gateway, caller's key, raw body, body parsed once): authenticated, within the body's
    size and time limits, a JSON object. The first steps of every route that takes a body."""
    gw: Gateway = request.app.state.gateway
    key = gw.authenticate(request)
    raw = await gw.read_body(request)
    return gw, key, raw, parse_object(raw)


async def admit(request: Request, route: str) -> Admitted:
    """The validation steps every generating route shares (module docstring)."""
    started = time.perf_counter()
    gw, key, raw, body = await read_object(request)
    check_fields(body, route)
    model = check_model(gw, body)
    check_prompt_size(body, route, gw.catalog.context_len, gw.catalog.max_token_bytes)
    if gw.limiter.enabled:
        gw.limiter.admit(key)
    return Admitted(gw, gw.metrics.by_route[route], key, raw, body, model, started)


async def deliver(gw: Gateway, send: Callable[[], Awaitable[tuple[Response, bool]]], close: Callable[[], None]) -> Response:
    """The last step: ``send()`` gives (the response, whether it took the runs over: a stream
    closes them when it ends, a background run when it finishes); a client that left gets 499;
    otherwise ``close()`` closes the runs here, whatever happened."""
    owned = False
    try:
        response, owned = await send()
        return response
    except ClientDisconnected:
        gw.metrics.reject("client_disconnect")
        return Response(status_code=499)
    finally:
        if not owned:
            close()

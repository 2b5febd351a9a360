"""The gateway's errors, and their OpenAI- and Anthropic-shaped JSON bodies.

One shallow hierarchy: every error a client can cause or suffer is a ``GatewayError`` carrying
its HTTP status, OpenAI ``type``/``code``/``param`` and extra headers (``Retry-After``). Errors of
lower layers (deepseek-recipe conversion, the router, the HTTP client) are translated here, at
the boundary, by ``translate``. Anything else reaching a handler is a bug: 500 ``server_error``.

Statuses chosen where OpenAI leaves it open:
- 408 ``request_timeout``: the client did not send its whole body within ``body_timeout_s``.
- 504 ``timeout``: the engine did not finish within ``request_timeout_s`` (the request is aborted).
- 503 ``overloaded`` with ``Retry-After``: the admission queue is full or waited too long, or the
  router has no worker / is overloaded.
- 502 ``engine_error``: the engine failed the request or could not be reached.

What lower layers say is never passed on verbatim (``client_text``): a 4xx keeps the first line
of the engine's reason (the JSON ``error`` of a worker's answer when there is one) with file
paths masked and tracebacks cut; a 5xx says only what kind of failure it was, and the detail is
logged.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

log = logging.getLogger(__name__)

_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.+-]+)+\.(?:py|pyx|c|cc|cpp|cxx|h|hh|hpp|cu|cuh|rs|so)\b(?::\d+)*")
_MAX_TEXT = 300

# Anthropic's error ``type`` per HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class GatewayError(Exception):
    """An error answered to the client as JSON with ``status``."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None
    reason: str = ""  # the ``deepserve_http_rejected_total`` reason; "" = derived from the status

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        if code is not None:
            self.code = code
        self.param = param
        self.retry_after = retry_after

    @property
    def reject_reason(self) -> str:
        if self.reason:
            return self.reason
        if self.status == 404:
            return "not_found"
        return "invalid_request" if self.status < 500 else "server_error"

    @property
    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body(self, flavor: str = "openai") -> bytes:
        payload = self.anthropic_body() if flavor == "anthropic" else self.openai_body()
        return json.dumps(payload, ensure_ascii=False).encode()


class InvalidRequest(GatewayError):
    status, type, code = 400, "invalid_request_error", "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code, reason = "context_length_exceeded", "context_length"


class AuthenticationFailed(GatewayError):
    status, type, code, reason = 401, "invalid_request_error", "invalid_api_key", "auth"


class NotFound(GatewayError):
    status, type, code = 404, "invalid_request_error", "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class RequestTimeout(GatewayError):
    status, type, code, reason = 408, "invalid_request_error", "request_timeout", "body_timeout"


class BodyTooLarge(GatewayError):
    status, type, code, reason = 413, "invalid_request_error", "request_too_large", "body_too_large"


class RateLimited(GatewayError):
    status, type, code, reason = 429, "rate_limit_exceeded", "rate_limit_exceeded", "rate_limit"


class Overloaded(GatewayError):
    status, type, code, reason = 503, "server_error", "overloaded", "overload"


class EngineFailed(GatewayError):
    status, type, code, reason = 502, "server_error", "engine_error", "engine_error"


class EngineTimeout(GatewayError):
    status, type, code, reason = 504, "server_error", "timeout", "timeout"


def client_text(text: str) -> str:
    """A lower layer's error text as a client may see it: the worker's JSON ``error`` message
    when the text carries one (``HTTP 400: {"error": ...}``), its first line, no traceback, file
    paths masked, at most 300 characters."""
    brace = text.find("{")
    if brace >= 0:
        try:
            err = json.loads(text[brace:]).get("error")
        except (ValueError, AttributeError):
            err = None
        if isinstance(err, dict):
            err = err.get("message")
        if isinstance(err, str) and err:
            text = err
    text = text.split("Traceback", 1)[0].strip().splitlines()[0] if text.strip() else ""
    text = _PATH.sub("<internal>", text)
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


def engine_failed(detail: str) -> EngineFailed:
    """The 502 for an engine that failed a request: ``detail`` goes to the log, not the client."""
    log.warning("engine failed a request: %s", detail)
    return EngineFailed("The engine failed the request.")


def from_conversion_error(exc: Exception) -> GatewayError:
    """deepseek-recipe's ``ConversionError`` already carries an OpenAI body and status."""
    status = int(getattr(exc, "status_code", 400) or 400)
    try:
        err = json.loads(getattr(exc, "body", ""))["error"]
        message = str(err.get("message") or exc)
        kind, code, param = err.get("type"), err.get("code"), err.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, kind, code, param = str(exc), None, None, None
    if "maximum context length" in message:
        return ContextLengthExceeded(message, param=param or "messages")
    if status >= 500:  # conversion never fails because of us; keep the client's 4xx space honest
        status = 400
    return GatewayError(message, status=status, type=kind or "invalid_request_error", code=code, param=param)


def translate(exc: BaseException) -> GatewayError:
    """Map an exception from the engine client (router, worker client, transport) to a client error.

    Router errors are matched by name so this module does not import the router package:
    ``NoWorkerAvailable`` / ``Overloaded`` / anything with ``retry_after`` -> 503 with Retry-After;
    an invalid request the engine refused (by name, or an HTTP ``status`` 400/422 attribute) -> 400;
    timeouts -> 504; an unreachable engine -> 503; the rest -> 502.
    """
    if isinstance(exc, GatewayError):
        return exc
    names = {cls.__name__ for cls in type(exc).__mro__}
    message = client_text(str(exc)) or type(exc).__name__
    retry_after = getattr(exc, "retry_after", None)
    if names & {"NoWorkerAvailable", "Overloaded", "CapacityError", "Draining"} or retry_after is not None:
        return Overloaded(f"The engine is overloaded: {message}", retry_after=float(retry_after or 1.0))
    if names & {"InvalidRequestError", "InvalidRequest", "PromptTooLong", "ContextLengthExceeded"} or getattr(
        exc, "status", None
    ) in (400, 422):
        return InvalidRequest(message)
    log.warning("engine error %s: %s", type(exc).__name__, exc)
    if isinstance(exc, TimeoutError) or names & {"TimeoutException", "ServerTimeoutError"}:
        return EngineTimeout("The engine did not answer in time.")
    status = getattr(exc, "status", None)
    if status == 503:
        return Overloaded("The engine is unavailable.", retry_after=1.0)
    if isinstance(exc, (ConnectionError, OSError)) or names & {"ClientConnectionError", "ConnectError"}:
        return Overloaded("The engine is unreachable.", retry_after=1.0)
    return EngineFailed("The engine failed the request.")

"""The gateway's errors, and their OpenAI- and Anthropic-shaped JSON bodies.

One shallow hierarchy: every error a client can cause or suffer is a ``GatewayError`` carrying
its HTTP status, OpenAI ``type``/``code``/``param`` and extra headers (``Retry-After``). Errors of
lower layers (deepseek-recipe conversion, the router, the HTTP client) are translated here, at
the boundary, by ``translate``; those of the router and the engines carry a
``deepserve.protocol.ErrorCode``, which ``from_code`` maps to the status, type and ``code`` the code
defines. Anything else reaching a handler is a bug: 500 ``server_error``.

Statuses chosen where OpenAI leaves it open:
- 408 ``request_timeout``: the client did not send its whole body within ``body_timeout_s``.
- 504 ``timeout``: the engine did not finish within ``request_timeout_s`` (the request is aborted).
- 503 with ``Retry-After``: the admission queue is full or waited too long (``overloaded``), or
  the code an engine or the router reported says so: ``overloaded``, ``engine_full``,
  ``unavailable`` (no worker, none reachable, draining), ``cancelled`` (the engine aborted it).
- 502 ``engine_error``: the engine failed the request.

What lower layers say is never passed on verbatim (``client_text``): a 4xx keeps the first line
of the engine's reason with file paths masked and tracebacks cut; a 5xx says only what kind of
failure it was, and the detail is logged.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

from deepserve.protocol import CodedError, ErrorCode

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
        message = self.message
        if self.param and self.param not in message:  # Anthropic's errors have no param: the message names it
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}

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
    """A lower layer's error text as a client may see it: its first line, no traceback, file
    paths masked, at most 300 characters."""
    text = text.split("Traceback", 1)[0].strip().splitlines()[0] if text.strip() else ""
    text = _PATH.sub("<internal>", text)
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


# The gateway class per code (its metrics reason); status, type and OpenAI code come from the code.
_CLASS_OF: dict[ErrorCode, type[GatewayError]] = {
    ErrorCode.INVALID_REQUEST: InvalidRequest,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: ContextLengthExceeded,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.PERMISSION_DENIED: GatewayError,
    ErrorCode.ENGINE_FULL: Overloaded,
    ErrorCode.OVERLOADED: Overloaded,
    ErrorCode.UNAVAILABLE: Overloaded,
    ErrorCode.CANCELLED: Overloaded,
    ErrorCode.TIMEOUT: EngineTimeout,
    ErrorCode.ENGINE_ERROR: EngineFailed,
    ErrorCode.INTERNAL: GatewayError,
}

# What a client is told for a server-side code (the lower layer's text goes to the log).
_SERVER_MESSAGES = {
    ErrorCode.ENGINE_FULL: "The engine is full. Please retry.",
    ErrorCode.OVERLOADED: "The engine is overloaded. Please retry.",
    ErrorCode.UNAVAILABLE: "The engine is unavailable. Please retry.",
    ErrorCode.CANCELLED: "The engine aborted the request (draining or preempted). Please retry.",
    ErrorCode.TIMEOUT: "The engine did not answer in time.",
    ErrorCode.ENGINE_ERROR: "The engine failed the request.",
    ErrorCode.INTERNAL: "Internal error.",
}


def from_code(code: ErrorCode, detail: str, retry_after: float | None = None) -> GatewayError:
    """The client error for a failure a lower layer reported with ``code`` (the one mapping of
    ``ErrorCode`` to HTTP): the code's status, OpenAI ``type`` and ``code``; a client-fault code
    keeps ``client_text(detail)``, a server-side one says only what kind of failure it was (the
    detail is logged); a 503 always has a ``Retry-After`` (``retry_after``, 1 s by default)."""
    if code.client_fault:
        message = client_text(detail) or _CLASS_OF[code].__name__
    else:
        log.warning("engine failure %s: %s", code.value, detail)
        message = _SERVER_MESSAGES[code]
        if code.status == 503 and retry_after is None:
            retry_after = 1.0
    return _CLASS_OF[code](message, status=code.status, type=code.openai_type, code=code.value, retry_after=retry_after)


def from_conversion_error(exc: Exception) -> GatewayError:
    """deepseek-recipe's ``ConversionError`` already carries an OpenAI body and status."""
    status = int(getattr(exc, "status_code", 400) or 400)
    try:
        err = json.loads(getattr(exc, "body", ""))["error"]
        message = str(err.get("message") or exc)
        kind, code, param = err.get("type"), err.get("code"), err.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, kind, code, param = str(exc), None, None, None
    if status >= 500:  # conversion never fails because of us; keep the client's 4xx space honest
        status = 400
    return GatewayError(message, status=status, type=kind or "invalid_request_error", code=code, param=param)


def translate(exc: BaseException) -> GatewayError:
    """Map an exception from the engine client (router, worker client, transport) to a client error.

    A ``CodedError`` (every router and engine error) by its code (``from_code``); a timeout ->
    ``timeout``; an unreachable engine -> ``unavailable``; anything else -> ``engine_error``.
    """
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, CodedError):
        return from_code(exc.code, str(exc), exc.retry_after)
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, TimeoutError):
        return from_code(ErrorCode.TIMEOUT, detail)
    if isinstance(exc, OSError):  # ConnectionError included
        return from_code(ErrorCode.UNAVAILABLE, detail)
    return from_code(ErrorCode.ENGINE_ERROR, detail)

"""Error codes shared by every process: what failed, not how a component phrased it.

An ``ErrorCode`` travels with every failure that crosses a process boundary: in a final
``TokenEvent`` (``error_code``) and in the JSON body of an HTTP error (``error_body``). Workers
and the router set it where the failure happens, the router forwards it unchanged, and the
gateway maps it once (``server.errors.from_code``) to the HTTP status and OpenAI ``type`` the
code carries here. Exceptions that end a request on purpose derive from ``CodedError``, so a
package's errors are typed by code, never matched by class name or message text.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, NamedTuple


class ErrorCode(str, Enum):
    """A failure kind, with the HTTP status and OpenAI error ``type`` the gateway answers with.

    The value is the wire string (and the OpenAI ``code`` a client sees). ``client_fault``: the
    request itself is at fault (4xx), so sending it to another worker would not help.
    """

    status: int
    openai_type: str

    def __new__(cls, value: str, status: int, openai_type: str) -> ErrorCode:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        member.openai_type = openai_type
        return member

    INVALID_REQUEST = ("invalid_request", 400, "invalid_request_error")
    CONTEXT_LENGTH_EXCEEDED = ("context_length_exceeded", 400, "invalid_request_error")
    NOT_FOUND = ("not_found", 404, "invalid_request_error")
    PERMISSION_DENIED = ("permission_denied", 403, "invalid_request_error")
    ENGINE_FULL = ("engine_full", 503, "server_error")  # a worker's queue is full
    OVERLOADED = ("overloaded", 503, "server_error")  # every worker is busy (router admission)
    UNAVAILABLE = ("unavailable", 503, "server_error")  # no worker can be reached, or it is draining
    CANCELLED = ("cancelled", 503, "server_error")  # the engine aborted the request (drain, preemption)
    TIMEOUT = ("timeout", 504, "server_error")
    ENGINE_ERROR = ("engine_error", 502, "server_error")  # a worker failed the request
    INTERNAL = ("internal", 500, "server_error")  # a bug in the process that answers

    @property
    def client_fault(self) -> bool:
        return self.status < 500


class CodedError(Exception):
    """Base of the exceptions that end a request on purpose: a message and an ``ErrorCode``
    (the class's, unless the instance is given its own), and for overload a ``retry_after``."""

    code: ErrorCode = ErrorCode.INTERNAL
    retry_after: float | None = None

    def __init__(self, message: str, *, code: ErrorCode | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if retry_after is not None:
            self.retry_after = retry_after


class WireError(NamedTuple):
    """An error as an HTTP error body carries it."""

    code: ErrorCode
    message: str


def error_body(code: ErrorCode, message: str) -> dict[str, Any]:
    """The JSON body of an HTTP error between deepserve processes (OpenAI's shape)."""
    return {"error": {"message": message, "type": code.openai_type, "code": code.value}}


def parse_error_body(body: bytes | str) -> WireError | None:
    """The code and message of an ``error_body``; None when the body is not one (a peer that
    is not deepserve, or an unknown code)."""
    try:
        err = json.loads(body)["error"]
        return WireError(ErrorCode(err["code"]), str(err.get("message", "")))
    except (ValueError, KeyError, TypeError):
        return None

"""The router's exceptions: one shallow hierarchy, translated at the boundaries.

Every ``RouterError`` is a ``deepserve.protocol.CodedError``: its ``ErrorCode`` (the class's, or
the one a worker answered with) gives the HTTP status the router service answers with and the
gateway maps once. Below the router, transport failures (HTTP statuses, truncated streams) become
``WorkerError`` subclasses in ``worker_client``, keeping the code a worker's error body carried.

Errors that happen before a request's first token are *raised* from ``Router.generate``; once
tokens have been streamed, a failure the router cannot repair ends the stream with a final
``TokenEvent(finish_reason="error", error=..., error_code=...)`` instead, so a caller never loses
tokens it saw.
"""

from __future__ import annotations

from deepserve.protocol import CodedError, ErrorCode


class RouterError(CodedError):
    """Base class; ``code.status`` is the HTTP status it is answered with."""


class NoWorkerAvailable(RouterError):
    """No healthy, non-draining worker can serve this request (pool empty or all down)."""

    code = ErrorCode.UNAVAILABLE


class Overloaded(RouterError):
    """Every eligible worker is at capacity and the admission queue is full or timed out."""

    code = ErrorCode.OVERLOADED
    retry_after = 1.0


class RequestRejected(RouterError):
    """A worker refused the request itself (a client-fault code): retrying elsewhere would not help."""

    code = ErrorCode.INVALID_REQUEST


class UnknownWorker(RouterError):
    """A register/deregister/drain call named a worker the registry does not hold."""

    code = ErrorCode.NOT_FOUND


class RegistrationRefused(RouterError):
    """A ``/register`` call for an address that is not the caller's, or a worker id already
    held by a live worker at another address (one worker cannot displace another)."""

    code = ErrorCode.PERMISSION_DENIED


class WorkerError(RouterError):
    """A worker failed a request; ``retryable`` says whether another worker may succeed."""

    code = ErrorCode.ENGINE_ERROR
    retryable = True

    def __init__(self, message: str, worker_url: str = "", *, connect: bool = False, code: ErrorCode | None = None) -> None:
        super().__init__(message, code=code)
        self.worker_url = worker_url
        self.connect = connect  # True: the worker could not be reached at all (likely dead)


class WorkerUnavailable(WorkerError):
    """Connection refused or dropped, 5xx, or a stream that ended without a finish event."""

    code = ErrorCode.UNAVAILABLE


class WorkerRejected(WorkerError):
    """The worker answered with a client-fault code: the request is at fault, not the worker."""

    code = ErrorCode.INVALID_REQUEST
    retryable = False

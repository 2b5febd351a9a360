"""The router's exceptions: one shallow hierarchy, translated at the boundaries.

Below the router, transport failures (aiohttp errors, HTTP statuses, truncated streams) become
``WorkerError`` subclasses in ``worker_client``; above it, the gateway (or the router service)
maps every ``RouterError`` to an HTTP status with ``status`` and, for overload, ``Retry-After``.

Errors that happen before a request's first token are *raised* from ``Router.generate``; once
tokens have been streamed, a failure the router cannot repair ends the stream with a final
``TokenEvent(finish_reason="error", error=...)`` instead, so a caller never loses tokens it saw.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base class; ``status`` is the HTTP status the gateway answers with."""

    status: int = 500
    code: str = "router_error"


class NoWorkerAvailable(RouterError):
    """No healthy, non-draining worker can serve this request (pool empty or all down)."""

    status = 503
    code = "no_worker_available"


class Overloaded(RouterError):
    """Every eligible worker is at capacity and the admission queue is full or timed out."""

    status = 503
    code = "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestRejected(RouterError):
    """A worker refused the request itself (HTTP 4xx): retrying elsewhere would not help."""

    status = 400
    code = "invalid_request"


class UnknownWorker(RouterError):
    """A register/deregister/drain call named a worker the registry does not hold."""

    status = 404
    code = "unknown_worker"


class RegistrationRefused(RouterError):
    """A ``/register`` call for an address that is not the caller's, or a worker id already
    held by a live worker at another address (one worker cannot displace another)."""

    status = 403
    code = "registration_refused"


class WorkerError(RouterError):
    """A worker failed a request; ``retryable`` says whether another worker may succeed."""

    status = 502
    code = "worker_error"
    retryable = True

    def __init__(self, message: str, worker_url: str = "", *, connect: bool = False) -> None:
        super().__init__(message)
        self.worker_url = worker_url
        self.connect = connect  # True: the worker could not be reached at all (likely dead)


class WorkerUnavailable(WorkerError):
    """Connection refused or dropped, 5xx, or a stream that ended without a finish event."""


class WorkerRejected(WorkerError):
    """The worker answered 4xx: the request is at fault, not the worker."""

    status = 400
    retryable = False

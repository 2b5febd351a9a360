"""The engine's exception hierarchy (one shallow tree). Each class carries the
``deepserve.protocol.ErrorCode`` its failures travel with; the gateway maps the code."""

from deepserve.protocol import CodedError, ErrorCode


class EngineError(CodedError):
    """Base of every error the engine raises on purpose."""

    code = ErrorCode.ENGINE_ERROR


class CheckpointError(EngineError):
    """A checkpoint directory, its config or one of its tensors is missing or malformed."""


class InvalidRequestError(EngineError):
    """A request the engine cannot serve as asked (bad token id, unsupported field, ...)."""

    code = ErrorCode.INVALID_REQUEST


class ContextLengthExceeded(InvalidRequestError):
    """The prompt plus ``max_tokens`` does not fit the engine's context length."""

    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED


class CapacityError(EngineError):
    """The engine cannot admit more work right now (queue full, draining)."""

    code = ErrorCode.ENGINE_FULL

"""The engine's exception hierarchy (one shallow tree; the gateway maps it to HTTP errors)."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class CheckpointError(EngineError):
    """A checkpoint directory, its config or one of its tensors is missing or malformed."""


class InvalidRequestError(EngineError):
    """A request the engine cannot serve as asked (prompt too long, bad token id, ...)."""


class CapacityError(EngineError):
    """The engine cannot admit more work right now (queue full, draining)."""

"""Errors of the sampling package, under the engine's hierarchy (``engine.errors``)."""

from engine.errors import InvalidRequestError


class InvalidConstraintError(InvalidRequestError):
    """An output constraint that cannot be compiled: a malformed JSON schema, regex, EBNF grammar
    or tool list, or an unknown constraint kind. The gateway answers it with a 400."""

"""The typed messages every deepserve package shares (a leaf: it imports no other package of
the project). ``messages`` holds the dataclasses that cross process boundaries as NDJSON,
``errors`` the error codes they carry."""

from deepserve.protocol.errors import CodedError, ErrorCode, WireError, error_body, parse_error_body
from deepserve.protocol.messages import (
    KV_REMOVED,
    KV_ROWS_FORMAT,
    KV_STORED,
    ConstraintKind,
    FinishReason,
    GenerateRequest,
    KVEvent,
    LoadReport,
    OutputConstraint,
    RankLoad,
    Role,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
)

__all__ = [
    "CodedError",
    "ErrorCode",
    "WireError",
    "error_body",
    "parse_error_body",
    "KV_REMOVED",
    "KV_ROWS_FORMAT",
    "KV_STORED",
    "ConstraintKind",
    "FinishReason",
    "GenerateRequest",
    "KVEvent",
    "LoadReport",
    "OutputConstraint",
    "RankLoad",
    "Role",
    "SamplingParams",
    "TokenEvent",
    "TokenLogprob",
]

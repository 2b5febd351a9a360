"""Server-sent events framing, as the OpenAI and Anthropic SDKs parse it.

Chat Completions and Completions: unnamed ``data: {json}`` events and a final ``data: [DONE]``.
Responses and Messages: named events (``event: response.output_text.delta`` / ``event:
message_start`` ...) with the name from the recipe's ``sse_event_name``, no final marker.
Frames are built as ``str`` and encoded once per engine event (one write per batch of chunks).
"""

from __future__ import annotations

import json
from typing import Any, Iterable

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"


def data_frame(payload: str) -> str:
    """One unnamed event; ``payload`` is compact JSON (no raw newlines)."""
    return f"data: {payload}\n\n"


def event_frame(name: str | None, payload: str) -> str:
    if name is None:
        return f"data: {payload}\n\n"
    return f"event: {name}\ndata: {payload}\n\n"


def frames(chunks: Iterable[Any], event_name: Any = None) -> str:
    """Frame recipe chunks (objects with ``to_json``); ``event_name(chunk)`` names each, if given."""
    if event_name is None:
        return "".join(f"data: {c.to_json()}\n\n" for c in chunks)
    return "".join(event_frame(event_name(c), c.to_json()) for c in chunks)


def json_frame(obj: Any, name: str | None = None) -> str:
    return event_frame(name, json.dumps(obj, ensure_ascii=False, separators=(",", ":")))

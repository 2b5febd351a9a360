"""SSE framing as the OpenAI and Anthropic SDKs parse it."""

from __future__ import annotations

import json

from server.sse import DONE, data_frame, event_frame, frames, json_frame


class Chunk:
    def __init__(self, payload: dict) -> None:
        self.payload = payload

    def to_json(self) -> str:
        return json.dumps(self.payload)


def test_frames():
    assert data_frame('{"a":1}') == 'data: {"a":1}\n\n'
    assert event_frame("message_start", "{}") == "event: message_start\ndata: {}\n\n"
    assert event_frame(None, "{}") == "data: {}\n\n"
    assert DONE == "data: [DONE]\n\n"
    batch = [Chunk({"type": "a"}), Chunk({"type": "b"})]
    assert frames(batch) == 'data: {"type": "a"}\n\ndata: {"type": "b"}\n\n'
    assert frames(batch, lambda c: c.payload["type"]) == 'event: a\ndata: {"type": "a"}\n\nevent: b\ndata: {"type": "b"}\n\n'
    assert json_frame({"x": "é\n"}, "error") == 'event: error\ndata: {"x":"é\\n"}\n\n'  # one line per event

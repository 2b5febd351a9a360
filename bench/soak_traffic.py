"""The soak benchmark's requests: each kind sends one request and says how it ended.

Kinds that the stack must answer with the undisturbed run's text (greedy, so compared with a
baseline taken before any fault): ``chat``, ``chat_stream``, ``completion``, ``completion_stream``,
``structured`` (a json_schema answer) and ``long`` (a prompt of a few thousand tokens). Kinds with
no text to compare: ``disconnect`` (a stream the client leaves after two events), ``hostile_pattern``
(the 16,000-repeat pattern), ``huge_enum`` (20,000 values in a json_schema, which the prompt
carries too), ``huge_alternation`` (a 20,000-way regex, vLLM's ``structured_outputs``, not in the
prompt), ``malformed`` (not JSON) and ``deep``
(JSON nested 100,000 deep); these must end cleanly: a 2xx, or a 4xx with an error body.

An ``Outcome`` is ``ok`` (with the text when there is one), ``refused`` (a clean error answer: an
error body or an SSE error event) or ``broken`` (no answer within the timeout, a cut stream, a body
that is not the API's JSON).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx

Status = Literal["ok", "refused", "broken"]
COMPARED = ("chat", "chat_stream", "completion", "completion_stream", "structured", "long")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


@dataclass
class Outcome:
    kind: str
    prompt: int  # index of the prompt (compared kinds), else -1
    status: Status
    started: float  # monotonic
    ended: float
    text: str | None = None  # the answer's text (compared kinds)
    detail: str = ""  # an error's code or what broke


def prompt_text(i: int, long: bool = False) -> str:
    """Prompt ``i``'s text: a few words, or ~3,000 tokens for ``long``."""
    words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(9 + i)]
    text = f"Request {i}: " + " ".join(words)
    return text + " " + " ".join(f"{WORDS[(i + j) % len(WORDS)]}{j}" for j in range(1500)) if long else text


def body_for(kind: str, i: int, model: str, max_tokens: int) -> dict[str, Any] | bytes:
    """The request of ``kind`` for prompt ``i`` (bytes: sent as they are)."""
    chat = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": prompt_text(i, long=kind == "long")}]}
    if kind in ("chat", "long"):
        return chat
    if kind == "chat_stream":
        return {**chat, "stream": True}
    if kind in ("completion", "completion_stream"):
        return {"model": model, "prompt": prompt_text(i), "max_tokens": max_tokens, "temperature": 0,
                "stream": kind == "completion_stream"}
    if kind == "structured":
        return {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}
    if kind == "disconnect":
        return {**chat, "stream": True, "max_tokens": 4 * max_tokens}
    if kind == "hostile_pattern":
        schema = {"type": "string", "pattern": "[a-z]{16000}"}
        return {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    if kind == "huge_enum":
        schema = {"type": "string", "enum": [f"value-{k}" for k in range(20_000)]}
        return {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": schema}}}
    if kind == "huge_alternation":
        return {**chat, "structured_outputs": {"regex": "(" + "|".join(f"w{k}x" for k in range(20_000)) + ")"}}
    if kind == "malformed":
        return b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": "x"'
    if kind == "deep":
        return b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    raise ValueError(f"unknown kind {kind!r}")


def path_for(kind: str) -> str:
    return "/v1/completions" if kind.startswith("completion") else "/v1/chat/completions"


def _error_detail(payload: Any) -> str | None:
    """The error's code (or type) and the start of its message when ``payload`` is the API's
    error JSON, else None."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        err = payload["error"]
        return f"{err.get('code') or err.get('type') or 'error'}: {str(err.get('message'))[:90]}"
    return None


def _text_of(kind: str, payload: dict[str, Any]) -> str:
    choice = payload["choices"][0]
    return choice["text"] if kind.startswith("completion") else choice["message"]["content"] or ""


async def _stream(kind: str, response: httpx.Response, leave_after: int | None) -> tuple[Status, str, str]:
    """(status, text, detail) of an SSE answer; ``leave_after``: close after that many events."""
    parts: list[str] = []
    events = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            return "ok", "".join(parts), ""
        payload = json.loads(data)
        detail = _error_detail(payload)
        if detail is not None:
            return "refused", "".join(parts), detail
        events += 1
        if leave_after is not None and events >= leave_after:
            return "ok", "", "left"
        for choice in payload.get("choices") or ():
            piece = choice.get("text") if kind.startswith("completion") else (choice.get("delta") or {}).get("content")
            parts.append(piece or "")
    return "broken", "".join(parts), "stream ended without [DONE]"


async def send(client: httpx.AsyncClient, kind: str, i: int, model: str, max_tokens: int, timeout_s: float) -> Outcome:
    """One request of ``kind``; never raises."""
    started = time.monotonic()
    body = body_for(kind, i, model, max_tokens)
    prompt = i if kind in COMPARED else -1
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    streaming = isinstance(body, dict) and bool(body.get("stream"))

    def done(status: Status, text: str | None = None, detail: str = "") -> Outcome:
        return Outcome(kind, prompt, status, started, time.monotonic(), text, detail)

    try:
        async with client.stream("POST", path_for(kind), content=content, timeout=timeout_s,
                                 headers={"content-type": "application/json"}) as r:
            if streaming and r.status_code == 200:
                status, text, detail = await _stream(kind, r, 2 if kind == "disconnect" else None)
                return done(status, text if kind in COMPARED else None, detail)
            raw = await r.aread()
    except (httpx.HTTPError, OSError) as exc:
        return done("broken", detail=f"{type(exc).__name__}: {exc}"[:200])
    try:
        payload = json.loads(raw)
    except ValueError:
        return done("broken", detail=f"HTTP {r.status_code}, not JSON")
    detail = _error_detail(payload)
    if r.status_code >= 400:
        return done("refused", detail=f"{r.status_code} {detail}") if detail else done("broken", detail=f"HTTP {r.status_code}")
    if kind not in COMPARED:
        return done("ok")
    try:
        return done("ok", _text_of(kind, payload))
    except (KeyError, IndexError, TypeError):
        return done("broken", detail="a 200 without choices")


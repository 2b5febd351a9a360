"""A prompt too long for the context is refused before it is tokenised.

Tokenising a many-megabyte prompt costs seconds of a render thread only to learn that it does not
fit. This check bounds the prompt's token count from below by its characters alone: in a byte-level
BPE tokenizer without a normaliser (DeepSeek's), the tokens of a text spell its UTF-8 bytes exactly,
so a text of ``c`` characters (at least ``c`` bytes) takes at least ``ceil(c / B)`` tokens, where
``B`` is the longest token in bytes (128 for DeepSeek V4: runs of spaces and dots; its added tokens
are at most 48). A rendered prompt contains each counted text whole (templates only add), so a
request whose counted texts give ``ceil(c / B) >= context`` tokens could never fit: 400
``context_length_exceeded``, naming the field. Only texts the renderer always keeps are counted
(user, system and tool turns; an assistant turn's reasoning is dropped from history), and nothing is
refused when the client asked for truncation (``truncate_prompt_tokens``), so a request that would
fit is never refused here.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from server.errors import ContextLengthExceeded

CHAT, RESPONSES, MESSAGES, COMPLETIONS = "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"
_KEPT_ROLES = frozenset({"user", "system", "developer", "tool"})
_TEXT_PARTS = frozenset({"text", "input_text"})


def _byte_alphabet() -> frozenset[str]:
    """GPT-2's byte-level alphabet: the 256 characters that each stand for one byte in a token's
    spelling (printable Latin-1 as itself, the other bytes as U+0100 onwards)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = 256 - len(printable)
    return frozenset(chr(b) for b in printable) | frozenset(chr(256 + i) for i in range(others))


def max_token_bytes(spec: dict[str, Any]) -> int | None:
    """The longest token's length in bytes of a parsed ``tokenizer.json``, or None when the bound
    above is not sound for it (not byte-level BPE, a normaliser that could shrink text, or an added
    token that swallows the whitespace around it)."""
    model = spec.get("model") or {}
    normalizer = spec.get("normalizer")
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        return None
    if normalizer is not None and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
        return None
    if "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None
    alphabet = _byte_alphabet()
    spelled = (len(s) if alphabet.issuperset(s) else len(s.encode()) for s in model.get("vocab") or {})
    return max(max(spelled, default=1), *(len(str(t["content"]).encode()) for t in added))


def _one_of(value: Any, names: frozenset[str]) -> bool:
    return isinstance(value, str) and value in names


def _texts(content: Any) -> Iterator[str]:
    """The text of a message's content: a string, or the text parts of a list."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and _one_of(part.get("type"), _TEXT_PARTS) and isinstance(part.get("text"), str):
                yield part["text"]


def _turns(items: Any) -> Iterator[str]:
    if isinstance(items, list):
        for m in items:
            if isinstance(m, dict) and _one_of(m.get("role"), _KEPT_ROLES):
                yield from _texts(m.get("content"))


def counted_chars(body: dict[str, Any], route: str) -> list[tuple[str, int]]:
    """(field, characters) of each prompt in ``body`` whose characters all reach the rendered
    prompt: one for chat, Responses and Messages, one per text prompt for Completions."""
    if route == CHAT:
        return [("messages", sum(map(len, _turns(body.get("messages")))))]
    if route == RESPONSES:
        items = body.get("input")
        return [("input", len(items) if isinstance(items, str) else sum(map(len, _turns(items))))]
    if route == MESSAGES:
        return [("messages", sum(map(len, _texts(body.get("system")))) + sum(map(len, _turns(body.get("messages")))))]
    if route == COMPLETIONS:
        prompt = body.get("prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
        return [("prompt", len(t)) for t in texts if isinstance(t, str)]
    return []


def check_prompt_size(body: dict[str, Any], route: str, context_len: int, token_bytes: int | None) -> None:
    """Raise 400 ``context_length_exceeded`` when a prompt of ``body`` cannot fit ``context_len``
    tokens whatever its text (see the module docstring); ``token_bytes``: ``max_token_bytes``."""
    if token_bytes is None or body.get("truncate_prompt_tokens") is not None:
        return
    for param, chars in counted_chars(body, route):
        at_least = -(-chars // token_bytes)
        if at_least >= context_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context_len} tokens. However, your prompt has "
                f"{chars} characters, which is at least {at_least} tokens. Please reduce the length of the messages.",
                param=param,
            )

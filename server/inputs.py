"""Request bodies checked and rewritten before deepseek-recipe converts them.

The recipe turns inputs it cannot render into placeholder text (an image becomes the words
``[Unsupported Image]``) and ignores fields it does not know. This module refuses those inputs
with a 400 naming where they are, and rewrites the spellings other servers accept into the ones
the recipe reads:
- Chat: ``developer`` role -> ``system``; ``max_completion_tokens`` -> ``max_tokens`` (it wins when
  both are sent, as in vLLM); ``chat_template_kwargs.thinking|enable_thinking`` -> ``thinking``;
  ``n`` is removed (the gateway runs one engine request per choice); a negative 64-bit ``seed``
  (OpenAI takes any int64; the recipe's range is [0, 2^63)) -> ``seed mod 2^63``, as Completions
  maps it (a negative seed then shares its stream with that one non-negative seed).
- Responses: ``developer`` role -> ``system``.
- Messages: ``max_tokens`` is required (Anthropic's rule); a ``system`` role inside ``messages`` is
  refused (Anthropic takes the system prompt only as the top-level ``system``); a ``tool_result``
  with ``is_error: true`` has its content opened by ``[tool error]`` (the recipe renders no flag);
  a final assistant text turn is a prefill (``anthropic_prefill``: the handler encodes it open, so
  the answer continues it), without thinking (thinking asked: 400).
Type checks the recipe does not make (it reads none of these fields, so it would take any value):
``user`` / ``safety_identifier`` / ``prompt_cache_key`` must be strings, ``metadata`` an object of
strings (Messages: only ``user_id``); Messages ``temperature`` is in [0, 1] (Anthropic's range).
Fields inside a message or ``text`` that nothing renders are refused rather than dropped: a Chat
message key other than role, content, reasoning_content, tool_calls, tool_call_id and prefix
(``name``: the DeepSeek encodings have no place for a participant's name) unless null or empty, and
a Responses message item key other than type, role, content, id, status and phase, an
``item_reference`` input item (items are not looked up by id), and
Responses ``text.verbosity`` other than null or "medium" (OpenAI's default, the only level served).
A ``tool_choice`` forcing a call (Chat / Responses ``required`` or a named tool, Messages ``any`` /
``tool``) without ``tools`` is refused naming ``tool_choice`` (the answer would be plain text).
Each ``prepare_*`` returns the body to convert: the same object when nothing changed.
"""

from __future__ import annotations

from typing import Any

from server.errors import InvalidRequest

# Content-part types that carry something other than text, per protocol.
_CHAT_MEDIA = {"image_url": "Image", "input_audio": "Audio", "file": "File", "video_url": "Video", "audio_url": "Audio"}
_RESPONSES_MEDIA = {"input_image": "Image", "input_file": "File", "input_audio": "Audio"}
_ANTHROPIC_MEDIA = {"image": "Image", "document": "Document", "search_result": "Search result", "container_upload": "File"}


def _refuse_media(kind: str, where: str) -> InvalidRequest:
    return InvalidRequest(
        f"{kind} inputs are not supported by this model (text only); found one at '{where}'.",
        param=where, code="unsupported_content",
    )


def _check_parts(content: Any, media: dict[str, str], where: str) -> None:
    if not isinstance(content, list):
        return
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            continue
        kind_name = part.get("type")
        kind = media.get(kind_name) if isinstance(kind_name, str) else None
        if kind is not None:
            raise _refuse_media(kind, f"{where}.content[{j}]")
        if part.get("type") == "tool_result":  # Anthropic: a tool result holds blocks of its own
            _check_parts(part.get("content"), media, f"{where}.content[{j}]")


def _items(body: dict[str, Any], key: str) -> list[Any] | None:
    value = body.get(key)
    return value if isinstance(value, list) else None


def _developer_as_system(items: list[Any]) -> list[Any] | None:
    """A copy with ``developer`` roles spelled ``system``, or None when there is none."""
    if not any(isinstance(m, dict) and m.get("role") == "developer" for m in items):
        return None
    return [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in items]


def _thinking_from_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """``chat_template_kwargs`` -> the recipe's ``thinking`` object (None: the kwargs say nothing)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise InvalidRequest("Invalid type for 'chat_template_kwargs': expected an object.", param="chat_template_kwargs")
    wanted: bool | None = None
    for key, value in kwargs.items():
        if key not in ("thinking", "enable_thinking"):
            raise InvalidRequest(
                f"chat_template_kwargs.{key} is not supported (accepted: thinking, enable_thinking).",
                param=f"chat_template_kwargs.{key}",
            )
        if not isinstance(value, bool):
            raise InvalidRequest(f"chat_template_kwargs.{key} must be a boolean.", param=f"chat_template_kwargs.{key}")
        if wanted is not None and wanted != value:
            raise InvalidRequest("chat_template_kwargs.thinking and enable_thinking disagree.", param="chat_template_kwargs")
        wanted = value
    if wanted is None:
        return None
    explicit = body.get("thinking")
    if explicit is not None and not isinstance(explicit, dict):
        raise InvalidRequest("Invalid type for 'thinking': expected an object.", param="thinking")
    thinking = {"type": "enabled" if wanted else "disabled"}
    if isinstance(explicit, dict) and explicit.get("type") not in (None, thinking["type"]):
        raise InvalidRequest("'thinking' and chat_template_kwargs disagree on the thinking mode.", param="chat_template_kwargs")
    return thinking


# Chat message keys the recipe renders (any other one, unless null, is refused naming it).
_CHAT_MESSAGE_KEYS = frozenset({"role", "content", "reasoning_content", "tool_calls", "tool_call_id", "prefix"})


def _check_strings(body: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidRequest(f"Invalid type for '{key}': expected a string.", param=key, code="invalid_type")


def _check_metadata(body: dict[str, Any], only: tuple[str, ...] | None = None) -> None:
    meta = body.get("metadata")
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise InvalidRequest("Invalid type for 'metadata': expected an object.", param="metadata", code="invalid_type")
    for key, value in meta.items():
        if only is not None and key not in only:
            raise InvalidRequest(f"metadata.{key}: Extra inputs are not permitted", param=f"metadata.{key}")
        if value is not None and not isinstance(value, str):
            raise InvalidRequest(
                f"Invalid type for 'metadata.{key}': expected a string.", param=f"metadata.{key}", code="invalid_type"
            )


def check_client_keys(body: dict[str, Any]) -> None:
    """``user`` / ``safety_identifier`` / ``prompt_cache_key`` strings, ``metadata`` an object of
    strings (OpenAI's types; the recipe and Completions read none of them)."""
    _check_strings(body, ("user", "safety_identifier", "prompt_cache_key"))
    _check_metadata(body)


# Responses message items: what the recipe reads, and what an earlier answer's output item carries.
_RESPONSES_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})


def _check_message_keys(m: dict[str, Any], where: str) -> None:
    _check_keys(m, _CHAT_MESSAGE_KEYS, where)


def _check_keys(m: dict[str, Any], known: frozenset[str], where: str) -> None:
    for key, value in m.items():
        if key in known or value is None or value in ("", [], {}):  # an empty value carries nothing to drop
            continue
        why = " (the model's chat encoding has no participant names)" if key == "name" else ""
        raise InvalidRequest(
            f"Unrecognized message field supplied: '{where}.{key}'{why}.", param=f"{where}.{key}", code="unknown_parameter"
        )


def _check_forced_tool_has_tools(body: dict[str, Any], forcing: tuple[str, ...]) -> None:
    """A ``tool_choice`` that forces a call (one of ``forcing``, or a named tool) needs ``tools``:
    without any the recipe would answer in plain text, dropping the choice."""
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice if isinstance(choice, str) else choice.get("type") if isinstance(choice, dict) else None
    forced = kind in forcing or (isinstance(choice, dict) and kind in ("function", "tool", "custom"))
    if forced and not body.get("tools"):
        raise InvalidRequest(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice"
        )


def prepare_chat(body: dict[str, Any]) -> dict[str, Any]:
    """Chat Completions body for the recipe (see the module docstring)."""
    out = body
    _check_forced_tool_has_tools(body, ("required",))
    check_client_keys(body)
    messages = _items(body, "messages")
    if messages is not None:
        for i, m in enumerate(messages):
            if isinstance(m, dict):
                _check_parts(m.get("content"), _CHAT_MEDIA, f"messages[{i}]")
                _check_message_keys(m, f"messages[{i}]")
        renamed = _developer_as_system(messages)
        if renamed is not None:
            out = {**out, "messages": renamed}
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and -(1 << 63) <= seed < 0:
        out = {**out, "seed": seed % (1 << 63)}
    if body.get("max_completion_tokens") is not None:
        out = {**out, "max_tokens": body["max_completion_tokens"]}
    thinking = _thinking_from_kwargs(body)
    if thinking is not None:
        out = {**out, "thinking": {**(body.get("thinking") or {}), **thinking}}
    for key in ("max_completion_tokens", "chat_template_kwargs", "n"):
        if key in out:
            out = {k: v for k, v in out.items() if k != key}
    return out


def prepare_responses(body: dict[str, Any]) -> dict[str, Any]:
    """Responses body for the recipe: media parts refused, ``developer`` -> ``system``."""
    check_client_keys(body)
    _check_forced_tool_has_tools(body, ("required",))
    text = body.get("text")
    if isinstance(text, dict):
        for key, value in text.items():
            if key == "verbosity" and value not in (None, "medium"):
                raise InvalidRequest(
                    "'text.verbosity' is not supported by this server (accepted: 'medium' or null).",
                    param="text.verbosity", code="unsupported_parameter",
                )
            if key not in ("format", "verbosity") and value is not None:
                raise InvalidRequest(f"Unrecognized request argument supplied: text.{key}", param=f"text.{key}", code="unknown_parameter")
    items = _items(body, "input")
    if items is None:
        return body
    for i, item in enumerate(items):
        if isinstance(item, dict):
            _check_parts(item.get("content"), _RESPONSES_MEDIA, f"input[{i}]")
            if "role" in item and item.get("type") in (None, "message"):
                _check_keys(item, _RESPONSES_MESSAGE_KEYS, f"input[{i}]")
            if item.get("type") == "item_reference":  # the recipe drops it: nothing looks items up by id
                raise InvalidRequest(
                    f"input[{i}]: item_reference is not supported; send the item itself, or continue with previous_response_id.",
                    param=f"input[{i}]", code="unsupported_parameter",
                )
    renamed = _developer_as_system(items)
    return body if renamed is None else {**body, "input": renamed}


def anthropic_prefill(body: dict[str, Any]) -> bool:
    """Whether a Messages body ends with an assistant turn of text only: Anthropic's prefill (the
    answer continues that text)."""
    messages = _items(body, "messages") if isinstance(body, dict) else None  # (a raw JSON body: not looked into)
    if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
        return False
    content = messages[-1].get("content")
    if isinstance(content, str):
        return bool(content)
    return isinstance(content, list) and bool(content) and all(
        isinstance(b, dict) and b.get("type") == "text" for b in content
    )


def _prefill_without_thinking(body: dict[str, Any]) -> dict[str, Any]:
    """A prefill is continued as the answer's text, so it runs without thinking: refused (as
    Anthropic does) when thinking is asked, thinking turned off when nothing was asked."""
    if not anthropic_prefill(body):
        return body
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in (None, "disabled"):
        last = len(body["messages"]) - 1
        raise InvalidRequest(
            f"messages[{last}]: a final assistant message (prefill) cannot be combined with thinking.",
            param=f"messages[{last}]",
        )
    return body if kind == "disabled" else {**body, "thinking": {"type": "disabled"}}


def prepare_messages(body: dict[str, Any], *, count_only: bool = False) -> dict[str, Any]:
    """Anthropic Messages body: ``max_tokens`` required (not for counting), no ``system`` role in
    ``messages``, no media blocks."""
    if not count_only and body.get("max_tokens") is None:
        raise InvalidRequest("max_tokens: Field required", param="max_tokens", code="missing_required_parameter")
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 1
    ):
        raise InvalidRequest("temperature: Input should be a number in [0, 1]", param="temperature")
    _check_metadata(body, only=("user_id",))
    _check_forced_tool_has_tools(body, ("any", "tool"))
    for i, m in enumerate(_items(body, "messages") or ()):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "system":
            raise InvalidRequest(
                f"messages[{i}].role: 'system' is not a message role; use the top-level 'system' parameter.",
                param=f"messages[{i}].role",
            )
        _check_parts(m.get("content"), _ANTHROPIC_MEDIA, f"messages[{i}]")
    system = body.get("system")
    if isinstance(system, list):
        _check_parts(system, _ANTHROPIC_MEDIA, "system")
    return _prefill_without_thinking(_tool_errors_marked(body))


ERROR_MARK = "[tool error] "


def _marked(block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content")
    if isinstance(content, list):
        content = [{"type": "text", "text": ERROR_MARK.strip()}, *content]
    else:
        content = ERROR_MARK + (content if isinstance(content, str) else "")
    return {k: v for k, v in block.items() if k != "is_error"} | {"content": content}


def _failed_result(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") == "tool_result" and block.get("is_error") is True


def _tool_errors_marked(body: dict[str, Any]) -> dict[str, Any]:
    """Anthropic ``tool_result`` blocks with ``is_error: true`` (which the recipe does not render)
    with their content opened by ``[tool error]``, so the model sees that the tool failed."""
    messages = _items(body, "messages")
    if not messages or not any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(map(_failed_result, m["content"])) for m in messages):
        return body
    out = [
        {**m, "content": [_marked(b) if _failed_result(b) else b for b in m["content"]]} if isinstance(m, dict) and isinstance(m.get("content"), list) else m
        for m in messages
    ]
    return {**body, "messages": out}

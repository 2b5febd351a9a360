"""Prompt <-> token endpoints: ``/tokenize``, ``/detokenize`` (vLLM's shapes), the token ids a chat
request renders to (``/v1/chat/completions/render``), and Anthropic's ``/v1/messages/count_tokens``.

``/tokenize`` takes a completion-style ``prompt`` (text; BOS prepended unless
``add_special_tokens: false``) or chat ``messages`` (rendered by the same encoding as
``/v1/chat/completions``, thinking mode and tools included) and answers ``{count, max_model_len,
tokens, token_strs}``. ``model`` is optional there (default: the first served name).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from server.decode import decode_tokens
from server.errors import InvalidRequest
from server.fields import check_fields
from server.handler import convert_request
from server.request_flow import check_model, read_object
from server.inputs import prepare_messages
from server.routes.chat import CHAT
from server.routes.messages import MESSAGES_PROTOCOL
from server.schemas import ERROR_RESPONSES
from server.state import Gateway

router = APIRouter()


def _json(obj: Any) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), media_type="application/json")


async def _body(request: Request, route: str | None, *, model_optional: bool = False) -> tuple[Gateway, dict[str, Any], int]:
    """(gateway, checked body, its size in bytes); ``route`` None: ``/tokenize``'s, by the body."""
    gw, _, raw, body = await read_object(request)
    check_fields(body, route or ("/tokenize (chat)" if "messages" in body else "/tokenize"))
    if model_optional and body.get("model") is None:
        body["model"] = next(iter(gw.catalog.served))
    check_model(gw, body)
    return gw, body, len(raw)


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"Invalid type for '{key}': expected a boolean.", param=key)
    return value


def _chat_ids(gw: Gateway, body: dict[str, Any]) -> tuple[Any, list[int]]:
    """(converted request, prompt ids) of a chat body, as ``/v1/chat/completions`` encodes it."""
    conv, _, prompt = convert_request(gw, CHAT, CHAT.prepare_body(body))
    return conv, prompt


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(request: Request) -> Response:
    """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` -> token ids."""
    gw, body, size = await _body(request, None, model_optional=True)
    catalog = gw.catalog
    with_strs = _flag(body, "return_token_strs", False)
    ids = await gw.render.run(size, _tokenize_ids, gw, body)
    strs = decode_tokens(catalog, ids)[1] if with_strs and ids else None
    return _json({"count": len(ids), "max_model_len": catalog.context_len, "tokens": ids, "token_strs": strs})


def _tokenize_ids(gw: Gateway, body: dict[str, Any]) -> list[int]:
    """The token ids of a ``/tokenize`` body (chat ``messages`` or a text ``prompt``)."""
    if "messages" in body:
        return _chat_ids(gw, {k: v for k, v in body.items() if k != "return_token_strs"})[1]
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest("'prompt' must be a string (or send 'messages').", param="prompt")
    ids = list(gw.catalog.tokenizer.encode(prompt))
    if _flag(body, "add_special_tokens", True) and gw.catalog.bos_token_id is not None:
        ids = [gw.catalog.bos_token_id, *ids]
    return ids


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(request: Request) -> Response:
    """vLLM's ``/detokenize``: ``tokens`` -> ``prompt`` text."""
    gw, body, _ = await _body(request, "/detokenize", model_optional=True)
    tokens = body.get("tokens")
    vocab = gw.catalog.vocab_size
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in tokens):
        raise InvalidRequest(f"'tokens' must be a list of token ids in [0, {vocab}).", param="tokens")
    return _json({"prompt": decode_tokens(gw.catalog, tokens)[0] if tokens else ""})


@router.post("/v1/chat/completions/render", responses=ERROR_RESPONSES)
async def render_chat(request: Request) -> Response:
    """The prompt text and token ids a Chat Completions request renders to (nothing is generated)."""
    gw, body, size = await _body(request, "/v1/chat/completions/render")
    text, ids = await gw.render.run(size, _rendered, gw, body)
    return _json({"model": body["model"], "prompt": text, "prompt_token_ids": ids, "count": len(ids), "max_model_len": gw.catalog.context_len})


def _rendered(gw: Gateway, body: dict[str, Any]) -> tuple[str, list[int]]:
    """(prompt text, prompt ids) of a chat body."""
    conv, ids = _chat_ids(gw, body)
    return gw.catalog.encoding_for(conv.model_version).render_conversation(conv.conversation).prompt, ids


@router.post("/v1/messages/count_tokens", responses=ERROR_RESPONSES)
async def count_tokens(request: Request) -> Response:
    """Anthropic's token count of a Messages request: ``{"input_tokens": N}``."""
    gw, body, size = await _body(request, "/v1/messages/count_tokens")
    _, _, ids = await gw.render.run(size, convert_request, gw, MESSAGES_PROTOCOL, prepare_messages(body, count_only=True))
    return _json({"input_tokens": len(ids)})

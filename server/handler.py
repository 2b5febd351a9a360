"""The request path shared by Chat Completions, Responses and Anthropic Messages.

Steps, each failing with a ``GatewayError`` (rendered by the app's exception handler):
authenticate (401) -> read the body with its size and time limits (413/408) -> parse JSON (400)
-> model known (404) -> rate limit (429) -> deepseek-recipe conversion (400) -> encode the prompt
-> resolve ``max_tokens`` against the context (400) -> admission (503) -> engine.

Streaming answers wait for the first engine event before sending headers, so failures that happen
before any token (no worker, engine refusal) still get their HTTP status; later failures become
an error event in the stream. The three protocols differ only in the ``RecipeProtocol`` below.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal

import deepseek_recipe as dr
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from server.convert import build_generate_request
from server.errors import GatewayError, InvalidRequest, ModelNotFound, from_conversion_error
from server.generation import ClientDisconnected, Run, race_disconnect
from server.sse import MEDIA_TYPE, SSE_HEADERS, event_frame, json_frame
from server.state import Gateway

Flavor = Literal["openai", "anthropic"]
MakeGenerator = Callable[[Any, str, str], Any]  # (ConversationRequest, id, model) -> chunk generator


@dataclass(frozen=True)
class RecipeProtocol:
    """What differs between the three deepseek-recipe protocols."""

    route: str
    request_cls: Any  # ChatCompletionRequest | ResponsesRequest | MessagesRequest
    response_cls: Any  # ChatCompletionResponse | ResponsesResponse | MessagesResponse
    id_prefix: str
    flavor: Flavor
    # Reads what the generator needs from the request before ``convert`` consumes it.
    prepare: Callable[[Any, Any], MakeGenerator]
    done: str | None = None  # final SSE frame (``data: [DONE]``) or None
    named_events: bool = False

    def new_id(self) -> str:
        return self.id_prefix + uuid.uuid4().hex


# ---- shared request steps -------------------------------------------------------------------------
def parse_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest(
            "We could not parse the JSON body of your request. The request body must be valid JSON.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return body


def check_model(gw: Gateway, body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise InvalidRequest("You must provide a model parameter.", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise InvalidRequest("Invalid type for 'model': expected a string.", param="model", code="invalid_type")
    if model not in gw.catalog.served:
        raise ModelNotFound(f"The model `{model}` does not exist or you do not have access to it.", param="model")
    return model


def body_error(exc: ValueError) -> InvalidRequest:
    """deepseek-recipe raises ``ValueError('invalid request body: ...')`` for a mistyped body."""
    message = str(exc) or "Invalid request body."
    return InvalidRequest(message[:1].upper() + message[1:])


# ---- the handler ----------------------------------------------------------------------------------
async def serve_recipe(request: Request, proto: RecipeProtocol) -> Response:
    gw: Gateway = request.app.state.gateway
    started = time.perf_counter()
    route = gw.metrics.by_route[proto.route]
    key = gw.authenticate(request)
    raw = await gw.read_body(request)
    body = parse_object(raw)
    model = check_model(gw, body)
    if gw.limiter.enabled:
        gw.limiter.admit(key)
    catalog = gw.catalog
    try:
        req_obj = proto.request_cls(raw)
        make_generator = proto.prepare(req_obj, catalog.conversion)
        conv = req_obj.convert(catalog.conversion)
    except dr.ConversionError as exc:
        raise from_conversion_error(exc) from None
    except ValueError as exc:
        raise body_error(exc) from None
    for message in conv.conversation.messages:
        if message.image_sources:
            raise InvalidRequest("Image inputs are not supported by this deployment.", param="messages")
    try:
        prompt = catalog.encoding_for(conv.model_version).encode(conv.conversation)
    except (RuntimeError, ValueError) as exc:
        raise InvalidRequest(f"The prompt could not be encoded: {exc}") from None
    rid = proto.new_id()
    greq = build_generate_request(
        rid, prompt, conv, body,
        context_len=catalog.context_len, eos_token_id=catalog.eos_token_id, thinking_end_id=catalog.thinking_end_id,
    )
    await gw.admission.acquire()
    gw.limiter.charge(key, len(prompt))
    route.prompt.inc(len(prompt))
    try:
        processor = dr.StreamProcessor(make_generator(conv, rid, model), conv.parsing_options, catalog.tokenizer)
    except BaseException:
        gw.admission.release()
        raise
    run = Run(gw, route, key, greq, processor, started=started)
    response: Response | None = None
    try:
        if conv.stream:
            response = await _stream(request, run, proto)
        else:
            response = await _complete(request, run, proto, model)
        return response
    except ClientDisconnected:
        gw.metrics.reject("client_disconnect")
        return Response(status_code=499)
    finally:
        if not isinstance(response, SSEResponse):  # a stream closes its run when it ends
            run.close()


async def _complete(request: Request, run: Run, proto: RecipeProtocol, model: str) -> Response:
    async def collect() -> str:
        resp = None
        async for chunks in run.chunks():
            if resp is None:
                resp = proto.response_cls(run.req.request_id, model, int(time.time()), run.prompt_tokens, run.cached_tokens)
            for chunk in chunks:
                resp.accumulate(chunk)
        assert resp is not None, "a finished run produced no chunks"
        return resp.to_json()

    text = await race_disconnect(collect(), request.receive, run.deadline)
    return Response(text, media_type="application/json")


async def _stream(request: Request, run: Run, proto: RecipeProtocol) -> Response:
    chunks = run.chunks()

    async def first() -> list[Any]:
        return await chunks.__anext__()

    head = await race_disconnect(first(), request.receive, run.deadline)
    return SSEResponse(_frames(head, chunks, run, proto), run.close)


async def _frames(head: list[Any], chunks: AsyncIterator[list[Any]], run: Run, proto: RecipeProtocol) -> AsyncIterator[bytes]:
    name = proto.response_cls.sse_event_name if proto.named_events else None
    route = run.route
    route.active.inc()
    try:
        if head:
            yield _frame_all(head, name).encode()
        async for batch in chunks:
            if batch:
                yield _frame_all(batch, name).encode()
        if proto.done:
            yield proto.done.encode()
    except GatewayError as exc:
        run.gw.metrics.reject(exc.reject_reason)
        yield stream_error(exc, proto.flavor, proto.named_events).encode()
    finally:
        route.active.dec()
        route.streamed.inc(run.completion_tokens)
        run.close()


def _frame_all(batch: list[Any], name: Any) -> str:
    if name is None:
        return "".join([f"data: {c.to_json()}\n\n" for c in batch])
    return "".join([event_frame(name(c), c.to_json()) for c in batch])


def stream_error(exc: GatewayError, flavor: Flavor, named_events: bool) -> str:
    """An error after the headers went out, as each SDK recognises it in a stream."""
    if flavor == "anthropic":
        return json_frame(exc.anthropic_body(), "error")
    if named_events:  # Responses
        return json_frame({"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}, "error")
    return json_frame(exc.openai_body())


class SSEResponse(StreamingResponse):
    """A streaming response that always calls ``on_close`` (closing its runs), even if streaming
    never started (an async generator that never ran has no ``finally`` to run)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type=MEDIA_TYPE, headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Runs the generator's ``finally`` now if it is suspended at a yield (the client left
            # mid-write); that ``finally`` does not await, so a cancelled scope cannot interrupt it.
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self._on_close()


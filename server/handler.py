"""Chat Completions, Responses and Anthropic Messages on the shared request skeleton.

The skeleton (``server/request_flow.py``) validates, admits and delivers; this module is the
recipe routes' render and shape steps: -> deepseek-recipe conversion (400) -> encode the prompt
(both on the render pool for large bodies, ``server/render_pool.py``) -> resolve ``max_tokens``
against the context (400) -> one engine run per choice -> the protocol's chunks, whole or streamed.

Streaming answers wait for the first engine event before sending headers, so failures that happen
before any token (no worker, engine refusal) still get their HTTP status; later failures become
an error event in the stream. The three protocols differ only in the ``RecipeProtocol`` below.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, Protocol

import deepseek_recipe as dr
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from server.chat_shape import ChatStreamShaper, echo_text, merge_answers
from server.convert import build_generate_request
from server.decode import matched_stop
from server.errors import ContextLengthExceeded, GatewayError, InvalidRequest, from_conversion_error
from server.extensions import parse_extras, truncated
from server.generation import Run, race_disconnect
from server.inputs import anthropic_prefill
from server.locate import huge_int_path, locate
from server.prompt_logprobs import with_chat_prompt_logprobs
from server.reasoning_cap import cap_sampling, requested_cap
from server.request_flow import admit, deliver
from server.request_id import ids
from server.sse import MEDIA_TYPE, SSE_HEADERS, data_frame, event_frame, json_frame
from server.state import Gateway
from server.structured import with_auto_tool_choice, with_non_strict_response_schema, with_strict_tools_translated

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
    # The body the recipe converts (``server.inputs``): refusals and spellings rewritten.
    prepare_body: Callable[[dict[str, Any]], dict[str, Any]] = lambda body: body
    done: str | None = None  # final SSE frame (``data: [DONE]``) or None
    named_events: bool = False
    chat: bool = False  # Chat Completions: n choices, echo and the spec's streamed usage


# ---- shared request steps -------------------------------------------------------------------------
def body_error(exc: ValueError) -> InvalidRequest:
    """deepseek-recipe raises ``ValueError('invalid request body: ...')`` for a mistyped body."""
    message = str(exc) or "Invalid request body."
    return InvalidRequest(message[:1].upper() + message[1:])


# ---- the handler ----------------------------------------------------------------------------------
class AnswerHooks(Protocol):
    """What an endpoint adds around the shared path (Responses: the response store)."""

    unique_id: bool  # the response id is unique even when the client sent its X-Request-Id
    added_bytes: int  # how much ``body`` adds to what the client sent (sizes the render decision)

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body to convert (the same object when unchanged)."""

    async def detach(self, answer: Answer) -> Response | None:
        """Take the answer over (a background run) and return the immediate reply; None: answer now."""

    async def finish(self, text: str) -> str:
        """The whole answer's JSON as it is sent, from the one made (not streaming)."""

    async def event(self, name: str, text: str) -> str | None:
        """A streamed named event's JSON as it is sent, from the one made (None: not sent)."""


@dataclass
class Answer:
    """The runs of one request (one per choice) and how their chunks reach the client."""

    rid: str  # the response id
    runs: list[Run]
    proto: RecipeProtocol
    model: str
    shaper: ChatStreamShaper | None  # Chat Completions only
    echo: str = ""
    stop_text: Callable[[int], str] = lambda i: ""  # the stop string choice i matched (include_stop_str_in_output)
    hooks: AnswerHooks | None = None

    def close(self) -> None:
        for run in self.runs:
            run.close()


async def serve_recipe(request: Request, proto: RecipeProtocol, make_hooks: Callable[[dict[str, Any], str], Awaitable[AnswerHooks | None]] | None = None) -> Response:
    """The recipe routes on the shared skeleton (``server.request_flow``); ``make_hooks(body, key)``:
    the endpoint's hooks."""
    req = await admit(request, proto.route)
    gw, body, catalog = req.gw, req.body, req.gw.catalog
    hooks = await make_hooks(body, req.key) if make_hooks is not None else None
    recipe_body = proto.prepare_body(hooks.body(body) if hooks is not None else body)
    extras = parse_extras(body, catalog.vocab_size, chat=proto.chat)
    cap = requested_cap(body, proto.route)
    if extras.n > gw.config.max_concurrent_requests:  # its choices could never all run at once
        raise InvalidRequest(
            f"n ({extras.n}) exceeds the server's concurrent request limit ({gw.config.max_concurrent_requests}).", param="n"
        )
    size = len(req.raw) + (hooks.added_bytes if hooks is not None else 0)
    conv, make_generator, prompt = await gw.render.run(size, convert_request, gw, proto, recipe_body)
    prompt = truncated(prompt, extras.truncate_prompt_tokens, catalog.context_len)
    capped = cap_sampling(cap, conv, catalog.thinking_end_id)
    if capped:
        extras = replace(extras, sampling={**extras.sampling, **capped})
    rid, engine_rid = ids(request, proto.id_prefix)
    if hooks is not None and hooks.unique_id:
        rid = engine_rid
    greqs = []
    for i in range(extras.n):
        try:
            greq = build_generate_request(
                engine_rid if extras.n == 1 else f"{engine_rid}-{i}", prompt, conv, body,
                context_len=catalog.context_len, eos_token_id=catalog.eos_token_id, thinking_end_id=catalog.thinking_end_id,
                extras=extras, official_thinking_sampling=gw.config.official_thinking_sampling,
                compact_json=gw.config.compact_json,
            )
        except ContextLengthExceeded as exc:
            if proto.route == "/v1/responses" and exc.param == "messages":  # Responses has no 'messages'
                exc.param = "input"
            raise
        if i and greq.sampling.seed is not None:  # choice i: its own seeded stream
            greq.sampling = replace(greq.sampling, seed=(greq.sampling.seed + i) % (1 << 63))
        greqs.append(greq)
    gw.metrics.params_n.labels(req.model).observe(extras.n)
    skip = catalog.special_ids if extras.skip_special_tokens else frozenset()
    runs: list[Run] = []
    answer = Answer(rid, runs, proto, req.model, None, echo_text(body) if extras.echo else "", hooks=hooks)
    stops = list(conv.parsing_options.stop_sequences) if extras.include_stop_str else []
    answer.stop_text = lambda i: (
        matched_stop(catalog, stops, runs[i].output_ids, runs[i].ids_before_stop) if stops and runs[i].stopped_by_string else ""
    )
    if proto.chat:
        answer.shaper = ChatStreamShaper(
            extras, answer.echo, lambda i: (runs[i].prompt_tokens, runs[i].completion_tokens),
            answer.stop_text if stops else None,
        )

    async def send() -> tuple[Response, bool]:
        for greq in greqs:
            runs.append(await req.start_run(
                greq, lambda: dr.StreamProcessor(make_generator(conv, rid, req.model), conv.parsing_options, catalog.tokenizer),
                skip_ids=skip, keep_ids=bool(stops),
            ))
        if hooks is not None:
            reply = await hooks.detach(answer)
            if reply is not None:
                return reply, True  # the background run owns the answer now
        response = await (_stream(request, answer) if conv.stream else _complete(request, answer))
        return response, isinstance(response, SSEResponse)  # a stream closes its runs when it ends

    return await deliver(gw, send, answer.close)


def convert_and_encode(gw: Gateway, proto: RecipeProtocol, body: dict[str, Any]) -> tuple[Any, MakeGenerator, list[int]]:
    """(converted request, chunk-generator factory, prompt token ids) of a protocol body."""
    catalog = gw.catalog
    try:
        req_obj = proto.request_cls(body)
        make_generator = proto.prepare(req_obj, catalog.conversion)
        conv = req_obj.convert(catalog.conversion)
    except (dr.ConversionError, ValueError, OverflowError) as exc:
        raise refusal(proto, catalog, body, exc) from None
    for message in conv.conversation.messages:
        if message.image_sources:
            raise InvalidRequest("Image inputs are not supported by this deployment.", param="messages")
    conversation = conv.conversation
    if proto.flavor == "anthropic" and anthropic_prefill(body):
        conversation = open_last_turn(conversation)
    try:
        prompt = catalog.encoding_for(conv.model_version).encode(conversation)
    except (RuntimeError, ValueError) as exc:
        raise InvalidRequest(f"The prompt could not be encoded: {exc}") from None
    return conv, make_generator, prompt


def open_last_turn(conversation: Any) -> Any:
    """``conversation`` with its last (assistant) message a prefix the answer continues (Anthropic's
    prefill; deepseek-recipe's Messages conversion closes that turn)."""
    last = conversation.messages[-1]
    if not isinstance(last, dr.AssistantMessage):
        return conversation
    messages = [*conversation.messages[:-1], dr.AssistantMessage(last.content, last.reasoning_content, last.tool_calls, prefix=True)]
    kw: dict[str, Any] = dict(
        thinking_mode=conversation.thinking_mode, tools=conversation.tools, tool_choice=conversation.tool_choice,
        reasoning_effort=conversation.reasoning_effort,
    )
    if conversation.response_schema is not None:
        kw["response_schema"] = conversation.response_schema
    elif conversation.response_regex is not None:
        kw["response_regex"] = conversation.response_regex
    else:
        kw["response_format"] = conversation.response_format
    return dr.Conversation(messages, **kw)


def _recipe_refusal(exc: Exception) -> GatewayError:
    if isinstance(exc, dr.ConversionError):
        return from_conversion_error(exc)
    return body_error(exc)  # type: ignore[arg-type]


def refusal(proto: RecipeProtocol, catalog: Any, body: dict[str, Any], exc: Exception) -> GatewayError:
    """The client error for the recipe refusing ``body``, naming the field (``server.locate``):
    an integer beyond 64 bits by its path; a refusal without a ``param`` by the field whose
    removal lifts it."""
    if isinstance(exc, OverflowError):
        path = huge_int_path(body) or None
        where = f"'{path}'" if path else "an integer field"
        return InvalidRequest(f"Invalid value for {where}: the integer is out of range.", param=path, code="invalid_value")
    err = _recipe_refusal(exc)
    if err.param:
        return err

    def attempt(candidate: Any) -> str | None:
        try:
            obj = proto.request_cls(candidate)
            proto.prepare(obj, catalog.conversion)
            obj.convert(catalog.conversion)
        except (dr.ConversionError, ValueError, OverflowError) as again:
            return _recipe_refusal(again).message if not isinstance(again, OverflowError) else "overflow"
        except Exception:  # a body the parser takes another way: no evidence either way
            return err.message
        return None

    err.param = locate(body, err.message, attempt)
    return err


def convert_request(gw: Gateway, proto: RecipeProtocol, recipe_body: dict[str, Any]) -> tuple[Any, MakeGenerator, list[int]]:
    """The conversion every route makes, the token routes too: ``convert_and_encode`` of the
    (parsed, maybe rewritten) body, its strict response schema handed over as non-strict,
    falling back to ``convert_forcing_tools``, then to both with the strict tools translated
    (``server.structured``; runs on the render pool for large bodies)."""
    recipe_body = with_non_strict_response_schema(recipe_body)
    try:
        return _convert_or_force(gw, proto, recipe_body)
    except GatewayError as refused:
        translated = with_strict_tools_translated(recipe_body)
        if translated is None:
            raise
        try:
            return _convert_or_force(gw, proto, translated)
        except GatewayError:
            raise refused from None


def _convert_or_force(gw: Gateway, proto: RecipeProtocol, recipe_body: dict[str, Any]) -> tuple[Any, MakeGenerator, list[int]]:
    """``convert_and_encode``, falling back to ``convert_forcing_tools``."""
    try:
        return convert_and_encode(gw, proto, recipe_body)
    except GatewayError as refused:
        return convert_forcing_tools(gw, proto, recipe_body, refused)


def convert_forcing_tools(
    gw: Gateway, proto: RecipeProtocol, recipe_body: dict[str, Any], refused: GatewayError
) -> tuple[Any, MakeGenerator, list[int]]:
    """deepseek-recipe refuses ``tool_choice`` required or named in thinking mode: convert with an
    "auto" choice and let the grammar force the call (``server.structured``); other refusals stand."""
    auto = with_auto_tool_choice(recipe_body)
    if auto is None:
        raise refused
    converted = convert_and_encode(gw, proto, auto)
    if not converted[0].conversation.thinking_mode:
        raise refused
    return converted


async def _choice_batches(runs: list[Run]) -> AsyncIterator[tuple[int, list[Any]]]:
    """(choice index, chunks) as the runs produce them; one run is read directly."""
    if len(runs) == 1:
        async for batch in runs[0].chunks():
            yield 0, batch
        return
    queue: asyncio.Queue[tuple[int, list[Any] | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, run: Run) -> None:
        try:
            async for batch in run.chunks():
                await queue.put((i, batch, None))
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put((i, None, exc))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, run)) for i, run in enumerate(runs)]
    try:
        pending = len(tasks)
        while pending:
            i, batch, exc = await queue.get()
            if exc is not None:
                raise exc
            if batch is None:
                pending -= 1
            else:
                yield i, batch
    finally:
        for t in tasks:
            t.cancel()


async def collect(answer: Answer) -> str:
    """The whole answer's JSON, once every run finished (no deadline here: the caller's)."""
    proto, runs = answer.proto, answer.runs
    resps: list[Any] = [None] * len(runs)
    async for i, chunks in _choice_batches(runs):
        if resps[i] is None:
            run = runs[i]
            resps[i] = proto.response_cls(answer.rid, answer.model, int(time.time()), run.prompt_tokens, run.cached_tokens)
        for chunk in chunks:
            resps[i].accumulate(chunk)
    assert all(r is not None for r in resps), "a finished run produced no chunks"
    texts = [r.to_json() for r in resps]
    if answer.shaper is None:
        text = texts[0]
    else:
        text = merge_answers(texts, answer.shaper.extras, answer.echo, [answer.stop_text(i) for i in range(len(runs))])
        text = with_chat_prompt_logprobs(text, runs[0].gw.catalog, runs[0])
    return text if answer.hooks is None else await answer.hooks.finish(text)


async def _complete(request: Request, answer: Answer) -> Response:
    text = await race_disconnect(collect(answer), request.receive, min(r.deadline for r in answer.runs))
    return Response(text, media_type="application/json")


async def _stream(request: Request, answer: Answer) -> Response:
    batches = _choice_batches(answer.runs)

    async def first() -> tuple[int, list[Any]]:
        return await batches.__anext__()

    try:
        head = await race_disconnect(first(), request.receive, min(r.deadline for r in answer.runs))
    except BaseException:
        await batches.aclose()
        raise
    return SSEResponse(_frames(head, batches, answer), answer.close)


async def _frames(head: tuple[int, list[Any]], batches: AsyncIterator[tuple[int, list[Any]]], answer: Answer) -> AsyncIterator[bytes]:
    proto, shaper = answer.proto, answer.shaper
    name = proto.response_cls.sse_event_name if proto.named_events else None
    route = answer.runs[0].route
    hooks = answer.hooks
    route.active.inc()
    try:
        i, batch = head
        if batch:
            yield (await _hooked(batch, name, hooks) if hooks is not None else _frame_all(batch, name, i, shaper)).encode()
        async for i, batch in batches:
            if batch:
                yield (await _hooked(batch, name, hooks) if hooks is not None else _frame_all(batch, name, i, shaper)).encode()
        final = shaper.final() if shaper is not None else None
        tail = (data_frame(final) if final else "") + (proto.done or "")
        if tail:
            yield tail.encode()
    except GatewayError as exc:
        answer.runs[0].gw.metrics.reject(exc.reject_reason)
        yield stream_error(exc, proto.flavor, proto.named_events).encode()
    finally:
        route.active.dec()
        route.streamed.inc(sum(r.completion_tokens for r in answer.runs))
        answer.close()


def _frame_all(batch: list[Any], name: Any, i: int = 0, shaper: ChatStreamShaper | None = None) -> str:
    if shaper is not None:
        return "".join([f"data: {shaper.shape(i, c.to_json())}\n\n" for c in batch])
    if name is None:
        return "".join([f"data: {c.to_json()}\n\n" for c in batch])
    return "".join([event_frame(name(c), c.to_json()) for c in batch])


async def _hooked(batch: list[Any], name: Any, hooks: AnswerHooks) -> str:
    """Named events as the endpoint's hooks rewrite them (Responses: stored on completion)."""
    out = []
    for c in batch:
        n = name(c)
        text = await hooks.event(n, c.to_json())
        if text is not None:  # None: the hooks drop this event
            out.append(event_frame(n, text))
    return "".join(out)


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


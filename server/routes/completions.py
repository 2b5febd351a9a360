"""``POST /v1/completions`` (OpenAI legacy Completions; deepseek-recipe has no converter for it).

``prompt``: a text, a list of texts, a list of token ids, or a list of token-id lists; several
prompts run concurrently and answer one choice each (``index`` = prompt position). Text prompts
are encoded with the full vocabulary and BOS prepended, as the DeepSeek tokenizer config asks.
``n`` choices per prompt (choice ``index`` = prompt * n + j, seed + j when seeded); ``best_of``
candidates per prompt, of which the ``n`` with the highest summed logprob are returned (not with
``stream``); usage counts each prompt once and every candidate's completion. ``suffix`` is refused
(400); the sampling extensions are ``server.extensions``'s.
``logprobs: k`` returns the legacy format (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``); with ``echo`` the prompt tokens come first with their log probabilities (the
first null, as OpenAI has it; the engine scores the whole prompt, ``server.prompt_logprobs``) and
vLLM's ``prompt_logprobs: k`` adds each choice's ``prompt_logprobs``. ``max_tokens: 0`` with
``echo`` answers the prompt only (scored by a one-token engine run whose token is dropped when
log probabilities are asked; no engine run otherwise). The echoed prompt is a choice's first
delta, sent once its run's first event brought the prompt's scores.

Decoding and stop strings reuse deepseek-recipe's ``StreamProcessor`` in plain-text mode (no
thinking, no tool parsing): it decodes incrementally, matches ``stop`` strings across token
boundaries, and reports per-token strings for log probabilities.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import deepseek_recipe as dr
from fastapi import APIRouter, Request
from starlette.responses import Response

from deepserve.protocol import GenerateRequest, OutputConstraint, SamplingParams
from server.convert import session_key
from server.decode import decode_tokens, matched_stop, text_processor
from server.structured import completion_constraint
from server.extensions import Extras, bool_field, int_field, parse_extras, truncated
from server.request_id import ids as request_ids
from server.errors import ContextLengthExceeded, EngineFailed, GatewayError, InvalidRequest
from server.generation import Run, race_disconnect
from server.handler import SSEResponse, stream_error
from server.inputs import check_client_keys
from server.model import ModelCatalog
from server.prompt_logprobs import legacy_echo, of_run
from server.request_flow import admit, deliver
from server.schemas import COMPLETIONS, ERROR_RESPONSES, json_body
from server.sse import DONE
from server.state import Gateway

router = APIRouter()
ROUTE = "/v1/completions"
MAX_PROMPTS = 64
MAX_STOPS = 16
MAX_CHOICES = 128  # engine requests (prompts x best_of) per request


@dataclass
class CompletionParams:
    prompts: list[tuple[list[int], str | None]]  # (token ids, original text or None for id prompts)
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    logprobs: int | None
    echo: bool
    stop: list[str]
    stream: bool
    n: int = 1
    best_of: int = 1
    extras: Extras = field(default_factory=Extras)


# ---- validation -----------------------------------------------------------------------------------
def _number(body: dict[str, Any], key: str, low: float, high: float, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidRequest(f"Invalid {key} value, the valid range of {key} is [{low:g}, {high:g}]", param=key)
    return float(value)


def _token_list(value: list[Any], vocab: int) -> list[int]:
    if not value:
        raise InvalidRequest("The prompt must not be empty.", param="prompt")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise InvalidRequest(f"Invalid token id in prompt: {t!r} (valid: 0..{vocab - 1}).", param="prompt")
    return list(value)


def _prompts(value: Any, catalog: ModelCatalog, add_bos: bool = True) -> list[tuple[list[int], str | None]]:
    def text(s: str) -> tuple[list[int], str]:
        ids = catalog.tokenizer.encode(s)
        if add_bos and catalog.bos_token_id is not None and (not ids or ids[0] != catalog.bos_token_id):
            ids = [catalog.bos_token_id, *ids]
        if not ids:
            raise InvalidRequest("The prompt must not be empty.", param="prompt")
        return ids, s

    if isinstance(value, str):
        return [text(value)]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'prompt' must be a string, a list of strings, or a (list of) token id list.", param="prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in value):  # one prompt of token ids
        return [(_token_list(value, catalog.vocab_size), None)]
    if len(value) > MAX_PROMPTS:
        raise InvalidRequest(f"At most {MAX_PROMPTS} prompts per request.", param="prompt")
    if all(isinstance(p, str) for p in value):
        return [text(p) for p in value]
    if all(isinstance(p, list) for p in value):
        return [(_token_list(p, catalog.vocab_size), None) for p in value]
    raise InvalidRequest("'prompt' must be a string, a list of strings, or a (list of) token id list.", param="prompt")


def parse_completion(body: dict[str, Any], catalog: ModelCatalog) -> CompletionParams:
    """Validate a Completions body (400 with ``param`` on the first bad field)."""
    if "prompt" not in body:
        raise InvalidRequest("You must provide a prompt parameter.", param="prompt", code="missing_required_parameter")
    check_client_keys(body)
    extras = parse_extras(body, catalog.vocab_size, chat=False)
    stream = bool_field(body, "stream")
    best_of = int(int_field(body, "best_of", 1, MAX_CHOICES, extras.n) or 1)
    if best_of < extras.n:
        raise InvalidRequest(f"best_of ({best_of}) must be at least n ({extras.n}).", param="best_of")
    if best_of > extras.n and stream:
        raise InvalidRequest("best_of > n is not supported with stream.", param="best_of")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop] if stop else []
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stops = [s for s in stop if s]
    else:
        raise InvalidRequest(f"'stop' must be a string or a list of at most {MAX_STOPS} strings.", param="stop")
    add_bos = body.get("add_special_tokens")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise InvalidRequest("Invalid type for 'add_special_tokens': expected a boolean.", param="add_special_tokens")
    prompts = _prompts(body["prompt"], catalog, add_bos is not False)
    if extras.truncate_prompt_tokens is not None:  # a cut text prompt echoes as its kept tokens
        prompts = [
            (cut, text if len(cut) == len(ids) else None)
            for ids, text in prompts
            for cut in [truncated(ids, extras.truncate_prompt_tokens, catalog.context_len)]
        ]
    if len(prompts) * best_of > MAX_CHOICES:
        raise InvalidRequest(f"At most {MAX_CHOICES} choices (prompts x best_of) per request.", param="best_of" if best_of > 1 else "n")
    return CompletionParams(
        prompts=prompts,
        max_tokens=int(int_field(body, "max_tokens", 0, 1 << 30, 16) or 0),
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0),
        seed=int_field(body, "seed", -(1 << 63), (1 << 63) - 1, None),  # any int64, as OpenAI; used mod 2^63 (run_candidate)
        logprobs=int_field(body, "logprobs", 0, 20, None),
        echo=bool_field(body, "echo"),
        stop=stops,
        stream=stream,
        n=extras.n,
        best_of=best_of,
        extras=extras,
    )


@dataclass
class Choice:
    """One prompt's answer, built from the plain-text processor's chat chunks."""

    index: int
    want_logprobs: bool
    offset: int = 0  # characters of text so far (text_offset of the next token)
    text: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def add_echo(
        self, text: str, tokens: list[str], logprobs: list[float | None], tops: list[dict[str, float] | None]
    ) -> dict[str, Any]:
        """The echoed prompt as the first delta: its text and, with logprobs, its tokens."""
        delta = self._delta()
        self.text.append(text)
        if self.want_logprobs:
            for tok, lp, top in zip(tokens, logprobs, tops):
                self.tokens.append(tok)
                self.token_logprobs.append(lp)
                self.top_logprobs.append(top)
                self.text_offset.append(self.offset)
                self.offset += len(tok)
        self.offset = len(text)
        return self._since(delta)

    def feed(self, chunks: list[Any]) -> dict[str, Any]:
        """Apply a batch of chat chunks; the delta (text, logprobs) this batch added."""
        delta = self._delta()
        for c in chunks:
            choices = json.loads(c.to_json())["choices"]
            if not choices:
                continue
            choice = choices[0]
            content = choice["delta"].get("content")
            entries = (choice.get("logprobs") or {}).get("content") if self.want_logprobs else None
            if entries:
                for entry in entries:
                    self.tokens.append(entry["token"])
                    self.token_logprobs.append(entry["logprob"])
                    self.top_logprobs.append({t["token"]: t["logprob"] for t in entry.get("top_logprobs") or ()})
                    self.text_offset.append(self.offset)
                    self.offset += len(entry["token"])
            if content:
                self.text.append(content)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return self._since(delta)

    def _delta(self) -> tuple[int, int]:
        return len(self.text), len(self.tokens)

    def _since(self, mark: tuple[int, int]) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": "".join(self.text[mark[0]:]),
            "logprobs": self._logprobs(mark[1]) if self.want_logprobs else None,
            "finish_reason": self.finish_reason,
        }

    def _logprobs(self, start: int) -> dict[str, Any]:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }

    def full(self) -> dict[str, Any]:
        return self._since((0, 0))


@dataclass
class Sub:
    """One candidate of one prompt: its choice, and its engine run (None when max_tokens is 0
    and nothing scores the prompt; ``score_only``: max_tokens 0, the run only scores it)."""

    choice: Choice
    run: Run | None
    prompt_tokens: int
    prompt_index: int = 0
    score_only: bool = False
    echoed: bool = False  # the echo head was made (or echo is off)

    @property
    def cached_tokens(self) -> int:
        return self.run.cached_tokens if self.run else 0

    @property
    def completion_tokens(self) -> int:
        return self.run.completion_tokens if self.run and not self.score_only else 0


def usage(subs: list[Sub]) -> dict[str, Any]:
    """Each prompt counted once (its first candidate's figures), every candidate's completion."""
    firsts = {s.prompt_index: s for s in reversed(subs)}.values()
    prompt = sum(s.run.prompt_tokens if s.run else s.prompt_tokens for s in firsts)
    cached = sum(s.cached_tokens for s in firsts)
    completion = sum(s.completion_tokens for s in subs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "prompt_cache_hit_tokens": cached,
        "prompt_cache_miss_tokens": prompt - cached,
    }


def best_of(subs: list[Sub], n: int) -> list[Sub]:
    """Per prompt, the ``n`` candidates with the highest summed logprob, indexed prompt * n + rank."""
    by_prompt: dict[int, list[Sub]] = {}
    for s in subs:
        by_prompt.setdefault(s.prompt_index, []).append(s)
    out = []
    for k, group in sorted(by_prompt.items()):
        ranked = sorted(group, key=lambda s: s.run.logprob_sum if s.run else 0.0, reverse=True)[:n]
        for rank, s in enumerate(ranked):
            s.choice.index = k * n + rank
            out.append(s)
    return out


# ---- the endpoint ---------------------------------------------------------------------------------
@router.post(ROUTE, openapi_extra=json_body(COMPLETIONS), responses=ERROR_RESPONSES)
async def create_completion(request: Request) -> Response:
    """Text completion for one or more prompts; ``stream: true`` answers SSE ending with ``[DONE]``."""
    req = await admit(request, ROUTE)
    gw, body, model, catalog = req.gw, req.body, req.model, req.gw.catalog
    p = await gw.render.run(len(req.raw), parse_completion, body, catalog)  # tokenises text prompts
    constraint = completion_constraint(body, compact=gw.config.compact_json)
    rid, engine_rid = request_ids(request, "cmpl-")
    requests: list[tuple[int, GenerateRequest | None]] = []  # (prompt index, engine request)
    for k, (ids, _) in enumerate(p.prompts):
        if len(ids) + max(p.max_tokens, 1) > catalog.context_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {catalog.context_len} tokens, however you requested "
                f"{len(ids) + p.max_tokens} tokens ({len(ids)} in your prompt; {p.max_tokens} for the completion). "
                "Please reduce your prompt; or completion length.",
                param="prompt",
            )
        for j in range(p.best_of):
            greq = None if p.max_tokens == 0 and not _scores_prompt(p) else _generate_request(
                f"{engine_rid}-{len(requests)}", ids, p, j, catalog, body, constraint
            )
            requests.append((k, greq))

    subs: list[Sub] = []
    gw.metrics.params_n.labels(model).observe(p.n)
    skip = catalog.special_ids if p.extras.skip_special_tokens else frozenset()

    def processor(greq: GenerateRequest) -> Any:
        proc = text_processor(catalog, p.stop, greq.request_id)
        proc.push(dr.InferenceChunk.ready())
        return proc

    async def send() -> tuple[Response, bool]:
        for k, greq in requests:
            run = None
            if greq is not None:
                run = await req.start_run(greq, functools.partial(processor, greq), skip_ids=skip, keep_ids=p.extras.include_stop_str)
            subs.append(Sub(Choice(len(subs), p.logprobs is not None), run, len(p.prompts[k][0]), k, score_only=p.max_tokens == 0))
        heads = [_echo(s, p, catalog) for s in subs if s.run is None]  # the others' come with their first event
        if p.stream:
            response = await _stream(request, gw, subs, heads, p, rid, model)
        else:
            response = await _complete(request, subs, p, rid, model, catalog)
        return response, isinstance(response, SSEResponse)  # a stream closes its runs when it ends

    def close() -> None:
        for s in subs:
            if s.run:
                s.run.close()

    return await deliver(gw, send, close)


def _scores_prompt(p: CompletionParams) -> bool:
    """Whether the engine must score the prompt: ``prompt_logprobs``, or ``echo`` with ``logprobs``."""
    return "prompt_logprobs" in p.extras.sampling or (p.echo and p.logprobs is not None)


def _generate_request(
    request_id: str, ids: list[int], p: CompletionParams, j: int, catalog: ModelCatalog, body: dict[str, Any],
    constraint: OutputConstraint | None,
) -> GenerateRequest:
    """Candidate ``j`` of a prompt: seed + j when seeded; logprobs computed when best_of ranks;
    the prompt scored with the alternatives ``prompt_logprobs`` and an echo's ``logprobs`` ask."""
    extra = dict(p.extras.sampling)
    if extra.get("min_tokens", 0) > p.max_tokens:
        raise InvalidRequest(f"min_tokens ({extra['min_tokens']}) must be at most max_tokens ({p.max_tokens}).", param="min_tokens")
    eos = () if extra.get("ignore_eos") else (catalog.eos_token_id,)
    extra["stop_token_ids"] = eos + tuple(extra.get("stop_token_ids", ()))
    if p.echo and p.logprobs is not None:
        extra["prompt_logprobs"] = max(p.logprobs, extra.get("prompt_logprobs", 0))
    sampling = SamplingParams(
        max_tokens=max(1, p.max_tokens),  # 0: a one-token run that only scores the prompt
        temperature=p.temperature,
        top_p=max(1e-6, p.top_p),
        seed=None if p.seed is None else (p.seed + j) % (1 << 63),
        logprobs=p.logprobs is not None or p.best_of > p.n,
        top_logprobs=p.logprobs or 0,
        constraint=constraint,
        **extra,
    )
    return GenerateRequest(
        request_id=request_id, prompt_token_ids=ids, sampling=sampling, priority=p.extras.priority, session_key=session_key(body)
    )


def _echo(sub: Sub, p: CompletionParams, catalog: ModelCatalog) -> dict[str, Any] | None:
    """The echoed prompt as the choice's first delta (None without ``echo``); with ``logprobs``
    the prompt's scores come from the run's first event."""
    sub.echoed = True
    if sub.run is None or sub.score_only:
        sub.choice.finish_reason = "length"
    if not p.echo:
        return None
    ids, text = p.prompts[sub.prompt_index]
    skip = int(text is not None and catalog.bos_token_id is not None and bool(ids) and ids[0] == catalog.bos_token_id)
    if p.logprobs is not None and sub.run is not None:
        if sub.run.prompt_logprobs is None:
            raise EngineFailed("The engine returned no prompt logprobs.")
        tokens, logprobs, tops = legacy_echo(catalog, ids, sub.run.prompt_logprobs, p.logprobs, skip)
        decoded = "".join(tokens) if text is None else text
    else:
        decoded, tokens = decode_tokens(catalog, ids) if (text is None or p.logprobs is not None) else ("", [])
        tokens = tokens[skip:]  # the BOS we prepended is not part of the client's text
        logprobs, tops = [None] * len(tokens), [None] * len(tokens)
    return sub.choice.add_echo(decoded if text is None else text, tokens, logprobs, tops)


def _deltas(sub: Sub, chunks: list[Any], p: CompletionParams, catalog: ModelCatalog) -> list[dict[str, Any]]:
    """The deltas one batch of a run's chunks gives: the echo head first (once, at its first
    event), then the batch's own (none for a run that only scores the prompt)."""
    out = []
    if not sub.echoed:
        head = _echo(sub, p, catalog)
        if head is not None:
            out.append(head)
    if not sub.score_only:
        out.append(_with_stop(sub, sub.choice.feed(chunks), p, catalog))
    return out


def _chunk(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None, *, usage_key: bool = False
) -> str:
    """One streamed chunk; ``usage_key``: write ``usage`` even when it is null (``include_usage``)."""
    obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None or usage_key:
        obj["usage"] = usage_
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _with_stop(sub: Sub, delta: dict[str, Any], p: CompletionParams, catalog: ModelCatalog) -> dict[str, Any]:
    """``include_stop_str_in_output``: the finishing delta (and the choice) get the matched stop."""
    run = sub.run
    if delta["finish_reason"] and p.extras.include_stop_str and run is not None and run.stopped_by_string:
        stop = matched_stop(catalog, p.stop, run.output_ids, run.ids_before_stop)
        sub.choice.text.append(stop)
        delta["text"] += stop
    return delta


def _full(sub: Sub, p: CompletionParams, catalog: ModelCatalog) -> dict[str, Any]:
    """A whole choice; with ``prompt_logprobs``, vLLM's per-choice ``prompt_logprobs`` too."""
    choice = sub.choice.full()
    top = p.extras.sampling.get("prompt_logprobs")
    if top is not None and sub.run is not None:
        choice["prompt_logprobs"] = of_run(catalog, sub.run, top)
    return choice


async def _complete(
    request: Request, subs: list[Sub], p: CompletionParams, rid: str, model: str, catalog: ModelCatalog
) -> Response:
    async def one(sub: Sub) -> None:
        if sub.run is not None:
            async for chunks in sub.run.chunks():
                _deltas(sub, chunks, p, catalog)

    deadline = min((s.run.deadline for s in subs if s.run), default=time.perf_counter() + 600)
    await race_disconnect(asyncio.gather(*(one(s) for s in subs)), request.receive, deadline)
    body = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_full(s, p, catalog) for s in (best_of(subs, p.n) if p.best_of > p.n else subs)],
        "usage": usage(subs),
    }
    return Response(json.dumps(body, ensure_ascii=False), media_type="application/json")


async def _stream(
    request: Request, gw: Gateway, subs: list[Sub], heads: list[dict[str, Any] | None], p: CompletionParams, rid: str, model: str
) -> Response:
    created = int(time.time())
    # One queue merges the choices' deltas (one prompt: a queue hop per engine event, ~µs).
    queue: asyncio.Queue[tuple[Sub, dict[str, Any] | None, GatewayError | None]] = asyncio.Queue()

    async def pump(sub: Sub) -> None:
        assert sub.run is not None
        try:
            async for chunks in sub.run.chunks():
                for delta in _deltas(sub, chunks, p, gw.catalog):
                    await queue.put((sub, delta, None))
        except GatewayError as exc:
            await queue.put((sub, None, exc))
            return
        await queue.put((sub, None, None))

    tasks = [asyncio.ensure_future(pump(s)) for s in subs if s.run is not None]
    pending = len(tasks)

    async def next_item() -> tuple[Sub, dict[str, Any] | None, GatewayError | None]:
        return await queue.get()

    def cancel_all() -> None:
        for t in tasks:
            t.cancel()
        for s in subs:
            if s.run:
                s.run.close()

    # Wait for the first engine event before sending headers (errors keep their status).
    first = None
    if pending:
        try:
            first = await race_disconnect(next_item(), request.receive, min(s.run.deadline for s in subs if s.run))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        if first[2] is not None:
            for t in tasks:
                t.cancel()
            raise first[2]

    include, continuous = p.extras.include_usage, p.extras.include_usage and p.extras.continuous_usage

    def chunk(choice: dict[str, Any]) -> str:
        return _chunk(rid, created, model, [choice], usage(subs) if continuous else None, usage_key=include)

    async def frames() -> AsyncIterator[bytes]:
        nonlocal pending
        route = gw.metrics.by_route[ROUTE]
        route.active.inc()
        try:
            out = [chunk(h) for h in heads if h is not None]
            for s in subs:
                if s.run is None and not p.echo:
                    out.append(chunk(s.choice.full()))
            item = first
            while pending:
                if item is None:
                    item = await queue.get()
                sub, delta, err = item
                item = None
                if err is not None:
                    raise err
                if delta is None:
                    pending -= 1
                elif delta["text"] or delta["finish_reason"] or delta["logprobs"]:
                    out.append(chunk(delta))
                if out:
                    yield "".join(out).encode()
                    out = []
            if include:
                out.append(_chunk(rid, created, model, [], usage(subs)))
            out.append(DONE)
            yield "".join(out).encode()
        except GatewayError as exc:
            gw.metrics.reject(exc.reject_reason)
            yield stream_error(exc, "openai", False).encode()
        finally:
            route.active.dec()
            route.streamed.inc(sum(s.completion_tokens for s in subs))
            cancel_all()

    return SSEResponse(frames(), cancel_all)

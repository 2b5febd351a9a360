"""A FAKE engine for gateway tests and the gateway benchmark: scripted tokens, no model.

``FakeEngine`` satisfies ``server.engine_client.EngineClient`` in-process. It answers each
request with a scripted token sequence (by default the tokens of "Hello world!" then EOS), one
token per event after ``delay_s``, honours ``max_tokens`` (finish ``length``), abort (the stream
ends with finish ``abort``), and reports ``num_cached_tokens`` (and scripted ``prompt_logprobs``
when asked) on its first event. It records
every request and abort so tests can assert what reached the engine.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from deepserve.protocol import ErrorCode, GenerateRequest, TokenEvent, TokenLogprob

EOS = 1


class FakeEngine:
    def __init__(
        self,
        script: list[int] | Callable[[GenerateRequest], list[int]] | None = None,
        *,
        delay_s: float = 0.0,
        cached_tokens: int = 0,
        tokens_per_event: int = 1,
        fail_with: BaseException | None = None,
        error_after: int | None = None,
        error_code: ErrorCode = ErrorCode.ENGINE_ERROR,
    ) -> None:
        self.script = script if script is not None else [19923, 2058, 3, EOS]
        self.delay_s = delay_s
        self.cached_tokens = cached_tokens
        self.tokens_per_event = tokens_per_event
        self.fail_with = fail_with
        self.error_after = error_after  # emit an error event with ``error_code`` after this many tokens
        self.error_code = error_code
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.active: set[str] = set()

    def tokens_for(self, req: GenerateRequest) -> list[int]:
        return list(self.script(req) if callable(self.script) else self.script)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(req)
        if self.fail_with is not None:
            raise self.fail_with
        rid = req.request_id
        ids = self.tokens_for(req)
        limit = req.sampling.max_tokens
        if EOS in ids[:limit]:
            ids = ids[: ids.index(EOS) + 1]
            finish_last = "stop"
        elif len(ids) >= limit:
            ids = ids[:limit]
            finish_last = "length"
        else:
            ids = ids + [EOS]
            finish_last = "stop"
        self.active.add(rid)
        first = True
        try:
            for start in range(0, len(ids), self.tokens_per_event):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                else:
                    await asyncio.sleep(0)
                if rid in self.aborted:
                    yield TokenEvent(rid, finish_reason="abort")
                    return
                if self.error_after is not None and start >= self.error_after:
                    yield TokenEvent(rid, finish_reason="error", error="fake engine failure", error_code=self.error_code)
                    return
                batch = ids[start : start + self.tokens_per_event]
                last = start + self.tokens_per_event >= len(ids)
                yield TokenEvent(
                    rid,
                    token_ids=batch,
                    logprobs=_logprobs(batch, req.sampling.top_logprobs) if req.sampling.logprobs else None,
                    finish_reason=finish_last if last else None,
                    num_prompt_tokens=len(req.prompt_token_ids) if first else 0,
                    num_cached_tokens=self.cached_tokens if first else 0,
                    prompt_logprobs=_prompt_logprobs(req) if first else None,
                )
                first = False
            self.finished.append(rid)
        finally:
            self.active.discard(rid)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _logprobs(ids: list[int], top: int) -> list[TokenLogprob]:
    return [TokenLogprob(-0.25, [(t, -0.25)] + [(100 + k, -2.0 - k) for k in range(max(0, top - 1))]) for t in ids]


def _prompt_logprobs(req: GenerateRequest) -> list[TokenLogprob | None] | None:
    """Scripted prompt scores when asked: rank 1 at -0.5, the alternatives below it."""
    top = req.sampling.prompt_logprobs
    if top is None:
        return None
    return [None] + [TokenLogprob(-0.5, [(t, -0.5)] + [(100 + k, -3.0 - k) for k in range(max(0, top - 1))], 1) for t in req.prompt_token_ids[1:]]


def text_script(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` (full vocabulary, special-token spellings included) then EOS."""
    return list(tokenizer.encode(text)) + [EOS]

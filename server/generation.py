"""One admitted request in flight: engine token events in, protocol chunks out.

``Run`` owns an engine request from admission to its end. ``chunks()`` feeds each ``TokenEvent``
through a deepseek-recipe ``StreamProcessor`` and yields the protocol chunks that event produced
(one list per event, so the caller makes one socket write per engine step). ``close()`` is the
one idempotent exit, called from every path (finished, stop sequence, error, client gone,
handler cancelled): it releases the admission slot, charges the tokens to the key's budget and,
when the engine request may still be running, aborts it in a detached task (a cancelled handler
cannot await).

Event -> processor mapping:
- first event: ``ready(PromptUsage(prompt_tokens, prompt_cache_hit_tokens=num_cached_tokens))``;
  its ``prompt_logprobs`` (when the request asked) kept on the run for the answer;
- tokens: ``tokens(ids, [(logprob, top)])``; a trailing EOS of a ``stop`` finish is dropped (the
  processor would render it as text), and so are the ``skip_ids`` (the special tokens, unless the
  client sent ``skip_special_tokens: false``; they still count as completion tokens);
- ``finish_reason`` stop/length: ``finish(Stop|Length)`` then ``finish()``; error: the error its
  ``error_code`` maps to (``server.errors.from_code``); an abort the gateway did not ask for: ``cancelled``;
- the processor finishing on its own (a stop sequence matched): the engine request is aborted.

``race_disconnect`` runs a step of a request while watching the client; it cancels the step when
the client goes away (the ``Run`` then aborts the engine request) or when the deadline passes.
``chunks()`` holds the deadline itself too: each wait for the next engine event ends at it (so a
stream whose engine went silent gets its timeout error event, then closes).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import deepseek_recipe as dr

from deepserve.protocol import ErrorCode, GenerateRequest, TokenEvent, TokenLogprob
from server.errors import EngineFailed, EngineTimeout, GatewayError, from_code, translate
from server.metrics import _RouteMetrics
from server.state import Gateway

T = TypeVar("T")

_FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length}


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was complete."""


class Run:
    """An engine request and its stream processor; see the module docstring."""

    def __init__(
        self,
        gw: Gateway,
        route: _RouteMetrics,
        key: str,
        req: GenerateRequest,
        processor: Any,
        *,
        started: float,
        skip_ids: frozenset[int] = frozenset(),
        keep_ids: bool = False,
    ) -> None:
        self.gw, self.route, self.key, self.req, self.processor = gw, route, key, req, processor
        self.started = started
        self.deadline = started + gw.config.request_timeout_s
        self.prompt_tokens = len(req.prompt_token_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.logprob_sum = 0.0  # of the sampled tokens, when the request computes logprobs (best_of)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # from the first event, when asked
        self.first_token_at: float | None = None
        self.engine_started = False  # generate() was called: an abort may be needed
        self.engine_done = False  # the engine reported the end (or we aborted it)
        self._events: Any = None
        self._closed = False
        self._want_logprobs = req.sampling.logprobs
        self._top_n = req.sampling.top_logprobs
        self._eos = gw.catalog.eos_token_id
        self._skip = skip_ids
        self._skipped = 0  # tokens of ``skip_ids`` left out of the text (skip_special_tokens)
        # With ``keep_ids`` (include_stop_str_in_output): the ids pushed to the processor, and how
        # many came before the batch that completed a stop-string match.
        self._keep = keep_ids
        self.output_ids: list[int] = []
        self.ids_before_stop = 0
        self.stopped_by_string = False

    # ---- the stream ---------------------------------------------------------------------------
    async def chunks(self) -> AsyncIterator[list[Any]]:
        """Protocol chunks, one list per engine event; raises a ``GatewayError`` on failure."""
        proc = self.processor
        push = proc.push
        ready = False
        self.engine_started = True
        events = self._events = self.gw.engine.generate(self.req)
        loop = asyncio.get_running_loop()
        until = loop.time() + (self.deadline - time.perf_counter())  # the deadline on the loop's clock
        try:
            while True:
                try:
                    async with asyncio.timeout_at(until):
                        ev = await anext(events)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise self._timeout() from None
                if self.engine_done:
                    continue  # drain what follows the finish so the client connection is reusable
                out: list[Any] = []
                if not ready:
                    ready = True
                    if ev.num_prompt_tokens:
                        self.prompt_tokens = ev.num_prompt_tokens
                    self.cached_tokens = min(ev.num_cached_tokens, self.prompt_tokens)
                    self.prompt_logprobs = ev.prompt_logprobs
                    usage = dr.PromptUsage(prompt_tokens=self.prompt_tokens, prompt_cache_hit_tokens=self.cached_tokens)
                    out = push(dr.InferenceChunk.ready(prompt_usage=usage))
                if ev.error is not None or ev.finish_reason in ("abort", "error"):
                    self.engine_done = True
                    raise self._engine_error(ev)
                ids = ev.token_ids
                if ids:
                    lps = ev.logprobs if self._want_logprobs else None
                    if ev.finish_reason == "stop" and ids[-1] == self._eos:
                        ids = ids[:-1]
                        lps = lps[:-1] if lps else lps
                    if ids:
                        if self.first_token_at is None:
                            self.first_token_at = time.perf_counter()
                        self.completion_tokens += len(ids)
                        if self._skip and not self._skip.isdisjoint(ids):
                            keep = [i for i, t in enumerate(ids) if t not in self._skip]
                            self._skipped += len(ids) - len(keep)
                            ids = [ids[i] for i in keep]
                            lps = [lps[i] for i in keep] if lps else lps
                    if ids:
                        if self._keep:
                            self.ids_before_stop = len(self.output_ids)
                            self.output_ids += ids
                        if lps:
                            self.logprob_sum += sum(lp.logprob for lp in lps)
                            n = self._top_n
                            out += push(dr.InferenceChunk.tokens(ids, [(lp.logprob, lp.top[:n]) for lp in lps]))
                        else:
                            out += push(dr.InferenceChunk.tokens(ids))
                        if proc.finished:  # a stop sequence ended the answer: close() aborts the engine
                            self.stopped_by_string = True
                            yield out
                            return
                if ev.finish_reason is not None:
                    self.engine_done = True
                    if self._skipped:  # generated, not shown: the usage counts them (as OpenAI and vLLM do)
                        out += push(dr.InferenceChunk.text("", self._skipped))
                    out += push(dr.InferenceChunk.finish(_FINISH[ev.finish_reason]))
                    out += proc.finish()
                    yield out
                    continue
                if time.perf_counter() > self.deadline:
                    raise self._timeout()
                yield out
            if not self.engine_done:
                self.engine_done = True
                raise EngineFailed("The engine stream ended without a finish reason.")
        except GatewayError:
            raise
        except Exception as exc:  # engine client errors; a StreamProcessor RuntimeError (bad ids)
            raise translate(exc) from exc
        finally:
            self.close()

    def _engine_error(self, ev: TokenEvent) -> GatewayError:
        if ev.finish_reason == "abort" and ev.error is None:
            if time.perf_counter() > self.deadline:
                return self._timeout()
            return from_code(ErrorCode.CANCELLED, f"{self.req.request_id}: aborted by the engine")
        return from_code(ev.error_code or ErrorCode.ENGINE_ERROR, f"{self.req.request_id}: {ev.error or ev.finish_reason}")

    def _timeout(self) -> EngineTimeout:
        return EngineTimeout(f"The request did not finish within {self.gw.config.request_timeout_s:g}s.")

    # ---- the one exit -------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        gw = self.gw
        if self.engine_started and not self.engine_done:
            gw.spawn(_abort(gw, self.req.request_id, self._events))
        gw.admission.release()
        gw.limiter.charge(self.key, self.completion_tokens)
        self.route.completion.inc(self.completion_tokens)
        if self.first_token_at is not None:
            self.route.ttft.observe(self.first_token_at - self.started)
        if not self.processor.finished:
            try:
                self.processor.close()
            except RuntimeError:
                pass


async def _abort(gw: Gateway, request_id: str, events: Any) -> None:
    """Abort the engine request, then close its event stream (it may be suspended mid-stream)."""
    try:
        await gw.engine.abort(request_id)
    except Exception:  # the request is gone either way
        pass
    if events is not None:
        try:
            await events.aclose()
        except (Exception, asyncio.CancelledError):
            pass


async def wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(step: Awaitable[T], receive: Callable[[], Awaitable[dict[str, Any]]], deadline: float) -> T:
    """Await ``step``; cancel it on client disconnect (``ClientDisconnected``) or at the deadline
    (``EngineTimeout``). The body must have been read already."""
    task = asyncio.ensure_future(step)
    watch = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait((task, watch), timeout=max(0.0, deadline - time.perf_counter()),
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    if watch in done and not watch.cancelled():
        raise ClientDisconnected()
    raise EngineTimeout("The request did not finish in time.")

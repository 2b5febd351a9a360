"""The load generator of ``deepserve bench serve``: sends a workload, times every token on arrival.

Three ways to pace requests (``Pacing``): a Poisson process at ``rate`` requests/s, a closed loop
of ``concurrency`` in-flight requests, or the workload's own timestamps (a trace replay, scaled by
``time_scale``). Bodies are rendered before the clock starts so the client adds little on the hot
path: one aiohttp session, no connection limit, SSE lines parsed as they arrive, the arrival time of
every content chunk recorded with ``time.perf_counter``.

Endpoints: ``chat`` (``/v1/chat/completions``), ``completions`` (``/v1/completions``), both with
``stream_options.include_usage``; and ``internal`` (``/internal/generate`` of
``deepserve/protocol/messages.py``: token ids in, NDJSON token events out) for engine workers and our router.

What a streamed OpenAI answer's times mean is ``vllm bench serve``'s (``Sample.observe``; read from
vLLM's ``benchmarks/lib/endpoint_request_func.py``): every SSE data message whose ``choices`` is
non-empty is a chunk, its text empty or not; TTFT is the first chunk's arrival; each later chunk
adds one ITL, the gap since the previous message (chat) or the previous chunk (completions); the
end-to-end latency (E2EL) is the last message's arrival for chat (the usage chunk included) and the
last chunk's for completions. The output length is the usage chunk's ``completion_tokens``
(without one, vLLM re-tokenises the text; we count the chunks).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import aiohttp

from bench.workloads import BlockContent, TraceRow

try:
    import orjson

    _loads = orjson.loads

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover
    import json

    _loads = json.loads

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


Endpoint = Literal["chat", "completions", "internal"]
PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "internal": "/internal/generate"}


@dataclass(frozen=True)
class ClientConfig:
    url: str  # base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    endpoint: Endpoint = "chat"
    model: str = "deepseek-v4-flash"
    api_key: str | None = None
    stream: bool = True
    ignore_eos: bool = True  # ask for exactly output_length tokens (vLLM/SGLang/ours accept it)
    temperature: float = 0.0
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)
    block_size: int = 512  # of the workload's hash ids
    content_seed: int = 0
    vocab_size: int | None = None  # internal endpoint: token ids modulo this (tiny models)

    def request_url(self) -> str:
        base = self.url.rstrip("/")
        if base.endswith("/v1") and self.endpoint != "internal":
            base = base[: -len("/v1")]
        return base + PATHS[self.endpoint]


@dataclass(frozen=True)
class Pacing:
    """Exactly one of ``rate``, ``concurrency`` or ``trace`` (timestamps x ``time_scale``)."""

    rate: float | None = None
    concurrency: int | None = None
    time_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        assert (self.rate is None) or (self.concurrency is None), "give --rate or --concurrency, not both"

    @property
    def label(self) -> str:
        if self.rate is not None:
            return f"rate={self.rate:g}/s"
        if self.concurrency is not None:
            return f"concurrency={self.concurrency}"
        return f"trace x{self.time_scale:g}"


@dataclass
class Sample:
    """One request's raw measurements (times in seconds; ``start`` from the run's start)."""

    index: int
    session_id: str | None
    expected_input: int
    expected_output: int
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None  # vLLM's E2EL: the last message's arrival (module docstring), from send
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk (non-empty choices), from send
    itls: list[float] = field(default_factory=list)  # vLLM's ITL: one per chunk after the first
    last_message: float | None = None  # arrival of the latest data message (chat ITLs count from it)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None  # kind: http_<status>, timeout, connect, disconnected, incomplete, ...
    error_detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        """vLLM's TPOT: ``(E2EL - TTFT) / (output tokens - 1)``; None for one token or none."""
        n = self.output_tokens
        if self.ttft is None or self.e2e is None or n < 2:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    def observe(self, t: float, chunk: dict, chat: bool) -> None:
        """One SSE data message that arrived ``t`` seconds after the send (vLLM's rules, in the
        module docstring)."""
        if chunk.get("choices"):
            if self.ttft is None:
                self.ttft = t
            else:
                since = self.last_message if chat and self.last_message is not None else self.chunk_times[-1]
                self.itls.append(t - since)
            self.chunk_times.append(t)
            self.e2e = t
        elif chunk.get("usage"):
            _usage_into(self, chunk["usage"])
        if chat:
            self.e2e = t
        self.last_message = t

    def to_dict(self) -> dict:
        return asdict(self)


def first_model(url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model ``GET {url}/v1/models`` lists (what ``--model`` defaults to)."""
    base = url.rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    req = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        data = json.loads(resp.read()).get("data") or []
    if not data:
        raise ValueError(f"{base}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def render_bodies(rows: Sequence[TraceRow], cfg: ClientConfig, prompts: Sequence[str] | None = None) -> list[bytes]:
    """Request bodies for ``rows`` (rendered up front, outside the timed run); ``prompts``: the
    rows' own texts (a ShareGPT workload) instead of content rendered from their hash ids."""
    if prompts is not None and cfg.endpoint == "internal":
        raise ValueError("the internal endpoint takes token ids; send text prompts to chat or completions")
    content = BlockContent(cfg.block_size, cfg.content_seed, cfg.vocab_size)
    bodies = []
    for i, row in enumerate(rows):
        if cfg.endpoint == "internal":
            body: dict[str, Any] = {
                "request_id": f"bench-{i}",
                "prompt_token_ids": content.token_ids(row.hash_ids, row.input_length, i).tolist(),
                "sampling": {"max_tokens": row.output_length, "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos},
                "session_key": row.session_id,
            }
        else:
            text = prompts[i] if prompts is not None else content.text(row.hash_ids, row.input_length, i)
            body = {"model": cfg.model, "max_tokens": row.output_length, "temperature": cfg.temperature, "stream": cfg.stream}
            if cfg.endpoint == "chat":
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            if cfg.stream:
                body["stream_options"] = {"include_usage": True}
            if cfg.ignore_eos:
                body["ignore_eos"] = True
            if row.session_id is not None:
                body["user"] = row.session_id
        body.update(cfg.extra_body)
        bodies.append(_dumps(body))
    return bodies


def _usage_into(sample: Sample, usage: dict) -> None:
    sample.prompt_tokens = usage.get("prompt_tokens")
    sample.completion_tokens = usage.get("completion_tokens")
    cached = usage.get("prompt_cache_hit_tokens")
    if cached is None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    sample.cached_tokens = cached


async def _read_openai_stream(resp: aiohttp.ClientResponse, sample: Sample, t0: float, chat: bool) -> None:
    done = False
    async for raw in resp.content:
        if not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        now = time.perf_counter()
        chunk = _loads(data)
        if chunk.get("error"):
            sample.error, sample.error_detail = "stream_error", str(chunk["error"])[:300]
            return
        sample.observe(now - t0, chunk, chat)
    if not done:
        sample.error = "incomplete"


async def _read_internal_stream(resp: aiohttp.ClientResponse, sample: Sample, t0: float) -> None:
    n_tokens, finished = 0, False
    async for raw in resp.content:
        if not raw.strip():
            continue
        now = time.perf_counter()
        ev = _loads(raw)
        if ev.get("error"):
            sample.error, sample.error_detail = "stream_error", str(ev["error"])[:300]
            return
        ids = ev.get("token_ids") or ()
        if ids:
            if sample.chunk_times:
                sample.itls.append(now - t0 - sample.chunk_times[-1])
            sample.chunk_times.append(now - t0)
            n_tokens += len(ids)
        if ev.get("num_prompt_tokens"):
            sample.prompt_tokens = ev["num_prompt_tokens"]
            sample.cached_tokens = ev.get("num_cached_tokens", 0)
        if ev.get("finish_reason"):
            finished = True
            if ev["finish_reason"] in ("abort", "error"):
                sample.error = f"finish_{ev['finish_reason']}"
            break
    sample.completion_tokens = n_tokens
    if not finished:
        sample.error = "incomplete"


async def send_one(session: aiohttp.ClientSession, cfg: ClientConfig, url: str, body: bytes, sample: Sample, headers: dict) -> Sample:
    """Send one request and fill ``sample`` (never raises for request failures)."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                sample.error = f"http_{resp.status}"
                sample.error_detail = (await resp.text())[:300]
            elif cfg.endpoint == "internal":
                await _read_internal_stream(resp, sample, t0)
            elif cfg.stream:
                await _read_openai_stream(resp, sample, t0, cfg.endpoint == "chat")
            else:
                d = _loads(await resp.read())
                sample.chunk_times.append(time.perf_counter() - t0)
                sample.ttft = sample.e2e = sample.chunk_times[0]  # no stream: the first token is the whole answer
                if d.get("usage"):
                    _usage_into(sample, d["usage"])
    except TimeoutError:
        sample.error = "timeout"
    except aiohttp.ClientConnectorError as exc:
        sample.error, sample.error_detail = "connect", str(exc)[:300]
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        sample.error, sample.error_detail = "disconnected", str(exc)[:300]
    except aiohttp.ClientError as exc:
        sample.error, sample.error_detail = "client_error", f"{type(exc).__name__}: {exc}"[:300]
    except ValueError as exc:  # JSON decoding
        sample.error, sample.error_detail = "bad_json", str(exc)[:300]
    if cfg.endpoint == "internal" or sample.e2e is None:  # the internal stream's E2E: until it ends
        sample.e2e = time.perf_counter() - t0
    if sample.error is None:
        if not sample.chunk_times:
            sample.error = "no_tokens"
        else:
            sample.ttft = sample.chunk_times[0]
    return sample


@dataclass
class RunResult:
    pacing: Pacing
    samples: list[Sample]
    duration: float  # first send to last completion, seconds
    wall_start: float  # time.time() at the start


async def run_async(
    rows: Sequence[TraceRow],
    cfg: ClientConfig,
    pacing: Pacing,
    on_done: Callable[[Sample], None] | None = None,
    bodies: list[bytes] | None = None,
) -> RunResult:
    """Send every row once, paced by ``pacing``; returns raw samples in row order."""
    bodies = bodies if bodies is not None else render_bodies(rows, cfg)
    url = cfg.request_url()
    headers = {"Content-Type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    samples = [Sample(i, r.session_id, r.input_length, r.output_length) for i, r in enumerate(rows)]
    connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s, sock_connect=30)
    wall_start = time.time()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",)) as session:
        t_start = time.perf_counter()

        async def one(i: int) -> None:
            s = samples[i]
            s.start = time.perf_counter() - t_start
            await send_one(session, cfg, url, bodies[i], s, headers)
            if on_done is not None:
                on_done(s)

        if pacing.concurrency is not None:
            next_i = iter(range(len(rows)))

            async def loop_worker() -> None:
                for i in next_i:  # shared iterator: each index taken once
                    await one(i)

            await asyncio.gather(*(loop_worker() for _ in range(max(1, pacing.concurrency))))
        else:
            if pacing.rate is not None:
                rng = random.Random(pacing.seed)
                t, offsets = 0.0, []
                for _ in rows:
                    offsets.append(t)
                    t += rng.expovariate(pacing.rate) if pacing.rate > 0 else 0.0
            else:
                base = rows[0].timestamp if rows else 0.0
                offsets = [max(0.0, (r.timestamp - base) / 1000.0 * pacing.time_scale) for r in rows]
            order = sorted(range(len(rows)), key=offsets.__getitem__)
            tasks = []
            for i in order:
                delay = offsets[i] - (time.perf_counter() - t_start)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start  # vLLM's: the first send is paced from here, to the last answer
    return RunResult(pacing, samples, duration, wall_start)


async def warmup_async(cfg: ClientConfig, n: int = 2) -> None:
    """A few tiny requests to open connections and warm the server (not measured)."""
    rows = [TraceRow(0.0, 16, 2, (10**12 + i,)) for i in range(n)]
    await run_async(rows, cfg, Pacing(concurrency=n))

"""The gateway's ``deepserve_http_*`` Prometheus metrics, and merging in the workers' metrics.

Metrics (route = the endpoint's path template, ``other`` for unknown paths):
- ``deepserve_http_requests_total{route,status}``: answered requests.
- ``deepserve_http_request_duration_seconds{route}``: until the last byte (streams included).
- ``deepserve_http_time_to_first_token_seconds{route}``: until the first output token left.
- ``deepserve_http_streamed_tokens_total{route}``: output tokens sent in SSE streams.
- ``deepserve_http_prompt_tokens_total{route}`` / ``..._completion_tokens_total{route}``.
- ``deepserve_http_active_streams{route}``: SSE streams open now.
- ``deepserve_http_requests_running`` / ``..._queued``: admission state.
- ``deepserve_http_rejected_total{reason}``: requests refused or failed, by reason.

``merge_exposition``: in ``deepserve up`` the gateway's ``/metrics`` also carries every worker's
metrics, each sample labelled ``worker=<name>``; families of the same name (``process_*`` from
every process, say) are emitted once with all their samples, as the text format requires.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)

ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/models",
    "/v1/models/{id}",
    "/health",
    "/metrics",
)
REJECT_REASONS = (
    "auth",
    "rate_limit",
    "body_too_large",
    "body_timeout",
    "overload",
    "context_length",
    "invalid_request",
    "not_found",
    "timeout",
    "engine_error",
    "client_disconnect",
    "server_error",
    "header_timeout",  # server/http_guard.py: request headers not in time (408)
    "connection_cap",  # server/http_guard.py: beyond --max-connections (503)
)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def route_label(path: str) -> str:
    if path in _ROUTE_SET:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return "other"


_ROUTE_SET = frozenset(ROUTES)


class GatewayMetrics:
    """All gateway metric objects, registered in ``registry`` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process_metrics: bool = True) -> None:
        if registry is None:
            registry = CollectorRegistry()
            if process_metrics:
                from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR

                for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                    registry.register(c)
        self.registry = registry
        r = registry
        self.requests = Counter("deepserve_http_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.duration = Histogram(
            "deepserve_http_request_duration_seconds", "Time until the last byte of the answer", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "deepserve_http_time_to_first_token_seconds", "Time until the first output token was sent", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.streamed_tokens = Counter("deepserve_http_streamed_tokens", "Output tokens sent in SSE streams", ["route"], registry=r)
        self.prompt_tokens = Counter("deepserve_http_prompt_tokens", "Prompt tokens of admitted requests", ["route"], registry=r)
        self.completion_tokens = Counter("deepserve_http_completion_tokens", "Output tokens generated", ["route"], registry=r)
        self.active_streams = Gauge("deepserve_http_active_streams", "SSE streams open now", ["route"], registry=r)
        self.running = Gauge("deepserve_http_requests_running", "Requests holding an engine slot", registry=r)
        self.queued = Gauge("deepserve_http_requests_queued", "Requests waiting for an engine slot", registry=r)
        self.rejected = Counter("deepserve_http_rejected", "Requests refused or failed, by reason", ["reason"], registry=r)
        # vLLM's name: the engines see each of the n choices as its own request, so the gateway counts n.
        self.params_n = Histogram(
            "vllm:request_params_n", "The n (choices) of admitted requests", ["model_name"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r,
        )
        # Bind label children once: a labels() lookup per token would cost more than the increment.
        self.by_route = {route: _RouteMetrics(self, route) for route in ROUTES + ("other",)}
        self._rejected = {reason: self.rejected.labels(reason) for reason in REJECT_REASONS}
        self._status: dict[tuple[str, int], Any] = {}

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        child = self._status.get((route, status))
        if child is None:
            child = self._status[(route, status)] = self.requests.labels(route, str(status))
        child.inc()
        self.by_route[route].duration.observe(seconds)

    def reject(self, reason: str) -> None:
        self._rejected[reason].inc()

    def track_admission(self, running: Callable[[], float], queued: Callable[[], float]) -> None:
        self.running.set_function(running)
        self.queued.set_function(queued)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RouteMetrics:
    __slots__ = ("duration", "ttft", "streamed", "prompt", "completion", "active")

    def __init__(self, m: GatewayMetrics, route: str) -> None:
        self.duration = m.duration.labels(route)
        self.ttft = m.ttft.labels(route)
        self.streamed = m.streamed_tokens.labels(route)
        self.prompt = m.prompt_tokens.labels(route)
        self.completion = m.completion_tokens.labels(route)
        self.active = m.active_streams.labels(route)


# ---- merging the workers' metrics -----------------------------------------------------------------
class _Families:
    """An object with ``collect()``, as ``generate_latest`` needs."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_families(own: Iterable[Metric], labelled_texts: Iterable[tuple[str, str]], label: str = "worker") -> list[Metric]:
    """Own families plus each ``(name, exposition_text)``'s families, samples labelled ``label=name``.

    A family that several sources expose is emitted once with all samples (the first source's
    help and type win; a source whose type disagrees is skipped for that family).
    """
    merged: dict[str, Metric] = {}
    for fam in own:
        merged[fam.name] = _copy_family(fam, fam.samples)
    for source, text in labelled_texts:
        try:
            families = list(text_string_to_metric_families(text))
        except Exception as exc:  # one broken worker must not break the scrape
            log.warning("metrics of %s unparseable: %s", source, exc)
            continue
        for fam in families:
            samples = [
                s if label in s.labels else Sample(s.name, {**s.labels, label: source}, s.value, s.timestamp, s.exemplar)
                for s in fam.samples
            ]
            have = merged.get(fam.name)
            if have is None:
                merged[fam.name] = _copy_family(fam, samples)
            elif have.type == fam.type:
                have.samples.extend(samples)
            else:
                log.warning("metric %s: type %s from %s conflicts with %s", fam.name, fam.type, source, have.type)
    return list(merged.values())


def _copy_family(fam: Metric, samples: Iterable[Sample]) -> Metric:
    out = Metric(fam.name, fam.documentation, fam.type, getattr(fam, "unit", ""))
    out.samples = list(samples)
    return out


def merge_exposition(registry: Any, labelled_texts: Iterable[tuple[str, str]]) -> bytes:
    return generate_latest(_Families(merge_families(registry.collect(), labelled_texts)))


async def fetch_texts(sources: list[tuple[str, str]], timeout_s: float = 2.0, ssl: Any = None) -> list[tuple[str, str]]:
    """``[(name, metrics_url)]`` -> ``[(name, text)]`` for the sources that answered in time;
    ``ssl``: the internal plane's client context for ``https://`` sources."""
    if not sources:
        return []
    import aiohttp

    async def one(session: Any, name: str, url: str) -> tuple[str, str] | None:
        try:
            async with session.get(url) as resp:
                if resp.status == 200:
                    return name, await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.debug("metrics of %s unavailable: %s", name, exc)
        return None

    connector = aiohttp.TCPConnector(ssl=ssl or True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        got = await asyncio.gather(*(one(session, n, u) for n, u in sources))
    return [g for g in got if g is not None]

"""Summaries of a bench run: throughput, latency percentiles, goodput, cache hits, errors;
the end-of-run table, the JSON document (every raw sample) and the PNG plots.

The figures are ``vllm bench serve``'s (its ``calculate_metrics``, read to learn the definitions),
over the completed requests: total input tokens = the dataset's prompt lengths (the server's own
count, template tokens included, is ``server_input_tokens``); total output tokens = the usage
chunk's counts; request / output / total-token throughput = completed requests, output tokens,
input + output tokens over the run's duration (first send paced to the last answer); TTFT, E2EL
and ITL per ``Sample`` (``bench/client.py``); TPOT = ``(E2EL - TTFT) / (output - 1)`` over the
requests with more than one output token; mean, median, population std and linear-interpolated
percentiles (numpy's); goodput = completed requests meeting every SLO given (TTFT, TPOT (0 for one
token), E2EL; a value equal to its SLO meets it) per second; peak output throughput = the most
chunks in one whole second since the first send, with the requests in flight in that second.
Where vLLM prints 0 for an empty set, these are None.
"""

from __future__ import annotations

import json
import platform
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.client import RunResult, Sample

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput, in seconds (vLLM's ``--goodput ttft:MS tpot:MS e2el:MS``)."""

    ttft: float | None = None
    tpot: float | None = None  # each request's (E2EL - TTFT) / (output - 1); 0 for one output token
    e2el: float | None = None

    def met(self, s: Sample) -> bool:
        if not s.ok:
            return False
        tpot = s.tpot or 0.0
        return all(
            limit is None or (value is not None and value <= limit)
            for limit, value in ((self.ttft, s.ttft), (self.tpot, tpot), (self.e2el, s.e2e))
        )

    @property
    def given(self) -> bool:
        return self.ttft is not None or self.tpot is not None or self.e2el is not None

    @classmethod
    def parse(cls, specs: Sequence[str]) -> SLO:
        """vLLM's ``--goodput`` form: ``["ttft:200", "tpot:50"]`` (milliseconds)."""
        kw: dict[str, float] = {}
        for spec in specs:
            name, sep, value = spec.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, not {spec!r}")
            if float(value) < 0:
                raise ValueError(f"--goodput {spec}: a value >= 0")
            kw[name] = float(value) / 1000.0
        return cls(**kw)


def dist(values: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """mean, median, population std and the percentiles (``None`` when empty)."""
    if not len(values):
        return {"mean": None, "median": None, "std": None, **{f"p{p:g}": None for p in percentiles}}
    a = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
        **{f"p{p:g}": float(np.percentile(a, p)) for p in percentiles},
    }


def peak_output(samples: Sequence[Sample]) -> tuple[float, int]:
    """(the most chunks that arrived in one whole second since the first send, the most requests in
    flight in one such second): two maxima, each over its own second, as vLLM reports them."""
    if not samples:
        return 0.0, 0
    t0 = min(s.start for s in samples)
    seconds = int(np.ceil(max(s.start + (s.e2e or 0.0) for s in samples) - t0)) + 1
    chunks, busy = np.zeros(seconds), np.zeros(seconds)
    for s in samples:
        for t in s.chunk_times:
            chunks[int(s.start + t - t0)] += 1
        busy[int(s.start - t0) : int(s.start + (s.e2e or 0.0) - t0) + 1] += 1
    return float(chunks.max()), int(busy.max())


def summarize(result: RunResult, slo: SLO = SLO(), percentiles: Sequence[float] = PERCENTILES) -> dict:
    samples = result.samples
    ok = [s for s in samples if s.ok]
    dur = max(result.duration, 1e-9)
    prompt = sum(s.expected_input for s in ok)
    served = [s.prompt_tokens for s in ok]
    output = sum(s.output_tokens for s in ok)
    peak, in_flight = peak_output(ok)
    with_usage = [s for s in ok if s.cached_tokens is not None and s.prompt_tokens]
    hit = (sum(s.cached_tokens for s in with_usage) / sum(s.prompt_tokens for s in with_usage)) if with_usage else None
    itls = [g for s in ok for g in s.itls]
    summary = {
        "pacing": result.pacing.label,
        "requests": len(samples),
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "duration_s": result.duration,
        "request_throughput": len(ok) / dur,
        "input_throughput": prompt / dur,
        "output_throughput": output / dur,
        "total_token_throughput": (prompt + output) / dur,
        "peak_output_throughput": peak,
        "peak_concurrent_requests": in_flight,
        "total_input_tokens": prompt,
        "server_input_tokens": sum(served) if ok and None not in served else None,  # type: ignore[arg-type]
        "total_output_tokens": output,
        "ttft_s": dist([s.ttft for s in ok if s.ttft is not None], percentiles),
        "itl_s": dist(itls, percentiles),
        "tpot_s": dist([t for s in ok if (t := s.tpot) is not None], percentiles),
        "e2e_s": dist([s.e2e for s in ok if s.e2e is not None], percentiles),
        "cache_hit_rate": hit,
        "errors": dict(Counter(s.error for s in samples if s.error)),
    }
    if slo.given:
        good = sum(1 for s in samples if slo.met(s))
        summary["slo"] = {"ttft_s": slo.ttft, "tpot_s": slo.tpot, "e2el_s": slo.e2el}
        summary["goodput"] = good / dur
        summary["slo_attainment"] = good / len(samples) if samples else 0.0
    return summary


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def format_table(summaries: Sequence[dict]) -> str:
    """One column per run; latencies in ms."""
    rows: list[tuple[str, list[str]]] = [
        ("pacing", [s["pacing"] for s in summaries]),
        ("completed / failed", [f"{s['completed']} / {s['failed']}" for s in summaries]),
        ("duration (s)", [f"{s['duration_s']:.2f}" for s in summaries]),
        ("requests/s", [f"{s['request_throughput']:.2f}" for s in summaries]),
        ("input tokens/s", [f"{s['input_throughput']:.1f}" for s in summaries]),
        ("output tokens/s", [f"{s['output_throughput']:.1f}" for s in summaries]),
        ("total tokens/s", [f"{s['total_token_throughput']:.1f}" for s in summaries]),
        ("peak output chunks/s", [f"{s['peak_output_throughput']:.0f}" for s in summaries]),
    ]
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        for stat in [k for k in summaries[0][key] if k != "std"]:
            rows.append((f"{name} {stat} (ms)", [_ms(s[key][stat]) for s in summaries]))
    rows.append(("cache hit rate", ["-" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.1%}" for s in summaries]))
    if any("goodput" in s for s in summaries):
        rows.append(("goodput (req/s)", [f"{s['goodput']:.2f}" if "goodput" in s else "-" for s in summaries]))
        rows.append(("SLO attainment", [f"{s['slo_attainment']:.1%}" if "goodput" in s else "-" for s in summaries]))
    rows.append(("errors", [", ".join(f"{k}:{v}" for k, v in s["errors"].items()) or "none" for s in summaries]))
    w0 = max(len(r[0]) for r in rows)
    widths = [max(len(r[1][i]) for r in rows) for i in range(len(summaries))]
    lines = []
    for name, vals in rows:
        lines.append(f"{name:<{w0}}  " + "  ".join(f"{v:>{w}}" for v, w in zip(vals, widths)))
    return "\n".join(lines)


def machine_info() -> dict:
    import os

    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}


def write_json(path: str | Path, config: dict, results: Sequence[RunResult], summaries: Sequence[dict]) -> None:
    doc = {
        "config": config,
        "machine": machine_info(),
        "runs": [
            {"pacing": r.pacing.label, "rate": r.pacing.rate, "concurrency": r.pacing.concurrency,
             "wall_start": r.wall_start, "summary": s, "samples": [x.to_dict() for x in r.samples]}
            for r, s in zip(results, summaries)
        ],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc))


def write_plots(out_dir: str | Path, results: Sequence[RunResult], summaries: Sequence[dict]) -> list[Path]:
    """Latency CDFs (TTFT, ITL, E2E; one line per run) and, for several runs, throughput-latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        ok = [s for s in r.samples if s.ok]
        series = {
            "TTFT": [s.ttft for s in ok if s.ttft is not None],
            "inter-token latency": [g for s in ok for g in s.itls],
            "end-to-end latency": [s.e2e for s in ok if s.e2e is not None],
        }
        for ax, (name, vals) in zip(axes, series.items()):
            if vals:
                v = np.sort(np.asarray(vals)) * 1000.0
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=r.pacing.label)
            ax.set_title(f"{name} CDF")
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of samples")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    p = out / "latency_cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    if len(summaries) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        x = [s["output_throughput"] for s in summaries]
        for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
            for stat in ("median", [k for k in summaries[0][key] if k.startswith("p")][-1]):
                y = [(s[key][stat] or float("nan")) * 1000 for s in summaries]
                ax.plot(x, y, marker="o", label=f"{name} {stat}")
            for xi, s in zip(x, summaries):
                ax.annotate(s["pacing"], (xi, (s[key]["median"] or 0) * 1000), fontsize=7)
            ax.set_xlabel("output tokens/s")
            ax.set_ylabel("ms")
            ax.set_title(f"throughput vs {name}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / "throughput_latency.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths

"""What a simulation reports: TTFT / TPOT / E2E, goodput, cache hits, per-rank load per pool."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bench.report import dist
from bench.simulator.sim import Simulation


def _spread(values: Sequence[float]) -> dict:
    """mean / min / max / max-over-mean / coefficient of variation of per-rank values."""
    if not len(values):
        return {}
    a = np.asarray(values, dtype=np.float64)
    mean = float(a.mean())
    return {
        "mean": mean, "min": float(a.min()), "max": float(a.max()),
        "max_over_mean": float(a.max() / mean) if mean else None,
        "cv": float(a.std() / mean) if mean else None,
    }


def summarize(sim: Simulation, slo_ttft: float | None = None, slo_tpot: float | None = None) -> dict:
    reqs = sim.requests
    done = [r for r in reqs if r.finish is not None]
    t_first = min((r.arrival for r in reqs), default=0.0)
    t_last = max((r.finish for r in done), default=t_first)
    dur = max(t_last - t_first, 1e-9)
    ttft = [r.first_token - r.arrival for r in done]
    tpot = [(r.finish - r.first_token) / (r.output - 1) for r in done if r.output > 1]
    prompt = sum(r.prompt for r in done)
    local = sum(r.cached_local for r in done)
    shared = sum(r.cached_shared for r in done)
    out = {
        "requests": len(reqs),
        "completed": len(done),
        "sim_duration_s": dur,
        "wall_s": sim.wall_s,
        "request_throughput": len(done) / dur,
        "input_throughput": prompt / dur,
        "output_throughput": sum(r.output for r in done) / dur,
        "ttft_s": dist(ttft),
        "tpot_s": dist(tpot),
        "e2e_s": dist([r.finish - r.arrival for r in done]),
        "cache_hit_rate": (local + shared) / prompt if prompt else None,
        "local_hit_rate": local / prompt if prompt else None,
        "shared_hit_rate": shared / prompt if prompt else None,
        "disaggregated_fraction": sum(1 for r in reqs if r.stage == "prefill") / len(reqs) if reqs else 0.0,
        "router_queue_max": sim.router_queue_max,
    }
    if slo_ttft is not None or slo_tpot is not None:
        def ok(r) -> bool:
            if slo_ttft is not None and r.first_token - r.arrival > slo_ttft:
                return False
            return not (slo_tpot is not None and r.output > 1 and (r.finish - r.first_token) / (r.output - 1) > slo_tpot)

        good = sum(1 for r in done if ok(r))
        out["slo"] = {"ttft_s": slo_ttft, "tpot_s": slo_tpot}
        out["goodput"] = good / dur
        out["slo_attainment"] = good / len(reqs) if reqs else 0.0
    pools: dict[str, dict] = {}
    for role in ("prefill", "decode", "mixed"):
        ws = [w for w in sim.workers if w.role == role]
        if not ws:
            continue
        ranks = [r for w in ws for r in w.ranks]
        pools[role] = {
            "workers": len(ws),
            "ranks": len(ranks),
            "busy_fraction": _spread([w.busy_time / dur for w in ws]),
            "prefills_per_rank": _spread([r.n_prefills for r in ranks]),
            "prefill_tokens_per_rank": _spread([r.prefill_tokens for r in ranks]),
            "cached_tokens_per_rank": _spread([r.cached_tokens for r in ranks]),
            "decodes_per_rank": _spread([r.n_decodes for r in ranks]),
            "decode_tokens_per_rank": _spread([r.stats_tokens for r in ranks]),
            "max_running_per_rank": _spread([r.max_running for r in ranks]),
        }
    out["pools"] = pools
    return out


def per_rank(sim: Simulation) -> list[dict]:
    return [
        {"worker": w.worker_id, "role": w.role, "dp_rank": r.dp_rank, "prefills": r.n_prefills, "prefill_tokens": r.prefill_tokens,
         "cached_tokens": r.cached_tokens, "decodes": r.n_decodes, "decode_tokens": r.stats_tokens, "max_running": r.max_running,
         "busy_s": w.busy_time}
        for w in sim.workers for r in w.ranks
    ]


def samples(sim: Simulation) -> list[dict]:
    return [
        {"idx": r.idx, "arrival": r.arrival, "prompt": r.prompt, "output": r.output, "stage": r.stage,
         "cached_local": r.cached_local, "cached_shared": r.cached_shared, "prefill_worker": r.prefill_worker,
         "decode_worker": r.decode_worker, "first_token": r.first_token, "finish": r.finish}
        for r in sim.requests
    ]


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def format_table(names: Sequence[str], summaries: Sequence[dict]) -> str:
    rows: list[tuple[str, list[str]]] = [
        ("", list(names)),
        ("completed", [f"{s['completed']}/{s['requests']}" for s in summaries]),
        ("requests/s", [f"{s['request_throughput']:.1f}" for s in summaries]),
        ("output tokens/s", [f"{s['output_throughput']:.0f}" for s in summaries]),
    ]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{name} {stat} (ms)", [_ms(s[key][stat]) for s in summaries]))
    rows.append(("cache hit rate", [f"{s['cache_hit_rate']:.1%}" if s["cache_hit_rate"] is not None else "-" for s in summaries]))
    if any("goodput" in s for s in summaries):
        rows.append(("goodput (req/s)", [f"{s.get('goodput', 0):.1f}" for s in summaries]))
        rows.append(("SLO attainment", [f"{s.get('slo_attainment', 0):.1%}" for s in summaries]))
    for role in ("prefill", "decode", "mixed"):
        if all(role in s["pools"] for s in summaries):
            key, label = ("prefill_tokens_per_rank", "prefill tokens") if role == "prefill" else ("decode_tokens_per_rank", "decode tokens")
            rows.append((f"{role} pool busy mean/max", [f"{s['pools'][role]['busy_fraction']['mean']:.2f}/{s['pools'][role]['busy_fraction']['max']:.2f}" for s in summaries]))
            rows.append((f"{role} pool {label}/rank max/mean", [f"{s['pools'][role][key]['max_over_mean'] or 0:.2f}" for s in summaries]))
    rows.append(("router queue max", [str(s["router_queue_max"]) for s in summaries]))
    rows.append(("wall time (s)", [f"{s['wall_s']:.1f}" for s in summaries]))
    w0 = max(len(r[0]) for r in rows)
    widths = [max(len(r[1][i]) for r in rows) for i in range(len(summaries))]
    return "\n".join(f"{n:<{w0}}  " + "  ".join(f"{v:>{w}}" for v, w in zip(vals, widths)) for n, vals in rows)

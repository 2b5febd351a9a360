"""Fit the simulator's cost model from measurements.

Two sources:

- **Engine step timings** (``--engine FILE.json``, or ``--measure-engine MODEL_DIR`` to take them
  now with our engine on this machine): ``{"prefill": [{"new_tokens", "past_tokens", "time_s"}],
  "decode": [{"batch", "context_tokens", "time_s"}]}``. Prefill rows fit
  ``fixed + per_token * n + per_token_ctx * n * (past + n / 2)``; decode rows fit
  ``fixed + per_seq * batch + per_ctx_token * context``.
- **Serving runs** (``--bench RUN.json`` from ``deepserve bench serve --output``), when only the
  HTTP surface is reachable. TTFT is regressed on the uncached prompt tokens of the requests that
  started while no other request was in its prefill (so queueing does not pollute it; all requests
  if too few). Each request's time per output token is regressed on the batch it shared its decode
  with (the time-averaged number of requests decoding at once, divided by ``--workers``) and their
  context. Gateway and network time end up in the fixed terms, which is what a simulation of that
  deployment should add.

Coefficients are non-negative least absolute deviations, each subset of the 2-3 columns fitted
and the one with the best BIC kept (``fit_columns``). A loaded machine delays some requests by
tens of ms; least squares followed those rows, and with the attention column (nearly collinear
with the linear one over a few hundred prompt tokens) it traded most of the per-token slope for
that column. Fields not fitted (caches, tiers, batch limits, transfer) come from ``--base``
(default: the shipped default model).

Run: ``python -m bench.simulator.fit --measure-engine /tmp/tiny --output cost.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench.simulator.cost_model import CostModel


def _lad(a: np.ndarray, y: np.ndarray, floor: float, iterations: int) -> np.ndarray:
    """Least absolute deviations of ``a @ coef ~ y`` by iteratively reweighted least squares
    (residuals below ``floor`` weigh as ``floor``: exact data stay a plain least-squares fit)."""
    w = np.ones_like(y)
    coef = np.zeros(a.shape[1])
    for _ in range(iterations):
        s = np.sqrt(w)
        coef, *_ = np.linalg.lstsq(a * s[:, None], y * s, rcond=None)
        w = 1.0 / np.maximum(np.abs(y - a @ coef), floor)
    return coef


def fit_columns(columns: list[np.ndarray], y: np.ndarray, iterations: int = 40) -> np.ndarray:
    """Non-negative coefficients of ``y ~ sum(coef[i] * columns[i])``, robust to delayed rows.

    Every subset of the columns gets its least-absolute-deviations fit; subsets with a negative
    coefficient are infeasible, and of the rest the one with the lowest Laplace BIC
    (``N ln(sum |residual| / N) + size ln N``) wins: a column is kept only when it pays for
    itself, so one the data do not determine stays at zero instead of fitting the noise.
    """
    n, k = len(y), len(columns)
    floor = 1e-12 * float(np.mean(np.abs(y)) or 1.0)
    best, best_score = np.zeros(k), n * np.log(max(float(np.mean(np.abs(y))), floor))
    for r in range(1, k + 1):
        for subset in itertools.combinations(range(k), r):
            a = np.stack([columns[i] for i in subset], axis=1)  # (N, r)
            coef = _lad(a, y, floor, iterations)
            if np.any(coef < 0):
                continue
            score = n * np.log(max(float(np.mean(np.abs(a @ coef - y))), floor)) + r * np.log(n)
            if score < best_score:
                best_score = score
                best = np.zeros(k)
                best[list(subset)] = coef
    return best


def fit_prefill(rows: list[dict]) -> dict:
    n = np.array([r["new_tokens"] for r in rows], dtype=np.float64)
    past = np.array([r.get("past_tokens", 0) for r in rows], dtype=np.float64)
    y = np.array([r["time_s"] for r in rows], dtype=np.float64)
    fixed, per_tok, per_ctx = fit_columns([np.ones_like(n), n, n * (past + n / 2)], y)
    return {"fixed_s": float(fixed), "per_token_s": float(per_tok), "per_token_ctx_s": float(per_ctx)}


def fit_decode(rows: list[dict]) -> dict:
    b = np.array([r["batch"] for r in rows], dtype=np.float64)
    c = np.array([r["context_tokens"] for r in rows], dtype=np.float64)
    y = np.array([r["time_s"] for r in rows], dtype=np.float64)
    fixed, per_seq, per_ctx = fit_columns([np.ones_like(b), b, c], y)
    return {"fixed_s": float(fixed), "per_seq_s": float(per_seq), "per_ctx_token_s": float(per_ctx)}


def relative_rms(rows: list[dict], predict) -> float:
    err = [(predict(r) - r["time_s"]) / r["time_s"] for r in rows if r["time_s"] > 0]
    return float(np.sqrt(np.mean(np.square(err)))) if err else 0.0


# ---- measurements from a serving run -------------------------------------------------------------
def rows_from_bench(doc: dict, workers: int = 1) -> dict:
    """Prefill and decode rows (the engine-measurement format) recovered from a bench JSON."""
    prefill, decode = [], []
    for run in doc["runs"]:
        ok = [s for s in run["samples"] if s["error"] is None and s["ttft"] is not None]
        if not ok:
            continue
        spans = [(s["start"], s["start"] + s["ttft"]) for s in ok]
        lone = []
        for i, s in enumerate(ok):
            a, b = spans[i]
            if not any(j != i and spans[j][0] < b and spans[j][1] > a for j in range(len(ok))):
                lone.append(s)
        use = lone if len(lone) >= 8 else ok
        for s in use:
            p = s["prompt_tokens"] if s["prompt_tokens"] is not None else s["expected_input"]
            cached = s["cached_tokens"] or 0
            prefill.append({"new_tokens": max(1, p - cached), "past_tokens": cached, "time_s": s["ttft"]})
        # decode intervals: (start, end, context tokens at the midpoint)
        iv = []
        for s in ok:
            n_out = s["completion_tokens"] or len(s["chunk_times"])
            if n_out < 2:
                continue
            p = s["prompt_tokens"] if s["prompt_tokens"] is not None else s["expected_input"]
            iv.append((s["start"] + s["ttft"], s["start"] + s["e2e"], p + n_out / 2, (s["e2e"] - s["ttft"]) / (n_out - 1)))
        if not iv:
            continue
        starts = np.array([x[0] for x in iv])
        ends = np.array([x[1] for x in iv])
        ctx = np.array([x[2] for x in iv])
        for a, b, _, tpot in iv:
            if b <= a:
                continue
            overlap = np.clip(np.minimum(ends, b) - np.maximum(starts, a), 0, None) / (b - a)  # time-averaged presence
            batch = float(overlap.sum()) / workers
            context = float((overlap * ctx).sum()) / workers
            decode.append({"batch": batch, "context_tokens": context, "time_s": tpot})
    return {"prefill": prefill, "decode": decode}


# ---- measurements of our engine ------------------------------------------------------------------
def measure_engine(model_dir: str, prompt_lens=(64, 128, 256, 512, 1024), batches=(1, 2, 4, 8, 16), contexts=(128, 512),
                   decode_steps: int = 8, repeats: int = 5, device: str = "cpu") -> dict:
    """Time prefill steps and decode steps of ``engine.runtime`` on this machine."""
    from deepserve.protocol import GenerateRequest, SamplingParams
    from engine.runtime.builder import build_engine
    from engine.runtime.config import EngineConfig

    cfg = EngineConfig(max_num_batched_tokens=max(prompt_lens) + max(batches), max_num_seqs=max(batches), kv_cache="off")
    engine = build_engine(model_dir, cfg, device=device)
    rng = np.random.default_rng(0)
    vocab = engine.model.config.vocab_size
    ids = iter(itertools.count())

    def prompt(n: int) -> list[int]:
        return rng.integers(100, vocab - 1, size=n).tolist()

    def drain() -> None:
        while engine.has_work():
            engine.step()

    # warm-up (first calls allocate)
    engine.add_request(GenerateRequest(f"w{next(ids)}", prompt(64), SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)))
    drain()
    prefill = []
    for n in prompt_lens:
        times = []
        for _ in range(repeats):
            engine.add_request(GenerateRequest(f"p{next(ids)}", prompt(n), SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)))
            t0 = time.perf_counter()
            drain()
            times.append(time.perf_counter() - t0)
        prefill.append({"new_tokens": n, "past_tokens": 0, "time_s": float(np.median(times))})  # median: a shared machine is noisy
    decode = []
    for c in contexts:
        for b in batches:
            for i in range(b):
                engine.add_request(GenerateRequest(f"d{next(ids)}", prompt(c), SamplingParams(max_tokens=decode_steps + 2, ignore_eos=True, temperature=0)))
            engine.step()  # all prompts in one prefill step (budget covers them)
            while engine.num_waiting:
                engine.step()
            times = []
            for k in range(decode_steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            drain()
            decode.append({"batch": b, "context_tokens": b * (c + 1 + decode_steps // 2), "time_s": float(np.median(times))})
    return {"prefill": prefill, "decode": decode, "model_dir": str(model_dir), "device": device}


def fit(measurements: dict, base: CostModel, source: str) -> tuple[CostModel, dict]:
    """A cost model with the fitted prefill/decode terms, and the fit's relative RMS errors."""
    cost = base
    quality = {}
    if measurements.get("prefill"):
        p = fit_prefill(measurements["prefill"])
        cost = dataclasses.replace(cost, prefill=dataclasses.replace(cost.prefill, **p))
        quality["prefill_rel_rms"] = relative_rms(measurements["prefill"], lambda r: cost.prefill.fixed_s + cost.prefill_chunk_s(r["new_tokens"], r.get("past_tokens", 0)))
    if measurements.get("decode"):
        d = fit_decode(measurements["decode"])
        cost = dataclasses.replace(cost, decode=dataclasses.replace(cost.decode, **d))
        quality["decode_rel_rms"] = relative_rms(measurements["decode"], lambda r: cost.decode_step_s(r["batch"], r["context_tokens"]))
    return dataclasses.replace(cost, source=source), quality


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", help="engine step measurements JSON")
    src.add_argument("--bench", nargs="+", help="deepserve bench serve --output JSON file(s)")
    src.add_argument("--measure-engine", metavar="MODEL_DIR", help="measure our engine now (e.g. a tiny model on CPU)")
    ap.add_argument("--workers", type=int, default=1, help="--bench: workers (DP ranks) that served the run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--base", default=None, help="cost model whose other fields are kept (default: the shipped default)")
    ap.add_argument("--save-measurements", default=None, help="write the measurement rows used")
    ap.add_argument("--output", "-o", required=True)
    args = ap.parse_args(argv)
    base = CostModel.load(args.base)
    if args.engine:
        meas = json.loads(Path(args.engine).read_text())
        source = f"fit from engine measurements {args.engine}"
    elif args.bench:
        meas = {"prefill": [], "decode": []}
        for path in args.bench:
            rows = rows_from_bench(json.loads(Path(path).read_text()), args.workers)
            meas["prefill"] += rows["prefill"]
            meas["decode"] += rows["decode"]
        source = f"fit from bench runs {' '.join(args.bench)} (workers={args.workers})"
    else:
        meas = measure_engine(args.measure_engine, device=args.device)
        source = f"fit from engine measurements of {args.measure_engine} on {args.device}"
    if args.save_measurements:
        Path(args.save_measurements).write_text(json.dumps(meas, indent=1))
    cost, quality = fit(meas, base, source)
    cost.save(args.output)
    print(json.dumps({"prefill": dataclasses.asdict(cost.prefill), "decode": dataclasses.asdict(cost.decode), **quality}, indent=1))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

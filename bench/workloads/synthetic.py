"""Synthetic single-turn workloads: fixed lengths, and heavy-tailed lengths like chat traffic.

Both produce trace rows whose hash ids are unique to each request, except an optional common
prefix of ``shared_prefix`` tokens (a system prompt every request carries). Timestamps form a
Poisson process of ``rate`` requests/s when a rate is given, else all zero (the bench client then
paces by ``--rate`` or ``--concurrency``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from bench.workloads.trace import TraceRow

# ids of shared-prefix blocks come from this range; request-unique ids count up from 0
SHARED_ID_BASE = 1 << 40


def _hash_ids(length: int, block_size: int, shared_prefix: int, next_id: int) -> tuple[tuple[int, ...], int]:
    shared = shared_prefix // block_size  # whole shared blocks only: the block the prefix ends in differs
    n = -(-length // block_size)
    shared = min(shared, n)
    ids = tuple(range(SHARED_ID_BASE, SHARED_ID_BASE + shared)) + tuple(range(next_id, next_id + n - shared))
    return ids, next_id + n - shared


def _arrivals(rng: np.random.Generator, n: int, rate: float | None) -> np.ndarray:
    if not rate:
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, size=n)) * 1000.0  # ms


@dataclass(frozen=True)
class FixedConfig:
    input_length: int = 1024
    output_length: int = 128
    shared_prefix: int = 0
    rate: float | None = None
    seed: int = 0
    block_size: int = 512


def fixed(cfg: FixedConfig, num_requests: int) -> list[TraceRow]:
    rng = np.random.default_rng(cfg.seed)
    ts = _arrivals(rng, num_requests, cfg.rate)
    rows, next_id = [], 0
    for i in range(num_requests):
        ids, next_id = _hash_ids(cfg.input_length, cfg.block_size, cfg.shared_prefix, next_id)
        rows.append(TraceRow(round(float(ts[i]), 3), cfg.input_length, cfg.output_length, ids))
    return rows


@dataclass(frozen=True)
class HeavyTailConfig:
    """Lengths from a lognormal (``dist="lognormal"``: median, sigma) or a Pareto (``dist="pareto"``:
    scale = minimum, shape ``alpha``; alpha <= 2 has infinite variance), capped at ``max_*``."""

    dist: Literal["lognormal", "pareto"] = "lognormal"
    input_median: float = 1024
    input_sigma: float = 1.0
    output_median: float = 256
    output_sigma: float = 0.9
    input_min: float = 128  # Pareto scale
    output_min: float = 32
    alpha: float = 1.5  # Pareto shape
    max_input: int = 32768
    max_output: int = 4096
    shared_prefix: int = 0
    rate: float | None = None
    seed: int = 0
    block_size: int = 512


def heavy_tail(cfg: HeavyTailConfig, num_requests: int) -> list[TraceRow]:
    rng = np.random.default_rng(cfg.seed)
    if cfg.dist == "lognormal":
        ins = cfg.input_median * np.exp(cfg.input_sigma * rng.standard_normal(num_requests))
        outs = cfg.output_median * np.exp(cfg.output_sigma * rng.standard_normal(num_requests))
    elif cfg.dist == "pareto":
        ins = cfg.input_min * (1.0 + rng.pareto(cfg.alpha, num_requests))
        outs = cfg.output_min * (1.0 + rng.pareto(cfg.alpha, num_requests))
    else:
        raise ValueError(f"unknown distribution {cfg.dist!r} (lognormal or pareto)")
    ins = np.clip(np.rint(ins), 1, cfg.max_input).astype(int)
    outs = np.clip(np.rint(outs), 1, cfg.max_output).astype(int)
    ts = _arrivals(rng, num_requests, cfg.rate)
    rows, next_id = [], 0
    for i in range(num_requests):
        length = max(int(ins[i]), min(cfg.shared_prefix + 1, cfg.max_input))
        ids, next_id = _hash_ids(length, cfg.block_size, cfg.shared_prefix, next_id)
        rows.append(TraceRow(round(float(ts[i]), 3), length, int(outs[i]), ids))
    return rows

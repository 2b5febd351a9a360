"""Seeded generator of Mooncake-format traces: sessions, turns, shared system prompts.

The traffic model (every draw from one ``numpy`` generator seeded with ``seed``):
- Sessions arrive as a Poisson process of rate ``session_rate`` per second.
- Each session uses one of ``num_system_prompts`` system prompts, picked by a Zipf law of
  exponent ``zipf_s`` (a few popular agents/apps, a long tail), of lognormal length.
- A session has a geometric number of turns (mean ``mean_turns``, at most ``max_turns``). Turn
  ``t``'s prompt is the previous prompt + the previous output + a new user message (``chat``) or
  a tool result (``agent``: long tool outputs, short model outputs, short pauses).
- Turn ``t+1`` arrives after turn ``t``'s estimated service time (``est_ttft_s`` +
  ``output_length * est_tpot_s``) plus an exponential pause (``think_time_s``): open-loop, as in
  a recorded trace.

Hash ids follow content identity at ``block_size`` granularity: a block keeps its id in later
turns only if it was a *whole* block of the earlier prompt (the block holding the prompt's end is
extended later, so its content, hence its id, changes); whole system-prompt blocks share ids across
sessions. So a prefix cache of infinite size would hit exactly the repeated ids.

CLI: ``python -m bench.workloads.trace_gen --sessions 200 --output trace.jsonl [--preset agent]``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from bench.workloads.trace import TraceRow, trace_stats, write_trace


@dataclass(frozen=True)
class TraceGenConfig:
    seed: int = 0
    block_size: int = 512
    num_sessions: int = 100
    session_rate: float = 2.0  # sessions per second (Poisson)
    mode: Literal["chat", "agent"] = "chat"
    mean_turns: float = 4.0  # geometric, >= 1
    max_turns: int = 32
    num_system_prompts: int = 8
    zipf_s: float = 1.1  # popularity exponent of system prompts
    system_median: int = 2048  # tokens (lognormal median)
    system_sigma: float = 0.5
    user_median: int = 256  # new tokens per turn: user message (chat) or tool result (agent)
    user_sigma: float = 1.0
    output_median: int = 256
    output_sigma: float = 0.8
    max_output: int = 4096
    max_context: int = 131072  # a session ends when its next prompt would exceed this
    think_time_s: float = 10.0  # mean pause between a response and the next turn
    est_ttft_s: float = 0.5
    est_tpot_s: float = 0.03
    num_requests: int | None = None  # keep only the first N requests by arrival time

    def __post_init__(self) -> None:
        assert self.block_size >= 1 and self.num_sessions >= 0 and self.session_rate > 0
        assert self.mean_turns >= 1 and self.max_turns >= 1 and self.num_system_prompts >= 1
        assert self.mode in ("chat", "agent"), f"unknown mode {self.mode!r}"


PRESETS: dict[str, TraceGenConfig] = {
    # chat assistants: a few long system prompts, a handful of turns, people reading and typing
    "multi_turn": TraceGenConfig(mode="chat"),
    # tool-calling agents: long tool results, short tool-call outputs, quick successive calls
    "tool_agent": TraceGenConfig(
        mode="agent", mean_turns=8.0, user_median=800, user_sigma=1.0, output_median=96,
        output_sigma=0.6, think_time_s=1.5, system_median=4096, num_system_prompts=4,
    ),
}


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: int = 1, hi: int | None = None) -> int:
    v = round(median * math.exp(sigma * rng.standard_normal()))
    v = max(lo, v)
    return v if hi is None else min(hi, v)


def generate(cfg: TraceGenConfig) -> list[TraceRow]:
    """Rows sorted by timestamp (ties by session, then turn)."""
    rng = np.random.default_rng(cfg.seed)
    bs = cfg.block_size
    next_id = 0

    # shared system prompts: lengths and the ids of their whole blocks
    sys_len: list[int] = []
    sys_ids: list[list[int]] = []
    for _ in range(cfg.num_system_prompts):
        n = _lognormal(rng, cfg.system_median, cfg.system_sigma, lo=1, hi=cfg.max_context // 2)
        sys_len.append(n)
        sys_ids.append(list(range(next_id, next_id + n // bs)))
        next_id += n // bs
    ranks = np.arange(1, cfg.num_system_prompts + 1, dtype=np.float64)
    popularity = ranks**-cfg.zipf_s
    popularity /= popularity.sum()

    rows: list[tuple[float, int, int, TraceRow]] = []
    t_start = 0.0
    p_more = 1.0 - 1.0 / cfg.mean_turns  # geometric: P(another turn)
    for s in range(cfg.num_sessions):
        t_start += rng.exponential(1.0 / cfg.session_rate)
        p = int(rng.choice(cfg.num_system_prompts, p=popularity))
        stable = list(sys_ids[p])  # ids of blocks that stay whole in every later prompt
        context = sys_len[p]  # tokens before the new message
        t = t_start
        for turn in range(cfg.max_turns):
            new = _lognormal(rng, cfg.user_median, cfg.user_sigma)
            out = _lognormal(rng, cfg.output_median, cfg.output_sigma, hi=cfg.max_output)
            length = context + new
            if length > cfg.max_context:
                break
            n_blocks = -(-length // bs)
            ids = stable[:n_blocks] + list(range(next_id, next_id + n_blocks - len(stable)))
            next_id += max(0, n_blocks - len(stable))
            rows.append((t, s, turn, TraceRow(round(t * 1000.0, 3), length, out, tuple(ids), f"s{s}", turn)))
            stable = ids[: length // bs]
            context = length + out
            t += cfg.est_ttft_s + out * cfg.est_tpot_s + rng.exponential(cfg.think_time_s)
            if rng.random() >= p_more:
                break
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    out_rows = [r[3] for r in rows]
    if cfg.num_requests is not None:
        out_rows = out_rows[: cfg.num_requests]
    return out_rows


def run(args: argparse.Namespace) -> int:
    from bench.workloads import typed_replace

    kw = dict(kv.split("=", 1) for kv in args.set)
    for flag, name in (("seed", "seed"), ("sessions", "num_sessions"), ("session_rate", "session_rate"),
                       ("block_size", "block_size"), ("num_requests", "num_requests")):
        if getattr(args, flag) is not None:
            kw[name] = str(getattr(args, flag))
    cfg = typed_replace(PRESETS[args.preset], kw)
    rows = generate(cfg)
    write_trace(args.output, rows)
    print({"written": len(rows), "output": args.output, **trace_stats(rows, cfg.block_size)})
    return 0


if __name__ == "__main__":
    from bench.cli import add_trace_gen_arguments

    parser = argparse.ArgumentParser(description="Generate a Mooncake-format trace (JSONL).")
    add_trace_gen_arguments(parser)
    raise SystemExit(run(parser.parse_args()))

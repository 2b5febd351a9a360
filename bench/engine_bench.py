"""Engine throughput on CPU with the tiny model, ours vs transformers, and resident memory per
running sequence over 1,000 requests, in one run.

    python -m bench.engine_bench --output FILE.json [--model DIR] [--new-tokens 128]
        [--concurrency 1,8,32] [--prompt-lens 256,1024] [--memory-requests 1000] [--repeats 2]
        [--general-path] [--eager-slots]

Throughput. For each prompt length P and concurrency B, B requests of P random token ids arrive
at once; greedy, ``ignore_eos``, exactly N output tokens each.
- ours: ``EngineCore`` (continuous batching, chunked prefill under the default 2048-token step
  budget, decode steps in the host slot pools, ``engine/model/host_decode.py``); output tokens/s =
  B·N / (submission → last token).
- transformers: ``DeepseekV4ForCausalLM.generate`` on the same checkpoint with the B prompts as one
  ``(B, P)`` batch. transformers cannot batch padded V4 prompts correctly, so every prompt of a
  run has the same length and nothing is padded; ``min_new_tokens = max_new_tokens = N``.
- ``--general-path``: our engine again with decode on the general path (per-sequence state
  tensors, ``Attention._attend_sequence``) instead of the slot pools, side by side.
- ``--eager-slots``: our engine again with the slot decode's eager PyTorch layers (its attention and
  compressors stay compiled; ``HostDecoder.compiled`` off) instead of its compiled loops, side by side.
Both fp32, one intra-op thread (the engine's default: on a shared 2-core machine extra threads
spin-wait), in this process, ours then transformers for each point, so both see the same machine.
"same tokens" counts the sequences whose greedy outputs agree token for token (the two must
compute the same model; a near-tie or transformers' EOS suppression may split one).

Memory. ``--memory-requests`` requests (prompts of 64-320 tokens, 16-48 output tokens) go through
one engine in waves of ``--memory-concurrency``. In each wave the resident set size (RSS, after
``malloc_trim`` so freed activations do not count) is read once every request is live (all
prefills done, none finished) and again when the wave is over. Reported: bytes per running
sequence = median over waves of (live RSS - idle RSS) / requests, next to the tensor bytes a
running sequence's state holds outside the decode slots and the size of the slot pools (allocated
and zeroed at startup, so a sequence decoding in a slot adds no RSS: the pools are the per-slot
cost); and the growth of live and idle RSS over the second half of the
waves (flat = nothing kept per finished request; the first waves grow the allocator's pools).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from engine.runtime.engine_core import EngineCore

PAGE = os.sysconf("SC_PAGE_SIZE")


def trimmed_rss() -> int:
    """This process's resident set size (Linux ``/proc/self/statm``) after ``malloc_trim(0)``
    hands freed heap pages back, so the number counts live memory, not the allocator's cache."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run_ours(engine: EngineCore, batch: list[list[int]], new_tokens: int, tag: str) -> dict[str, Any]:
    """Submit every prompt at once and step to completion; tokens per request and timings."""
    out: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(batch))}
    t0 = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(GenerateRequest(f"{tag}-{i}", p, greedy(new_tokens)))
    first = None
    steps = 0
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id] += ev.token_ids
            if first is None and ev.token_ids:
                first = time.perf_counter() - t0
        steps += 1
    elapsed = time.perf_counter() - t0
    tokens = [out[f"{tag}-{i}"] for i in range(len(batch))]
    n = sum(len(t) for t in tokens)
    assert n == len(batch) * new_tokens, f"expected {len(batch) * new_tokens} tokens, got {n}"
    return {"tok_s": n / elapsed, "elapsed_s": elapsed, "first_token_s": first, "steps": steps, "tokens": tokens}


def run_hf(hf: Any, batch: list[list[int]], new_tokens: int) -> dict[str, Any]:
    ids = torch.tensor(batch)  # (B, P), equal lengths: no padding
    t0 = time.perf_counter()
    with torch.inference_mode():
        gen = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    elapsed = time.perf_counter() - t0
    tokens = gen[:, ids.shape[1] :].tolist()
    return {"tok_s": len(batch) * new_tokens / elapsed, "elapsed_s": elapsed, "tokens": tokens}


# side-by-side variants of our engine: (JSON key, label in the table, what it runs instead)
VARIANTS = {
    "general_path": ("general", "decode in the slot pools (default) against the general path"),
    "eager_slots": ("eager", "the slot decode's compiled layers (default) against its eager PyTorch layers"),
}


def throughput(engine: EngineCore, hf: Any, args: argparse.Namespace, vocab: int, variants: dict[str, EngineCore] | None = None) -> list[dict[str, Any]]:
    """Every (prompt length, concurrency) point: ours, transformers and each of ``variants`` (our
    engine run another way, ``VARIANTS``), ``repeats`` rounds of one run each, the best kept."""
    rows = []
    for plen in args.prompt_lens:
        for conc in args.concurrency:
            batch = prompts(conc, plen, seed=plen * 1000 + conc, vocab=vocab)
            runs: dict[str, list[dict[str, Any]]] = {"ours": [], "theirs": [], **{name: [] for name in variants or {}}}
            for r in range(args.repeats):  # interleaved: a slow spell of the box falls on every side
                runs["ours"].append(run_ours(engine, batch, args.new_tokens, f"p{plen}c{conc}r{r}"))
                for name, eng in (variants or {}).items():
                    runs[name].append(run_ours(eng, batch, args.new_tokens, f"{name}{plen}c{conc}r{r}"))
                if hf is not None:
                    runs["theirs"].append(run_hf(hf, batch, args.new_tokens))
            best = {name: max(rs, key=lambda x: x["tok_s"]) for name, rs in runs.items() if rs}
            ours, theirs = best.pop("ours"), best.pop("theirs", None)
            other = best
            row = {
                "prompt_len": plen,
                "concurrency": conc,
                "new_tokens": args.new_tokens,
                "ours_tok_s": ours["tok_s"],
                "ours_elapsed_s": ours["elapsed_s"],
                "ours_first_token_s": ours["first_token_s"],
                "ours_steps": ours["steps"],
            }
            for name, res in other.items():
                row |= {f"{name}_tok_s": res["tok_s"], f"slots_vs_{name}": ours["tok_s"] / res["tok_s"]}
            if theirs is not None:
                same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
                row |= {
                    "transformers_tok_s": theirs["tok_s"],
                    "transformers_elapsed_s": theirs["elapsed_s"],
                    "ratio": ours["tok_s"] / theirs["tok_s"],
                    "same_tokens": f"{same}/{conc}",
                }
            rows.append(row)
            print(_row_line(row), flush=True)
    return rows


def memory(engine: EngineCore, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Waves of requests through one engine; per wave, the RSS with every request of the wave
    live (prefills done, none finished) and the idle RSS after it (see module docstring)."""
    rng = random.Random(7)
    conc, total = args.memory_concurrency, args.memory_requests
    idle_before = trimmed_rss()
    waves: list[dict[str, Any]] = []
    done = 0
    while done < total:
        n = min(conc, total - done)
        for i in range(n):
            p = [rng.randrange(2, vocab) for _ in range(rng.randint(64, 320))]
            engine.add_request(GenerateRequest(f"mem-{done + i}", p, greedy(rng.randint(16, 48))))
        done += n
        wave: dict[str, Any] = {"requests": n, "steps": 0}
        while engine.has_work():
            engine.step()
            wave["steps"] += 1
            live = list(engine.seqs.values())
            if "live_rss" not in wave and len(live) == n and all(s.num_computed >= s.num_prompt for s in live):
                wave["live_rss"] = trimmed_rss()
                wave["state_tensor_bytes"] = statistics.fmean(s.state.nbytes() for s in live if s.state is not None) if any(s.state is not None for s in live) else 0.0
                wave["in_slots"] = sum(s.state is None for s in live)  # decoding in the slot pools
        wave["idle_rss"] = trimmed_rss()
        wave["bytes_per_seq"] = (wave["live_rss"] - wave["idle_rss"]) / n
        waves.append(wave)
    slots = engine.static.decoder.max_slots if engine.static is not None else 0
    slot_bytes = engine.static.decoder.nbytes() if engine.static is not None else 0  # allocated (and zeroed) at startup
    steady = waves[len(waves) // 2 :]  # the first waves also grow the allocator's pools, then it is flat
    return {
        "requests": total,
        "concurrency": conc,
        "idle_rss_before": idle_before,
        "bytes_per_running_seq": statistics.median(w["bytes_per_seq"] for w in steady),
        "state_tensor_bytes_per_seq": statistics.fmean(w["state_tensor_bytes"] for w in steady),
        "pool_bytes_per_seq_boundary": engine.pool.boundary_bytes,
        "slot_pool_bytes": slot_bytes,
        "slot_pool_slots": slots,
        "pool_bytes_per_block_unit": engine.pool.block_bytes,
        "live_rss_growth": steady[-1]["live_rss"] - steady[0]["live_rss"],
        "idle_rss_growth": steady[-1]["idle_rss"] - steady[0]["idle_rss"],
        "waves": waves,
    }


def _row_line(r: dict[str, Any]) -> str:
    hf = f"{r['transformers_tok_s']:10.1f}  {r['ratio']:6.2f}x  {r['same_tokens']:>6}" if "ratio" in r else f"{'-':>10}  {'-':>7}  {'-':>6}"
    return f"{r['prompt_len']:>6}  {r['concurrency']:>4}  {r['new_tokens']:>4}  {r['ours_tok_s']:10.1f}  {hf}"


def render(report: dict[str, Any]) -> str:
    lines = [
        f"output tokens/s, greedy, fp32, {report['machine'].get('threads', 1)} intra-op thread(s) per side; "
        "transformers batches equal-length prompts (no padding)",
        f"{'prompt':>6}  {'conc':>4}  {'new':>4}  {'ours':>10}  {'transformers':>10}  {'ratio':>7}  {'same':>6}",
    ]
    lines += [_row_line(r) for r in report["throughput"]]
    for name, (label, title) in VARIANTS.items():
        if any(f"{name}_tok_s" in r for r in report["throughput"]):
            lines += ["", f"{title}, same process:"]
            lines += [
                f"{r['prompt_len']:>6}  {r['concurrency']:>4}  ours {r['ours_tok_s']:8.1f}  {label} {r[f'{name}_tok_s']:8.1f}  {r[f'slots_vs_{name}']:5.2f}x"
                for r in report["throughput"]
            ]
    m = report.get("memory")
    if m:
        mib = 1 << 20
        lines += [
            "",
            (
                f"memory: {m['requests']} requests in waves of {m['concurrency']}: "
                f"{m['bytes_per_running_seq'] / 1024:.0f} KiB RSS per running sequence "
                f"(state tensors outside the slots {m['state_tensor_bytes_per_seq'] / 1024:.0f} KiB; decode slot pools "
                f"{m['slot_pool_bytes'] / mib:.0f} MiB for {m['slot_pool_slots']} slots, allocated at startup); "
                f"growth over the second half ({m['requests'] // 2} requests): "
                f"live {m['live_rss_growth'] / mib:+.1f} MiB, idle {m['idle_rss_growth'] / mib:+.1f} MiB"
            ),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True, help="JSON results file")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: make the tiny one in a temp dir)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-lens", default="256,1024")
    ap.add_argument("--repeats", type=int, default=2, help="runs per point and side; the best is kept (noisy machines)")
    ap.add_argument("--memory-requests", type=int, default=1000)
    ap.add_argument("--memory-concurrency", type=int, default=64)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--general-path", action="store_true", help="also run our engine with decode on the general path (no slot pools)")
    ap.add_argument("--eager-slots", action="store_true", help="also run our engine with the slot decode's eager PyTorch layers (attention stays compiled)")
    args = ap.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    t_start = time.perf_counter()

    model_dir = args.model
    if model_dir is None:
        from engine.model.tiny import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="engine-bench-")) / "tiny", seed=0, preset="tiny"))
    from engine.model.loader import load_model

    model = load_model(model_dir, dtype="float32", progress=False)
    max_seqs = max(64, max(args.concurrency), args.memory_concurrency)
    engine = build_engine(model_dir, EngineConfig(max_num_seqs=max_seqs), model=model)  # sets 1 thread
    variants: dict[str, EngineCore] = {}
    if args.general_path:
        variants["general_path"] = build_engine(model_dir, EngineConfig(max_num_seqs=max_seqs, static_decode=False), model=model)
    if args.eager_slots and engine.static is not None and hasattr(engine.static.decoder, "compiled"):
        variants["eager_slots"] = eager = build_engine(model_dir, EngineConfig(max_num_seqs=max_seqs), model=model)
        eager.static.decoder.compiled = False
    torch.set_num_threads(int(os.environ.get("DEEPSERVE_CPU_THREADS", "1")))
    vocab = model.config.vocab_size
    hf = None
    if not args.skip_transformers:
        import transformers

        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        run_hf(hf, prompts(2, 16, 0, vocab), 2)  # warm-up
    for b in (1, 2):
        run_ours(engine, prompts(b, 16, 0, vocab), 2, f"warm{b}")

    print(f"{'prompt':>6}  {'conc':>4}  {'new':>4}  {'ours':>10}  {'transformers':>10}  {'ratio':>7}  {'same':>6}", flush=True)
    report: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_avg_at_start": os.getloadavg(),
        },
        "model": {"dir": model_dir, "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size, "layer_types": list(model.config.layer_types)},
        "notes": [
            "transformers runs each point as one equal-length (B, P) batch: it cannot batch padded V4 prompts correctly",
            "both fp32 and one intra-op thread, measured one after the other in one process",
        ],
    }
    if hf is not None:
        import transformers

        report["machine"]["transformers"] = transformers.__version__
    report["throughput"] = throughput(engine, hf, args, vocab, variants)
    del hf
    report["memory"] = memory(engine, args, vocab) if args.memory_requests else None
    report["wall_s"] = time.perf_counter() - t_start
    report["machine"]["load_avg_at_end"] = os.getloadavg()
    Path(args.output).write_text(json.dumps(report, indent=2))
    print()
    print(render(report))
    print(f"\nwall time {report['wall_s']:.0f} s; results in {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

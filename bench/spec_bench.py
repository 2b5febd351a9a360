"""Speculative decoding with the checkpoint's own draft layers on CPU: tokens per step and
inter-token latency.

    python -m bench.spec_bench --output FILE.json [--model DIR] [--preset tiny|tiny-v41] [--k 1,2,3]
        [--concurrency 1,8] [--prompt-len 256] [--new-tokens 128] [--repeats 2] [--drafts slots,general] [--serve]

The model is the tiny checkpoint trained by ``make-tiny-model --preset PRESET --train-mtp`` (made
in a temporary directory unless ``--model`` names one): ``tiny`` (DeepSeek-V4, drafting with its
MTP layer, ``method="mtp"``) or ``tiny-v41`` (DeepSeek-V4.1, its DSpark draft layers,
``method="dspark"``; V4.1 verifies on the general path, so ``--drafts`` does not apply). For each concurrency B, B requests arrive at once: a
prompt of ``--prompt-len - 8`` random token ids then 8 tokens of the synthetic language
(``engine/model/tiny_mtp.py``), greedy, ``ignore_eos``, exactly N output tokens each, through one
in-process ``EngineCore`` — without speculation (decode in the host slot pools) and with
``num_speculative_tokens = k`` (one verify step of 1 + k tokens per slot in the host slot pools).
Reported per point: output tokens/s (B·N / submission → last token), ITL = mean over requests of
(last token − first token) / (N − 1), tokens per verify step = 1 + accepted / verifies, the
acceptance rate of each draft position, and whether every request's tokens equal the
non-speculative run's. One intra-op thread; the best (highest tokens/s) of ``--repeats`` rounds.
``--drafts``: where slot-verified sequences draft — ``slots`` (``slots.mtp_draft.SlotDrafter``,
the default) and/or ``general`` (``mtp.Drafter``, as before the slot draft step), each ``k`` run
with each, same rounds; per point also the seconds spent drafting (``draft_s``).

``--serve``: the same comparison through the whole stack instead — ``deepserve up`` on the
checkpoint without and with ``--speculative-config`` (each ``k``), each measured at each
concurrency by ``deepserve bench serve`` (``--dataset-name random``, ``--prompt-len`` /
``--new-tokens``, ``--num-requests``, greedy, ``ignore_eos``); per point the client's output
tokens/s, TPOT and ITL (mean, p50, p99: with speculation a chunk may carry several tokens, so TPOT
is the per-token figure) and, from the gateway's ``/metrics`` (the workers' merged), the verify
steps, drafts and accepted tokens of the run, so tokens per step = 1 + accepted / verifies.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from deepserve.protocol import GenerateRequest, SamplingParams
from engine.model.tiny import make_tiny_model
from engine.model.tiny_mtp import TrainConfig, sentence
from engine.runtime.builder import build_engine, load_any_model
from engine.runtime.config import EngineConfig, SpeculativeConfig
from engine.runtime.metrics import EngineMetricFamilies, EngineMetrics

LABELS = {"model_name": "bench", "dp_rank": "0", "engine": "0"}


def requests(b: int, prompt_len: int, new_tokens: int, seed: int) -> list[GenerateRequest]:
    rng, lang = random.Random(seed), TrainConfig()
    out = []
    for i in range(b):
        ids = [rng.randrange(2, 129280) for _ in range(prompt_len - 8)] + sentence(lang, lang.first_id + rng.randrange(lang.vocab), 8)
        out.append(GenerateRequest(f"b{seed}-{i}", ids, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)))
    return out


METHODS = {"tiny": "mtp", "tiny-v41": "dspark"}  # make-tiny-model preset → its drafting method


def run_point(ckpt: Path, model: Any, k: int | None, reqs: list[GenerateRequest], where: str = "slots", method: str = "mtp") -> dict[str, Any]:
    """One run of ``reqs`` through a fresh engine (``method``'s drafts; V4 drafting where ``where``
    says): timings, tokens, the spec counters and the time spent drafting."""
    reg = CollectorRegistry()
    spec = None if k is None else SpeculativeConfig(method, k)
    engine = build_engine(ckpt, EngineConfig(max_num_seqs=max(8, len(reqs)), speculative=spec), model=model,
                          metrics=EngineMetrics(EngineMetricFamilies(reg), "bench", 0))  # fmt: skip
    if engine.static is not None:
        engine.static.warm_up()
    draft_s = [0.0]
    if engine.spec is not None:
        engine.spec.slot_drafts = where == "slots" and engine.spec.target.slots
        inner = engine.spec._draft

        def timed(*a, inner=inner):
            t = time.perf_counter()
            inner(*a)
            draft_s[0] += time.perf_counter() - t

        engine.spec._draft = timed
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for ev in engine.step():
            now = time.perf_counter()
            if ev.token_ids:
                tokens[ev.request_id] += ev.token_ids
                first.setdefault(ev.request_id, now)
                last[ev.request_id] = now
    wall = time.perf_counter() - t0
    n = reqs[0].sampling.max_tokens
    itl = sum((last[r] - first[r]) / (n - 1) for r in tokens) / len(tokens)
    value = lambda name, **kw: reg.get_sample_value(f"vllm:spec_decode_{name}_total", {**LABELS, **kw}) or 0.0  # noqa: E731
    verifies, drafts = value("num_drafts"), value("num_draft_tokens")
    per_pos = [value("num_accepted_tokens_per_pos", position=str(p)) / verifies if verifies else 0.0 for p in range(k or 0)]
    return {
        "k": k, "drafts": ("slots" if engine.spec.slot_drafts else "general") if engine.spec is not None else None, "draft_s": draft_s[0], "tok_s": len(reqs) * n / wall, "itl_ms": 1e3 * itl, "wall_s": wall, "tokens": tokens,
        "verifies": verifies, "draft_tokens": drafts, "accepted": value("num_accepted_tokens"),
        "tokens_per_step": 1 + value("num_accepted_tokens") / verifies if verifies else 1.0, "acceptance_per_position": per_pos,
    }  # fmt: skip


def scrape_spec(url: str) -> dict[str, float]:
    """The stack's ``vllm:spec_decode_*`` counters (summed over workers) from ``url/metrics``."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {n: 0.0 for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    for line in text.splitlines():
        for n in out:
            if line.startswith(f"vllm:spec_decode_{n}_total{{"):
                out[n] += float(line.rsplit(" ", 1)[1])
    return out


def serve_points(ckpt: Path, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """``--serve`` (module docstring): one ``deepserve up`` per setting, ``bench serve`` per concurrency."""
    import subprocess
    import sys

    from bench.procs import free_port, start, stop

    points = []
    for k in [None] + [int(x) for x in args.k.split(",")]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "deepserve.cli", "up", "--model", str(ckpt), "--port", str(port), "--max-num-seqs", "16"]
        if k is not None:
            cmd += ["--speculative-config", json.dumps({"method": METHODS[args.preset], "num_speculative_tokens": k})]
        log = work / f"up-{k}.log"
        try:
            proc = start(cmd, url + "/health", log=log, timeout=300, env={"DEEPSERVE_CPU_THREADS": "1"})
        except RuntimeError:
            print(log.read_text()[-3000:], file=sys.stderr)
            raise
        try:
            for c in (int(x) for x in args.concurrency.split(",")):
                before = scrape_spec(url)
                res = work / f"serve-{k}-{c}.json"
                subprocess.run([
                    sys.executable, "-m", "deepserve.cli", "bench", "serve", "--url", url, "--dataset-name", "random",
                    "--random-input-len", str(args.prompt_len), "--random-output-len", str(args.new_tokens), "--concurrency", str(c),
                    "--num-requests", str(args.num_requests or 4 * c), "--seed", "0", "--no-progress", "--output", str(res),
                ], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
                after = scrape_spec(url)
                got = {n: after[n] - before[n] for n in after}
                summary = json.loads(res.read_text())["runs"][0]["summary"]
                ms = lambda d: {q: None if d[q] is None else 1e3 * d[q] for q in ("mean", "median", "p99")}  # noqa: E731
                verifies = got["num_drafts"]
                point = {
                    "k": k, "concurrency": c, "output_tok_s": summary["output_throughput"], "tpot_ms": ms(summary["tpot_s"]),
                    "itl_ms": ms(summary["itl_s"]), "ttft_ms": ms(summary["ttft_s"]), "completed": summary.get("completed"),
                    "verifies": verifies, "draft_tokens": got["num_draft_tokens"], "accepted": got["num_accepted_tokens"],
                    "tokens_per_step": 1 + got["num_accepted_tokens"] / verifies if verifies else 1.0,
                }  # fmt: skip
                print(json.dumps(point), flush=True)
                points.append(point)
        finally:
            stop(proc, timeout=20)
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--model", default=None, help="a --train-mtp checkpoint (default: made in a temporary directory)")
    ap.add_argument("--preset", default="tiny", choices=sorted(METHODS), help="the checkpoint's family when --model is not given (module docstring)")
    ap.add_argument("--k", default="1,2,3")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--drafts", default="slots", help="slots and/or general (comma list; module docstring)")
    ap.add_argument("--serve", action="store_true", help="through deepserve up + deepserve bench serve (module docstring)")
    ap.add_argument("--num-requests", type=int, default=0, help="--serve: requests per point (default 4 x concurrency)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory()
    ckpt = Path(args.model) if args.model else make_tiny_model(Path(tmp.name) / "model", seed=0, preset=args.preset, train_mtp=TrainConfig())
    if args.serve:
        meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": 1, **vars(args)}
        Path(args.output).write_text(json.dumps({"meta": meta, "points": serve_points(ckpt, args, Path(tmp.name))}, indent=2))
        return
    model = load_any_model(ckpt, dtype="float32")
    points = []
    for b in (int(x) for x in args.concurrency.split(",")):
        reqs = requests(b, args.prompt_len, args.new_tokens, seed=b)
        runs: dict[tuple[int | None, str], dict[str, Any]] = {}
        settings = [(None, "-")] + [(int(x), d) for x in args.k.split(",") for d in args.drafts.split(",")]
        for _ in range(args.repeats):  # rounds interleave the settings
            for k, d in settings:
                r = run_point(ckpt, model, k, [GenerateRequest.from_dict(q.to_dict()) for q in reqs], d, METHODS[args.preset])
                if (k, d) not in runs or r["tok_s"] > runs[k, d]["tok_s"]:
                    runs[k, d] = r
        base = runs[None, "-"]["tokens"]
        for r in runs.values():
            r["same_tokens"] = sum(r["tokens"][q] == base[q] for q in base)
            del r["tokens"]
            points.append({"concurrency": b, **r})
            print(json.dumps({"concurrency": b, **{key: r[key] for key in ("k", "drafts", "tok_s", "itl_ms", "draft_s", "tokens_per_step", "acceptance_per_position", "same_tokens")}}))
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": 1, **vars(args)}
    Path(args.output).write_text(json.dumps({"meta": meta, "points": points}, indent=2))


if __name__ == "__main__":
    main()

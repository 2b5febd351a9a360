"""``deepserve bench soak``: mixed traffic against a loopback stack with faults injected on a schedule.

The stack (``bench/soak_stack.py``): ``deepserve up`` with a prefill and two decode workers, a real
valkey Redis tier. First an undisturbed baseline: each compared kind's greedy answer to each
prompt, one request at a time. Then ``--duration`` seconds of traffic at ``--concurrency`` (kinds in
``bench/soak_traffic.py``: streaming and plain chat, completions, structured output, long prompts,
client disconnects, hostile grammars, malformed and deep JSON), while every ``--fault-every``
seconds the next fault of the cycle strikes: SIGKILL of a decode worker, SIGSTOP of a decode worker
for ``--stop-hold`` seconds, Redis killed for ``--redis-down`` seconds, SIGKILL of the prefill
worker. Recorded:
- per kind: requests ok; refused with a clean error while a fault was in effect (its window: from
  the fault until the stack is whole again, plus ``--grace``); failed otherwise (a clean error
  outside any fault window, or a broken answer anywhere: cut streams, timeouts, non-API bodies);
- wrong tokens: ok answers of the compared kinds whose text differs from the baseline's;
- RSS and open file descriptors of the gateway and each worker, every ``--sample-every`` seconds.
The JSON goes to ``--out``. The figure is failures and wrong tokens, not speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.soak_stack import SoakStack, StackOptions, healthy
from bench.soak_traffic import COMPARED, Outcome, send

WEIGHTS = {
    "chat": 4, "chat_stream": 4, "completion": 2, "completion_stream": 2, "structured": 2, "long": 1,
    "disconnect": 1, "hostile_pattern": 0.25, "huge_enum": 0.2, "huge_alternation": 0.2, "malformed": 0.5, "deep": 0.5,
}
BASELINE_OF = {"chat_stream": "chat", "completion_stream": "completion"}  # same engine request, same text
FAULTS = ("kill_decode", "stop_decode", "redis_down", "kill_prefill")
CLEAN_REFUSALS = frozenset({"hostile_pattern", "huge_enum", "huge_alternation", "malformed", "deep"})  # a 4xx is their right answer


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 1800.0
    concurrency: int = 6
    fault_every_s: float = 60.0
    first_fault_s: float = 20.0
    stop_hold_s: float = 10.0
    redis_down_s: float = 10.0
    grace_s: float = 15.0
    prompts: int = 6
    max_tokens: int = 24
    timeout_s: float = 240.0
    sample_every_s: float = 10.0
    seed: int = 0


@dataclass
class Fault:
    name: str
    target: str
    start: float  # monotonic
    end: float  # the stack whole again


def _base(kind: str) -> str:
    return BASELINE_OF.get(kind, kind)


async def baseline(client: httpx.AsyncClient, stack: SoakStack, cfg: SoakConfig) -> dict[tuple[str, int], str]:
    """Each compared kind's answer to each prompt, one request at a time, no fault."""
    out = {}
    for kind in sorted({_base(k) for k in COMPARED}):
        for i in range(cfg.prompts):
            o = await send(client, kind, i, stack.model, cfg.max_tokens, cfg.timeout_s)
            if o.status != "ok" or o.text is None:
                raise RuntimeError(f"baseline {kind} #{i} failed: {o.status} {o.detail}")
            out[(kind, i)] = o.text
    return out


def run_fault(stack: SoakStack, cfg: SoakConfig, turn: int) -> Fault:
    name = FAULTS[turn % len(FAULTS)]
    start = time.monotonic()
    cycle = turn // len(FAULTS)
    if name == "kill_decode":
        target = stack.kill_worker("decode", cycle)
    elif name == "stop_decode":
        target = stack.stop_worker("decode", cycle + 1, cfg.stop_hold_s)
    elif name == "redis_down":
        target = stack.bounce_redis(cfg.redis_down_s)
    else:
        target = stack.kill_worker("prefill", cycle)
    return Fault(name, target, start, time.monotonic())


async def soak(stack: SoakStack, cfg: SoakConfig) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(base_url=stack.url, limits=limits) as client:
        t0 = time.monotonic()
        base = await baseline(client, stack, cfg)
        baseline_s = time.monotonic() - t0
        outcomes: list[Outcome] = []
        faults: list[Fault] = []
        samples: list[dict[str, Any]] = []
        start = time.monotonic()
        deadline = start + cfg.duration_s
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())

        async def client_loop(k: int) -> None:
            rng = random.Random(cfg.seed * 1000 + k)
            while time.monotonic() < deadline:
                kind = rng.choices(kinds, weights)[0]
                outcomes.append(await send(client, kind, rng.randrange(cfg.prompts), stack.model, cfg.max_tokens, cfg.timeout_s))

        async def fault_loop() -> None:
            turn = 0
            next_at = start + cfg.first_fault_s
            while True:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                if time.monotonic() >= deadline - cfg.grace_s:
                    return
                faults.append(await asyncio.to_thread(run_fault, stack, cfg, turn))
                turn += 1
                next_at = max(next_at + cfg.fault_every_s, time.monotonic() + 5.0)

        async def sample_loop() -> None:
            while time.monotonic() < deadline:
                procs = await asyncio.to_thread(stack.sample)
                up = await asyncio.to_thread(healthy, stack.url, 5.0)
                samples.append({"t": round(time.monotonic() - start, 1), "health": up, "procs": procs})
                await asyncio.sleep(cfg.sample_every_s)

        await asyncio.gather(*(client_loop(k) for k in range(cfg.concurrency)), fault_loop(), sample_loop())
        elapsed = time.monotonic() - start
    await asyncio.to_thread(stack.wait_whole)
    samples.append({"t": round(time.monotonic() - start, 1), "health": healthy(stack.url), "procs": stack.sample()})
    return report(cfg, base, outcomes, faults, samples, start, elapsed, baseline_s)


def _in_fault(o: Outcome, faults: list[Fault], grace_s: float) -> bool:
    return any(o.started <= f.end + grace_s and o.ended >= f.start for f in faults)


def classify(o: Outcome, base: dict[tuple[str, int], str], faults: list[Fault], grace_s: float) -> tuple[str, bool | None]:
    """(``ok`` | ``fault_refused`` | ``failed``, whether the text matched the baseline or None)."""
    if o.status == "ok":
        if o.kind in COMPARED and o.text is not None:
            return "ok", o.text == base[(_base(o.kind), o.prompt)]
        return "ok", None
    if o.status == "refused":
        if o.kind in CLEAN_REFUSALS and o.detail[:1] == "4":
            return "ok", None
        return ("fault_refused" if _in_fault(o, faults, grace_s) else "failed"), None
    return "failed", None


def _series(samples: list[dict[str, Any]], field: str) -> dict[str, dict[str, float]]:
    names = sorted({n for s in samples for n in s["procs"]})
    out = {}
    for name in names:
        values = [s["procs"][name][field] for s in samples if name in s["procs"]]
        out[name] = {"first": values[0], "last": values[-1], "max": max(values), "samples": len(values)}
    return out


def report(cfg: SoakConfig, base: dict[tuple[str, int], str], outcomes: list[Outcome], faults: list[Fault],
           samples: list[dict[str, Any]], start: float, elapsed: float, baseline_s: float) -> dict[str, Any]:
    by_kind: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        row = by_kind.setdefault(o.kind, {"sent": 0, "ok": 0, "fault_refused": 0, "failed": 0, "compared": 0,
                                          "wrong_tokens": 0, "broken": 0, "latency_s": [], "details": Counter()})
        verdict, same = classify(o, base, faults, cfg.grace_s)
        row["sent"] += 1
        row[verdict] += 1
        row["broken"] += o.status == "broken"
        if same is not None:
            row["compared"] += 1
            row["wrong_tokens"] += not same
        if o.detail and o.detail != "left":
            row["details"][o.detail] += 1
        if o.status == "ok":
            row["latency_s"].append(o.ended - o.started)
    for row in by_kind.values():
        lat = row.pop("latency_s")
        row["p50_s"] = round(statistics.median(lat), 3) if lat else None
        row["max_s"] = round(max(lat), 3) if lat else None
        row["details"] = dict(row["details"].most_common(8))
    totals = {k: sum(r[k] for r in by_kind.values()) for k in ("sent", "ok", "fault_refused", "failed", "compared", "wrong_tokens", "broken")}
    return {
        "benchmark": "soak",
        "config": asdict(cfg),
        "elapsed_s": round(elapsed, 1),
        "baseline_s": round(baseline_s, 1),
        "baseline_answers": len(base),
        "totals": totals,
        "by_kind": dict(sorted(by_kind.items())),
        "faults": [{"name": f.name, "target": f.target, "at_s": round(f.start - start, 1),
                    "whole_after_s": round(f.end - f.start, 1)} for f in faults],
        "health_not_200_samples": sum(not s["health"] for s in samples),
        "rss_mb": _series(samples, "rss_mb"),
        "fds": _series(samples, "fds"),
        "samples": samples,
    }


# ---- command line ---------------------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    ap.add_argument("--duration", type=float, default=d.duration_s, help="seconds of traffic after the baseline")
    ap.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight")
    ap.add_argument("--fault-every", type=float, default=d.fault_every_s, help="seconds between faults")
    ap.add_argument("--first-fault", type=float, default=d.first_fault_s, help="seconds before the first fault")
    ap.add_argument("--stop-hold", type=float, default=d.stop_hold_s, help="seconds a decode worker stays SIGSTOPped")
    ap.add_argument("--redis-down", type=float, default=d.redis_down_s, help="seconds Redis stays dead")
    ap.add_argument("--grace", type=float, default=d.grace_s, help="seconds after a fault its refusals still count to it")
    ap.add_argument("--prompts", type=int, default=d.prompts, help="distinct prompts per compared kind")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--sample-every", type=float, default=d.sample_every_s, help="seconds between RSS/fd samples")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--model", help="checkpoint directory (default: a tiny one made in --work-dir)")
    ap.add_argument("--work-dir", help="checkpoint, KV files and logs (default: a temporary directory)")
    ap.add_argument("--out", help="result JSON (default: print only)")


def run(args: argparse.Namespace) -> int:
    cfg = SoakConfig(
        duration_s=args.duration, concurrency=args.concurrency, fault_every_s=args.fault_every,
        first_fault_s=args.first_fault, stop_hold_s=args.stop_hold, redis_down_s=args.redis_down, grace_s=args.grace,
        prompts=args.prompts, max_tokens=args.max_tokens, sample_every_s=args.sample_every, seed=args.seed,
    )
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="deepserve-soak-"))
    stack = SoakStack(StackOptions(work_dir=work, model_dir=Path(args.model) if args.model else None))
    try:
        stack.start()
        result = asyncio.run(soak(stack, cfg))
    finally:
        stack.stop()
    result["restarts_logged"] = (work / "up.log").read_text(errors="replace").count("restarted (restart")
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    summary = {k: result[k] for k in ("elapsed_s", "totals", "faults", "health_not_200_samples", "restarts_logged")}
    print(json.dumps({**summary, "rss_mb": result["rss_mb"], "fds": result["fds"]}, indent=1))
    print(f"logs: {work}")
    return 0 if result["totals"]["failed"] == 0 and result["totals"]["wrong_tokens"] == 0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())

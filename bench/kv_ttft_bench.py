"""Time to first token for a long prompt, cold vs a KV-store hit per tier, on the tiny model.

    python -m bench.kv_ttft_bench --output FILE.json [--prompt-tokens 4096] [--tiers memory,ssd,redis]

For each tier: TTFT of the prompt on an empty store (cold), then the same prompt again (hit:
units restored, only the tail recomputed), and the raw load time of the restored records against
the time to recompute them — the two sides of the connector's load-versus-recompute rule.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from prometheus_client import CollectorRegistry

from engine.kv_connector import KVConnector
from deepserve.protocol import GenerateRequest, SamplingParams
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from kvstore import KVStoreConfig, build_store


def ttft(engine, rid: str, prompt: list[int]) -> tuple[float, int]:
    engine.add_request(GenerateRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0)))
    t0 = time.perf_counter()
    first, cached = None, 0
    while engine.has_work():
        for ev in engine.step():
            if ev.token_ids and first is None:
                first = time.perf_counter() - t0
            cached = max(cached, ev.num_cached_tokens)
    return first or 0.0, cached


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a fresh tiny model)")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--tiers", default="memory,ssd,redis")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="kv_ttft.json")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvbench-")
    model_dir = args.model
    if model_dir is None:
        from engine.model.tiny import make_tiny_model

        model_dir = str(make_tiny_model(f"{tmp}/model"))
    engine = build_engine(model_dir, EngineConfig(max_num_batched_tokens=8192), dtype="float32")
    rng = random.Random(0)
    rows = []
    redis_server = None
    for tier in args.tiers.split(","):
        kw: dict = {}
        if tier == "ssd":
            kw["ssd_dir"] = tempfile.mkdtemp(dir=tmp)
        if tier == "fs":
            kw["fs_dir"] = tempfile.mkdtemp(dir=tmp)
        if tier == "redis":
            from bench.localredis import LocalRedisServer

            redis_server = redis_server or LocalRedisServer().start()
            kw["redis_url"] = redis_server.url
        for rep in range(args.repeats):
            store = build_store(KVStoreConfig(tiers=(tier,), **kw), registry=CollectorRegistry())
            engine.kv = KVConnector(store, engine.model)
            prompt = [rng.randrange(2, 129280) for _ in range(args.prompt_tokens)]
            cold, _ = ttft(engine, f"c{tier}{rep}", prompt)
            hit, cached = ttft(engine, f"h{tier}{rep}", prompt)
            keys = engine.kv.keys(prompt[: cached or 1])
            t0 = time.perf_counter()
            store.get_many(keys)
            load_s = time.perf_counter() - t0
            rows.append({"tier": tier, "rep": rep, "cold_ttft_s": cold, "hit_ttft_s": hit, "cached_tokens": cached,
                         "load_blocks_s": load_s, "recompute_s_est": cached / engine.kv.prefill_tps if cached else None})
            store.close()
    if redis_server is not None:
        redis_server.kill()
    print(f"prompt {args.prompt_tokens} tokens, tiny model, fp32 CPU, 1 thread")
    print(f"{'tier':8s} {'cold TTFT ms':>13s} {'hit TTFT ms':>12s} {'speedup':>8s} {'cached':>7s} {'load ms':>8s}")
    summary = []
    for tier in args.tiers.split(","):
        rs = [r for r in rows if r["tier"] == tier]
        cold = sorted(r["cold_ttft_s"] for r in rs)[len(rs) // 2]
        hit = sorted(r["hit_ttft_s"] for r in rs)[len(rs) // 2]
        load = sorted(r["load_blocks_s"] for r in rs)[len(rs) // 2]
        cached = rs[0]["cached_tokens"]
        summary.append({"tier": tier, "cold_ttft_ms": cold * 1e3, "hit_ttft_ms": hit * 1e3, "speedup": cold / hit, "cached_tokens": cached, "load_ms": load * 1e3})
        print(f"{tier:8s} {cold * 1e3:13.1f} {hit * 1e3:12.1f} {cold / hit:7.1f}x {cached:7d} {load * 1e3:8.1f}")
    with open(args.output, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

"""KV store put/get throughput and latency per tier for real DeepSeek-V4-Flash record sizes.

Usage::

    python -m bench.kvstore_bench --output bench/results/kvstore.json [--iters 30] [--tiers memory,host,ssd,fs,redis]

Records (bf16, V4-Flash: 43 layers, layers 0-1 HCA, then CSA/HCA alternating from layer 2 -> 21
CSA + 22 HCA layers):
- block (one 128-token unit): CSA layer = 32 compressed rows x 512 + 32 indexer rows x 128;
  HCA layer = 1 row x 512. ~0.88 MB.
- snapshot (one prefix end): every layer's SWA window, 127 rows x 512, plus small compressor /
  indexer overlap buffers. ~5.7 MB.

For every tier two levels are timed, one operation at a time (the engine's access pattern):
- ``backend``: raw bytes ``put``/``get`` of the encoded record on the tier's backend;
- ``store``: a one-tier ``TieredStore``: encode + crc32 + put, and get + verify + decode.
Next to them, the tier's raw ceiling measured in the same run on the same bytes: memcpy (memory,
host), ``dd`` sequential write with ``conv=fdatasync`` and read (ssd, fs directory; the read is
from the page cache, as is ours), ``redis-benchmark``/``valkey-benchmark`` SET/GET with the same
value size when installed, else plain redis-py SET/GET. ``ratio`` = our MB/s / ceiling MB/s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
from prometheus_client import CollectorRegistry

from kvstore import KVStoreConfig, RecordHeader, build_store, encode_record
from kvstore.backends.base import Backend
from bench.localredis import LocalRedisServer, find_benchmark_binary
from kvstore.store import TieredStore

N_LAYERS = 43
SWA_ROWS = 127
HEAD_DIM = 512
INDEX_DIM = 128
CSA_ROWS = 32  # compressed rows per 128 tokens in a CSA layer (one per 4 tokens)


def layer_kinds() -> list[str]:
    """V4-Flash: two HCA layers, then CSA/HCA alternating."""
    return ["hca", "hca"] + ["csa" if i % 2 == 0 else "hca" for i in range(N_LAYERS - 2)]


def block_tensors(g: torch.Generator) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, kind in enumerate(layer_kinds()):
        if kind == "csa":
            out[f"L{i}.kv"] = torch.randn(CSA_ROWS, HEAD_DIM, generator=g).to(torch.bfloat16)  # (32, 512)
            out[f"L{i}.idx"] = torch.randn(CSA_ROWS, INDEX_DIM, generator=g).to(torch.bfloat16)  # (32, 128)
        else:
            out[f"L{i}.kv"] = torch.randn(1, HEAD_DIM, generator=g).to(torch.bfloat16)  # (1, 512)
    return out


def snapshot_tensors(g: torch.Generator) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, kind in enumerate(layer_kinds()):
        out[f"L{i}.swa"] = torch.randn(SWA_ROWS, HEAD_DIM, generator=g).to(torch.bfloat16)  # (127, 512)
        if kind == "csa":  # compressor / indexer overlap windows
            out[f"L{i}.cmp"] = torch.randn(4, HEAD_DIM, generator=g).to(torch.bfloat16)  # (4, 512)
            out[f"L{i}.icmp"] = torch.randn(4, INDEX_DIM, generator=g).to(torch.bfloat16)  # (4, 128)
        else:  # HCA running compressor state
            out[f"L{i}.cmp"] = torch.randn(1, HEAD_DIM, generator=g)  # (1, 512) fp32
    return out


# --- timing helpers ------------------------------------------------------------------------------
def summarize(lat_s: list[float], nbytes: int) -> dict[str, float]:
    lat = sorted(lat_s)
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
    mean = statistics.fmean(lat)
    return {
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": p99 * 1e3,
        "mean_ms": mean * 1e3,
        "mb_s": nbytes / mean / 1e6,
        "n": len(lat),
    }


def timed(fn: Callable[[int], object], n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


# --- ceilings ------------------------------------------------------------------------------------
def memcpy_ceiling(blob: bytes, n: int) -> dict[str, dict[str, float]]:
    """memcpy into memory that is already mapped (the ceiling the task sets)."""
    src = np.frombuffer(blob, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    lat = timed(lambda _: np.copyto(dst, src), n)
    s = summarize(lat, len(blob))
    return {"put": s, "get": s}


def fresh_memcpy(blob: bytes, n: int) -> dict[str, float]:
    """memcpy into a new allocation each time, all kept alive (what storing a new value costs:
    the kernel maps and zeroes fresh pages first)."""
    src = np.frombuffer(blob, dtype=np.uint8)
    kept: list[np.ndarray] = []
    lat = timed(lambda _: kept.append(src.copy()), n)
    return summarize(lat, len(blob))


def _dd_rate(args: list[str]) -> float:
    """Run dd and return bytes/s parsed from its summary line."""
    res = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", res.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {res.stderr!r}")
    return int(m.group(1)) / float(m.group(2))


def dd_ceiling(directory: Path, size: int, n: int) -> dict[str, dict[str, float]]:
    path = directory / "dd.bench"
    count = max(n, 4)
    write = _dd_rate(["if=/dev/zero", f"of={path}", f"bs={size}", f"count={count}", "conv=fdatasync"])
    read = _dd_rate([f"if={path}", "of=/dev/null", f"bs={size}"])
    path.unlink()

    def row(rate: float) -> dict[str, float]:
        return {"p50_ms": size / rate * 1e3, "p99_ms": float("nan"), "mean_ms": size / rate * 1e3, "mb_s": rate / 1e6}

    return {"put": row(write), "get": row(read)}


def redis_ceiling(url: str, port: int, blob: bytes, n: int) -> tuple[dict[str, dict[str, float]], str]:
    binary = find_benchmark_binary()
    if binary:
        out = subprocess.run(
            [binary, "-p", str(port), "-t", "set,get", "-d", str(len(blob)), "-n", str(n), "-c", "1", "--csv"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows: dict[str, dict[str, float]] = {}
        for line in out.splitlines():
            cells = [c.strip('"') for c in line.split(",")]
            if cells[0] in ("SET", "GET"):
                rps = float(cells[1])
                op = "put" if cells[0] == "SET" else "get"
                rows[op] = {"p50_ms": float(cells[5]) if len(cells) > 5 else 1e3 / rps, "p99_ms": float("nan"),
                            "mean_ms": 1e3 / rps, "mb_s": rps * len(blob) / 1e6}  # fmt: skip
        return rows, Path(binary).name
    client = redis.Redis.from_url(url)
    client.set("bench:ceiling", blob)
    put = timed(lambda _: client.set("bench:ceiling", blob), n)
    get = timed(lambda _: client.get("bench:ceiling"), n)
    client.delete("bench:ceiling")
    client.close()
    return {"put": summarize(put, len(blob)), "get": summarize(get, len(blob))}, "redis-py SET/GET"


# --- our tiers -----------------------------------------------------------------------------------
def one_tier_store(tier: str, work: Path, redis_url: str) -> TieredStore:
    cfg = KVStoreConfig(
        tiers=(tier,),
        memory_bytes=None,
        host_bytes=8 << 30,
        ssd_bytes=None,
        ssd_dir=str(work / "ssd"),
        fs_dir=str(work / "fs"),
        redis_url=redis_url,
        redis_prefix=f"bench:{os.getpid()}",
        redis_ttl_s=600,
        redis_timeout_s=5.0,
    )
    return build_store(cfg, registry=CollectorRegistry())


def bench_tier(
    store: TieredStore, record: str, header: RecordHeader, tensors: dict[str, torch.Tensor], n: int
) -> dict[str, dict[str, float]]:
    backend: Backend = store.tiers[0].backend
    blob = encode_record(header, tensors)
    keys = [f"{record[:1]}{i:031x}" for i in range(n)]
    raw_put = timed(lambda i: backend.put(keys[i], blob), n)
    raw_get = timed(lambda i: backend.get(keys[i]), n)
    for key in keys:
        backend.remove(key)
    skeys = [f"s{record[:1]}{i:030x}" for i in range(n)]
    st_put = timed(lambda i: store.put(skeys[i], header, tensors), n)
    st_get = timed(lambda i: store.get(skeys[i]), n)
    assert store.get(skeys[0]) is not None
    for key in skeys:
        store.remove(key)
    size = len(blob)
    return {
        "backend_put": summarize(raw_put, size),
        "backend_get": summarize(raw_get, size),
        "store_put": summarize(st_put, size),
        "store_get": summarize(st_get, size),
    }


def checksum_speed(blob: bytes) -> dict[str, float]:
    out = {}
    for name, fn in {
        "crc32": lambda b: zlib.crc32(b),
        "blake2b-16": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
    }.items():
        lat = timed(lambda _: fn(blob), 10)
        out[name + "_gb_s"] = len(blob) / statistics.fmean(lat) / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True, help="JSON results file")
    ap.add_argument("--iters", type=int, default=30, help="operations per (tier, record, op)")
    ap.add_argument("--tiers", default="memory,host,ssd,fs,redis")
    ap.add_argument("--dir", default=None, help="directory for the ssd/fs tiers (default: a temp dir)")
    ap.add_argument("--redis-url", default=None, help="use this server instead of starting one")
    args = ap.parse_args(argv)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    torch.set_num_threads(1)

    g = torch.Generator().manual_seed(0)
    records = {
        "block": (RecordHeader("block", "v4-flash", "bfloat16", 0, 128), block_tensors(g)),
        "snapshot": (RecordHeader("snapshot", "v4-flash", "bfloat16", 0, 4096), snapshot_tensors(g)),
    }
    sizes = {name: len(encode_record(h, t)) for name, (h, t) in records.items()}
    work = Path(tempfile.mkdtemp(prefix="kvbench-", dir=args.dir))
    server: LocalRedisServer | None = None
    redis_url = args.redis_url or ""
    if "redis" in tiers and not redis_url:
        server = LocalRedisServer().start()
        redis_url = server.url
    port = int(re.search(r":(\d+)", redis_url.split("//", 1)[-1]).group(1)) if redis_url else 0  # type: ignore[union-attr]

    results: list[dict[str, Any]] = []
    try:
        for tier in tiers:
            store = one_tier_store(tier, work, redis_url)
            for rec_name, (header, tensors) in records.items():
                blob = encode_record(header, tensors)
                ours = bench_tier(store, rec_name, header, tensors, args.iters)
                ceiling_name = "memcpy"
                extra: dict[str, Any] = {}
                if tier in ("memory", "host"):
                    ceiling = memcpy_ceiling(blob, args.iters)
                    extra["memcpy_fresh_alloc"] = fresh_memcpy(blob, args.iters)
                elif tier in ("ssd", "fs"):
                    ceiling, ceiling_name = dd_ceiling(work / tier, len(blob), args.iters), "dd (fdatasync)"
                else:
                    ceiling, ceiling_name = redis_ceiling(redis_url, port, blob, args.iters)
                for op in ("put", "get"):
                    c = ceiling[op]["mb_s"]
                    results.append(
                        {
                            "tier": tier,
                            "record": rec_name,
                            "op": op,
                            "bytes": len(blob),
                            "backend": ours[f"backend_{op}"],
                            "store": ours[f"store_{op}"],
                            "ceiling": ceiling[op],
                            "ceiling_method": ceiling_name,
                            **extra,
                            "backend_ratio": ours[f"backend_{op}"]["mb_s"] / c,
                            "store_ratio": ours[f"store_{op}"]["mb_s"] / c,
                        }
                    )
            store.close()
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    report = {
        "command": " ".join([Path(sys.executable).name, "-m", "bench.kvstore_bench", *(argv or sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "record_bytes": sizes,
        "checksum": checksum_speed(encode_record(*records["snapshot"])),
        "iters": args.iters,
        "results": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(render_table(report))
    return 0


def render_table(report: dict[str, Any]) -> str:
    head = (
        f"{'tier':<7}{'record':<9}{'op':<4}{'MB':>6}  {'backend MB/s':>12}{'p50 ms':>8}{'p99 ms':>8}"
        f"  {'store MB/s':>10}{'p50 ms':>8}{'p99 ms':>8}  {'ceiling MB/s':>12}  {'bk/ceil':>7}{'st/ceil':>8}  ceiling"
    )
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        b, s, c = r["backend"], r["store"], r["ceiling"]
        lines.append(
            f"{r['tier']:<7}{r['record']:<9}{r['op']:<4}{r['bytes'] / 1e6:>6.2f}  {b['mb_s']:>12.0f}{b['p50_ms']:>8.2f}"
            f"{b['p99_ms']:>8.2f}  {s['mb_s']:>10.0f}{s['p50_ms']:>8.2f}{s['p99_ms']:>8.2f}  {c['mb_s']:>12.0f}"
            f"  {r['backend_ratio']:>7.2f}{r['store_ratio']:>8.2f}  {r['ceiling_method']}"
        )
    ck = report["checksum"]
    lines.append(
        f"checksum on a snapshot: crc32 {ck['crc32_gb_s']:.2f} GB/s, blake2b-16 {ck['blake2b-16_gb_s']:.2f} GB/s"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

"""Where the wall time of a general-path prefill goes that no kernel uses: GPU idle gaps.

    python -m bench.gpu_prefill_trace --out DIR [--tokens 8192,2048] [--small]

Builds only our model (the 4-layer V4-Flash-width slice of ``bench.gpu_slice_bench``, random
weights initialised as transformers does, hash tables with k distinct random experts per token)
and, per prefill size:

- ``wall``: best / median of synced prefills; ``enqueue``: time until ``model(...)`` returns
  without a sync (the host's share: when it is close to ``wall`` the host, not the GPU, bounds it);
  ``gpu``: the forward's GPU time when a spin kernel queued first lets the host get far ahead
  (``wall - gpu`` = GPU idle the host causes);
- kernel time and the union of kernel intervals from a profile, and the largest GPU idle gaps, each
  with the Python stack at the launch of the kernel after it (what the host was doing late) and any
  host-syncing runtime call (``cudaStreamSynchronize``, device-to-host ``cudaMemcpy``) in the gap;
  then the kernels by total time;
- host syncs reported by ``torch.cuda.set_sync_debug_mode("warn")`` with their stacks.

Writes ``DIR/prefill_gaps.txt`` (also printed) and ``DIR/trace_<n>.json.gz`` (chrome trace).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import time
import traceback
import warnings

import torch


def build_model(small: bool = False, layers: int = 4):
    from transformers import DeepseekV4Config

    from engine.model.config import ModelConfig
    from engine.model.model import DeepseekV4ForCausalLM as Ours

    kw = {}
    if small:
        kw = {"hidden_size": 128, "head_dim": 64, "num_attention_heads": 4, "q_lora_rank": 64, "o_lora_rank": 32,
              "o_groups": 2, "moe_intermediate_size": 64, "n_routed_experts": 16, "index_n_heads": 4,
              "index_head_dim": 32, "index_topk": 16, "vocab_size": 1000}  # fmt: skip
    hf_cfg = DeepseekV4Config(num_hidden_layers=layers, **kw)
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    std = hf_cfg.initializer_range
    with torch.device("meta"):
        model = Ours(cfg, dtype)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            last = name.rsplit(".", 1)[-1]
            if last == "tid2eid":
                for a in range(0, p.shape[0], 16384):
                    rand = torch.rand(min(16384, p.shape[0] - a), cfg.n_routed_experts, generator=g, device=device)
                    p[a : a + rand.shape[0]] = rand.argsort(dim=-1)[:, : p.shape[1]]
            elif last in ("sinks", "base", "hc_base", "position_bias", "e_score_correction_bias"):
                p.zero_()
            elif last in ("scale", "hc_scale") or (p.dim() == 1 and "norm" in name):
                p.fill_(1.0)
            elif p.is_floating_point():
                p.normal_(0.0, std, generator=g)
    model.eval()
    return model, cfg


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timings(model, ids: list[int], reps: int = 5) -> dict:
    walls, enq = [], []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        model([(model.new_state(), ids)])
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        walls.append(t2 - t0)
        enq.append(t1 - t0)
    return {"wall_best_ms": min(walls) * 1e3, "wall_median_ms": statistics.median(walls) * 1e3,
            "enqueue_median_ms": statistics.median(enq) * 1e3}  # fmt: skip


def sync_points(model, ids: list[int]) -> list[str]:
    """Stacks of the host syncs of one prefill (``set_sync_debug_mode('warn')``)."""
    if not torch.cuda.is_available():
        return []
    found: list[str] = []
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith("Synchronization debug mode"):  # the mode's own notice, not a sync
            return
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(stack[-8:]))
        found.append(f"{str(message)[:80]} | {where}")

    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                model([(model.new_state(), ids)])
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    _sync()
    return found


def gap_report(trace: dict, top: int = 25, min_gap_us: float = 20.0) -> list[str]:
    ev = trace["traceEvents"]
    kernels = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e), key=lambda e: e["ts"])
    if not kernels:
        return ["no kernels in the trace"]
    launches = {}
    runtime = []
    for e in ev:
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver":
            runtime.append(e)
            c = e.get("args", {}).get("correlation")
            if c is not None:
                launches[c] = e
    pyf = [e for e in ev if e.get("cat") == "python_function" and "dur" in e]
    pyf.sort(key=lambda e: e["ts"])
    busy = 0.0
    cur_s, cur_e = kernels[0]["ts"], kernels[0]["ts"] + kernels[0]["dur"]
    gaps = []
    ksum = sum(k["dur"] for k in kernels)
    for k in kernels[1:]:
        s, e = k["ts"], k["ts"] + k["dur"]
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e, k))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = cur_e - kernels[0]["ts"]
    idle = sum(g for g, _, _ in gaps)
    head = (f"kernels {len(kernels)}, kernel time {ksum / 1e3:.2f} ms, busy (union) {busy / 1e3:.2f} ms, "
            f"first kernel start to last end {span / 1e3:.2f} ms, idle gaps {idle / 1e3:.2f} ms "
            f"({sum(1 for g, _, _ in gaps if g >= min_gap_us)} of >= {min_gap_us:.0f} us, "
            f"{sum(g for g, _, _ in gaps if g >= min_gap_us) / 1e3:.2f} ms)")  # fmt: skip
    lines = [head]

    def stack_at(ts: float) -> str:
        frames = [f for f in pyf if f["ts"] <= ts <= f["ts"] + f["dur"]]
        frames.sort(key=lambda f: f["ts"])
        names = [f["name"] for f in frames if "site-packages/torch" not in f["name"] and "<built-in" not in f["name"]]
        return " > ".join(n.split("/")[-1] for n in names[-7:])

    # host-side: what blocked between the previous kernel end and the next launch
    for g, t_end, k in sorted(gaps, key=lambda x: -x[0])[:top]:
        launch = launches.get(k.get("args", {}).get("correlation"))
        lts = launch["ts"] if launch else float("nan")
        blocking = [r for r in runtime if r["ts"] < k["ts"] and r["ts"] + r.get("dur", 0) > t_end - 1
                    and any(w in r["name"] for w in ("Synchronize", "Memcpy", "EventSynchronize", "Malloc", "Free"))]  # fmt: skip
        blk = ", ".join(f"{r['name']} {r.get('dur', 0):.0f}us" for r in blocking[:3])
        lines.append(f"  gap {g:8.1f} us before {k['name'][:60]!r} (launched {lts - t_end:+.0f} us after the gap began)"
                     f"{' | blocking: ' + blk if blk else ''}\n      at: {stack_at(lts) if launch else '?'}")  # fmt: skip
    # gaps summed by the launching stack's innermost two model frames
    by: dict[str, list[float]] = {}
    for g, t_end, k in gaps:
        if g < min_gap_us:
            continue
        launch = launches.get(k.get("args", {}).get("correlation"))
        key = " > ".join(stack_at(launch["ts"]).split(" > ")[-3:]) if launch else "?"
        by.setdefault(key, [0.0, 0])
        by[key][0] += g
        by[key][1] += 1
    lines.append("idle before launches, by launching frames:")
    for key, (t, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:20]:
        lines.append(f"  {t / 1e3:7.2f} ms {c:4d}x  {key}")
    per: dict[str, list[float]] = {}
    for k in kernels:
        e = per.setdefault(k["name"][:80], [0.0, 0])
        e[0] += k["dur"]
        e[1] += 1
    lines.append("kernels by total time:")
    for name, (t, c) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top + 15]:
        lines.append(f"  {t / 1e3:7.3f} ms {c:4d}x  {name}")
    return lines


def gpu_time(model, ids: list[int], reps: int = 5, sleep_ms: float = 40.0) -> dict:
    """The prefill's GPU time with the host far ahead: a ~``sleep_ms`` spin kernel is queued first,
    so every launch of the forward is queued before the GPU reaches it; CUDA events around the
    forward. ``wall - gpu`` is then the GPU idle the host causes (preamble, slow launches)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    _sync()
    cycles = int(10_000_000 * sleep_ms / a.elapsed_time(b))  # spin cycles per ms, measured
    times = []
    for _ in range(reps):
        _sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        a.record()
        model([(model.new_state(), ids)])
        b.record()
        _sync()
        times.append(a.elapsed_time(b))
    return {"gpu_best_ms": min(times), "gpu_median_ms": statistics.median(times)}


def micro_indexer(variants: str) -> list[str]:
    """The 8K prefill's two indexer scoring calls (4,096 queries each, 2,048 rows, 64×128 heads):
    the decode kernel (``indexer_scores``, as runs 7-10) against ``indexer_scores_prefill`` per
    variant 'BQ.BT.W;...' (queries per program, rows per tile, warps), checked against it."""
    from triton.testing import do_bench

    from kernels.indexer import indexer_scores, indexer_scores_prefill

    lines = []
    s, hi, di, t = 4096, 64, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s, hi, di, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(s, hi, generator=g, device="cuda").to(torch.bfloat16)
    rows = torch.randn(t, di, generator=g, device="cuda").to(torch.bfloat16)
    scale = di**-0.5 * hi**-0.5
    for first in (0, 4096):
        row_len = ((torch.arange(first, first + s, device="cuda") + 1) // 4).to(torch.int32)
        zero = torch.zeros_like(row_len)
        want = indexer_scores(q, w, rows, zero, row_len, scale, t_max=t)
        ms = do_bench(lambda rl=row_len, z=zero: indexer_scores(q, w, rows, z, rl, scale, t_max=t), warmup=20, rep=100, return_mode="median")
        lines.append(f"indexer queries {first}-{first + s}: decode kernel {ms * 1e3:7.1f} us")
        print(lines[-1], flush=True)
        fin = torch.isfinite(want)
        for v in [a for a in variants.split(";") if a]:
            bq, bt, nw = (int(a) for a in v.split("."))
            kw = {"block_q": bq, "block_t": bt, "num_warps": nw}
            try:
                got = indexer_scores_prefill(q, w, rows, row_len, scale, t, **kw)
                ok = torch.equal(fin, torch.isfinite(got))
                err = ((got[fin] - want[fin]).norm() / want[fin].norm()).item()
                ms = do_bench(lambda rl=row_len, kw=kw: indexer_scores_prefill(q, w, rows, rl, scale, t, **kw), warmup=20, rep=100, return_mode="median")
                lines.append(f"indexer queries {first}-{first + s}: prefill kernel {v}: {ms * 1e3:7.1f} us  err {err:.1e}  mask {'ok' if ok else 'WRONG'}")
            except Exception as exc:  # noqa: BLE001
                lines.append(f"indexer prefill kernel {v}: failed {exc!r}"[:200])
            print(lines[-1], flush=True)
    return lines


def micro(hc_variants: str, nr_variants: str) -> list[str]:
    """Median times (``triton.testing.do_bench``) of the 8K/2K-size ``hc_pre_block_parts`` per
    ``HcPreTuning`` variant ('BM.BK.W.S.P[.X3];...', X3=0: tf32x3 dots) and of the q ``norm_rope`` pass per rows-per-program
    ('1;4;8;16'), each checked against its reference."""
    from triton.testing import do_bench

    from engine.model.config import RopeParams
    from engine.model.rope import Rotary
    from kernels import fused as fk
    from kernels import prefill as kp

    lines = []
    for n in (8192, 2048):
        streams = torch.randn(n, 4, 4096, device="cuda").to(torch.bfloat16)
        fn = torch.randn(24, 4 * 4096, device="cuda") * 0.01
        want = kp.hc_pre_parts_reference(streams, fn)[:, 0, :25]
        for v in [a for a in hc_variants.split(";") if a]:
            bm, bk, w, st, pps, *x3 = (int(a) for a in v.split("."))
            tuning = kp.HcPreTuning(block_m=bm, block_k=bk, num_warps=w, num_stages=st, programs_per_sm=pps, bf16x3=bool(x3[0]) if x3 else True)
            try:
                got = kp.hc_pre_block_parts(streams, fn, tuning=tuning).sum(1)[:, :25]
                err = ((got - want).norm() / want.norm()).item()
                t = do_bench(lambda s=streams, f=fn, t=tuning: kp.hc_pre_block_parts(s, f, tuning=t), warmup=20, rep=100, return_mode="median")
                lines.append(f"hc_pre_block_parts n={n} {v}: {t * 1e3:7.1f} us  {n * 16384 * 2 / t / 1e9:6.2f} TB/s  err {err:.1e}")
            except Exception as exc:  # noqa: BLE001
                lines.append(f"hc_pre_block_parts n={n} {v}: failed {exc!r}"[:200])
            print(lines[-1], flush=True)
    rot = Rotary(RopeParams(rope_type="default", theta=10000.0), 64, 65536)
    for n in (8192, 2048):
        q = torch.randn(n, 64 * 512, device="cuda").to(torch.bfloat16).view(n, 64, 512)
        cos, sin = rot.cos_sin(torch.arange(n, device="cuda"), torch.bfloat16)
        at = torch.arange(n, device="cuda")
        want = fk.norm_rope_reference(q, None, 2, 1e-6, cos, sin, at)
        for v in [a for a in nr_variants.split(";") if a]:
            nr = fk.NormRopeTuning(rows=int(v), min_rows=1)
            got = fk.norm_rope(q, None, 2, 1e-6, cos, sin, at, tuning=nr)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            t = do_bench(lambda q=q, c=cos, s=sin, a=at, nr=nr: fk.norm_rope(q, None, 2, 1e-6, c, s, a, tuning=nr), warmup=20, rep=100, return_mode="median")
            lines.append(f"norm_rope q n={n} rows/program {v}: {t * 1e3:7.1f} us  {2 * q.numel() * 2 / t / 1e9:6.2f} TB/s  err {err:.1e}")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", default="8192,2048")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--micro-hc", default="", help="hc_pre_block_parts variants 'BM.BK.W.S.P;...' (kernels.prefill.HcPreTuning)")
    ap.add_argument("--micro-nr", default="", help="norm_rope rows-per-program variants '1;8;...'")
    ap.add_argument("--micro-idx", default="", help="indexer_scores_prefill variants 'BQ.BT.W;...'")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.micro_hc or args.micro_nr or args.micro_idx:
        lines = micro(args.micro_hc, args.micro_nr) if args.micro_hc or args.micro_nr else []
        lines += micro_indexer(args.micro_idx) if args.micro_idx else []
        with open(os.path.join(args.out, "micro.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    if not args.tokens:
        return
    t0 = time.perf_counter()
    model, cfg = build_model(args.small)
    print(f"model built in {time.perf_counter() - t0:.1f} s", flush=True)
    report: list[str] = []
    gen = torch.Generator().manual_seed(1)
    for n in [int(a) for a in args.tokens.split(",") if a]:
        ids = torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist()
        model([(model.new_state(), ids)])  # compile / warm
        _sync()
        t = timings(model, ids)
        if torch.cuda.is_available():
            t.update(gpu_time(model, ids))
        report.append(f"== prefill {n}: {json.dumps({k: round(v, 2) for k, v in t.items()})}")
        print(report[-1], flush=True)
        syncs = sync_points(model, ids)
        report.append(f"host syncs in one prefill: {len(syncs)}")
        report += [f"  {s}" for s in syncs[:30]]
        if args.no_trace or not torch.cuda.is_available():
            continue
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            model([(model.new_state(), ids)])
            _sync()
        path = os.path.join(args.out, f"trace_{n}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        report += gap_report(trace)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb", compresslevel=6) as g:
            g.write(f.read())
        os.remove(path)
        print("\n".join(report[-40:]), flush=True)
    with open(os.path.join(args.out, "prefill_gaps.txt"), "w") as f:
        f.write("\n".join(report) + "\n")
    print("\n".join(report), flush=True)


if __name__ == "__main__":
    main()

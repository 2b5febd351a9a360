"""Decode step and prefill time of a 4-layer DeepSeek-V4-Flash-width slice on one GPU: our general
path, our static CUDA-graph decode (``engine.model.static_decode``) and transformers' eager model,
same random bf16 weights (shared tensors), one run.

    python -m bench.gpu_slice_bench --output FILE.json [--batches 1,16,64] [--contexts 1024,32768]
    python -m bench.gpu_slice_bench --verify 1,2,3 --batches 1,4,16 --contexts 1024 --output FILE.json

``--verify``: only issue 25's speculative verify step against the plain step (``verify_rows``),
on our own model at the release's shape with random weights (no transformers); each replay beside
its byte floor, and the verify floor / plain floor ratio a verify cannot beat (``floor_ratio``).

Per context one sequence is prefilled by the general path (in 8K chunks) and its state cloned
into every batch row (the next tokens differ per row, so routing does too; attention reads the
same amount per row as distinct prompts would). The hash-routing tables (zeros in transformers' random init)
get k distinct random experts per token. Rows: ``ours`` = the general path's step
(``model(chunks)``), ``graph`` = ``StaticDecoder.step`` (inputs copied, graph replayed, synced;
``replay`` = back-to-back replays timed with CUDA events), ``transformers`` = its eager model with
a ``DynamicCache`` (1K context only). The floor is the bytes a step must read (weights, touched
experts, lm_head, the attended state) at the copy bandwidth measured in the run; prefill is shown
against the bf16 matmul rate measured in the run. Each decode row also checks the static step's
logits against the general path's on the same state and tokens (max error / max |logit|, and the
share of equal argmax tokens).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from bench.kernel_helpers import replay_ms


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_time(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t0) / iters


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), 4 GiB buffers."""
    a = torch.empty(1 << 31, dtype=torch.int16, device="cuda").random_()
    b = torch.empty_like(a)
    s = _sync_time(lambda: b.copy_(a), 1, 5)
    return 2 * (1 << 32) / s  # the buffers are freed on return


def matmul_rate() -> float:
    """bf16 8192³ matmul rate in FLOP/s on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    s = _sync_time(lambda: a @ b, 3, 10)
    return 2 * 8192**3 / s


def layer_weight_params(cfg) -> tuple[float, float]:
    """(dense params per layer: attention + compressors + indexer + shared expert + gate, params of one routed expert)."""
    h, hd, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    attn = (
        h * cfg.q_lora_rank
        + cfg.q_lora_rank * nh * hd
        + h * hd
        + nh * hd * cfg.o_lora_rank
        + cfg.o_groups * cfg.o_lora_rank * h
    )
    comp = (
        2 * h * 2 * hd
    )  # CSA/HCA kv + gate projections (CSA width 2·hd; HCA hd: upper bound)
    index = (
        2 * h * 2 * cfg.index_head_dim
        + cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim
        + h * cfg.index_n_heads
    )
    expert = 3 * h * cfg.moe_intermediate_size
    return attn + comp + index + expert + cfg.n_routed_experts * h, expert


def touched_experts(cfg, batch: int) -> float:
    """Expected distinct routed experts a batch of ``batch`` tokens touches per layer."""
    e = cfg.n_routed_experts
    return e * (1 - (1 - cfg.num_experts_per_tok / e) ** batch)


def decode_floor_bytes(cfg, batch: int, context: int, width: int = 1, head: bool = True) -> float:
    """Bytes a decode step must read: each layer's weights, the routed experts its
    ``batch · width`` tokens touch (expected distinct count; ``width`` tokens per sequence: a
    verify step's ``1 + k``), lm_head (``head``), and each sequence's attended state once (window +
    compressed rows: CSA top-k rows + indexer rows, HCA all rows; a verify's offsets read their
    sequence's state, so at least once)."""
    dense, expert = layer_weight_params(cfg)
    weights = (
        cfg.num_hidden_layers * (dense + expert * touched_experts(cfg, batch * width))
        + (cfg.vocab_size * cfg.hidden_size if head else 0)
    )
    return 2 * weights + state_read_bytes(cfg, batch, context)


def state_read_bytes(cfg, batch: int, context: int) -> float:
    """Bytes of bf16 state a decode step attends over ``batch`` sequences of ``context`` tokens."""
    state = 0.0
    for lt in cfg.layer_types:
        r = cfg.compress_rate(lt)
        rows = 0 if r == 0 else context // r
        state += cfg.sliding_window * cfg.head_dim
        if lt.startswith("compressed_sparse"):
            state += (
                min(rows, cfg.index_topk) * cfg.head_dim + rows * cfg.index_head_dim
            )
        elif r:
            state += rows * cfg.head_dim
    return 2 * batch * state


def prefill_flops(cfg, n: int) -> float:
    """Matmul FLOPs of an ``n``-token prefill: active weights per token (k of E experts) plus
    attention (window + compressed rows / top-k rows per query; indexer scores)."""
    dense, expert = layer_weight_params(cfg)
    per_token = (
        cfg.num_hidden_layers * (dense + cfg.num_experts_per_tok * expert)
        + cfg.vocab_size * cfg.hidden_size / n
    )
    attn = 0.0
    for lt in cfg.layer_types:
        r = cfg.compress_rate(lt)
        keys = cfg.sliding_window
        if lt.startswith("compressed_sparse"):
            keys += min(n // (2 * r), cfg.index_topk)
            attn += (
                2 * cfg.index_n_heads * cfg.index_head_dim * n / (2 * r)
            )  # indexer scores
        elif r:
            keys += n // (2 * r)
        attn += 4 * cfg.num_attention_heads * cfg.head_dim * keys
    return n * (2 * per_token + attn)


def profile_step(dec, batch: int, out_prefix: str) -> None:
    """Kernels of one eager static step (what the graph replays): count and top CUDA times."""
    from torch.profiler import ProfilerActivity, profile

    from engine.model.static_decode import bucket_for

    b = bucket_for(batch, dec.buckets)
    dec._forward(b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec._forward(b)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(e.device_time for e in events)
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=25, max_name_column_width=70
    )
    head = f"static step b={batch}: {len(events)} kernels, {total / 1e3:.3f} ms of kernel time"
    print(head)
    print(table)
    with open(f"{out_prefix}_b{batch}.txt", "w") as f:
        f.write(head + "\n" + table)
    if dec.use_graphs:
        profile_graph(dec, b, out_prefix)


def profile_graph(dec, key: int | tuple[int, int], out_prefix: str) -> None:
    """Kernels of one graph replay in start order (offset, duration, stream): the replay's span
    against the sum of its kernels shows launch gaps and overlap. ``key``: the decoder's graph key,
    a bucket or a verify's (bucket, width)."""
    from torch.profiler import ProfilerActivity, profile

    graph, _ = dec._graphs[key]
    b = key if isinstance(key, int) else "{}_w{}".format(*key)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    if not ev:
        print("graph profile: no kernels recorded")
        return
    per = len(ev) // 3
    last = ev[-per:]
    t0 = last[0].time_range.start
    span = last[-1].time_range.end - t0
    busy = sum(e.device_time for e in last)
    lines = [f"graph replay b={b}: {per} kernels, span {span / 1e3:.3f} ms, kernel time {busy / 1e3:.3f} ms"]
    lines += [f"{(e.time_range.start - t0) / 1e3:8.4f} {e.device_time:7.1f}us  {e.name[:90]}" for e in last]
    print(lines[0], flush=True)
    with open(f"{out_prefix}_b{b}_graph.txt", "w") as f:
        f.write("\n".join(lines) + "\n")


def decode_tuning(kv: dict[str, str]):
    """A ``DecodeTuning`` from variant options (``decode_variants``' keys; those left out take
    the defaults)."""
    from engine.model import static_decode as sd
    from kernels.moe_gemv import MoEGemvTuning

    dflt = sd.DECODE

    def flag(key: str, default: bool) -> bool:
        return kv[key] == "1" if key in kv else default

    def ints(key: str, default: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return tuple(int(v) for v in kv[key].split(".")) if key in kv else default

    moe = MoEGemvTuning(max_slots=int(kv.get("gemv", dflt.moe_gemv.max_slots)), up=ints("up", dflt.moe_gemv.up), down=ints("down", dflt.moe_gemv.down))
    return sd.DecodeTuning(
        side_stream=flag("side", dflt.side_stream), hc_splits=dflt.hc_splits, attn_rope_out=flag("undo", dflt.attn_rope_out),
        dense_gemv=flag("dgemv", dflt.dense_gemv), gemv_pdl=flag("pdl", dflt.gemv_pdl), moe_gemv=moe,
    )  # fmt: skip


def decode_variants(spec: str, ours, base, context: int, extra: int, batches: list[int], iters: int, rows: list) -> None:
    """Static-step variants 'name:side=0|1,gemv=SLOTS,up=BI.BK.W,down=BH.BK.W,undo=0|1,dgemv=0|1,pdl=0|1,b=1.16;...'
    (``DecodeTuning``: ``side_stream``, ``moe_gemv`` max_slots / up / down, ``attn_rope_out``,
    ``dense_gemv``, ``gemv_pdl``; flags left out take their defaults), each a fresh decoder,
    graph step and replay per batch (``b``: these batches only)."""
    from engine.model import static_decode as sd

    for item in spec.split(";"):
        name, _, opts = item.partition(":")
        kv = dict(o.split("=") for o in opts.split(",") if o)
        tuning = decode_tuning(kv)
        dec = sd.StaticDecoder(ours, max_slots=max(batches), max_tokens=context + extra, tuning=tuning)
        for batch in [int(v) for v in kv["b"].split(".")] if "b" in kv else batches:
            nxt = torch.randint(2, ours.config.vocab_size, (batch,)).tolist()
            t, r = time_static(dec, batch, base, nxt, iters)
            print(f"decode variant {name} b={batch}: graph step {t * 1e3:.3f} ms, replay {r * 1e3:.3f} ms", flush=True)
            rows.append({"what": f"decode variant {name} b={batch}", "variant_graph_ms": t * 1e3, "variant_replay_ms": r * 1e3})
        del dec
        torch.cuda.empty_cache()


def time_static(dec, batch: int, base, nxt, iters: int) -> tuple[float, float]:
    """(host-inclusive ``step`` seconds, bare replay seconds) of ``dec`` at ``batch`` rows."""
    from engine.model.static_decode import bucket_for

    for i in range(batch):
        dec.load(i, base)
    slots = list(range(batch))
    t_step = _sync_time(lambda: dec.step(slots, nxt), 2, iters)
    t_replay = float("nan")
    if dec.use_graphs:
        graph, _ = dec._graphs[bucket_for(batch, dec.buckets)]
        for i in range(batch):
            dec.load(i, base)
        t_replay = replay_ms(graph, iters) / 1e3
    return t_step, t_replay


def random_slice(preset: str, device: str, dtype: torch.dtype):
    """Our model at ``engine.model.random_checkpoint``'s ``preset`` shape cut to 4 layers (sliding,
    sliding, CSA, HCA), drawn on ``device``: matrices N(0, 1/fan_in), norms 1, biases, sinks and
    position biases 0, hash-routing tables k distinct random experts per token."""
    from engine.model.config import ModelConfig
    from engine.model.model import DeepseekV4ForCausalLM as Ours
    from engine.model.random_checkpoint import config_dict

    cfg = ModelConfig.from_dict(config_dict(preset, layers=4))
    with torch.inference_mode(False), torch.device(device):  # normal tensors: the CPU experts' packing reads versions
        model = Ours(cfg, dtype).eval()
    g = torch.Generator(device=device).manual_seed(2)
    with torch.inference_mode(False), torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                for a in range(0, t.shape[0], 16384):
                    rand = torch.rand(min(16384, t.shape[0] - a), cfg.n_routed_experts, generator=g, device=device)
                    t[a : a + rand.shape[0]] = rand.argsort(dim=-1)[:, : t.shape[1]]
            elif not t.is_floating_point():
                continue
            elif t.dim() == 1:
                t.fill_(1.0 if name.endswith(("norm.weight", "scale")) else 0.0)
            elif name.endswith("position_bias"):
                t.zero_()
            else:
                t.normal_(0.0, t.shape[-1] ** -0.5, generator=g)
    return model


def verify_rows(
    ours, ks: list[int], batches: list[int], context: int, iters: int, gen, rows: list, bw: float,
    profile: str = "", full_cfg=None, tuning=None,
) -> None:  # fmt: skip
    """Speculative verify against the plain decode step (issue 25), CUDA graphs: per batch the
    plain ``StaticDecoder.step`` and, per ``k``, ``StaticDecoder.verify`` of ``1 + k`` tokens per
    slot (bare graph replays; host-inclusive ``verify`` + ``accept`` with every draft rejected,
    so the rewind's copies count, and with every draft kept). Also the verify's offset-0 logits
    against the plain step's on the same state and token (max error / max |logit|). ``profile``: a
    path prefix for each verify graph's replay, kernel by kernel (``profile_graph``).

    Each replay beside its byte floor at the copy bandwidth ``bw`` (``decode_floor_bytes``): the
    plain step's (lm_head included: its graph ends in the logits) and each verify's (the experts
    of ``b·(1+k)`` tokens, no lm_head: its graph ends in the hidden states, the runtime's head runs
    after it). ``floor_ratio`` = verify floor / plain floor is the ratio the replays cannot beat
    (random routing: ``1 + k`` tokens touch up to ``(1 + k)x`` the experts), so a ``replay_ratio``
    target below it is out of reach; ``floor_ratio_head`` adds the head's bytes to the verify's
    (a speculative round's read), ``floor_ratio_full`` is ``floor_ratio`` at ``full_cfg``'s depth
    (the release's layer count: the 4-layer slice weighs lm_head far more than the model does)."""
    from engine.model.static_decode import StaticDecoder, bucket_for

    vocab = ours.config.vocab_size
    prompt = torch.randint(2, vocab, (context,), generator=gen).tolist()
    base = ours.new_state()
    for a in range(0, context, 8192):
        ours([(base, prompt[a : a + 8192])])
    _sync()
    room = context + (iters + 4) * (max(ks) + 1) + 8
    plain = StaticDecoder(ours, max_slots=max(batches), max_tokens=room)
    extra = {} if tuning is None else {"tuning": tuning}
    decs = {k: StaticDecoder(ours, max_slots=max(batches), max_tokens=room, verify_width=k + 1, **extra) for k in ks}

    def replay(graph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters / 1e3

    for batch in batches:
        slots = list(range(batch))
        nxt = torch.randint(2, vocab, (batch,), generator=gen).tolist()
        t_step, t_replay = time_static(plain, batch, base, nxt, iters)
        if profile and plain.use_graphs:
            profile_graph(plain, bucket_for(batch, plain.buckets), profile)
        for i in slots:
            plain.load(i, base)
        want = plain.step(slots, nxt).float().clone()
        cfg = ours.config
        plain_floor = decode_floor_bytes(cfg, batch, context) / bw
        row = {
            "what": f"verify b={batch} ctx={context}", "batch": batch, "context": context, "plain_step_ms": t_step * 1e3,
            "plain_replay_ms": t_replay * 1e3, "plain_floor_ms": plain_floor * 1e3, "plain_replay_over_floor": t_replay / plain_floor,
            "plain_experts_touched": touched_experts(cfg, batch),
        }  # fmt: skip
        for k, dec in decs.items():
            for i in slots:
                dec.load(i, base)
            drafts = [[t, *torch.randint(2, vocab, (k,), generator=gen).tolist()] for t in nxt]
            hidden, _ = dec.verify(slots, drafts)
            got = ours.head.logits(hidden[:, 0].contiguous()).float()
            dec.accept([1] * batch)
            err = ((got - want).abs().max() / want.abs().max()).item()

            def once(kept: int, dec=dec, drafts=drafts) -> None:
                dec.verify(slots, drafts)
                dec.accept([kept] * batch)

            for i in slots:
                dec.load(i, base)
            t_rej = _sync_time(lambda: once(1), 2, iters)
            for i in slots:
                dec.load(i, base)
            t_acc = _sync_time(lambda: once(k + 1), 2, iters)
            key = bucket_for(batch, dec.buckets), k + 1
            r = replay(dec._graphs[key][0]) if dec.use_graphs else float("nan")
            if profile and dec.use_graphs:
                profile_graph(dec, key, profile)
            floor = decode_floor_bytes(cfg, batch, context, k + 1, head=False) / bw
            head = 2 * cfg.vocab_size * cfg.hidden_size / bw
            full = None
            if full_cfg is not None:
                full = decode_floor_bytes(full_cfg, batch, context, k + 1, head=False) / decode_floor_bytes(full_cfg, batch, context)
            row[f"k{k}"] = {
                "verify_replay_ms": r * 1e3, "verify_reject_all_ms": t_rej * 1e3, "verify_accept_all_ms": t_acc * 1e3,
                "replay_ratio": r / t_replay, "reject_all_ratio": t_rej / t_step, "offset0_rel_err": err,
                "floor_ms": floor * 1e3, "replay_over_floor": r / floor, "experts_touched": touched_experts(cfg, batch * (k + 1)),
                "floor_ratio": floor / plain_floor, "floor_ratio_head": (floor + head) / plain_floor, "floor_ratio_full": full,
            }  # fmt: skip
            print(f"b={batch} k={k}: plain replay {t_replay * 1e3:.3f} ms / step {t_step * 1e3:.3f} ms; verify replay {r * 1e3:.3f} ms "
                  f"({r / t_replay:.2f}x), reject-all step {t_rej * 1e3:.3f} ms ({t_rej / t_step:.2f}x), accept-all {t_acc * 1e3:.3f} ms, err {err:.1e}; "
                  f"floors plain {plain_floor * 1e3:.3f} / verify {floor * 1e3:.3f} ms ({floor / plain_floor:.2f}x)", flush=True)  # fmt: skip
        rows.append(row)
    print("verify(1+k) / plain step, graph replays (target <= 1.3x), [floor ratio: verify floor / plain floor], "
          "replay / its floor for plain and each verify:", flush=True)  # fmt: skip
    for row in rows:
        if "plain_replay_ms" in row:
            cells = "  ".join(
                f"k={k} {row[f'k{k}']['replay_ratio']:.2f}x [{row[f'k{k}']['floor_ratio']:.2f}x] {row[f'k{k}']['replay_over_floor']:.2f}/floor" for k in ks
            )  # fmt: skip
            print(f"  b={row['batch']:3d}  plain {row['plain_replay_over_floor']:.2f}/floor  {cells}", flush=True)
    del plain, decs
    torch.cuda.empty_cache()


_ANNOTATED = False


def annotate_modules() -> None:
    """Wrap the model's parts in ``record_function`` ranges (``ds:...``), so a profile can be read
    by module: mHC, attention's projections / compressors / indexer / attention core, MoE parts."""
    global _ANNOTATED
    if _ANNOTATED:
        return
    _ANNOTATED = True
    import functools

    from torch.profiler import record_function

    from engine.model import attention as attn_mod
    from engine.model import layers as layers_mod
    from engine.model import model as model_mod
    from engine.model import moe as moe_mod

    def wrap(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def inner(*a, **k):
            with record_function("ds:" + label):
                return fn(*a, **k)

        setattr(owner, name, inner)

    wrap(layers_mod.HyperConnection, "forward", "hc_pre")
    wrap(model_mod, "hc_merge", "hc_merge")
    wrap(attn_mod.Attention, "forward", "attn")
    wrap(attn_mod.Attention, "_project", "attn.project")
    wrap(attn_mod.Attention, "_window_keys", "attn.window")
    wrap(attn_mod.Compressor, "update", "attn.compress")
    wrap(attn_mod.Indexer, "topk_rows", "attn.indexer")
    wrap(attn_mod, "attend_with_sinks", "attn.core")
    wrap(moe_mod.MoE, "forward", "moe")
    wrap(moe_mod.Router, "forward", "moe.route")
    wrap(moe_mod.Experts, "forward", "moe.experts")
    wrap(layers_mod.SharedMLP, "forward", "moe.shared")
    wrap(layers_mod.HyperHead, "forward", "head.hc")
    from kernels import fused as fk
    from kernels import prefill as kp

    wrap(kp, "hc_pre_norm", "hc_pre")  # the Triton path (CUDA bf16) calls these instead
    wrap(kp, "prefill_attention", "attn.core")
    wrap(kp, "prefill_topk", "attn.indexer")
    wrap(fk, "norm_rope", "norm_rope")


def idle_gaps(events: list, top: int = 12) -> list[str]:
    """Lines on where the GPU waits inside a profiled run, from the first kernel's start to the
    last one's end: the time between one kernel's end and the next one's start in total, and the
    ``top`` largest gaps with the kernels on either side (host work or a sync the stream waited for)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    if not spans:
        return []
    gaps, end, prev = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, start - spans[0][0], prev, name))
        if stop > end:
            end, prev = stop, name
    lines = [f"GPU idle between kernels: {sum(g[0] for g in gaps) / 1e3:.2f} ms in {len(gaps)} gaps over {(end - spans[0][0]) / 1e3:.2f} ms; the largest:"]
    for gap, at, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap / 1e3:7.3f} ms at {at / 1e3:7.2f} ms  after {before[:50]}  before {after[:50]}")
    return lines


def profile_prefill(model, n: int, vocab: int, out_prefix: str) -> None:
    """CUDA kernels of one ``n``-token general-path prefill, by total time (where prefill goes),
    plus the time per annotated module (``annotate_modules``), the GPU's idle gaps (``idle_gaps``)
    and the device time per operator and input shapes."""
    from torch.profiler import ProfilerActivity, profile

    annotate_modules()
    ids = torch.randint(2, vocab, (n,)).tolist()
    model([(model.new_state(), ids)])
    _sync()
    t0 = time.perf_counter()
    model([(model.new_state(), ids)])
    _sync()
    wall = time.perf_counter() - t0
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, record_shapes=True) as prof:
        model([(model.new_state(), ids)])
        _sync()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(e.device_time for e in events)
    kern: dict[str, list[float]] = {}
    for e in events:
        k = kern.setdefault(e.name[:90], [0.0, 0])
        k[0] += e.device_time
        k[1] += 1
    lines = [f"prefill {n}: wall {wall * 1e3:.2f} ms (unprofiled), {len(events)} kernels, {total / 1e3:.2f} ms of kernel time", "", "by module (device time of the kernels launched inside; nested ranges overlap):"]
    mods = [e for e in prof.key_averages() if e.key.startswith("ds:")]
    mods.sort(key=lambda e: -e.device_time_total)
    for e in mods:
        lines.append(f"  {e.key:34s} {e.count:6d} calls {e.device_time_total / 1e3:9.2f} ms  cpu {e.cpu_time_total / 1e3:9.2f} ms")
    lines += ["", "kernels by total device time:"]
    for name, (t, c) in sorted(kern.items(), key=lambda kv: -kv[1][0])[:40]:
        lines.append(f"  {t / 1e3:9.2f} ms {c:6d}x  {name}")
    sort = "cuda_time_total" if events else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
    lines += ["", *idle_gaps(events)]
    lines += ["", "operators by input shapes (device time):"]
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
    for e in sorted(ops, key=lambda e: -e.device_time_total)[:30]:
        lines.append(f"  {e.device_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key} {str(e.input_shapes)[:160]}")
    text = "\n".join(lines)
    print(text, flush=True)
    with open(f"{out_prefix}_prefill{n}.txt", "w") as f:
        f.write(text + "\n\n" + table)


def fp8_rows(args, ours, cfg, bases, batches, vocab, gen, bw, rows) -> None:
    """Static graph step with the routed experts in FP8 (``engine.model.fp8``), first context."""
    from engine.model.fp8 import attach_fp8_experts
    from engine.model.static_decode import StaticDecoder, bucket_for

    context = int(args.contexts.split(",")[0])
    base, extra = bases[context]
    nbytes = attach_fp8_experts(ours)
    print(f"fp8 experts: {nbytes / 2**30:.2f} GiB", flush=True)
    dec = StaticDecoder(ours, max_slots=max(batches), max_tokens=context + extra)
    for batch in batches:
        nxt = torch.randint(2, vocab, (batch,), generator=gen).tolist()
        states = [base.clone() for _ in range(batch)]
        want = ours([(st, [t]) for st, t in zip(states, nxt)])  # bf16 experts
        del states
        for i in range(batch):
            dec.load(i, base)
        got = dec.step(list(range(batch)), nxt).float()
        rel_err = ((got - want).abs().max() / want.abs().max()).item()
        argmax_agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        t_step, t_replay = time_static(dec, batch, base, nxt, args.graph_iters)
        # the fp8-expert floor: the touched experts' bytes halve
        dense, expert = layer_weight_params(cfg)
        e = cfg.n_routed_experts
        touched = e * (1 - (1 - cfg.num_experts_per_tok / e) ** batch)
        floor = (decode_floor_bytes(cfg, batch, context) - cfg.num_hidden_layers * expert * touched) / bw
        row = {
            "what": f"decode fp8-experts b={batch} ctx={context}", "ours_ms": float("nan"), "graph_ms": t_step * 1e3,
            "replay_ms": t_replay * 1e3, "transformers_ms": None, "floor_ms": floor * 1e3,
            "graph_rel_err": rel_err, "graph_argmax_agree": argmax_agree,
            "bf16_floor_ms": decode_floor_bytes(cfg, batch, context) / bw * 1e3,
        }  # fmt: skip
        print(row, flush=True)
        rows.append(row)
    for layer in ours.model.layers:
        del layer.mlp.experts.fp8
    del dec
    torch.cuda.empty_cache()


def fp8_matmul_rate() -> float:
    """FP8 e4m3 8192³ matmul rate in FLOP/s (``torch._scaled_mm``, row-wise fp32 scales, bf16 out):
    the FP8 rate a block-scaled prefill is set against."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(8192, 1, device="cuda"), torch.ones(1, 8192, device="cuda")
    s = _sync_time(lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16), 3, 10)
    return 2 * 8192**3 / s


def fp4_prefill_rows(model, tokens: int, mm: float, rows: list) -> None:
    """The first layer's FP4 routed experts at a ``tokens``-token prefill's sizes (every token's
    top-k, random and balanced): ``fp4_grouped_linear`` with the in-register kernel beside the bf16
    scratch + ``torch._grouped_mm`` path and ``kernels.moe_fp4_fp8``'s FP8 kernel (the default,
    ``Fp4PrefillTuning``), each projection, against the bf16 matmul rate."""
    from kernels.moe_fp4 import Fp4PrefillTuning, fp4_grouped_linear

    gate_up_q, gate_up_s, down_q, down_s = next(layer.mlp.experts.fp4 for layer in model.model.layers if layer.mlp.experts.fp4 is not None)
    e, k = gate_up_q.shape[0], model.config.num_experts_per_tok
    m = tokens * k
    counts = torch.full((e,), m // e, dtype=torch.int32)
    counts[: m % e] += 1
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    for name, (wq, ws) in (("gate_up", (gate_up_q, gate_up_s)), ("down", (down_q, down_s))):
        xs = torch.randn(m, 2 * wq.shape[2], device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * m * wq.shape[1] * xs.shape[1]
        row = {"what": f"fp4 experts {name} at prefill {tokens}", "rows_per_expert": m / e}
        for label, tuning in (
            ("kernel", Fp4PrefillTuning(min_rows_per_expert=10**9, fp8=False)), ("scratch", Fp4PrefillTuning(min_rows_per_expert=0, fp8=False)),
            ("fp8", Fp4PrefillTuning(fp8_min_rows_per_expert=0)),
        ):  # fmt: skip
            t = _sync_time(lambda tuning=tuning: fp4_grouped_linear(xs, wq, ws, offs, prefill=tuning), 2, 5)
            row[f"{label}_ms"], row[f"{label}_of_bf16_rate"] = t * 1e3, flops / t / mm
        print(row, flush=True)
        rows.append(row)


def native_weight_bytes(model) -> tuple[float, float]:
    """(bytes a decode step reads of every layer's non-routed weights plus the lm_head, as stored:
    FP8 linears + their scales, bf16 rest; bytes of one routed expert, FP4 + scales) of a model
    loaded with native weights. Embeddings and hash tables are read a row per token (left out)."""
    dense = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    expert = 0.0
    for layer in model.model.layers:
        ex = layer.mlp.experts
        skip = {id(t) for t in (ex.gate_up_proj, ex.down_proj, getattr(layer.mlp.gate, "tid2eid", None)) if t is not None}
        dense += sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()) if id(t) not in skip)
        expert += sum(t.numel() * t.element_size() for t in ex.fp4) / ex.fp4[0].shape[0] / len(model.model.layers)
    return dense, expert


def native_rows(args, bw: float, mm: float, rows: list) -> None:
    """``--native``: the 4-layer V4-Flash slice in its released formats — a ``make-random-checkpoint
    --preset v4-flash`` checkpoint (FP8 linears, FP4 experts) loaded with them kept
    (``load_model(fp8=..., fp4_experts=True)``) — static graph step per batch beside its floor
    (the FP8/FP4/bf16 bytes of the weights it reads, touched experts at their FP4 bytes, plus the
    attended bf16 state, at the copy rate of this run), its logits against the native general
    path's, and prefill against the FP8 matmul rate of this run."""
    import tempfile

    from engine.model.loader import load_model
    from engine.model.random_checkpoint import make_random_checkpoint
    from engine.model.static_decode import StaticDecoder, bucket_for
    from kernels.fp8_gemm import Fp8GemmConfig

    fp8_mm = fp8_matmul_rate()
    print(f"fp8 matmul (_scaled_mm row-wise) {fp8_mm / 1e12:.0f} TFLOP/s", flush=True)
    with tempfile.TemporaryDirectory(dir=args.native_dir or None) as tmp:
        t0 = time.perf_counter()
        ckpt = make_random_checkpoint(f"{tmp}/ckpt", "v4-flash", layers=args.native_layers, device="cuda", mtp=False)
        t1 = time.perf_counter()
        model = load_model(ckpt, dtype="bfloat16", device="cuda", progress=False, fp8=Fp8GemmConfig(), fp4_experts=True)
        print(f"native checkpoint: written {t1 - t0:.1f} s, loaded {time.perf_counter() - t1:.1f} s", flush=True)
    cfg = model.config
    dense, expert = native_weight_bytes(model)
    gen = torch.Generator().manual_seed(5)
    batches = [int(b) for b in args.batches.split(",")]
    context = int(args.contexts.split(",")[0])
    prompt = torch.randint(2, cfg.vocab_size, (context,), generator=gen).tolist()
    base = model.new_state()
    for a in range(0, context, 8192):
        model([(base, prompt[a : a + 8192])])
    dec = StaticDecoder(model, max_slots=max(batches), max_tokens=context + args.graph_iters + 16)
    for batch in batches:
        nxt = torch.randint(2, cfg.vocab_size, (batch,), generator=gen).tolist()
        states = [base.clone() for _ in range(batch)]
        want = model([(st, [t]) for st, t in zip(states, nxt)]).float()
        del states
        for i in range(batch):
            dec.load(i, base)
        got = dec.step(list(range(batch)), nxt).float()
        rel_err = ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
        argmax_agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        t_step, t_replay = time_static(dec, batch, base, nxt, args.graph_iters)
        if args.profile:
            profile_graph(dec, bucket_for(batch, dec.buckets), args.profile + "_native")
        floor_bytes = dense + cfg.num_hidden_layers * expert * touched_experts(cfg, batch) + state_read_bytes(cfg, batch, context)
        row = {
            "what": f"decode native b={batch} ctx={context}", "graph_ms": t_step * 1e3, "replay_ms": t_replay * 1e3,
            "floor_ms": floor_bytes / bw * 1e3, "floor_bytes": floor_bytes, "replay_over_floor": t_replay * bw / floor_bytes,
            "rel_err_vs_native_general": rel_err, "argmax_agree": argmax_agree,
        }  # fmt: skip
        print(row, flush=True)
        rows.append(row)
    del dec
    torch.cuda.empty_cache()
    for n in [int(x) for x in args.prefill.split(",") if x]:
        fp4_prefill_rows(model, n, mm, rows)
        ids = torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist()
        each = sorted(_sync_time(lambda ids=ids: model([(model.new_state(), ids)]), 1 if i == 0 else 0, 1) for i in range(3))
        flops = prefill_flops(cfg, n)
        row = {
            "what": f"prefill native {n}", "prefill_ms": each[1] * 1e3, "tflops": flops / each[1] / 1e12,
            "fp8_matmul_tflops": fp8_mm / 1e12, "share_of_fp8_rate": flops / each[1] / fp8_mm, "share_of_bf16_rate": flops / each[1] / mm,
        }  # fmt: skip
        print(row, flush=True)
        rows.append(row)
        if args.native_bf16_experts:
            native_prefill_bf16(model, ids, flops, fp8_mm, rows)
        if args.profile:
            profile_prefill(model, n, cfg.vocab_size, args.profile + "_native")
    rows.append({"what": "native weights", "dense_and_head_bytes": dense, "expert_bytes": expert, "fp8_matmul_tflops": fp8_mm / 1e12})


def native_prefill_bf16(model, ids: list[int], flops: float, fp8_mm: float, rows: list) -> None:
    """The native prefill of ``ids`` again with the FP4 experts' products in bf16 (the bf16
    scratch or kernels, ``Fp4PrefillTuning(fp8=False)``; median of 3 after a warm-up), its logits
    against the default (FP8) path's; the model's tuning is restored after."""
    from dataclasses import replace

    from kernels.moe_fp4 import Fp4PrefillTuning

    saved = model.tuning
    want = model([(model.new_state(), ids)]).float()
    model.set_tuning(replace(saved, moe=replace(saved.moe, fp4_prefill=Fp4PrefillTuning(fp8=False))))
    try:
        got = model([(model.new_state(), ids)]).float()
        each = sorted(_sync_time(lambda: model([(model.new_state(), ids)]), 1 if i == 0 else 0, 1) for i in range(3))
        row = {
            "what": f"prefill native {len(ids)} bf16 experts", "prefill_ms": each[1] * 1e3, "tflops": flops / each[1] / 1e12,
            "share_of_fp8_rate": flops / each[1] / fp8_mm, "rel_err_vs_default": ((got - want).norm() / want.norm()).item(),
            "argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
        }  # fmt: skip
        print(row, flush=True)
        rows.append(row)
    finally:
        model.set_tuning(saved)


def prefill_variants(spec: str, ours, vocab: int, rows: list) -> None:
    """2K and 8K prefill (median of 5 single runs after one warm-up; to run 9: the mean of 3) per variant of the
    model's ``ModelTuning`` (folded norm/RoPE, attention, mHC input, norm_rope and MoE grouped GEMM
    launches); the model's tuning is restored after."""
    from dataclasses import replace

    from kernels import prefill as kp

    saved = ours.tuning

    def cfg(v: str):
        return None if v == "torch" else tuple(int(a) for a in v.split("."))

    for item in spec.split(";"):
        name, _, opts = item.partition(":")
        prefill, grouped = saved.prefill, saved.moe.grouped
        for kv in opts.split(","):
            if not kv:
                continue
            key, val = kv.split("=")
            if key == "hc":  # HcPreTuning: block_m.block_k.warps.stages.programs_per_sm
                bm, bk, w, st, pps = (int(a) for a in val.split("."))
                hc = replace(prefill.hc_pre, block_m=bm, block_k=bk, num_warps=w, num_stages=st, programs_per_sm=pps)
                prefill = replace(prefill, hc_pre=hc)
            elif key == "hc3":  # HcPreTuning.bf16x3: 0 = tf32x3 dots on widened streams
                prefill = replace(prefill, hc_pre=replace(prefill.hc_pre, bf16x3=bool(int(val))))
            elif key == "nr":  # NormRopeTuning.rows (1 = run 8's one row per program)
                prefill = replace(prefill, norm_rope=replace(prefill.norm_rope, rows=int(val)))
            elif key == "fold":
                prefill = replace(prefill, fold_norm_rope=int(val))
            elif key == "up":
                grouped = replace(grouped, up=cfg(val))
            elif key == "down":
                grouped = replace(grouped, down=cfg(val))
            elif key == "attn":
                bh, bn, nw, ns = (int(a) for a in val.split("."))
                prefill = replace(prefill, attention=kp.AttentionTuning(bh, bn, nw, ns))
            elif key == "rows":
                grouped = replace(grouped, max_rows=int(val))
        ours.set_tuning(replace(saved, prefill=prefill, moe=replace(saved.moe, grouped=grouped)))
        for n in (8192, 2048):
            ids = torch.randint(2, vocab, (n,)).tolist()
            try:
                # as the prefill rows: one warm-up, then 5 single runs; median (and best) of them
                each = sorted(_sync_time(lambda ids=ids: ours([(ours.new_state(), ids)]), 1 if i == 0 else 0, 1) for i in range(5))
                t = each[2]
                print(f"variant {name} ({opts}): prefill {n} {t * 1e3:.2f} ms (median of 5, best {each[0] * 1e3:.2f})", flush=True)
                rows.append({"what": f"variant {name} {opts}", "n": n, "prefill_ms": t * 1e3, "prefill_best_ms": each[0] * 1e3})
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    ours.set_tuning(saved)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="gpu_slice.json")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--hf-contexts", default="1024")
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--graph-iters", type=int, default=20)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--profile",
        default="",
        help="prefix of kernel-profile files of the static step (first context)",
    )
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8-expert static step rows")
    ap.add_argument("--no-unmerged", action="store_true", help="skip the one-GEMM-per-projection static step rows")
    ap.add_argument("--profile-prefill", default="", help="profile one prefill of each of these many tokens (comma list)")
    ap.add_argument("--attn-tune", default="", help="prefill attention variants 'block_h,block_n,warps,stages;...'")
    ap.add_argument(
        "--prefill-variants",
        default="",
        help="prefill 8K/2K per variant 'name:fold=0|1|2|3,up=BM.BN.BK.W.S|torch,down=...,rows=MAX_ROWS,attn=BH.BN.W.S,hc=BM.BK.W.S.P,hc3=0|1,nr=ROWS;...' (PrefillTuning fold_norm_rope / attention / hc_pre / norm_rope rows, GroupedMoETuning)",
    )
    ap.add_argument("--native", action="store_true",
                    help="only the native FP8/FP4 rows: a v4-flash random checkpoint (--native-layers) loaded with its formats kept; "
                    "static step per --batches (first context) beside its floor, --prefill against the FP8 matmul rate")  # fmt: skip
    ap.add_argument("--native-layers", type=int, default=4)
    ap.add_argument("--native-bf16-experts", action="store_true", help="also time the native prefill with the FP4 experts' products in bf16")
    ap.add_argument("--native-dir", default="", help="where the native checkpoint is written (a temporary directory under it)")
    ap.add_argument("--decode-variants", default="", help="static-step variants 'name:side=0|1,gemv=SLOTS,undo=0|1,dgemv=0|1,pdl=0|1,b=1.16;...' (first context)")
    ap.add_argument("--verify-tuning", default="", help="the verify decoders' DecodeTuning, --decode-variants' options (e.g. 'gemv=32')")
    ap.add_argument("--verify", default="", help="only the speculative verify rows for these k (comma list; first context, --batches)")
    ap.add_argument(
        "--small",
        action="store_true",
        help="a narrow config (a smoke test of this script, CPU too)",
    )
    args = ap.parse_args()
    if args.verify:  # no transformers needed: our model at the release's shape, random weights
        torch.manual_seed(0)
        cuda = torch.cuda.is_available()
        bw, mm = (copy_bandwidth(), matmul_rate()) if cuda else (1e10, 1e11)
        from engine.model.config import ModelConfig
        from engine.model.random_checkpoint import config_dict

        preset = "v4-flash-narrow" if args.small else "v4-flash"
        ours = random_slice(preset, "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
        rows: list = []
        ks, batches = [int(k) for k in args.verify.split(",")], [int(b) for b in args.batches.split(",")]
        verify_rows(
            ours, ks, batches, int(args.contexts.split(",")[0]), args.graph_iters, torch.Generator().manual_seed(1), rows, bw,
            args.profile, ModelConfig.from_dict(config_dict(preset)),
            decode_tuning(dict(o.split("=") for o in args.verify_tuning.split(",") if o)) if args.verify_tuning else None,
        )  # fmt: skip
        write_json(args.output, rows, bw, mm)
        return
    if args.native:
        bw, mm = copy_bandwidth(), matmul_rate()
        print(f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
        rows: list = []
        native_rows(args, bw, mm, rows)
        with open(args.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "matmul_flops": mm, "rows": rows}, f, indent=2)
        return
    from transformers import DeepseekV4Config, DynamicCache
    from transformers import DeepseekV4ForCausalLM as HF

    from engine.model.config import ModelConfig
    from engine.model.model import DeepseekV4ForCausalLM as Ours
    from engine.model.static_decode import StaticDecoder, bucket_for

    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    bw = copy_bandwidth() if cuda else 1e10
    mm = matmul_rate() if cuda else 1e11
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    small = {
        "hidden_size": 128,
        "head_dim": 64,
        "num_attention_heads": 4,
        "q_lora_rank": 64,
        "o_lora_rank": 32,
        "o_groups": 2,
        "moe_intermediate_size": 64,
        "n_routed_experts": 16,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 16,
        "vocab_size": 1000,
    }
    hf_cfg = DeepseekV4Config(num_hidden_layers=4, **(small if args.small else {}))
    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.inference_mode(
        False
    ):  # parameters as normal tensors (CPU lm_head packs by version)
        with torch.device(device):
            hf = HF._from_config(hf_cfg, dtype=dtype).eval()
        cfg = ModelConfig.from_dict(hf_cfg.to_dict())
        with torch.device("meta"):
            ours = Ours(cfg, dtype)
        # transformers initialises the hash-routing tables to zeros (every token → expert 0, six
        # times): give each token k distinct random experts, as a trained table does
        g = torch.Generator(device=device).manual_seed(2)
        for layer in hf.model.layers:
            table = getattr(layer.mlp.gate, "tid2eid", None)
            if table is not None:
                for a in range(0, table.shape[0], 16384):
                    rand = torch.rand(
                        min(16384, table.shape[0] - a),
                        cfg.n_routed_experts,
                        generator=g,
                        device=device,
                    )
                    table[a : a + rand.shape[0]] = rand.argsort(dim=-1)[
                        :, : table.shape[1]
                    ]
        ours.load_state_dict(
            hf.state_dict(), strict=True, assign=True
        )  # same tensors, no copy
        ours.eval()
    n_params = sum(p.numel() for p in hf.parameters())
    batches = [int(b) for b in args.batches.split(",")]
    vocab = cfg.vocab_size
    rows = []
    bases = {}
    gen = torch.Generator().manual_seed(1)
    for context in [int(c) for c in args.contexts.split(",") if c]:
        prompt = torch.randint(2, vocab, (context,), generator=gen).tolist()
        base = ours.new_state()
        t0 = time.perf_counter()
        for a in range(0, context, 8192):
            ours([(base, prompt[a : a + 8192])])
        _sync()
        print(
            f"prefill {context} (general path, 8K chunks): {time.perf_counter() - t0:.2f} s",
            flush=True,
        )
        extra = (
            2 + 5 + 2 + args.graph_iters + 8
        )  # decode tokens a slot takes in this benchmark
        dec = StaticDecoder(ours, max_slots=max(batches), max_tokens=context + extra)
        print(
            f"static pool {dec.nbytes() / 2**30:.2f} GiB for {max(batches)} slots × {context + extra} tokens",
            flush=True,
        )
        first = context == int(args.contexts.split(",")[0])
        dec_um = None
        if first and not args.no_unmerged:  # run 5's fused step: one GEMM per projection of x
            dec_um = StaticDecoder(ours, max_slots=max(batches), max_tokens=context + extra, merge_proj=False)
        bases[context] = (base, extra)
        for batch in batches:
            floor = decode_floor_bytes(cfg, batch, context) / bw
            nxt = torch.randint(2, vocab, (batch,), generator=gen).tolist()
            # general path: the same first step for both paths, then its timing
            states = [base.clone() for _ in range(batch)]
            for i in range(batch):
                dec.load(i, base)
            want = ours([(st, [t]) for st, t in zip(states, nxt)])
            try:
                got = dec.step(list(range(batch)), nxt).float()
            except Exception:  # noqa: BLE001 - report the failure; retry without graphs
                traceback.print_exc()
                dec.use_graphs = False
                dec._graphs.clear()
                for i in range(batch):
                    dec.load(i, base)
                got = dec.step(list(range(batch)), nxt).float()
            if args.profile and context == int(args.contexts.split(",")[0]):
                profile_step(dec, batch, args.profile)
            rel_err = ((got - want).abs().max() / want.abs().max()).item()
            argmax_agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            t_ours = _sync_time(
                lambda states=states, nxt=nxt: ours(
                    [(st, [t]) for st, t in zip(states, nxt)]
                )
            )
            del states
            # static graph path: the host-inclusive step, then bare replays
            slots = list(range(batch))
            t_graph = _sync_time(
                lambda dec=dec, slots=slots, nxt=nxt: dec.step(slots, nxt),
                2,
                args.graph_iters,
            )
            t_replay = float("nan")
            if dec.use_graphs:
                graph, _ = dec._graphs[bucket_for(batch, dec.buckets)]
                for i in range(batch):
                    dec.load(i, base)
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                graph.replay()
                start.record()
                for _ in range(args.graph_iters):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                t_replay = start.elapsed_time(end) / args.graph_iters / 1e3
            t_um = r_um = float("nan")
            if dec_um is not None:
                t_um, r_um = time_static(dec_um, batch, base, nxt, args.graph_iters)
            t_hf = None
            if not args.skip_hf and str(context) in args.hf_contexts.split(","):
                try:
                    cache = DynamicCache(config=hf.config)
                    with torch.no_grad():
                        hf(
                            torch.tensor([prompt] * batch, device=device),
                            past_key_values=cache,
                            use_cache=True,
                        )
                    tok = torch.tensor(nxt, device=device)[:, None]

                    def hf_step(tok=tok, cache=cache):
                        with torch.no_grad():
                            hf(tok, past_key_values=cache, use_cache=True)

                    t_hf = _sync_time(hf_step)
                    del cache
                except torch.OutOfMemoryError as exc:
                    print(f"transformers OOM at batch {batch}: {exc}".splitlines()[0])
                if cuda:
                    torch.cuda.empty_cache()
            row = {
                "what": f"decode b={batch} ctx={context}", "ours_ms": t_ours * 1e3, "graph_ms": t_graph * 1e3,
                "replay_ms": t_replay * 1e3, "transformers_ms": None if t_hf is None else t_hf * 1e3,
                "floor_ms": floor * 1e3, "graph_rel_err": rel_err, "graph_argmax_agree": argmax_agree,
                "triton": dec.triton,
                "unmerged_graph_ms": t_um * 1e3, "unmerged_replay_ms": r_um * 1e3, "merge_proj": dec.merge_proj,
            }  # fmt: skip
            print(row, flush=True)
            rows.append(row)
        del dec, dec_um
        if first and args.decode_variants:
            decode_variants(args.decode_variants, ours, base, context, extra, batches, args.graph_iters, rows)
        if cuda:
            torch.cuda.empty_cache()
    if cuda and not args.no_fp8:  # FP8 routed experts (engine.model.fp8) in the static step
        try:
            fp8_rows(args, ours, cfg, bases, batches, vocab, gen, bw, rows)
        except Exception:  # noqa: BLE001 - keep the other rows
            traceback.print_exc()
    if args.profile_prefill:
        for n in [int(x) for x in str(args.profile_prefill).split(",") if x]:
            try:
                profile_prefill(ours, n, vocab, args.profile or "prof")
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    if args.attn_tune:  # prefill attention kernel variants: 8K prefill per variant
        from dataclasses import replace

        from kernels import prefill as kp

        ids = torch.randint(2, vocab, (8192,)).tolist()
        saved = ours.tuning
        for spec in args.attn_tune.split(";"):
            bh, bn, nw, ns = (int(v) for v in spec.split(","))
            ours.set_tuning(replace(saved, prefill=replace(saved.prefill, attention=kp.AttentionTuning(bh, bn, nw, ns))))
            try:
                t = _sync_time(lambda: ours([(ours.new_state(), ids)]), 1, 3)
                print(f"attn tune block_h={bh} block_n={bn} warps={nw} stages={ns}: prefill 8192 {t * 1e3:.2f} ms", flush=True)
                rows.append({"what": f"attn tune {spec}", "prefill8192_ms": t * 1e3})
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        ours.set_tuning(saved)
    if args.prefill_variants:
        prefill_variants(args.prefill_variants, ours, vocab, rows)
    for n in [int(x) for x in args.prefill.split(",") if x]:
        ids = torch.randint(2, vocab, (1, n), device=device)
        flops = prefill_flops(cfg, n)
        # median of 5 synced runs after a warm-up (run 9; runs 6-8 took the mean of 2, which moved
        # by ±1.5 ms at 8K between calls); the best of the 5 goes to the JSON too
        each = [_sync_time(lambda ids=ids: ours([(ours.new_state(), ids[0].tolist())]), 1 if i == 0 else 0, 1) for i in range(5)]
        t_ours, t_best = sorted(each)[2], min(each)
        t_hf = None
        if not args.skip_hf:
            try:
                t_hf = _sync_time(lambda ids=ids: hf(ids, use_cache=True), 1, 2)
            except torch.OutOfMemoryError:
                t_hf = None
            if cuda:
                torch.cuda.empty_cache()
        rows.append(
            {
                "what": f"prefill {n}",
                "ours_ms": t_ours * 1e3,
                "ours_best_ms": t_best * 1e3,
                "transformers_ms": None if t_hf is None else t_hf * 1e3,
                "floor_ms": flops / mm * 1e3,
                "flops": flops,
                "pct_of_matmul": flops / t_ours / mm * 100,
            }
        )
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(
        f"{name}  copy bandwidth {bw / 1e12:.2f} TB/s  bf16 matmul {mm / 1e12:.0f} TFLOP/s  params {n_params / 1e9:.1f}B"
    )
    print(
        f"{'case':34s} {'ours ms':>9s} {'graph ms':>9s} {'replay ms':>9s} {'hf ms':>8s} {'floor ms':>9s} {'graph/floor':>11s} {'hf/graph':>8s} {'rel err':>8s} {'argmax':>6s}"
    )
    for r in rows:
        if "transformers_ms" not in r:
            continue
        hf_ms = "-" if r["transformers_ms"] is None else f"{r['transformers_ms']:.2f}"
        if "graph_ms" in r:
            vs = (
                "-"
                if r["transformers_ms"] is None
                else f"{r['transformers_ms'] / r['graph_ms']:.1f}x"
            )
            print(
                f"{r['what']:34s} {r['ours_ms']:9.2f} {r['graph_ms']:9.3f} {r['replay_ms']:9.3f} {hf_ms:>8s} {r['floor_ms']:9.3f} {r['graph_ms'] / r['floor_ms']:10.2f}x {vs:>8s} {r['graph_rel_err']:8.1e} {r['graph_argmax_agree']:6.2f}"
            )
        else:
            print(
                f"{r['what']:34s} {r['ours_ms']:9.2f} {'':>9s} {'':>9s} {'':>9s} {hf_ms:>8s} {r['floor_ms']:9.3f}   ({r['pct_of_matmul']:.0f}% of the matmul rate; median of 5, best {r.get('ours_best_ms', float('nan')):.2f} ms)"
            )
    write_json(args.output, rows, bw, mm)


def write_json(path: str, rows: list, bw: float, mm: float) -> None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with open(path, "w") as f:
        json.dump({"device": name, "copy_bw": bw, "matmul_flops": mm, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    with torch.inference_mode():
        main()

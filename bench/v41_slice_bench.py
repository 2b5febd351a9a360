"""Decode step and prefill time of a 4-layer DeepSeek-V4.1-Flash-width slice on one GPU, random
bf16 weights, one run, one JSON (issue 22 item 4).

    python -m bench.v41_slice_bench --output FILE.json [--batches 1,64] [--context 1024] [--prefill 8192]

The slice: hidden 5120, 64 × 512 heads, q_lora 1280, 384 experts top-6 (``V41Config``'s Flash
defaults), schedule ``(0, 2, 2, 2)`` with one KV source (layer 1, also the candidate source of the
two-level indexer) and index sources 1 and 3; the lm_head over the full vocabulary. The experts are
drawn as per-layer stacks that the model's expert parameters are views of (the weights held once).

Rows: ``decode`` = ``V41SlotDecoder.step`` (CUDA graph, inputs copied, synced) at each batch, the
context's state prefilled once by the model and loaded into every slot; beside it the floor
= the bytes the step must read (every dense weight, the expected distinct routed experts of the
batch, the lm_head, each slot's FP8 window, chosen FP4 rows and FP4 indexer keys as the pools hold them)
at the copy bandwidth measured in the same run. ``parity`` = the slot step's logits against the
model's forward on the same states and tokens. ``prefill`` = one chunk of ``--prefill`` tokens on
the model's default path on the device (the fast path, ``engine.model.v41.prefill``, on CUDA), the
median of 5 single synced forwards after 2 warm-ups (``seconds_each``: all 5), its
FLOPs (projections, experts, attention, indexer) against the bf16 matmul rate measured in the run;
``breakdown``: one more prefill with a device sync around each layer's attention (projections,
compressor, indexer, attention, output projections; the indexer's ``select``, the compressor's
``update`` and the softmax attention also on their own) and
FFN (router, routed and shared experts), "rest" = the total less those (mHC, norms, engram,
embedding, lm_head), each with its FLOPs and % of the matmul rate; ``general`` (``--general``): the
general path's time and the largest logit difference of the two paths, relative to the largest
logit. ``kv_bytes_per_token`` = the 40-layer released config's block bytes per
token (FP4 main rows 288 B + FP4 indexer rows 68 B per source row, over each source's ratio).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from bench.gpu_slice_bench import _sync, _sync_time, copy_bandwidth, matmul_rate, profile_graph, profile_prefill, touched_experts
from engine.model.rope import Rotary
from engine.model.v41 import prefill as fast_path
from engine.model.v41.attention import V41_TUNING, V41Tuning
from engine.model.v41.config import V41Config
from engine.model.v41.model import DecoderLayer, DeepseekV41ForCausalLM
from engine.model.v41.row_codec import FP4_INDEX, FP4_MAIN, FP8_WINDOW, MXFP8_MAIN
from engine.model.static_decode import bucket_for
from engine.model.v41.slot_decode import V41SlotDecoder, V41SlotTuning
from kernels.prefill import AttentionTuning

SLICE = dict(num_hidden_layers=4, compress_ratios=(0, 2, 2, 2), kv_source_layer_ids=(1,), index_source_layer_ids=(1, 3), candidate_source_layer_id=1)


def kv_bytes_per_token(cfg: V41Config) -> float:
    """Block bytes per token of the KV-source layers' stored rows (``engine.kv_units_v41``'s records)."""
    main = FP4_MAIN if cfg.use_fp4_sparse_kv else MXFP8_MAIN
    total = 0.0
    for i in cfg.kv_source_layer_ids:
        row = main.row_bytes(cfg.head_dim) + (FP4_INDEX.row_bytes(cfg.index_head_dim) if i in cfg.index_source_layer_ids else 0)
        total += row / cfg.compress_ratios[i]
    return total


def random_slice(
    cfg: V41Config, device: str, dtype: torch.dtype, tuning: V41Tuning = V41_TUNING
) -> tuple[DeepseekV41ForCausalLM, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model of ``cfg`` with N(0, 1/fan_in) matrices, norms and mHC scales 1, sinks and biases 0."""
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(cfg, dtype, tuning=tuning).eval()
    experts = [layer.ffn.experts for layer in model.model.layers]
    for layer in model.model.layers:
        layer.ffn.experts = nn.ModuleList()  # drawn below as stacks, not by to_empty
    model.to_empty(device=device)
    model.rotary = {
        "main": Rotary(cfg.rope_main, cfg.qk_rope_head_dim, cfg.max_position_embeddings),
        "compress": Rotary(cfg.rope_compress, cfg.qk_rope_head_dim, cfg.max_position_embeddings),
    }  # built on the meta device above
    g = torch.Generator(device=device).manual_seed(2)
    stacks = []
    with torch.no_grad():
        for name, t in model.named_parameters():
            if t.dim() == 1:
                t.fill_(1.0 if name.endswith(("norm.weight", "scale")) else 0.0)
            else:
                t.normal_(0.0, t.shape[-1] ** -0.5, generator=g)
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        for layer, ex in zip(model.model.layers, experts):
            gate_up = torch.empty(len(ex), 2 * inter, h, dtype=dtype, device=device).normal_(0.0, h**-0.5, generator=g)
            down = torch.empty(len(ex), h, inter, dtype=dtype, device=device).normal_(0.0, inter**-0.5, generator=g)
            for j, e in enumerate(ex):
                e.w1.weight = nn.Parameter(gate_up[j, :inter], requires_grad=False)
                e.w3.weight = nn.Parameter(gate_up[j, inter:], requires_grad=False)
                e.w2.weight = nn.Parameter(down[j], requires_grad=False)
            layer.ffn.experts = ex
            layer.ffn.stacks = (gate_up, down)  # MoE.stack: already stacked
            stacks.append((gate_up, down))
    return model, stacks


def dense_bytes(model: DeepseekV41ForCausalLM) -> tuple[float, float]:
    """(bytes of every weight a step reads whole, bytes of one routed expert)."""
    expert = sum(p.numel() * p.element_size() for p in model.model.layers[0].ffn.experts[0].parameters())
    routed = sum(expert for layer in model.model.layers for _ in layer.ffn.experts)
    embed = model.model.embed.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - routed - embed.numel() * embed.element_size(), expert


def state_bytes(cfg: V41Config, context: int) -> float:
    """Bytes of one slot's state a step reads at ``context`` tokens, as the pools store it: every
    layer's FP8 window ring, the top-k chosen FP4 rows of each compressed layer, all complete FP4
    indexer keys at each index source."""
    total = cfg.num_hidden_layers * cfg.sliding_window * FP8_WINDOW.row_bytes(cfg.head_dim)
    for i, r in enumerate(cfg.compress_ratios):
        if r:
            rows = context // cfg.compress_ratios[cfg.kv_source_of(i)]
            total += min(cfg.index_topk, rows) * FP4_MAIN.row_bytes(cfg.head_dim)
            if i in cfg.index_source_layer_ids:
                total += rows * FP4_INDEX.row_bytes(cfg.index_head_dim)
    return total


def prefill_flops(cfg: V41Config, dense_params: float, n: int) -> dict[str, float]:
    """Multiply-adds × 2 of an ``n``-token prefill by component: ``experts`` (the router, the top-k
    routed and the shared experts), ``attention`` (its projections, the compressor, the attention
    over the window and the top-k rows, the indexer over the complete rows), ``rest`` (mHC
    projections, the lm_head on the last token) and ``total``. ``dense_params``: every weight a
    token meets once (the shared experts included, the routed ones not)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    expert = 3 * h * cfg.moe_intermediate_size
    dense_ffn = (cfg.n_shared_experts * expert + cfg.n_routed_experts * h) * layers  # shared experts + router
    ffn = cfg.num_experts_per_tok * expert * layers + dense_ffn
    hc = 2 * (2 + cfg.hc_mult) * cfg.hc_mult * cfg.hc_mult * h * layers  # two mHC sites a layer
    lm_head = cfg.vocab_size * h
    attn = 2 * (dense_params - lm_head - dense_ffn - hc) * n  # dense_params holds no routed expert
    for i, r in enumerate(cfg.compress_ratios):
        rows = min(cfg.index_topk, n // max(r, 1)) if r else 0
        attn += 4 * n * cfg.num_attention_heads * cfg.head_dim * (cfg.sliding_window + rows)
        if i in cfg.index_source_layer_ids:
            attn += 2 * n * cfg.index_n_heads * cfg.index_head_dim * (n // r) / 2  # causal: half the rows on average
    out = {"experts": 2.0 * ffn * n, "attention": float(attn), "rest": 2.0 * hc * n + 2.0 * lm_head}
    out["total"] = sum(out.values())
    return out


@contextmanager
def component_timer(model: DeepseekV41ForCausalLM) -> Iterator[dict[str, float]]:
    """Seconds spent in each layer's ``attn`` and ``ffn`` and, inside ``attn``, each indexer's
    ``select``, the KV source's ``compressor.update`` and the softmax attention itself (``_attend``
    or ``_attend_fast``), summed over the forwards run inside (a device sync on entry and exit of
    each: it slows the run)."""
    times = {"attention": 0.0, "indexer": 0.0, "compressor": 0.0, "attend": 0.0, "experts": 0.0}
    handles, wrapped = [], []

    def timed(key: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            _sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync()
            times[key] += time.perf_counter() - t0
            return out

        return run

    for layer in model.model.layers:
        for key, module in (("attention", layer.attn), ("experts", layer.ffn)):
            start: dict[str, float] = {}

            def pre(_m, _a, start=start):
                _sync()
                start["t"] = time.perf_counter()

            def post(_m, _a, _o, key=key, start=start):
                _sync()
                times[key] += time.perf_counter() - start["t"]

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        parts = [(layer.attn, "_attend", "attend"), (layer.attn, "_attend_fast", "attend")]
        if layer.attn.indexer is not None:
            parts.append((layer.attn.indexer, "select", "indexer"))
        if layer.attn.compressor is not None:
            parts.append((layer.attn.compressor, "update", "compressor"))
        for obj, name, key in parts:
            setattr(obj, name, timed(key, getattr(obj, name)))  # an instance attribute over the method, removed below
            wrapped.append((obj, name))
    # the fast path's MoE is a function of the module, not its forward (no hooks): timed in the
    # LayerOps the layers look up at each call, restored below
    fast_ops = fast_path.FAST
    fast_path.FAST = fast_ops._replace(moe=timed("experts", fast_ops.moe))
    try:
        yield times
    finally:
        fast_path.FAST = fast_ops
        for hd in handles:
            hd.remove()
        for obj, name in wrapped:
            delattr(obj, name)


def prefill_rows(model: DeepseekV41ForCausalLM, ids: list[int], flops: dict[str, float], mm: float, general: bool) -> dict:
    """The ``prefill`` row (module docstring) of one chunk ``ids`` on a fresh state."""
    # the median of 5 single forwards after 2 warm-ups (the mean of 2 moved by ~3 ms between calls)
    each = sorted(_sync_time(lambda: model([(model.new_state(), ids)]), 2 if i == 0 else 0, 1) for i in range(5))
    pre = each[2]
    row: dict = {"kind": "prefill", "tokens": len(ids), "seconds": pre, "seconds_each": each, "flops": flops["total"],
                 "tflops": flops["total"] / pre / 1e12, "of_matmul_rate": flops["total"] / pre / mm}  # fmt: skip
    with component_timer(model) as times:
        t0 = time.perf_counter()
        model([(model.new_state(), ids)])
        _sync()
        total = time.perf_counter() - t0
    secs = {"attention": times["attention"], "experts": times["experts"], "rest": total - times["attention"] - times["experts"]}
    row["breakdown"] = {"synced_seconds": total, "inside_attention_seconds": {k: times[k] for k in ("indexer", "compressor", "attend")}}
    for key, t in secs.items():
        row["breakdown"][key] = {"seconds": t, "share": t / total, "flops": flops[key], "of_matmul_rate": flops[key] / max(t, 1e-9) / mm}
    if general:
        got = model([(model.new_state(), ids)]).float()
        before = [layer.tuning for layer in model.model.layers]
        for layer, tuning in zip(model.model.layers, before):
            _set_tuning(layer, replace(tuning, fast=False))
        try:
            t0 = time.perf_counter()
            want = model([(model.new_state(), ids)]).float()
            _sync()
            seconds = time.perf_counter() - t0
        finally:
            for layer, tuning in zip(model.model.layers, before):
                _set_tuning(layer, tuning)
        row["general"] = {"seconds": seconds, "max_err_over_max_logit": float((got - want).abs().max() / want.abs().max()),
                          "same_argmax": bool((got.argmax(-1) == want.argmax(-1)).all())}  # fmt: skip
    return row


def _set_tuning(layer: DecoderLayer, tuning: V41Tuning) -> None:
    """A built layer switched to ``tuning`` (the general path for ``--general``)."""
    layer.tuning = layer.attn.tuning = tuning
    if layer.attn.indexer is not None:
        layer.attn.indexer.tuning = tuning


def slot_tuning(kv: dict[str, str]) -> V41SlotTuning:
    """A ``V41SlotTuning`` from variant options ``dgemv=0|1`` (``dense_gemv``), ``pdl=0|1``
    (``gemv_pdl``), ``gemv=SLOTS`` (``moe_gemv.max_slots``), ``up=`` / ``down=ROWSxBKxWARPS``
    (``moe_gemv.up`` / ``down``), ``fuse=0|1`` (``fuse_sites``), ``side=0|1`` (``side_stream``), ``attn=BHxBNxWARPSxFILLxMAXSPLITS``
    (``attention``'s fields in order, a prefix of them), ``hcs=N`` (``hc_splits``); those left out
    take the defaults (``kern=0|1``, the decoder's ``kernels``, is read by ``run``)."""
    dflt = V41SlotTuning()

    def cfg(key: str, default: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        return tuple(int(v) for v in kv[key].split("x")) if key in kv else default  # type: ignore[return-value]

    moe = replace(dflt.moe_gemv, max_slots=int(kv.get("gemv", dflt.moe_gemv.max_slots)),
                  up=cfg("up", dflt.moe_gemv.up), down=cfg("down", dflt.moe_gemv.down))  # fmt: skip
    attn = dflt.attention
    for name, value in zip(("block_h", "block_n", "num_warps", "fill", "max_splits"), kv["attn"].split("x") if kv.get("attn") else ()):
        attn = replace(attn, **{name: type(getattr(attn, name))(value)})
    return replace(dflt, moe_gemv=moe, attention=attn, hc_splits=int(kv.get("hcs", dflt.hc_splits)),
                   dense_gemv=kv.get("dgemv", "1" if dflt.dense_gemv else "0") == "1",
                   gemv_pdl=kv.get("pdl", "1" if dflt.gemv_pdl else "0") == "1",
                   fuse_sites=kv.get("fuse", "1" if dflt.fuse_sites else "0") == "1",
                   side_stream=kv.get("side", "1" if dflt.side_stream else "0") == "1")  # fmt: skip


def prefill_tuning(kv: dict[str, str], base: V41Tuning) -> V41Tuning:
    """``base`` with ``expert_gemm`` from variant options ``up=`` / ``down=BM.BN.BK.WARPS.STAGES``
    (``torch``: ``torch._grouped_mm``; both left out: ``base``'s) and ``attention`` from
    ``attn=BH.BN.WARPS.STAGES`` (left out: ``base``'s)."""

    def cfg(key: str):
        v = kv.get(key, "torch")
        return None if v == "torch" else tuple(int(a) for a in v.split("."))

    out = replace(base, expert_gemm=(cfg("up"), cfg("down"))) if "up" in kv or "down" in kv else base
    if "attn" in kv:
        out = replace(out, attention=AttentionTuning(*(int(a) for a in kv["attn"].split("."))))
    return out


def parse_variants(spec: str) -> list[tuple[str, dict[str, str]]]:
    """'name:key=v,key=v;name2:...' → [(name, {key: v})]."""
    out = []
    for part in filter(None, spec.split(";")):
        name, _, opts = part.partition(":")
        out.append((name, dict(o.split("=", 1) for o in filter(None, opts.split(",")))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--general", action="store_true", help="also time the general path's prefill and compare its logits")
    ap.add_argument("--profile", metavar="PREFIX", help="write each batch's graph replay, kernel by kernel, to PREFIX_b<B>_graph.txt")
    ap.add_argument("--profile-prefill", metavar="PREFIX", help="write the prefill's kernels by total time to PREFIX_prefill<N>.txt")
    ap.add_argument("--variants", default="", metavar="NAME:dgemv=0,pdl=0,gemv=N,attn=BHxBNxW,hcs=N,kern=0;...", help="also time the decode batches with these slot tunings (slot_tuning)")
    ap.add_argument("--prefill-variants", default="", metavar="NAME:up=BM.BN.BK.W.S,down=BM.BN.BK.W.S,attn=BH.BN.W.S;...", help="also time the prefill with these V41Tuning.expert_gemm / attention configs (prefill_tuning)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.perf_counter()
    bw, mm = copy_bandwidth(), matmul_rate()
    torch.cuda.empty_cache()
    out = run(V41Config(**SLICE), "cuda", batches, args.context, args.prefill, args.iters, bw, mm, args.general, profile=args.profile, variants=parse_variants(args.variants), profile_prefill_to=args.profile_prefill,
              prefill_variants=parse_variants(args.prefill_variants))  # fmt: skip
    out["wall_s"] = time.perf_counter() - t0
    with open(args.output, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))
    print(summary(out))


def summary(out: dict) -> str:
    """One line per row: decode against its floor, prefill against the bf16 matmul rate of the run."""
    lines = [f"bf16 matmul rate {out['matmul_flops'] / 1e12:.0f} TFLOP/s, copy {out['copy_bw'] / 1e12:.2f} TB/s"]
    for r in out["rows"]:
        if r["kind"] == "decode":
            lines.append(f"decode{' ' + r['variant'] if r.get('variant') else ''} b={r['batch']}: {r['step_ms']:.2f} ms, floor {r['floor_ms']:.2f} ms ({r['x_floor']:.2f}x)")
        elif r["kind"] == "error":
            lines.append(f"variant {r['variant']}: failed: {r['error'][-160:]}")
        else:
            lines.append(f"prefill{' ' + r['variant'] if r.get('variant') else ''} {r['tokens']} tokens: {r['seconds'] * 1e3:.1f} ms, {r['tflops']:.0f} TFLOP/s = {100 * r['of_matmul_rate']:.1f}% of the bf16 matmul rate")
            for key in ("attention", "experts", "rest"):
                b = r["breakdown"][key]
                lines.append(f"  {key}: {b['seconds'] * 1e3:.1f} ms ({100 * b['share']:.0f}% of the synced run), {100 * b['of_matmul_rate']:.1f}% of the rate")
            inside = r["breakdown"]["inside_attention_seconds"]
            lines.append("  inside attention: " + ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in inside.items()))
            if "general" in r:
                g = r["general"]
                lines.append(f"  general path: {g['seconds'] * 1e3:.0f} ms, logits max err / max {g['max_err_over_max_logit']:.2e}, same argmax {g['same_argmax']}")
    return "\n".join(lines)


def run(
    cfg: V41Config, device: str, batches: list[int], context: int, prefill: int, iters: int, bw: float, mm: float,
    general: bool = False, tuning: V41Tuning = V41_TUNING, profile: str | None = None,
    variants: Sequence[tuple[str, dict[str, str]]] = (), profile_prefill_to: str | None = None,
    prefill_variants: Sequence[tuple[str, dict[str, str]]] = (),
) -> dict:  # fmt: skip
    """The rows of one run (module docstring) of ``cfg``'s slice on ``device``, the model built with ``tuning``;
    ``profile``: a path prefix for each batch's graph replay, kernel by kernel (``gpu_slice_bench.profile_graph``);
    ``variants``: (name, options) of more decoders timed at the same batches (``slot_tuning``);
    ``profile_prefill_to``: a path prefix for the prefill's kernels by total time (``gpu_slice_bench.profile_prefill``);
    ``prefill_variants``: (name, options) of more prefills timed on the same tokens (``prefill_tuning``)."""
    model, stacks = random_slice(cfg, device, torch.bfloat16, tuning)
    dense, expert = dense_bytes(model)
    out: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else device, "copy_bw": bw, "matmul_flops": mm,
                 "config": SLICE, "kv_bytes_per_token_40_layers": kv_bytes_per_token(V41Config()), "rows": []}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        ctx = torch.randint(2, cfg.vocab_size, (context,), generator=gen).tolist()
        state = model.new_state()
        model([(state, ctx)])
        max_tokens = context + (len(batches) + 1) * (iters + 4) * (1 + len(variants)) + 8
        for name, tuning_kv in [("", {}), *variants]:
            try:
                decode_rows(out, model, stacks, state, cfg, name, tuning_kv, batches, max_tokens, context, iters, bw, dense, expert, gen, profile)
            except Exception as e:  # a variant that cannot compile (shared memory, registers): recorded, the others run
                if not name:
                    raise
                out["rows"].append({"kind": "error", "variant": name, "error": repr(e)[-400:]})
            if device == "cuda":
                torch.cuda.empty_cache()
        ids = torch.randint(2, cfg.vocab_size, (prefill,), generator=gen).tolist()
        flops = prefill_flops(cfg, dense / 2, prefill)
        out["rows"].append(prefill_rows(model, ids, flops, mm, general))
        for name, kv in prefill_variants:
            for layer in model.model.layers:
                _set_tuning(layer, prefill_tuning(kv, tuning))
            try:
                out["rows"].append({**prefill_rows(model, ids, flops, mm, False), "variant": name})
            except Exception as e:  # a config that cannot compile: recorded, the others run
                out["rows"].append({"kind": "error", "variant": name, "error": repr(e)[-400:]})
            for layer in model.model.layers:
                _set_tuning(layer, tuning)
        if profile_prefill_to:
            profile_prefill(model, prefill, cfg.vocab_size, profile_prefill_to)
    return out


def decode_rows(
    out: dict, model: DeepseekV41ForCausalLM, stacks, state, cfg: V41Config, name: str, tuning_kv: dict[str, str],
    batches: list[int], max_tokens: int, context: int, iters: int, bw: float, dense: float, expert: float,
    gen: torch.Generator, profile: str | None,
) -> None:  # fmt: skip
    """One decoder's rows (variant ``name``): its step at each batch against the floor, its parity rows."""
    kernels = None if "kern" not in tuning_kv else tuning_kv["kern"] == "1"
    dec = V41SlotDecoder(model, max(batches), max_tokens, experts=stacks, kernels=kernels, tuning=slot_tuning(tuning_kv))
    for s in range(dec.max_slots):
        dec.load(s, state)
    if dec.use_graphs:
        dec.capture_graphs()
    out["slot_pool_bytes"] = dec.nbytes()
    for b in batches:
        toks = torch.randint(2, cfg.vocab_size, (b,), generator=gen).tolist()
        step = _sync_time(lambda b=b, toks=toks: dec.step(list(range(b)), toks), 2, iters)
        floor_bytes = dense + expert * cfg.num_hidden_layers * touched_experts(cfg, b) + b * state_bytes(cfg, context)
        out["rows"].append({"kind": "decode", "variant": name, "batch": b, "context": context, "step_ms": step * 1e3,
                            "floor_ms": floor_bytes / bw * 1e3, "floor_bytes": floor_bytes, "x_floor": step / (floor_bytes / bw)})  # fmt: skip
        if profile and dec.use_graphs and not name:
            profile_graph(dec, bucket_for(b, dec.buckets), profile)
    # parity: the slot step against the model's forward on the same states and tokens, at
    # batch 1 (the dense projections through kernels.gemv) and at 4
    for n in sorted({1, min(4, dec.max_slots)}):
        states = [dec.export(s) for s in range(n)]
        toks = torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist()
        want = model([(st, [t]) for st, t in zip(states, toks)]).float()
        got = dec.step(list(range(n)), toks).float()
        out.setdefault("parity", []).append({"variant": name, "rows": n, "max_err_over_max_logit": float((got - want).abs().max() / want.abs().max()),
                                             "same_argmax": float((got.argmax(-1) == want.argmax(-1)).float().mean())})  # fmt: skip


if __name__ == "__main__":
    main()

"""Decode step and prefill time of a 4-layer DeepSeek-V4.1-Flash-width slice on one GPU, random
bf16 weights, one run, one JSON (issue 22 item 4).

    python -m bench.v41_slice_bench --output FILE.json [--batches 1,64] [--context 1024] [--prefill 8192]

The slice: hidden 5120, 64 × 512 heads, q_lora 1280, 384 experts top-6 (``V41Config``'s Flash
defaults), schedule ``(0, 2, 2, 2)`` with one KV source (layer 1, also the candidate source of the
two-level indexer) and index sources 1 and 3; the lm_head over the full vocabulary. The experts are
drawn as per-layer stacks that the model's expert parameters are views of (the weights held once).

Rows: ``decode`` = ``V41SlotDecoder.step`` (CUDA graph, inputs copied, synced) at each batch, the
context's state prefilled once by the general path and loaded into every slot; beside it the floor
= the bytes the step must read (every dense weight, the expected distinct routed experts of the
batch, the lm_head, each slot's FP8 window, chosen FP4 rows and FP4 indexer keys as the pools hold them)
at the copy bandwidth measured in the same run. ``parity`` = the slot step's logits against the
general path's on the same states and tokens. ``prefill`` = one chunk of ``--prefill`` tokens on
the general path, its FLOPs (projections, experts, attention, indexer) against the bf16 matmul
rate measured in the run. ``kv_bytes_per_token`` = the 40-layer released config's block bytes per
token (FP4 main rows 288 B + FP4 indexer rows 68 B per source row, over each source's ratio).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from bench.gpu_slice_bench import _sync_time, copy_bandwidth, matmul_rate, touched_experts
from engine.model.rope import Rotary
from engine.model.v41.config import V41Config
from engine.model.v41.model import DeepseekV41ForCausalLM
from engine.model.v41.row_codec import FP4_INDEX, FP4_MAIN, FP8_WINDOW, MXFP8_MAIN
from engine.model.v41.slot_decode import V41SlotDecoder

SLICE = dict(num_hidden_layers=4, compress_ratios=(0, 2, 2, 2), kv_source_layer_ids=(1,), index_source_layer_ids=(1, 3), candidate_source_layer_id=1)


def kv_bytes_per_token(cfg: V41Config) -> float:
    """Block bytes per token of the KV-source layers' stored rows (``engine.kv_units_v41``'s records)."""
    main = FP4_MAIN if cfg.use_fp4_sparse_kv else MXFP8_MAIN
    total = 0.0
    for i in cfg.kv_source_layer_ids:
        row = main.row_bytes(cfg.head_dim) + (FP4_INDEX.row_bytes(cfg.index_head_dim) if i in cfg.index_source_layer_ids else 0)
        total += row / cfg.compress_ratios[i]
    return total


def random_slice(cfg: V41Config, device: str, dtype: torch.dtype) -> tuple[DeepseekV41ForCausalLM, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model of ``cfg`` with N(0, 1/fan_in) matrices, norms and mHC scales 1, sinks and biases 0."""
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(cfg, dtype).eval()
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


def prefill_flops(cfg: V41Config, dense_params: float, n: int) -> float:
    """Multiply-adds × 2 of an ``n``-token prefill: dense projections and the 6 + 1 experts per
    token, attention over the window and the top-k rows, the indexer over the complete rows."""
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    per_token = dense_params - cfg.vocab_size * cfg.hidden_size + (cfg.num_experts_per_tok + cfg.n_shared_experts) * expert * cfg.num_hidden_layers
    flops = 2 * per_token * n + 2 * cfg.vocab_size * cfg.hidden_size  # lm_head on the last token
    for i, r in enumerate(cfg.compress_ratios):
        rows = min(cfg.index_topk, n // max(r, 1)) if r else 0
        flops += 4 * n * cfg.num_attention_heads * cfg.head_dim * (cfg.sliding_window + rows)
        if i in cfg.index_source_layer_ids:
            flops += 2 * n * cfg.index_n_heads * cfg.index_head_dim * (n // r) / 2  # causal: half the rows on average
    return flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.perf_counter()
    bw, mm = copy_bandwidth(), matmul_rate()
    torch.cuda.empty_cache()
    out = run(V41Config(**SLICE), "cuda", batches, args.context, args.prefill, args.iters, bw, mm)
    out["wall_s"] = time.perf_counter() - t0
    with open(args.output, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))


def run(cfg: V41Config, device: str, batches: list[int], context: int, prefill: int, iters: int, bw: float, mm: float) -> dict:
    """The rows of one run (module docstring) of ``cfg``'s slice on ``device``."""
    model, stacks = random_slice(cfg, device, torch.bfloat16)
    dense, expert = dense_bytes(model)
    out: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else device, "copy_bw": bw, "matmul_flops": mm,
                 "config": SLICE, "kv_bytes_per_token_40_layers": kv_bytes_per_token(V41Config()), "rows": []}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        ctx = torch.randint(2, cfg.vocab_size, (context,), generator=gen).tolist()
        state = model.new_state()
        model([(state, ctx)])
        dec = V41SlotDecoder(model, max(batches), context + (len(batches) + 1) * (iters + 4) + 8, experts=stacks)
        for s in range(dec.max_slots):
            dec.load(s, state)
        if dec.use_graphs:
            dec.capture_graphs()
        out["slot_pool_bytes"] = dec.nbytes()
        for b in batches:
            toks = torch.randint(2, cfg.vocab_size, (b,), generator=gen).tolist()
            step = _sync_time(lambda b=b, toks=toks: dec.step(list(range(b)), toks), 2, iters)
            floor_bytes = dense + expert * cfg.num_hidden_layers * touched_experts(cfg, b) + b * state_bytes(cfg, context)
            out["rows"].append({"kind": "decode", "batch": b, "context": context, "step_ms": step * 1e3,
                                "floor_ms": floor_bytes / bw * 1e3, "floor_bytes": floor_bytes, "x_floor": step / (floor_bytes / bw)})  # fmt: skip
        # parity: the slot step against the general path on the same states and tokens
        n = min(4, dec.max_slots)
        states = [dec.export(s) for s in range(n)]
        toks = torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist()
        want = model([(st, [t]) for st, t in zip(states, toks)]).float()
        got = dec.step(list(range(n)), toks).float()
        out["parity"] = {"rows": n, "max_err_over_max_logit": float((got - want).abs().max() / want.abs().max()),
                         "same_argmax": float((got.argmax(-1) == want.argmax(-1)).float().mean())}  # fmt: skip
        del dec, states
        if device == "cuda":
            torch.cuda.empty_cache()
        ids = torch.randint(2, cfg.vocab_size, (prefill,), generator=gen).tolist()
        pre = _sync_time(lambda: model([(model.new_state(), ids)]), 1, 2)
        flops = prefill_flops(cfg, dense / 2, prefill)
        out["rows"].append({"kind": "prefill", "tokens": prefill, "seconds": pre, "flops": flops,
                            "tflops": flops / pre / 1e12, "of_matmul_rate": flops / pre / mm})  # fmt: skip
    return out


if __name__ == "__main__":
    main()

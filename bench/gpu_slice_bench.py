"""Decode step and prefill time of a 4-layer DeepSeek-V4-Flash-width slice on one GPU, ours vs
transformers' eager model, same random bf16 weights (shared tensors), one run.

    python -m bench.gpu_slice_bench --output FILE.json [--batches 1,64] [--context 1024]

Prints a table with the memory-bandwidth floor (bytes of weights and state a step must read at
the measured copy bandwidth) next to each time.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _sync_time(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), 4 GiB buffers."""
    a = torch.empty(1 << 31, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    s = _sync_time(lambda: b.copy_(a), 1, 5)
    del a, b
    return 2 * (1 << 32) / s


def decode_floor_bytes(cfg, batch: int) -> float:
    """Weights a decode step must read: attention + shared expert + touched routed experts + lm_head."""
    h, hd, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    attn = h * cfg.q_lora_rank + cfg.q_lora_rank * nh * hd + h * hd + nh * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * h
    expert = 3 * h * cfg.moe_intermediate_size
    e = cfg.n_routed_experts
    touched = e * (1 - (1 - cfg.num_experts_per_tok / e) ** batch)  # expected distinct experts
    per_layer = attn + expert * (1 + touched) + 2 * h * hd  # + compressor projections
    return 2 * (cfg.num_hidden_layers * per_layer + cfg.vocab_size * h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="gpu_slice.json")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM as HF, DynamicCache

    from engine.model.config import ModelConfig
    from engine.model.model import DeepseekV4ForCausalLM as Ours

    torch.manual_seed(0)
    bw = copy_bandwidth()
    hf_cfg = DeepseekV4Config(num_hidden_layers=4)
    with torch.device("cuda"):
        hf = HF._from_config(hf_cfg, dtype=torch.bfloat16).eval()
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    with torch.device("meta"):
        ours = Ours(cfg, torch.bfloat16)
    ours.load_state_dict(hf.state_dict(), strict=True, assign=True)  # same tensors, no copy
    ours.eval()
    n_params = sum(p.numel() for p in hf.parameters())
    rows = []
    vocab = cfg.vocab_size
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = torch.randint(2, vocab, (batch, args.context), device="cuda")
        floor = decode_floor_bytes(cfg, batch) / bw
        # ours
        states = [ours.new_state() for _ in range(batch)]
        for i in range(batch):  # prefill one by one keeps activation memory small
            ours([(states[i], prompts[i].tolist())])
        nxt = [[int(t)] for t in torch.randint(2, vocab, (batch,))]
        snapshot = [s.clone() for s in states]

        def ours_step():
            ours(list(zip(states, nxt)))

        t_ours = _sync_time(ours_step)
        states = snapshot
        t_hf = None
        if not args.skip_hf:
            try:
                cache = DynamicCache(config=hf.config)
                with torch.no_grad():
                    hf(prompts, past_key_values=cache, use_cache=True)
                tok = torch.randint(2, vocab, (batch, 1), device="cuda")

                def hf_step():
                    with torch.no_grad():
                        hf(tok, past_key_values=cache, use_cache=True)

                t_hf = _sync_time(hf_step)
                del cache
            except torch.OutOfMemoryError as exc:
                t_hf = None
                print(f"transformers OOM at batch {batch}: {exc}".splitlines()[0])
            torch.cuda.empty_cache()
        rows.append({"what": f"decode b={batch} ctx={args.context}", "ours_ms": t_ours * 1e3, "transformers_ms": None if t_hf is None else t_hf * 1e3, "floor_ms": floor * 1e3})
    for n in [int(x) for x in args.prefill.split(",") if x]:
        ids = torch.randint(2, vocab, (1, n), device="cuda")
        flops = 2 * n * (n_params - cfg.vocab_size * cfg.hidden_size * 2) * (cfg.num_experts_per_tok + 2) / (cfg.n_routed_experts + 2)
        t_ours = _sync_time(lambda: ours([(ours.new_state(), ids[0].tolist())]), 1, 2)
        t_hf = None
        if not args.skip_hf:
            try:
                t_hf = _sync_time(lambda: hf(ids, use_cache=True), 1, 2)
            except torch.OutOfMemoryError:
                t_hf = None
            torch.cuda.empty_cache()
        rows.append({"what": f"prefill {n}", "ours_ms": t_ours * 1e3, "transformers_ms": None if t_hf is None else t_hf * 1e3, "floor_ms": flops / 787e12 * 1e3})
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  params {n_params / 1e9:.1f}B")
    print(f"{'case':28s} {'ours ms':>10s} {'transformers ms':>16s} {'ratio':>7s} {'floor ms':>9s}")
    for r in rows:
        ratio = "" if r["transformers_ms"] is None else f"{r['transformers_ms'] / r['ours_ms']:.2f}x"
        hf_ms = "OOM/skip" if r["transformers_ms"] is None else f"{r['transformers_ms']:.1f}"
        print(f"{r['what']:28s} {r['ours_ms']:10.1f} {hf_ms:>16s} {ratio:>7s} {r['floor_ms']:9.2f}")
    with open(args.output, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    with torch.inference_mode():
        main()

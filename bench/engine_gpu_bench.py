"""The engine on one GPU: output tokens/s with decode through the static runner (CUDA graphs per
batch bucket, ``engine/runtime/static_runner.py``) against the general path, same run.

    python -m bench.engine_gpu_bench --output FILE.json [--model DIR] [--dtype bfloat16]
        [--concurrency 1,16,64] [--prompt-len 256] [--new-tokens 128]

Same workload as ``bench.engine_bench``: B requests of P random tokens arrive at once; greedy,
``ignore_eos``, N output tokens each; best of 2 runs per point. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.engine_bench import prompts, run_ours
from engine.model.loader import load_model
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="engine_gpu.json")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the tiny one, made here)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    model_dir = args.model
    if model_dir is None:
        from engine.model.tiny import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="engine-gpu-")) / "tiny", seed=0, preset="tiny"))
    model = load_model(model_dir, dtype=args.dtype, device="cuda", progress=False)
    vocab = model.config.vocab_size
    rows = []
    print(f"{'conc':>5} {'general tok/s':>14} {'static tok/s':>13} {'ratio':>7} {'same':>6}", flush=True)
    for conc in (int(c) for c in args.concurrency.split(",")):
        batch = prompts(conc, args.prompt_len, seed=conc, vocab=vocab)
        out = {}
        for static in (False, True):
            cfg = EngineConfig(max_num_seqs=max(conc, 1), static_decode=static, static_max_tokens=args.prompt_len + args.new_tokens + 8)
            engine = build_engine(model_dir, cfg, device="cuda", model=model)
            run_ours(engine, batch, args.new_tokens, f"warm{static}")  # graphs captured, allocator warm
            best = max((run_ours(engine, batch, args.new_tokens, f"s{static}r{r}") for r in range(2)), key=lambda r: r["tok_s"])
            torch.cuda.synchronize()
            out[static] = best
        same = sum(a == b for a, b in zip(out[False]["tokens"], out[True]["tokens"]))
        row = {
            "concurrency": conc,
            "general_tok_s": out[False]["tok_s"],
            "static_tok_s": out[True]["tok_s"],
            "ratio": out[True]["tok_s"] / out[False]["tok_s"],
            "same_tokens": f"{same}/{conc}",
        }
        rows.append(row)
        print(f"{conc:>5} {row['general_tok_s']:>14.1f} {row['static_tok_s']:>13.1f} {row['ratio']:>6.2f}x {row['same_tokens']:>6}", flush=True)
    info = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    Path(args.output).write_text(json.dumps({"info": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

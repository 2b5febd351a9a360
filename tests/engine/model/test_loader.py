"""Checkpoint loading: DeepSeek's original names, sharded index, FP8 / FP4 dequantization, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError
from engine.model.loader import _FP4_LUT, load_model, to_hf_name

# transformers name (after "model.layers.N.") -> DeepSeek original name; the loader's inverse.
_TO_ORIGINAL = [
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.q_a_proj.", "attn.wq_a."),
    ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."),
    ("self_attn.sinks", "attn.attn_sink"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.", "ffn.gate."),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.", "hc_attn_"),
    ("ffn_hc.", "hc_ffn_"),
]
_TOP = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight",
        "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}


def _original_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    prefix, rest = name.split(".layers.", 1)
    idx, rest = rest.split(".", 1)
    for hf, orig in _TO_ORIGINAL:
        if rest.startswith(hf):
            return f"layers.{idx}.{orig}{rest[len(hf):]}"
    raise AssertionError(f"no original name for {name}")


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """128×128 block-scaled e4m3: (quantized, scales, dequantized)."""
    out, inp = w.shape
    bo, bi = -(-out // 128), -(-inp // 128)
    padded = torch.zeros(bo * 128, bi * 128)
    padded[:out, :inp] = w
    blocks = padded.view(bo, 128, bi, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0  # (bo, bi)
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inp]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e2m1 with one fp32 scale per 32 inputs, two values per int8 (low nibble first)."""
    out, inp = w.shape
    scale = w.view(out, inp // 32, 32).abs().amax(-1).clamp(min=1e-8) / 6.0  # (out, inp/32)
    x = w / scale.repeat_interleave(32, 1)
    codes = (x[..., None] - _FP4_LUT).abs().argmin(-1)  # nearest representable value
    deq = _FP4_LUT[codes] * scale.repeat_interleave(32, 1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale, deq


@pytest.fixture(scope="module")
def original_fp8_checkpoint(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model re-saved with DeepSeek's names in 3 shards with an index, attention and shared
    experts in FP8, routed experts in FP4; plus a transformers-format twin holding the dequantized
    values (the reference the FP8/FP4 load must reproduce)."""
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    hf = load_file(str(tiny_model_dir / "model.safetensors"))
    orig_dir = tmp_path_factory.mktemp("orig")
    twin_dir = tmp_path_factory.mktemp("twin")
    original: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name.startswith("mtp."):  # the MTP layer is stored under release names already
            continue
        if name.endswith("experts.gate_up_proj"):
            prefix = _original_name(name.replace("experts.gate_up_proj", "shared_experts.gate_proj.weight")).split("ffn.")[0] + "ffn.experts"
            inter = t.shape[1] // 2
            deq_gate_up = torch.empty_like(t)
            for e in range(t.shape[0]):
                for part, (lo, hi) in (("w1", (0, inter)), ("w3", (inter, 2 * inter))):
                    q, s, d = _fp4(t[e, lo:hi])
                    original[f"{prefix}.{e}.{part}.weight"], original[f"{prefix}.{e}.{part}.scale"] = q, s
                    deq_gate_up[e, lo:hi] = d
            twin[name] = deq_gate_up
            continue
        if name.endswith("experts.down_proj"):
            prefix = _original_name(name.replace("experts.down_proj", "shared_experts.gate_proj.weight")).split("ffn.")[0] + "ffn.experts"
            deq = torch.empty_like(t)
            for e in range(t.shape[0]):
                q, s, deq[e] = _fp4(t[e])
                original[f"{prefix}.{e}.w2.weight"], original[f"{prefix}.{e}.w2.scale"] = q, s
            twin[name] = deq
            continue
        orig = _original_name(name)
        if t.dim() == 2 and ("self_attn" in name and "proj" in name or "shared_experts" in name) and "indexer" not in name and "compressor" not in name:
            q, s, d = _fp8(t)
            original[orig], original[orig[: -len(".weight")] + ".scale"] = q, s
            twin[name] = d
        else:
            original[orig] = t
            twin[name] = t
    original["mtp.0.e_proj.weight"] = torch.randn(4, 4)  # kept, unused
    names = sorted(original)
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: original[n].contiguous() for n in shard}, str(orig_dir / fname))
        weight_map.update({n: fname for n in shard})
    (orig_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    legacy = {k: v for k, v in cfg.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor")}
    legacy["compress_ratios"] = [{"sliding_attention": 0}.get(t, cfg["compress_rates"].get(t, 0)) for t in cfg["layer_types"]]
    legacy["num_hash_layers"] = cfg["mlp_layer_types"].count("hash_moe")
    legacy["qk_rope_head_dim"] = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    legacy["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"}
    (orig_dir / "config.json").write_text(json.dumps(legacy))
    shutil.copy(tiny_model_dir / "config.json", twin_dir / "config.json")
    save_file(twin, str(twin_dir / "model.safetensors"))
    return orig_dir, twin_dir


def test_original_names_sharded_fp8_fp4_load_exactly(original_fp8_checkpoint) -> None:
    orig_dir, twin_dir = original_fp8_checkpoint
    ours = load_model(orig_dir, dtype="float32", progress=False)
    twin = load_model(twin_dir, dtype="float32", progress=False)
    assert "mtp.0.e_proj.weight" in ours.mtp
    ids = list(range(5, 300))
    a = ours([(ours.new_state(), ids)], logits="all")
    b = twin([(twin.new_state(), ids)], logits="all")
    assert (a - b).abs().max().item() < 1e-5


def test_name_mapping_round_trips(tiny_model_dir) -> None:
    for name in load_file(str(tiny_model_dir / "model.safetensors")):
        if ".experts." not in name and not name.startswith("mtp."):
            assert to_hf_name(_original_name(name)) == name


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_errors_name_the_file_and_tensor(tiny_model_dir, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path, progress=False)
    bad = _copy(tiny_model_dir, tmp_path / "bad_type")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type"):
        load_model(bad, progress=False)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    for case, mutate, pattern in [
        ("missing", lambda w: w.pop("model.layers.1.self_attn.sinks"), r"missing tensor 'model.layers.1.self_attn.sinks'"),
        ("extra", lambda w: w.__setitem__("model.layers.0.bogus.weight", torch.zeros(2)), r"model.safetensors: unexpected tensor 'model.layers.0.bogus.weight'"),
        ("shape", lambda w: w.__setitem__("model.norm.weight", torch.zeros(7)), r"model.safetensors: tensor 'model.norm.weight' has shape \(7,\)"),
    ]:
        d = _copy(tiny_model_dir, tmp_path / case)
        w = dict(weights)
        mutate(w)
        save_file(w, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError, match=pattern):
            load_model(d, progress=False)
    missing_shard = _copy(tiny_model_dir, tmp_path / "shard")
    (missing_shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_model(missing_shard, progress=False)

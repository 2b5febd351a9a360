"""``make-random-checkpoint``: the released layout (names, dtypes, shapes, shards), loadable and runnable."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.model.fp8 import Fp8Linear
from engine.model.loader import load_model
from engine.model.random_checkpoint import DTYPES, config_dict, shard_specs
from kernels.fp8_gemm import Fp8GemmConfig


def _nbytes(spec) -> int:
    return math.prod(spec.shape) * torch.empty(0, dtype=DTYPES[spec.kind]).element_size()


def test_full_layout_matches_the_release() -> None:
    """Facts of deepseek-ai/DeepSeek-V4-Flash: 46 shards, 148.7 GiB of tensors, the MTP shard's 1575
    tensors, and the last three shards' file sizes (tensor bytes + a JSON header of ~100-110 bytes
    per tensor: layer 42's shard 3,590,026,352, the head's 1,059,332,516, MTP's 3,593,956,092)."""
    shards = shard_specs(config_dict("v4-flash"))
    assert len(shards) == 46 and len(shards[-1]) == 1575
    assert abs(sum(_nbytes(s) for sh in shards for s in sh) / 2**30 - 148.65) < 0.01
    for index, size in ((44, 3_590_026_352), (45, 1_059_332_516), (46, 3_593_956_092)):
        specs = shards[index - 1]
        header = size - sum(_nbytes(s) for s in specs)
        assert 60 * len(specs) < header < 120 * len(specs), (index, header)
    by_name = {s.name: s for sh in shards for s in sh}
    expect = {
        "layers.0.attn.wq_b.weight": ((32768, 1024), torch.float8_e4m3fn),
        "layers.0.attn.wq_b.scale": ((256, 8), torch.float8_e8m0fnu),
        "layers.0.attn.wo_a.weight": ((8192, 4096), torch.float8_e4m3fn),
        "layers.2.attn.compressor.ape": ((4, 1024), torch.float32),
        "layers.3.attn.compressor.wkv.weight": ((512, 4096), torch.bfloat16),
        "layers.2.attn.indexer.wq_b.scale": ((64, 8), torch.float8_e8m0fnu),
        "layers.2.attn.indexer.compressor.ape": ((4, 256), torch.float32),
        "layers.7.ffn.experts.255.w2.weight": ((4096, 1024), torch.int8),
        "layers.7.ffn.experts.255.w2.scale": ((4096, 64), torch.float8_e8m0fnu),
        "layers.2.ffn.gate.tid2eid": ((129280, 6), torch.int64),
        "layers.3.ffn.gate.bias": ((256,), torch.float32),
        "layers.0.hc_attn_fn": ((24, 16384), torch.float32),
        "mtp.0.h_proj.scale": ((32, 32), torch.float8_e8m0fnu),
        "hc_head_fn": ((4, 16384), torch.float32),
    }
    for name, (shape, dtype) in expect.items():
        assert by_name[name].shape == shape and DTYPES[by_name[name].kind] == dtype, name
    assert "layers.3.attn.indexer.wq_b.weight" not in by_name and "layers.1.attn.compressor.ape" not in by_name


@pytest.fixture(scope="module")
def narrow_dir(narrow_checkpoint_dir: Path) -> Path:
    """Written by ``make-random-checkpoint`` through the CLI (``narrow_checkpoint_dir``, once per run)."""
    return narrow_checkpoint_dir


@pytest.fixture(scope="module")
def dequantised(narrow_dir: Path):
    """The checkpoint loaded dequantised in fp32, once for the module (the tests only read it and
    run forwards on fresh states)."""
    return load_model(narrow_dir, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def fp4_kept(narrow_dir: Path):
    """The checkpoint loaded in fp32 with its FP4 experts kept packed, once for the module."""
    return load_model(narrow_dir, dtype="float32", progress=False, fp4_experts=True)


def test_files_index_and_values(narrow_dir: Path) -> None:
    index = json.loads((narrow_dir / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert files == [f"model-{i:05d}-of-00007.safetensors" for i in range(1, 8)]
    assert index["embed.weight"] == files[0] and index["layers.3.ffn_norm.weight"] == files[4] and index["head.weight"] == files[5]
    with safe_open(str(narrow_dir / files[1]), framework="pt") as f:
        tid2eid = f.get_tensor("layers.0.ffn.gate.tid2eid")
        scale = f.get_tensor("layers.0.attn.wq_a.scale")
        fp4 = f.get_tensor("layers.0.ffn.experts.3.w1.weight")
    assert all(len(set(row)) == 2 for row in tid2eid[:1000].tolist())  # k distinct experts per token
    counts = torch.bincount(tid2eid.flatten(), minlength=8).float()
    assert counts.min() / counts.mean() > 0.98  # balanced
    assert scale.dtype == torch.float8_e8m0fnu and fp4.dtype == torch.int8
    cfg = json.loads((narrow_dir / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 0, 4, 128, 0] and cfg["quantization_config"]["scale_fmt"] == "ue8m0"


def test_loads_and_runs_a_forward_step(narrow_dir: Path, dequantised) -> None:
    """The loader reads it (FP8/FP4 dequantised, or FP8 linears kept as ``Fp8Linear``); one step each,
    the FP8 model within its activation-quantisation error of the dequantised one."""
    ids = [0, 17, 4242, 99, 128000, 5]
    ref_model = dequantised
    ref = ref_model([(ref_model.new_state(), ids)], logits="all")
    assert torch.isfinite(ref).all() and ref.shape == (len(ids), 129280)
    fp8_model = load_model(narrow_dir, dtype="float32", progress=False, fp8=Fp8GemmConfig())
    kept = [n for n, m in fp8_model.named_modules() if isinstance(m, Fp8Linear)]
    assert len(kept) == 4 * 7 + 1  # per layer q_a, q_b, kv, o_b + 3 shared-expert; the CSA layer's indexer q_b
    got = fp8_model([(fp8_model.new_state(), ids)], logits="all")
    err = ((got - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.1, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_drawn_checkpoint_runs_with_fp8_linears(tmp_path: Path) -> None:
    """Drawn on the GPU, loaded on it in bf16 with FP8 linears kept (the Triton GEMM) and without."""
    from engine.model.random_checkpoint import make_random_checkpoint

    out = make_random_checkpoint(tmp_path / "ckpt", "v4-flash-narrow", layers=4, device="cuda")
    ids = [0, 17, 4242, 99, 128000, 5] * 30
    ref_model = load_model(out, dtype="bfloat16", device="cuda", progress=False)
    ref = ref_model([(ref_model.new_state(), ids)], logits="all")
    fp8_model = load_model(out, dtype="bfloat16", device="cuda", progress=False, fp8=Fp8GemmConfig())
    kept = [m for m in fp8_model.modules() if isinstance(m, Fp8Linear)]
    assert kept and all(m.weight.is_cuda and m.weight.dtype == torch.float8_e4m3fn for m in kept)
    got = fp8_model([(fp8_model.new_state(), ids)], logits="all")
    assert torch.isfinite(got).all()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 0.15, err


def test_fp4_experts_kept_packed(dequantised, fp4_kept) -> None:
    """``fp4_experts=True``: the experts stay packed (a quarter of bf16's bytes plus scales) and the
    forward matches the dequantised model's (FP4 × e8m0 dequantises exactly; fp32 sums)."""
    ids = [0, 17, 4242, 99, 128000, 5]
    ref_model, model = dequantised, fp4_kept
    ex = model.model.layers[2].mlp.experts
    assert ex.fp4 is not None and ex.gate_up_proj.numel() == 0
    assert ex.fp4[0].dtype == torch.int8 and ex.fp4[0].shape == (8, 256, 128) and ex.fp4[1].shape == (8, 256, 8)
    want = ref_model([(ref_model.new_state(), ids)], logits="all")
    got = model([(model.new_state(), ids)], logits="all")
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_fp4_experts_never_allocate_dense_weights(narrow_dir: Path, tiny_model_dir: Path) -> None:
    """A model built for FP4 experts has empty dense expert parameters from the start (at
    V4-Flash width they would be 12.9 GB a layer before the FP4 copies replace them); a checkpoint
    whose experts are dense still loads into it, to the same logits as without the flag."""
    from engine.model.config import ModelConfig
    from engine.model.model import DeepseekV4ForCausalLM

    built = DeepseekV4ForCausalLM(ModelConfig.from_dir(narrow_dir), torch.bfloat16, fp4_experts=True)
    assert all(layer.mlp.experts.gate_up_proj.numel() == 0 == layer.mlp.experts.down_proj.numel() for layer in built.model.layers)
    ids = [3, 9, 27, 81]
    dense = load_model(tiny_model_dir, dtype="float32", progress=False)
    flagged = load_model(tiny_model_dir, dtype="float32", progress=False, fp4_experts=True)
    assert flagged.model.layers[0].mlp.experts.fp4 is None
    assert torch.equal(flagged([(flagged.new_state(), ids)], logits="all"), dense([(dense.new_state(), ids)], logits="all"))


def test_host_slot_decoder_refuses_native_weights(fp4_kept) -> None:
    """The CPU slot decoder's compiled loops read dense weights: a native model is refused (the
    engine then decodes it on the general path); ``StaticDecoder`` takes it (test_static_decode_native)."""
    from engine.model.host_decode import HostDecoder

    with pytest.raises(ValueError, match="dequantised weights"):
        HostDecoder(fp4_kept, max_slots=2, max_tokens=64)


def test_experts_stacked_per_layer_in_the_model_dtype(narrow_dir: Path, dequantised, tmp_path: Path) -> None:
    """Each layer's dequantised experts are held in the model's dtype and stacked once complete
    (a real checkpoint's fp32 experts of every layer would not fit host memory): the bf16 model's
    experts are the fp32 model's rounded once; a missing expert is named, packed FP4 ones too (each
    layer's packed codes are stacked once complete, so one layer's per-expert copies exist at a time)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.errors import CheckpointError

    ref = dequantised
    half = load_model(narrow_dir, dtype="bfloat16", progress=False)
    for (name, a), (_, b) in zip(ref.named_parameters(), half.named_parameters()):
        if name.endswith(("gate_up_proj", "down_proj")):
            assert torch.equal(a.to(torch.bfloat16), b), name
    broken = tmp_path / "broken"
    shutil.copytree(narrow_dir, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    doomed = [k for k in sorted(index["weight_map"]) if k.startswith("layers.1.ffn.experts.3.w2.")]
    assert len(doomed) == 2  # its weight and scale
    for key in doomed:
        shard = broken / index["weight_map"].pop(key)
        tensors = load_file(str(shard))
        del tensors[key]
        save_file(tensors, str(shard), metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="experts of .* incomplete"):
        load_model(broken, dtype="float32", progress=False)
    with pytest.raises(CheckpointError, match="experts of 'model.layers.1.mlp.experts' incomplete"):  # kept packed
        load_model(broken, dtype="float32", progress=False, fp4_experts=True)


def test_without_mtp_layer() -> None:
    """``--no-mtp``: the same shards but the MTP layer's (the bench's faster write and load)."""
    cfg = config_dict("v4-flash", 2)
    full, bare = shard_specs(cfg), shard_specs(cfg, mtp=False)
    assert bare == full[:-1] and all(s.name.startswith("mtp.") for s in full[-1])

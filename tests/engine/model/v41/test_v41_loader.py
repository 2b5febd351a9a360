"""V4.1 checkpoint loading: native names, the family switch, and the errors a bad checkpoint gets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError
from engine.model.config import ModelConfig, model_type_of
from engine.model.v41.loader import load_v41_model, to_internal_name
from engine.runtime.builder import load_any_model
from tests.engine.model.v41.conftest import fixture_case


def _copy(case: str, tmp_path: Path, tokenizer: bool = True) -> tuple[Path, dict[str, torch.Tensor]]:
    ckpt, _ = fixture_case(case)
    out = tmp_path / case
    out.mkdir()
    shutil.copy(ckpt / "config.json", out / "config.json")
    if tokenizer and (ckpt / "tokenizer.json").is_file():
        shutil.copy(ckpt / "tokenizer.json", out / "tokenizer.json")
    return out, load_file(str(ckpt / "model.safetensors"))


def test_native_names_map_like_save_pretrained_names() -> None:
    assert to_internal_name("head.weight") == to_internal_name("lm_head.weight") == "lm_head.weight"
    assert to_internal_name("embed.weight") == to_internal_name("model.embed.weight") == "model.embed.weight"
    assert to_internal_name("layers.3.hc_ffn_scale") == "model.layers.3.hc_ffn.scale"
    assert to_internal_name("layers.3.attn.indexer.wq_b.weight") == "model.layers.3.attn.indexer.wq_b.weight"
    assert to_internal_name("layers.0.ffn.gate.bias_vl") is None  # image-span routing: text only
    assert to_internal_name("vision.blocks.0.attn.qkv.weight") is None


def test_native_checkpoint_loads_the_same_model(tmp_path: Path) -> None:
    """The released layout: no ``model.`` prefix, ``head.weight``, a composite config."""
    out, tensors = _copy("tester", tmp_path)
    native = {("head.weight" if k == "lm_head.weight" else k.removeprefix("model.")): v for k, v in tensors.items()}
    native["mtp.0.emb.weight"] = torch.zeros(2, 2)  # DSpark draft layers are kept aside
    save_file(native, str(out / "model.safetensors"))
    text = json.loads((out / "config.json").read_text())
    composite = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": text, "vision_config": {}}
    (out / "config.json").write_text(json.dumps(composite))
    ckpt, ref = fixture_case("tester")
    a, b = load_v41_model(ckpt, dtype="float32"), load_v41_model(out, dtype="float32")
    ids = ref["prompts"][0]["prompt_ids"]
    assert torch.equal(a([(a.new_state(), ids)]), b([(b.new_state(), ids)]))
    assert "mtp.0.emb.weight" in b.mtp


def test_family_selected_from_config_json(tmp_path: Path) -> None:
    ckpt, _ = fixture_case("tester")
    assert model_type_of(ckpt) == "deepseek_v41_text"
    assert type(load_any_model(ckpt, dtype="float32")).__name__ == "DeepseekV41ForCausalLM"
    with pytest.raises(CheckpointError, match="deepseek_v4"):
        ModelConfig.from_dir(ckpt)
    bad = tmp_path / "other"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="unsupported model_type 'llama'"):
        load_any_model(bad)


def test_missing_tensor_names_it(tmp_path: Path) -> None:
    out, tensors = _copy("tester", tmp_path)
    del tensors["model.layers.3.attn.indexer.wk.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.3\.attn\.indexer\.wk\.weight'"):
        load_v41_model(out)


def test_misshapen_tensor_names_file_and_tensor(tmp_path: Path) -> None:
    out, tensors = _copy("tester", tmp_path)
    tensors["model.layers.2.ffn.experts.1.w2.weight"] = torch.zeros(64, 63)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_v41_model(out)
    msg = str(err.value)
    assert "model.safetensors" in msg and "'model.layers.2.ffn.experts.1.w2.weight'" in msg and "(64, 63)" in msg


def test_unexpected_tensor_is_an_error(tmp_path: Path) -> None:
    out, tensors = _copy("tester", tmp_path)
    tensors["model.layers.0.attn.compressor.wkv.weight"] = torch.zeros(32, 64)  # layer 0 is window-only
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.attn.compressor.wkv.weight'"):
        load_v41_model(out)


def test_engram_checkpoint_without_tokenizer_is_refused(tmp_path: Path) -> None:
    out, tensors = _copy("engram", tmp_path, tokenizer=False)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_v41_model(out)


def test_engram_checkpoint_with_a_foreign_tokenizer_is_refused(tmp_path: Path) -> None:
    out, tensors = _copy("engram", tmp_path, tokenizer=False)
    save_file(tensors, str(out / "model.safetensors"))
    tok = json.loads((fixture_case("engram")[0] / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {k: v for k, v in tok["model"]["vocab"].items() if v < 30}  # another vocabulary
    (out / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match="engram_compressed_vocab_size is 40"):
        load_v41_model(out)


def test_fp8_block_scaled_weights_are_dequantized(tmp_path: Path) -> None:
    """The released layout stores non-expert weights as FP8 e4m3 with 128×128 ue8m0 (uint8
    exponent) block scales: the loaded model equals one loaded from the dequantized floats."""
    out, tensors = _copy("tester", tmp_path)
    name = "model.layers.1.attn.wq_b.weight"  # (128, 32): one 128×128 block
    w = tensors[name]
    exp = torch.ceil(torch.log2(w.abs().max() / 448.0))  # a power-of-two scale covering the block
    q = (w / 2.0**exp).to(torch.float8_e4m3fn)
    tensors[name] = q
    tensors[name.removesuffix(".weight") + ".scale"] = (exp + 127).to(torch.uint8).reshape(1, 1)
    save_file(tensors, str(out / "model.safetensors"))
    plain = tmp_path / "plain"
    shutil.copytree(out, plain)
    floats = dict(tensors)
    floats[name] = q.float() * 2.0**exp
    del floats[name.removesuffix(".weight") + ".scale"]
    save_file(floats, str(plain / "model.safetensors"))
    a, b = load_v41_model(out, dtype="float32"), load_v41_model(plain, dtype="float32")
    assert torch.equal(a.model.layers[1].attn.wq_b.weight, b.model.layers[1].attn.wq_b.weight)
    assert not torch.equal(a.model.layers[1].attn.wq_b.weight, w)  # it really was rounded


def test_state_accounting_covers_a_real_state() -> None:
    """The state pool's byte model (block units + one boundary) bounds what a sequence holds."""
    from engine.model.v41.state import state_bytes

    ckpt, ref = fixture_case("flash_shape")
    model = load_v41_model(ckpt, dtype="float32")
    block, boundary = state_bytes(model.config, torch.float32)
    st = model.new_state()
    model([(st, ref["prompts"][0]["prompt_ids"])])  # 82 tokens: one unit of 128
    assert 0 < st.nbytes() <= block + boundary

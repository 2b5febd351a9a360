"""ModelCatalog: served names, families (V4 / V4.1 encodings), tokenizer source, special ids."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest

from server.config import GatewayConfig
from server.model import ModelCatalog, package_tokenizer_path


def test_defaults_without_checkpoint():
    cat = ModelCatalog.load(GatewayConfig())
    assert list(cat.served) == ["DeepSeek-V4-Pro"]
    assert (cat.eos_token_id, cat.bos_token_id, cat.thinking_end_id) == (1, 0, 128822)
    assert cat.context_len == 65536


def test_v41_alias_needs_the_checkpoint_tokenizer():
    with pytest.raises(ValueError, match="System"):
        ModelCatalog.load(GatewayConfig(served_model_names=("flash=v4.1",)))


def test_v41_checkpoint(tmp_path):
    tok = json.loads(package_tokenizer_path().read_text())
    system_id = 129280
    tok["added_tokens"].append({
        "id": system_id, "content": "<｜System｜>", "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": False, "special": True,
    })
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "max_position_embeddings": 8192, "vocab_size": 129536}))
    cat = ModelCatalog.load(GatewayConfig(model_dir=str(tmp_path), served_model_names=("flash", "pro=v4")))
    assert cat.served["flash"].family == "v4.1" and cat.served["pro"].family == "v4"
    assert cat.context_len == 8192 and cat.vocab_size == 129536
    body = {"model": "flash", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    conv = dr.ChatCompletionRequest(body).convert(cat.conversion)
    assert system_id in cat.encoding_for(conv.model_version).encode(conv.conversation)
    default = ModelCatalog.load(GatewayConfig(model_dir=str(tmp_path)))
    assert set(default.served) == {tmp_path.name, "DeepSeek-V4.1-Flash"}
    assert ModelCatalog.load(GatewayConfig(model_dir=str(tmp_path), max_model_len=100)).context_len == 100


def test_default_context_is_the_engines(tmp_path):
    """A checkpoint allowing 1M tokens still defaults to the engine's 65536, so a default
    request the gateway admits is one the engine accepts."""
    from engine.runtime.config import EngineConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "max_position_embeddings": 1 << 20}))
    cat = ModelCatalog.load(GatewayConfig(model_dir=str(tmp_path)))
    assert cat.context_len == EngineConfig.max_model_len == 65536

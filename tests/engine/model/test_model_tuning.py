"""ModelTuning is passed down from where the model is built to every layer, and set_tuning
re-applies it (engine/model/model.py); MoETuning picks the CPU experts path (engine/model/moe.py)."""

from __future__ import annotations

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.model import TUNING, DeepseekV4ForCausalLM, ModelTuning
from engine.model.moe import MoETuning
from engine.model.tiny import random_state_dict, tiny_config_dict
from kernels.prefill import HcPreTuning, IndexerTuning, PrefillTuning


def _layers_tuning(model: DeepseekV4ForCausalLM) -> set[tuple]:
    return {(layer.self_attn.prefill, layer.hc_pre, layer.mlp.experts.tuning) for layer in model.model.layers}


def test_every_layer_gets_the_model_tuning() -> None:
    cfg = ModelConfig.from_dict(tiny_config_dict())
    tuning = ModelTuning(
        prefill=PrefillTuning(indexer=IndexerTuning(query_tile=64), fold_norm_rope=0, hc_pre=HcPreTuning(block_m=16)),
        moe=MoETuning(dense_macs=0),
    )
    model = DeepseekV4ForCausalLM(cfg, torch.float32, tuning)
    assert model.tuning is tuning and _layers_tuning(model) == {(tuning.prefill, tuning.prefill.hc_pre, tuning.moe)}
    model.set_tuning(TUNING)
    assert _layers_tuning(model) == {(TUNING.prefill, TUNING.prefill.hc_pre, TUNING.moe)}
    assert DeepseekV4ForCausalLM(cfg).tuning == ModelTuning()  # the defaults


def test_moe_tuning_picks_the_cpu_path_and_not_the_result() -> None:
    """``dense_macs=0`` takes the per-expert loop instead of the dense GEMMs; ``fused_tokens=0``
    the eager experts instead of the compiled loop; the logits stay the same."""
    cfg = ModelConfig.from_dict(tiny_config_dict())
    ref = DeepseekV4ForCausalLM(cfg)
    ref.load_state_dict(random_state_dict(ref, 3), strict=False)
    other = DeepseekV4ForCausalLM(cfg, tuning=ModelTuning(moe=MoETuning(dense_macs=0, fused_tokens=0)))
    other.load_state_dict(ref.state_dict())
    for layer in other.model.layers:
        layer.mlp.experts._dense = lambda *a: pytest.fail("the dense path ran with dense_macs=0")
    ids = list(range(5, 13))
    torch.testing.assert_close(other([(other.new_state(), ids)]), ref([(ref.new_state(), ids)]), rtol=1e-5, atol=1e-5)

"""V4.1 config parsing: the fixture configs, defaults as transformers derives them, bad schedules."""

from __future__ import annotations

import pytest

from engine.errors import CheckpointError
from engine.model.v41.config import V41Config
from tests.engine.model.v41.conftest import fixture_case


def test_fixture_schedules() -> None:
    cfg = V41Config.from_dir(fixture_case("flash_shape")[0])
    assert cfg.compress_ratios == (0, 0, 2, 2, 2, 1, 1, 1)
    assert (cfg.kv_source_layer_ids, cfg.index_source_layer_ids, cfg.candidate_source_layer_id) == ((2, 5), (2, 4, 5, 7), 5)
    assert [cfg.kv_source_of(i) for i in range(8)] == [None, None, 2, 2, 2, 5, 5, 5]
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_main.rope_type == "default"
    assert cfg.rms_norm_eps == 1e-20 and cfg.unit_tokens == 128


def test_defaults_follow_the_released_schedule() -> None:
    flash = V41Config.from_dict({"model_type": "deepseek_v41_text"})
    assert flash.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert flash.kv_source_layer_ids == (2, 8, 14, 20) and flash.candidate_source_layer_id == 20
    small = V41Config.from_dict({"model_type": "deepseek_v41_text", "num_hidden_layers": 6})
    assert small.compress_ratios == (0, 0, 2, 2, 1, 1)  # the released pattern scaled to 6 layers
    assert small.kv_source_layer_ids == (2, 4) == small.index_source_layer_ids and small.candidate_source_layer_id == 4


def test_composite_config_reads_text_config() -> None:
    raw = {"model_type": "deepseek_v41", "text_config": {"num_hidden_layers": 4, "compress_ratios": [0, 2, 1, 1, 0], "num_nextn_predict_layers": 1}, "quantization_config": {"fmt": "e4m3"}}
    cfg = V41Config.from_dict(raw)
    assert cfg.compress_ratios == (0, 2, 1, 1) and cfg.quantization == {"fmt": "e4m3"}


@pytest.mark.parametrize(
    "text, match",
    [
        ({"num_hidden_layers": 3, "compress_ratios": [0, 2]}, "compress_ratios has 2 entries"),
        ({"num_hidden_layers": 3, "compress_ratios": [0, 2, 2], "kv_source_layer_ids": [0]}, "kv_source_layer_ids"),
        ({"num_hidden_layers": 3, "compress_ratios": [0, 2, 2], "kv_source_layer_ids": [2]}, "needs a kv_source_layer_ids entry"),
        ({"num_hidden_layers": 3, "compress_ratios": [0, 2, 2], "candidate_source_layer_id": 0}, "candidate_source_layer_id"),
        ({"num_hidden_layers": 3, "engram_layer_ids": [1], "engram_num_embeddings": [5, 6]}, "engram_num_embeddings"),
        # schedules the reference's forward fails on (held-out shapes run against it):
        ({"num_hidden_layers": 4, "compress_ratios": [0, 2, 2, 1], "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 2],
          "candidate_source_layer_id": -1}, "layer 3 reads the compressed rows of KV source 3"),
        ({"num_hidden_layers": 6, "compress_ratios": [0, 2, 2, 2, 1, 1], "kv_source_layer_ids": [1, 4], "index_source_layer_ids": [1, 2, 3, 4, 5],
          "candidate_source_layer_id": 1}, r"index sources \[4, 5\] come after candidate_source_layer_id 1"),
    ],
)
def test_bad_schedules_are_refused(text: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        V41Config.from_dict({"model_type": "deepseek_v41_text", **text})

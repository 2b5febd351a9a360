"""DSpark draft layers: release names round-trip, blocks of k <= dspark_block_size with confidences,
the confidence cut-off, and the trained tiny checkpoint drafting its language."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.errors import CheckpointError
from engine.model.tiny_mtp import TrainConfig, sentence
from engine.model.v41.dspark import DSpark, DSparkDrafter
from engine.model.v41.loader import load_v41_model


@pytest.fixture(scope="module")
def trained(trained_dspark_model_dir: Path):
    """The session's trained ``tiny-v41`` checkpoint (tests/conftest.py: the same
    ``make_tiny_model(seed=0, preset="tiny-v41", train_mtp=TrainConfig(seed=0))`` call, built once
    for the run instead of once more here), loaded read-only."""
    model = load_v41_model(Path(trained_dspark_model_dir), dtype="float32")
    return model, DSpark.from_model(model)


def _drafter(model, dspark, ids: list[int], threshold: float | None = None):
    drafter = DSparkDrafter(model, dspark, threshold)
    state = model.new_state()
    rows = model([(state, ids[:-1])], logits="taps")
    st = drafter.new_state()
    anchors = drafter.feed([st], [rows], [ids[1:]], [0])
    return drafter, st, anchors


def test_release_names_round_trip_and_missing_tensors_are_refused(trained) -> None:
    model, dspark = trained
    tensors = dspark.release_tensors()
    assert "mtp.0.main_proj.weight" in tensors and "mtp.1.markov_head.markov_w1.weight" in tensors and "mtp.1.hc_attn_fn" in tensors
    again = DSpark(model.config, torch.float32)
    again.load_release(tensors)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), dspark.parameters()))
    with pytest.raises(CheckpointError, match="missing DSpark tensor"):
        DSpark(model.config, torch.float32).load_release({k: v for k, v in tensors.items() if "confidence" not in k})


def test_trained_blocks_continue_the_language_with_confidences(trained) -> None:
    model, dspark = trained
    lang = TrainConfig()
    ids = sentence(lang, 1007, 20)
    drafter, st, anchors = _drafter(model, dspark, ids)
    assert int(anchors[0]) == ids[-1] and st.next_pos == len(ids) - 1
    for k in range(1, model.config.dspark_block_size + 1):
        (block,) = drafter.draft([st], anchors, k)
        assert len(block.tokens) == len(block.confidence) == k and all(0 < c < 1 for c in block.confidence)
    truth = sentence(lang, ids[-1], 6)[1:]
    right = sum(a == b for a, b in zip(block.tokens, truth))
    assert right >= 3, (block.tokens, truth)
    assert drafter.propose([st], anchors, 5) == [block.tokens]  # no cut-off by default
    cut, _, _ = _drafter(model, dspark, ids, threshold=1.0)  # nothing reaches 1.0: one draft
    assert [len(d) for d in cut.propose([st], anchors, 5)] == [1]

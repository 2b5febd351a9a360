"""``make-tiny-model --preset tiny-v41``: a loadable V4.1 checkpoint whose cached path is exact."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model.tiny import make_tiny_model
from engine.model.v41.loader import load_v41_model


def test_tiny_v41_loads_and_chunked_equals_one_shot(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "tiny", seed=3, preset="tiny-v41")
    model = load_v41_model(path)
    assert model.config.vocab_size == 129280 and (path / "tokenizer.json").is_file()
    ids = torch.randint(0, 129280, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    one = model([(model.new_state(), ids)])[0]
    st = model.new_state()
    for a in range(0, 40, 9):
        chunked = model([(st, ids[a : a + 9])])[0]
    assert int(one.argmax()) == int(chunked.argmax())
    assert (one - chunked).abs().max().item() < 1e-3

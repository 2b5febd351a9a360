"""The V4.1 model runs in bf16 too (``--dtype bfloat16``): finite fp32 logits, the same shape."""

from __future__ import annotations

import torch

from engine.model.v41.loader import load_v41_model
from tests.engine.model.v41.conftest import fixture_case


def test_bf16_forward_and_decode() -> None:
    ckpt, ref = fixture_case("tester")
    model = load_v41_model(ckpt, dtype="bfloat16")
    ids = ref["prompts"][0]["prompt_ids"]
    st = model.new_state()
    logits = model([(st, ids)])
    logits = model([(st, [int(logits[0].argmax())])])
    assert logits.dtype == torch.float32 and logits.shape == (1, model.config.vocab_size)
    assert bool(torch.isfinite(logits).all()) and st.num_tokens == len(ids) + 1

"""``cpu_layer``: the compiled decode layer's router against ``MoE`` for every scoring function,
and ``cpu_fused._exp`` (the vectorisable exp those loops use) against float64 ``exp``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model import cpu_fused, cpu_layer
from engine.model.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="numba missing")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32", progress=False)


@pytest.mark.parametrize("scoring", sorted(cpu_layer.SCORING))
def test_moe_matches_eager_for_each_scoring(model, scoring: str) -> None:
    """Hash-routed and score-routed layers, sqrtsoftplus / sigmoid / softmax scores: the compiled
    router + experts give the eager ``MoE``'s output (its compiled experts off) within 1e-5."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, model.config.hidden_size, generator=g)
    ids = torch.randint(0, model.config.vocab_size, (9,), generator=g)
    for layer in model.model.layers:
        moe = layer.mlp
        old = moe.gate.scoring_func, moe.fused
        moe.gate.scoring_func, moe.fused = scoring, False
        try:
            with torch.inference_mode():
                want = moe(x, ids)
            w = cpu_layer.pack(layer)
            hashed, code, k, scaling = w.routing
            got = cpu_layer._moe(x.numpy(), ids.numpy(), w.gate, w.bias, w.tid2eid, hashed, code, k, scaling, *w.experts, w.limit)
        finally:
            moe.gate.scoring_func, moe.fused = old
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-5)


def test_exp_within_a_few_ulp() -> None:
    xs = np.concatenate([np.linspace(-87, 88, 20001), [-1e-8, 0.0, 1e-8, -0.5, 0.5]]).astype(np.float32)
    got = np.array([cpu_fused._exp(x) for x in xs], np.float64)
    want = np.exp(xs.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 4e-7  # ~3 ulp of float32
    assert cpu_fused._exp(np.float32(-200.0)) <= np.float32(1.7e-38)  # clamped to exp(-87): below any rounding step
    assert np.isfinite(cpu_fused._exp(np.float32(200.0)))
    assert np.isnan(cpu_fused._exp(np.float32("nan")))

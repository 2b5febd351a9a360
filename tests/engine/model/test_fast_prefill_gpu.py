"""The general path with ``Attention.fast_prefill`` (Triton prefill: ``kernels.prefill``, fused norm
+ RoPE, mHC input) against the same model on the exact path, fp32, within 1e-4 of the logits.

On CUDA: ``pytest -m gpu tests/engine/model/test_fast_prefill_gpu.py``; on CPU it runs under
Triton's interpreter through ``tests/kernels/test_interpret.py``. The CSA indexer keeps every
visible row here (``topk`` raised), so the comparison does not hinge on how the two paths order
exactly tied indexer scores; the kernel's top-k itself is ``tests/kernels/test_prefill.py``'s.
"""

from __future__ import annotations

import pytest
import torch

from bench.kernel_helpers import kernel_test_device

pytestmark = pytest.mark.gpu
DEV = kernel_test_device()

from engine.model.loader import load_model
from engine.model.model import ModelTuning


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _set(model, fast: bool) -> None:
    for layer in model.model.layers:
        layer.self_attn.fast_prefill = fast
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk = 1 << 20


@pytest.mark.parametrize("fold", [0, 3] if DEV == "cpu" else [0, 1, 2, 3])
@pytest.mark.parametrize("fixture", ["tiny_model_dir", "small_windows_model_dir"])
def test_fast_prefill_matches_general_path(request, fixture, fold) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    from kernels import prefill as kp

    tuning = ModelTuning(prefill=kp.PrefillTuning(fold_norm_rope=fold))  # norm/RoPE folded into attention
    model = load_model(request.getfixturevalue(fixture), dtype="float32", device=DEV, progress=False, tuning=tuning)
    n = 300 if DEV == "cuda" else 66
    ids = _ids(n, 1)

    calls = []
    real = kp.prefill_attention
    kp.prefill_attention = lambda *a, **k: calls.append(1) or real(*a, **k)
    runs = {}
    try:
        for fast in (False, True):
            _set(model, fast)
            one = model([(model.new_state(), ids)], logits="all")
            st = model.new_state()  # chunked, then decode tokens and a new prompt in one batch
            a = model([(st, ids[: n // 3])], logits="all")
            b = model([(st, ids[n // 3 :])], logits="all")
            other = model.new_state()
            model([(other, ids[:20])])
            mixed = model([(st, ids[:1]), (other, ids[20:45]), (model.new_state(), ids[5:9])])
            runs[fast] = (one, torch.cat([a, b]), mixed)
            assert bool(calls) == fast  # the Triton path ran exactly when asked for
    finally:
        kp.prefill_attention = real
    for got, want in zip(runs[True], runs[False]):
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= 1e-4 * max(1.0, scale)

"""V4.1 indexer scores over stored FP4 keys (``kernels.v41_indexer``) against their PyTorch
reference, and the reference against ``Indexer.select``'s scores over fake-quantised keys.

GPU: ``pytest -m gpu tests/kernels/test_v41_indexer.py``; on CPU the GPU tests run under
Triton's interpreter at small sizes (``tests/kernels/test_interpret.py``)."""

from __future__ import annotations

import pytest
import torch

from engine.model.v41.quant import fp4_indexer
from kernels.v41_indexer import v41_indexer_scores, v41_indexer_scores_reference
from kernels.v41_kv import pack_fp4_keys
from tests.kernels.interpreted import INTERPRETED, ON_GPU, run_gpu_tests_interpreted

DEV = "cuda" if ON_GPU else "cpu"


def _case(b: int, hi: int, di: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = fp4_indexer(torch.randn(b, hi, di, generator=g))
    w = torch.randn(b, hi, generator=g)
    keys = torch.randn(b + 1, t, di, generator=g)
    slot = torch.randperm(b + 1, generator=g)[:b]
    complete = torch.randint(0, t + 1, (b,), generator=g)
    return q, w, keys, slot, complete


def test_reference_is_the_indexer_score() -> None:
    q, w, keys, slot, complete = _case(3, 8, 32, 12)
    kq, ke = pack_fp4_keys(keys)
    got = v41_indexer_scores_reference(q, w, kq, ke, slot, complete, 32**-0.5)
    for i in range(3):
        k = fp4_indexer(keys[slot[i]])
        want = ((q[i] @ k.t()).relu() * 32**-0.5 * w[i][:, None]).sum(0)
        want[complete[i] :] = float("-inf")
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)


def _gpu_or_interpreter() -> None:
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (see tests/kernels/test_interpret.py)")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 8, 32, 12), (2, 20, 64, 150)] if not ON_GPU else [(3, 8, 32, 12), (64, 32, 128, 512), (1, 32, 128, 65536)])
def test_kernel_matches_the_reference(shape) -> None:
    _gpu_or_interpreter()
    q, w, keys, slot, complete = (t.to(DEV) for t in _case(*shape))
    kq, ke = pack_fp4_keys(keys)
    args = (q, w, kq, ke, slot, complete, shape[2] ** -0.5)
    got, want = v41_indexer_scores(*args), v41_indexer_scores_reference(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


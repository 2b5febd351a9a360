"""The static decode step over native FP8/FP4 weights on CUDA with CUDA graphs (the fused step:
FP8 GEMV at batch 1, block-scaled FP8 GEMM above, FP4 grouped experts), against the native
general path and the dequantised model — the bounds of ``test_static_decode_native``.

Run on a GPU machine: ``pytest -m gpu tests/engine/model/test_static_decode_native_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.model.loader import load_model
from tests.engine.model.test_static_decode_native import FLIP, NATIVE_VS_DEQUANT, check, decode_both, native_dir, native_model  # noqa: F401 (fixture)

BATCHES = {"b1": [5], "b2": [3, 130], "b9": [0, 1, 3, 4, 5, 127, 128, 130, 200]}


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize("lengths", BATCHES.values(), ids=BATCHES.keys())
def test_graph_step_fp32_native(native_dir, lengths) -> None:
    """fp32 activations: the same bounds as on CPU, through the Triton kernels and graphs."""
    native = native_model(native_dir, "float32", "cuda")
    dense = load_model(native_dir, dtype="float32", device="cuda", progress=False)
    errors, _, _, dec = decode_both(native, dense, lengths, steps=6, seed=11, use_graphs=True)
    assert dec.triton and dec._graphs
    check(errors)


@pytest.mark.parametrize("lengths", BATCHES.values(), ids=BATCHES.keys())
def test_graph_step_bf16_native(native_dir, lengths) -> None:
    """bf16: the slot step within bf16's rounding of the native general path (every row within
    ``FLIP`` relative) and no farther from the dequantised bf16 model than the general path."""
    native = native_model(native_dir, "bfloat16", "cuda")
    dense = load_model(native_dir, dtype="bfloat16", device="cuda", progress=False)
    errors, _, _, dec = decode_both(native, dense, lengths, steps=6, seed=12, use_graphs=True)
    assert dec.triton and dec._graphs
    assert errors.flip <= FLIP, errors
    assert errors.general <= NATIVE_VS_DEQUANT and errors.static <= errors.general + FLIP, errors

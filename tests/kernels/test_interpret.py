"""The Triton kernels on CPU, through Triton's interpreter (``TRITON_INTERPRET=1``), at small sizes.

The interpreter is chosen when a kernel module is imported, so the kernel tests run in a child
pytest. Checks the kernels' indexing, masking and split logic in CI, which has no GPU; timing and
compilation for the real chip are only checked by ``pytest -m gpu tests/kernels`` on the device.

The default run covers V4.1's kernel tests (decode attention, indexer, fused packing, mHC) and the
grouped GEMMs and the RoPE V4.1's prefill takes; the ``slow`` run (``make test-all``) adds V4's
and the shared kernel files (attention, indexer, pooling, routing, experts, GEMVs, mHC, fused
glue, the prefill kernels) and the fast-prefill model comparisons (``Attention.fast_prefill``
against the exact path on both tiny checkpoints), which take minutes under the interpreter and
are also run on the GPU by ``pytest -m gpu``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.interpreted import run_gpu_tests_interpreted

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["tests/kernels/test_kernels.py", "tests/kernels/test_prefill.py"]
FAST_PREFILL = "tests/engine/model/test_fast_prefill_gpu.py"
V41_KERNEL_TESTS = [
    "tests/kernels/test_v41_attention.py", "tests/kernels/test_v41_indexer.py", "tests/kernels/test_v41_pack.py", "tests/kernels/test_v41_mhc.py",
    "tests/kernels/test_moe_grouped.py", "tests/kernels/test_rope.py", "tests/kernels/test_topk.py",
]


def run_interpreted(targets: list[str], timeout: float) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "KERNELS_TEST_SMALL": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "gpu", "-p", "no:cacheprovider", *targets]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]


def test_v41_kernels_under_triton_interpreter() -> None:
    """V4.1's kernels (decode attention, indexer scores, fused packing, mHC, grouped GEMMs, RoPE, row top-k) at small sizes, one child."""
    run_gpu_tests_interpreted(*V41_KERNEL_TESTS)


@pytest.mark.slow  # the Triton interpreter: minutes on a 2-core box; the GPU suite runs these kernels natively
def test_kernels_under_triton_interpreter() -> None:
    run_interpreted(KERNEL_TESTS, timeout=500)


@pytest.mark.slow
def test_all_interpreted_kernel_and_model_tests() -> None:
    run_interpreted([*KERNEL_TESTS, FAST_PREFILL], timeout=1800)

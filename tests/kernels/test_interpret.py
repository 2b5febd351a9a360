"""The Triton kernels on CPU, through Triton's interpreter (``TRITON_INTERPRET=1``), at small sizes.

The interpreter is chosen when a kernel module is imported, so the kernel tests run in a child
pytest. Checks the kernels' indexing, masking and split logic in CI, which has no GPU; timing and
compilation for the real chip are only checked by ``pytest -m gpu tests/kernels`` on the device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_kernels_under_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "KERNELS_TEST_SMALL": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "gpu", "-p", "no:cacheprovider", "tests/kernels/test_kernels.py", "tests/kernels/test_prefill.py", "tests/kernels/test_moe_grouped.py",
           "tests/engine/model/test_fast_prefill_gpu.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

"""Running a kernel test file's GPU tests on CPU through Triton's interpreter, in a child pytest
(the interpreter is chosen when Triton kernels are defined, so it cannot be switched in-process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def run_gpu_tests_interpreted(*test_files: str) -> None:
    """Run the ``gpu``-marked tests of ``test_files`` in one child pytest under ``TRITON_INTERPRET=1``
    (a child's start is seconds: group files rather than one child each); skip where they run directly."""
    pytest.importorskip("triton")
    if ON_GPU or INTERPRETED:
        pytest.skip("the GPU tests run directly here")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "gpu", "-p", "no:cacheprovider", *test_files]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300 * len(test_files), check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

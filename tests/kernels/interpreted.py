"""Running a kernel test file's GPU tests on CPU through Triton's interpreter, in a child pytest
(the interpreter is chosen when Triton kernels are defined, so it cannot be switched in-process)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The files whose ``*_under_interpreter`` test is in the default suite: one child pytest runs the
# GPU tests of all of them, for whichever of those tests comes first in this process (a child's
# start alone, torch and Triton imported and the files collected, is ~9 s of the 2-core box), and
# each test then passes or fails on its own file's results. tests/conftest.py sends those tests to
# one xdist worker. Any other file (the slow ones) runs in a child of its own.
BATCHED = ("tests/kernels/test_v41_attention.py", "tests/kernels/test_v41_indexer.py", "tests/kernels/test_v41_pack.py")
_batch: dict[str, str | None] = {}  # file -> None (its GPU tests passed) or why not


def _child(files: list[str], *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *extra, *files]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300 * len(files), check=False)


def _run_batch() -> None:
    """Every ``BATCHED`` file's GPU tests in one child: each file's verdict from the JUnit report
    (at least one test ran, none failed or errored: what the child's exit status 0 is for one file)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        proc = _child(list(BATCHED), f"--junitxml={report}")
        cases = ET.parse(report).getroot().iter("testcase") if report.is_file() else iter(())
        ran: dict[str, int] = dict.fromkeys(BATCHED, 0)
        bad: dict[str, list[str]] = {f: [] for f in BATCHED}
        for case in cases:
            module = case.get("classname", "")
            for f in BATCHED:
                if module == f[:-3].replace("/", ".") or module.startswith(f[:-3].replace("/", ".") + "."):
                    ran[f] += 1
                    for outcome in ("failure", "error"):
                        for el in case.iter(outcome):
                            bad[f].append(f"{case.get('name')}: {outcome}: {(el.get('message') or '')[:500]}\n{(el.text or '')[-1500:]}")
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    for f in BATCHED:
        if bad[f]:
            _batch[f] = "\n".join(bad[f])[-6000:]
        elif not ran[f]:
            _batch[f] = f"no GPU test of {f} ran (child exit status {proc.returncode}):\n{tail}"
        else:
            _batch[f] = None


def run_gpu_tests_interpreted(test_file: str) -> None:
    """Run ``test_file``'s ``gpu``-marked tests under ``TRITON_INTERPRET=1``; skip where they run directly."""
    pytest.importorskip("triton")
    if ON_GPU or INTERPRETED:
        pytest.skip("the GPU tests run directly here")
    path = Path(test_file).resolve()
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    if rel in BATCHED:
        if rel not in _batch:
            _run_batch()
        failure = _batch[rel]
        assert failure is None, failure
        return
    proc = _child(["-x", test_file])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

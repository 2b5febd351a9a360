"""The int8 GEMM probe (engine/model/int8_gemm.py) picks a weight range whose products are exact,
and the greedy head is exact on the AVX2 path whatever this machine offers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model import int8_gemm

pytestmark = pytest.mark.skipif(not hasattr(torch, "_int_mm"), reason="no CPU int8 GEMM in this torch")
REPO = Path(__file__).resolve().parents[3]


def run_capped(args: list[str], isa: str = "AVX2", timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python args`` in a fresh process whose oneDNN may use at most ``isa``."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_probed_range_is_exact_on_random_full_range_products() -> None:
    levels = int8_gemm.probe().weight_levels
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (5, 4096), dtype=torch.int8, generator=g)  # (M, K)
    b = torch.randint(-levels, levels + 1, (4096, 700), dtype=torch.int8, generator=g)  # (K, N)
    a[:, : 2048] = 127  # long runs of the largest codes: the pairs most likely to saturate
    b[: 2048, : 350] = levels
    assert torch.equal(torch._int_mm(a, b), a.int() @ b.int())


def test_avx2_cap_reports_saturating_pairs_and_the_safe_range() -> None:
    code = "from engine.model import int8_gemm as g; p = g.probe(); print(p.exact_full_range, p.weight_levels)"
    out = run_capped(["-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", str(int8_gemm.SAFE_LEVELS)]


@pytest.mark.skipif(not int8_gemm.probe().exact_full_range, reason="this process already runs the AVX2 path")
def test_greedy_head_is_exact_with_onednn_capped_at_avx2() -> None:
    """The whole lm_head test file again, oneDNN limited to AVX2 (no VNNI), so a VNNI machine
    proves the path an AVX2-only CPU takes; its saturation case must run there, not skip."""
    out = run_capped(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine/model/test_lm_head.py"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary and "failed" not in summary, summary


def test_cpu_dot_flags_reads_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n")
    assert int8_gemm.cpu_dot_flags(str(info)) == ("avx512_vnni",)
    info.write_text("flags\t\t: fpu sse2 avx2 fma\n")
    assert int8_gemm.cpu_dot_flags(str(info)) == ()
    assert int8_gemm.cpu_dot_flags(str(tmp_path / "missing")) == ()

"""Shared helpers of the V4.1 tests: the reference fixtures of ``../shared/fixtures/deepseek_v41``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parents[5] / "shared" / "fixtures" / "deepseek_v41"
CASES = ("tester", "flash_shape", "engram")


def fixture_case(case: str) -> tuple[Path, dict]:
    """``(checkpoint dir, reference.json)`` of one case; skips when the fixtures are absent."""
    root = FIXTURES / case
    if not (root / "reference.json").is_file():
        pytest.skip(f"fixture {root} not present")
    return root / "checkpoint", json.loads((root / "reference.json").read_text())


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, as the engine runs on CPU (and ~10x faster on the shared 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

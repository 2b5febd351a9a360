"""``bench.gpu_slice_bench``: the byte floors of the plain and the verify step (issue 25), the profile's idle gaps."""

from __future__ import annotations

import pytest

from bench.gpu_slice_bench import decode_floor_bytes, touched_experts
from engine.model.config import ModelConfig
from engine.model.random_checkpoint import config_dict


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_verify_floor_between_the_plain_floor_and_width_plain_steps(batch: int) -> None:
    """A verify of ``w`` tokens per sequence reads the experts of ``batch·w`` tokens (more than a
    plain step's, at most ``w``x), the same dense weights and state once; lm_head only with ``head``."""
    cfg = ModelConfig.from_dict(config_dict("v4-flash", layers=4))
    plain = decode_floor_bytes(cfg, batch, 1024)
    head = 2 * cfg.vocab_size * cfg.hidden_size
    assert decode_floor_bytes(cfg, batch, 1024, 1, head=False) + head == pytest.approx(plain)
    last = plain
    for w in (2, 3, 4):
        assert touched_experts(cfg, batch) < touched_experts(cfg, batch * w) <= w * touched_experts(cfg, batch)
        verify = decode_floor_bytes(cfg, batch, 1024, w)
        assert last < verify < w * plain
        last = verify


def test_idle_gaps_are_the_time_no_kernel_runs() -> None:
    """``idle_gaps``: overlapping kernels leave no gap; the waits between them sum, largest first,
    each named by the kernels on either side."""
    from types import SimpleNamespace

    from bench.gpu_slice_bench import idle_gaps

    spans = [(0, 10, "a"), (5, 12, "b"), (40, 50, "c"), (51, 60, "d")]  # µs, as the profiler's events
    lines = idle_gaps([SimpleNamespace(time_range=SimpleNamespace(start=a, end=b), name=n) for a, b, n in spans])
    assert lines[0].startswith("GPU idle between kernels: 0.03 ms in 2 gaps over 0.06 ms")
    assert "after b  before c" in lines[1] and "after c  before d" in lines[2]
    assert idle_gaps([]) == []

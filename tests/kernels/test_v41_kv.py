"""V4.1's stored KV codes (``kernels.v41_kv``): unpacking them gives the engine's fake
quantisation (``engine.model.v41.quant``) bit for bit, at the released widths and over a wide
range of block magnitudes, ties and zeros included."""

from __future__ import annotations

import torch

from engine.model.v41.quant import fp4_compressed, fp4_indexer, fp8_window
from kernels.v41_kv import (
    pack_fp4_keys,
    pack_fp4_rows,
    pack_fp8_window,
    unpack_fp4_keys,
    unpack_fp4_rows,
    unpack_fp8_window,
)


def _rows(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, d, generator=g) * torch.logspace(-12, 12, 64, base=2.0)[:, None]  # (64, D) rows of every magnitude
    x[0] = 0.0  # an all-zero block
    x[1, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)  # midpoints at scale 1
    return x


def test_window_codes_unpack_to_the_fake_quantisation() -> None:
    x = _rows(512, 1)
    q, e = pack_fp8_window(x)
    assert q.dtype == torch.float8_e4m3fn and e.dtype == torch.uint8 and e.shape == (64, 16)
    assert torch.equal(unpack_fp8_window(q, e), fp8_window(x))


def test_row_codes_unpack_to_the_fake_quantisation() -> None:
    x = _rows(512, 2)
    q, s = pack_fp4_rows(x)
    assert q.shape == (64, 256) and q.dtype == torch.uint8 and s.shape == (64, 32) and s.dtype == torch.float8_e4m3fn
    assert torch.equal(unpack_fp4_rows(q, s), fp4_compressed(x))
    assert q.numel() + s.numel() == 64 * 288  # the 288 B FP4 main row (issue 22)


def test_key_codes_unpack_to_the_fake_quantisation() -> None:
    x = _rows(128, 3)
    q, e = pack_fp4_keys(x)
    assert q.shape == (64, 64) and e.shape == (64, 4)
    assert torch.equal(unpack_fp4_keys(q, e), fp4_indexer(x))
    assert q.numel() + e.numel() == 64 * 68  # the 68 B FP4 indexer row

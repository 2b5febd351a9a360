"""V4.1 cache rows ⇄ DeepInfer's row bytes (engine/model/v41/row_codec.py): exact round trips of
the quantisers' outputs, DeepInfer's row sizes, the byte order, and refusal of off-grid rows."""

from __future__ import annotations

import pytest
import torch

from engine.backends.deepinfer.layout import fp4_row_bytes, fp8_row_bytes
from engine.model.v41.quant import fp4_compressed, fp4_indexer, fp8_window
from engine.model.v41.row_codec import FP4_INDEX, FP4_MAIN, FP8_WINDOW, decode_rows, encode_rows

FORMATS = [(fp8_window, FP8_WINDOW), (fp4_compressed, FP4_MAIN), (fp4_indexer, FP4_INDEX)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantise,fmt", FORMATS)
def test_quantised_rows_round_trip_exactly(quantise, fmt, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for magnitude in (1e-7, 1e-3, 1.0, 1e4):  # through e4m3's subnormal scales and the clamps
        x = torch.randn(65, 64, generator=g) * magnitude
        x[1] = 0.0
        x[2, :32] = -0.0
        v = quantise(x.to(dtype))
        raw = encode_rows(v, fmt)
        assert raw.dtype == torch.uint8 and raw.shape == (65, fmt.row_bytes(64))
        back = decode_rows(raw, 64, fmt).to(dtype)
        assert torch.equal(back, v) and torch.equal(torch.signbit(back), torch.signbit(v))


@pytest.mark.parametrize("quantise,fmt", FORMATS)
def test_no_rows_encode_to_no_bytes(quantise, fmt) -> None:
    """A source with no complete group yet (a prompt shorter than its ratio) has no rows to store."""
    raw = encode_rows(quantise(torch.zeros(0, 64)), fmt)
    assert raw.shape == (0, fmt.row_bytes(64)) and decode_rows(raw, 64, fmt).shape == (0, 64)


def test_row_sizes_are_deepinfers() -> None:
    assert FP4_MAIN.row_bytes(512) == fp4_row_bytes(512, 16) == 288
    assert FP4_INDEX.row_bytes(128) == fp4_row_bytes(128, 32) == 68
    assert FP8_WINDOW.row_bytes(512) == fp8_row_bytes(512) == 528


def test_byte_order() -> None:
    """e2m1 pairs low nibble first, sign in bit 3, then the scales; e4m3 data, then UE8M0 exponents."""
    row = torch.zeros(1, 32)
    row[0, 0], row[0, 1], row[0, 31] = 0.5 * 2.0, -6.0 * 2.0, 3.0 * 2.0  # FP4 index scale 2 = 2^(128-127)
    raw = encode_rows(row, FP4_INDEX)
    assert raw[0, 0] == 0x1 | (0xF << 4) and raw[0, 15] == 0x5 << 4 and raw[0, 16] == 128
    fp8 = torch.zeros(1, 32)
    fp8[0, 0] = 448.0 * 0.25  # block max: scale 2^-2 (UE8M0 125), code 448 = e4m3 0x7E
    assert encode_rows(fp8, FP8_WINDOW)[0, 0] == 0x7E and encode_rows(fp8, FP8_WINDOW)[0, 32] == 125


@pytest.mark.parametrize("quantise,fmt", FORMATS)
def test_rows_off_the_grid_are_refused(quantise, fmt) -> None:
    with pytest.raises(ValueError):
        encode_rows(torch.full((1, 64), 0.1) + torch.linspace(0, 1e-3, 64), fmt)
    with pytest.raises(ValueError):
        encode_rows(quantise(torch.randn(2, 40)), fmt)  # not whole blocks: the model leaves them unquantised

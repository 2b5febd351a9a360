"""DeepSeek-V4.1's KV-cache number formats as stored codes (the engine's fake quantisation,
``engine/model/v41/quant.py``, is ``unpack(pack(x))`` of these, bit for bit).

All blockwise over the last axis ``D``:

- window KV: ``q (..., D) float8_e4m3fn`` and ``e (..., D/32) uint8``, the ue8m0 exponent of a
  power-of-two scale ``2^(e-127) = 2^ceil(log2(max(amax, 1e-4) / 448))``;
- compressed KV: ``q (..., D/2) uint8``, two e2m1 codes a byte (the even channel in the low
  nibble; bit 3 the sign, bits 0-2 the magnitude's code into ``FP4_GRID``), and ``s (..., D/16)
  float8_e4m3fn`` scales ``e4m3(max(amax, 6·2⁻⁹) / 6)``;
- indexer keys: the same e2m1 codes, ``e (..., D/32) uint8`` ue8m0 scales
  ``2^ceil(log2(max(amax, 6·2⁻¹²⁶) / 6))``.

Rounding is to the nearest grid point, ties to the even code.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP4_MAX = 6.0  # float4_e2m1's largest value
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by code 0..7


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2 t)`` of positive fp32 ``t``, exactly (from the binary exponent)."""
    mantissa, exponent = torch.frexp(t)  # t = m · 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(t), exponent - (mantissa == 0.5).to(exponent.dtype))


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` (already within ±6) rounded onto the e2m1 grid, ties to the even code.

    The grid's step is 0.5 below 2, 1 below 4 and 2 above, so each range rounds half-to-even at
    its own step (``torch.round``): every tie lands on the even code (down at 0.25, 1.25, 2.5, 5;
    up at 0.75, 1.75, 3.5). Elementwise ops only, no constant tensors: it runs inside a CUDA graph."""
    mag = x.abs()
    q = torch.where(mag < 2.0, torch.round(mag * 2.0) * 0.5, torch.where(mag < 4.0, torch.round(mag), torch.round(mag * 0.5) * 2.0))
    return torch.where(torch.signbit(x), -q, q)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    assert x.shape[-1] % block == 0, f"last axis {x.shape[-1]} is not a whole number of {block}-channel blocks"
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)  # (..., n/b, b)


def _ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """The biased exponent (uint8) of power-of-two fp32 ``scale``."""
    return (torch.frexp(scale)[1] - 1 + 127).to(torch.uint8)


def pack_fp8_window(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Window KV ``x (..., D)`` → e4m3 codes ``(..., D)`` and ue8m0 exponents ``(..., D/block)``."""
    b = _blocks(x, block)
    scale = pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1.0 / FP8_MAX))  # (..., n/b, 1)
    q = (b / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), _ue8m0(scale[..., 0])


def unpack_fp8_window(q: torch.Tensor, e: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp32 values of ``pack_fp8_window``'s codes."""
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.int() - 127)  # (..., n/b)
    return (_blocks(q, block) * scale[..., None]).reshape(q.shape)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) of values ``v`` on the e2m1 grid."""
    mag = v.abs()
    code = torch.where(mag < 2.0, mag * 2.0, torch.where(mag < 4.0, mag + 2.0, mag * 0.5 + 4.0)).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)  # (..., D/2): even channel low


def _unpack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """e2m1 values (fp32) of packed codes ``q (..., D/2)`` → ``(..., D)``."""
    codes = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2).int()
    e, m = (codes >> 1) & 3, (codes & 1).float()  # exponent and mantissa bits: FP4_GRID by arithmetic
    mag = torch.where(e == 0, m * 0.5, torch.ldexp(1.0 + m * 0.5, (e - 1).clamp_min(0)))
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_fp4_rows(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed KV ``x (..., D)`` → packed e2m1 codes ``(..., D/2)``, e4m3 scales ``(..., D/block)``."""
    b = _blocks(x, block)
    scale = (b.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).to(torch.float8_e4m3fn)
    v = round_e2m1((b / scale.float()).clamp(-FP4_MAX, FP4_MAX)).reshape(x.shape)
    return _pack_nibbles(_e2m1_codes(v)), scale[..., 0]


def unpack_fp4_rows(q: torch.Tensor, s: torch.Tensor, block: int = 16) -> torch.Tensor:
    """fp32 values of ``pack_fp4_rows``' codes."""
    v = _unpack_nibbles(q)
    return (_blocks(v, block) * s.float()[..., None]).reshape(v.shape)


def pack_fp4_keys(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys ``x (..., D)`` → packed e2m1 codes ``(..., D/2)``, ue8m0 exponents ``(..., D/block)``."""
    b = _blocks(x, block)
    scale = pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))
    v = round_e2m1((b / scale).clamp(-FP4_MAX, FP4_MAX)).reshape(x.shape)
    return _pack_nibbles(_e2m1_codes(v)), _ue8m0(scale[..., 0])


def unpack_fp4_keys(q: torch.Tensor, e: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp32 values of ``pack_fp4_keys``' codes."""
    v = _unpack_nibbles(q)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.int() - 127)
    return (_blocks(v, block) * scale[..., None]).reshape(v.shape)

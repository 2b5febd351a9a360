"""The KV-cache quantisation of DeepSeek-V4.1, as fake quantisation (quantise, dequantise).

V4.1 was trained with its caches quantised, so the rounding is part of the model and runs in
every precision, fp32 included. Three formats, all blockwise over the last axis:

- window KV (post-RoPE): FP8 e4m3, 32 channels per block, a power-of-two (ue8m0) scale
  ``2^ceil(log2(amax / 448))`` with ``amax ≥ 1e-4``;
- compressed KV (post-RoPE): FP4 e2m1, 16 channels per block, an e4m3 scale
  ``e4m3(max(amax, 6·2⁻⁹) / 6)``;
- indexer keys and queries: FP4 e2m1, 32 channels per block, a ue8m0 scale
  ``2^ceil(log2(max(amax, 6·2⁻¹²⁶) / 6))``.

A last axis that is not a whole number of blocks is left unquantised (tiny test shapes), as the
reference does. Values are rounded to the nearest grid point, ties to the even code.
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
    its own step (``torch.round``): every tie lands on the even code, as the table of midpoints
    says (down at 0.25, 1.25, 2.5, 5; up at 0.75, 1.75, 3.5). Pure elementwise ops, no constant
    tensors: the same code runs inside a CUDA graph."""
    mag = x.abs()
    q = torch.where(mag < 2.0, torch.round(mag * 2.0) * 0.5, torch.where(mag < 4.0, torch.round(mag), torch.round(mag * 0.5) * 2.0))
    return torch.where(torch.signbit(x), -q, q)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    n = x.shape[-1]
    return None if n % block else x.float().reshape(*x.shape[:-1], n // block, block)  # (..., n/b, b)


def fp8_window(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Window-KV fake quantisation: FP8 e4m3 with ue8m0 scales per ``block`` channels."""
    b = _blocks(x, block)
    if b is None:
        return x
    amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-4)  # (..., n/b, 1)
    scale = pow2_ceil(amax * (1.0 / FP8_MAX))
    q = (b / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape).to(x.dtype)


def fp4_compressed(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Compressed-KV fake quantisation: FP4 e2m1 with e4m3 scales per ``block`` channels."""
    b = _blocks(x, block)
    if b is None:
        return x
    amax = b.abs().amax(-1, keepdim=True)  # (..., n/b, 1)
    scale = (amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).to(torch.float8_e4m3fn).float()
    return (round_e2m1((b / scale).clamp(-FP4_MAX, FP4_MAX)) * scale).reshape(x.shape).to(x.dtype)


def fp4_indexer(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Indexer key/query fake quantisation: FP4 e2m1 with ue8m0 scales per ``block`` channels."""
    b = _blocks(x, block)
    if b is None:
        return x
    amax = b.abs().amax(-1, keepdim=True)  # (..., n/b, 1)
    scale = pow2_ceil(amax.clamp_min(FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))
    return (round_e2m1((b / scale).clamp(-FP4_MAX, FP4_MAX)) * scale).reshape(x.shape).to(x.dtype)

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
reference does. Values are rounded to the nearest grid point, ties to the even code. The stored
codes of these formats, and their unpacking, are ``kernels.v41_kv``.
"""

from __future__ import annotations

import torch

from kernels.v41_kv import FP4_GRID, FP4_MAX, FP8_MAX, pow2_ceil, round_e2m1  # noqa: F401 (the formats' constants and roundings)


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

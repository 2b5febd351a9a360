"""Partial, interleaved rotary position embeddings of DeepSeek-V4 (``main`` and ``compress``/YaRN).

Only the trailing ``rope_dim`` channels of a head rotate; channel pairs ``(2i, 2i+1)`` rotate by
``position * inv_freq[i]``. Attention outputs are rotated back (``-sin``) at the query position,
since keys double as values.
"""

from __future__ import annotations

import math

import torch

from engine.model import cpu_fused
from engine.model.config import RopeParams
from kernels.reference import apply_rope_eager


def inv_freq(params: RopeParams, rope_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``(rope_dim // 2,)`` and the cos/sin scale for one RoPE variant."""
    base = params.theta
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float, device="cpu") / rope_dim  # (rope_dim/2,)
    if params.rope_type == "default":
        return 1.0 / (base**exponents), 1.0
    factor = params.factor
    original = params.original_max_position_embeddings
    if original is None:
        raise ValueError("yarn rope needs original_max_position_embeddings")
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = params.attention_factor
    if attention_factor is None:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if params.mscale and params.mscale_all_dim:
            attention_factor = mscale(factor, params.mscale) / mscale(factor, params.mscale_all_dim)
        else:
            attention_factor = mscale(factor)
    beta_fast = params.beta_fast or 32
    beta_slow = params.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (rope_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    # transformers reads `truncate` from the top-level (nested) rope dict, so it is always True for V4
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base**exponents
    extrapolation = 1 - ramp
    freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return freq, float(attention_factor)


class Rotary:
    """cos/sin tables for one RoPE variant, computed per call from absolute positions."""

    def __init__(self, params: RopeParams, rope_dim: int, max_position_embeddings: int) -> None:
        self.inv_freq, self.scale = inv_freq(params, rope_dim, max_position_embeddings)  # on CPU
        self.rope_dim = rope_dim
        self._on: dict[torch.device, torch.Tensor] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions (N,)`` → cos, sin ``(N, rope_dim/2)`` in ``dtype`` (as transformers casts them)."""
        inv = self._on.get(positions.device)
        if inv is None:
            inv = self._on[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv  # (N, rope_dim/2)
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)

    def table(self, length: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions ``[0, L)``, ``L ≥ length``: ``cos_sin(arange(L))``, kept per device
        and dtype and regrown to the next power of two when a longer one is asked for. On CUDA a
        row equals ``cos_sin`` of its position bit for bit (elementwise kernels), so slices of it
        replace the ~8 launches of ``cos_sin`` per call."""
        key = (torch.device(device), dtype)
        tab = self._tables.get(key)
        if tab is None or tab[0].shape[0] < length:
            size = max(4096, 1 << max(0, length - 1).bit_length())
            tab = self._tables[key] = self.cos_sin(torch.arange(size, device=device), dtype)
        return tab


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing rope channels of ``x (N, ..., D)`` by ``cos/sin (N, rope_dim/2)``.

    ``cos/sin`` broadcast over every middle axis of ``x`` (heads). Math in fp32, result in x.dtype.
    """
    if x.dtype == cos.dtype == sin.dtype == torch.float32 and x.device.type == "cpu" and cpu_fused.available():
        return cpu_fused.rope(x, cos, sin)  # one compiled loop, the same values
    return apply_rope_eager(x, cos, sin)



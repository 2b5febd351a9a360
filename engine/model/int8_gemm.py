"""What this process's CPU int8 GEMMs compute exactly, and the weight range that keeps them exact.

The greedy head (``lm_head.Int8Screen``) relies on integer products summed exactly. That holds on
CPUs whose int8 dot product accumulates straight into int32 (AVX-512 VNNI, AVX-VNNI, AMX). Without
VNNI, oneDNN's uint8×int8 kernels (and ``torch._int_mm``, which adds 128 to its int8 input to
reach them) multiply with ``vpmaddubsw``: adjacent byte products are summed *pairwise into a
saturating int16* before widening, so ``255·127 + 255·127 = 64770`` becomes 32767 and the
screen's error bound no longer holds.

With weight codes in ``[-63, 63]`` every pair sum is at most ``2·255·63 = 32130 < 32767``: no
saturation on any ISA, at the price of one bit of weight precision (a wider screen margin, never a
wrong token). Which range this process needs is decided by running the GEMMs on inputs that
saturate a pairwise int16 sum and comparing with exact integers: that sees what the kernels oneDNN
actually dispatched do, including a cap set with ``ONEDNN_MAX_CPU_ISA`` (read once, when oneDNN
first runs). ``/proc/cpuinfo`` is read only to report the ISA in logs.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

FULL_LEVELS = 127  # weight codes in [-127, 127]: exact where int8 products reach int32 directly
SAFE_LEVELS = 63  # weight codes in [-63, 63]: a uint8×int8 pair sum stays inside int16
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # /proc/cpuinfo flags of int32-accumulating dots
PROBE_K = 64  # probe reduction length: 32 byte pairs per dot product


@dataclass(frozen=True)
class Int8Gemm:
    """The int8 GEMM behaviour of this process: ``exact_full_range`` when weight codes up to ±127
    multiply exactly; ``weight_levels`` is the largest weight code the screen may use."""

    exact_full_range: bool
    cpu_dot_flags: tuple[str, ...]  # which of INT8_DOT_FLAGS the CPU reports
    onednn_isa_cap: str  # ONEDNN_MAX_CPU_ISA as set for this process ("" = none)

    @property
    def weight_levels(self) -> int:
        return FULL_LEVELS if self.exact_full_range else SAFE_LEVELS

    def describe(self) -> str:
        flags = ",".join(self.cpu_dot_flags) or "no VNNI/AMX"
        cap = f", ONEDNN_MAX_CPU_ISA={self.onednn_isa_cap}" if self.onednn_isa_cap else ""
        return f"int8 GEMM {'exact' if self.exact_full_range else 'pairwise-int16'} ({flags}{cap}): weight codes ±{self.weight_levels}"


def cpu_dot_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The int32-accumulating int8 dot-product flags the CPU reports (empty off Linux)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return tuple(flag for flag in INT8_DOT_FLAGS if flag in have)
    except OSError:
        pass
    return ()


def products_exact(levels: int) -> bool:
    """True when ``torch._int_mm`` and oneDNN's pre-packed uint8×int8 linear (where this torch has
    it) return the exact integer products for weight codes ``±levels`` and full-range activations,
    on inputs whose byte pairs saturate an int16 sum whenever ``levels`` allows it."""
    k, n = PROBE_K, 16
    w = torch.full((n, k), levels, dtype=torch.int8)  # (N, K)
    w[1::2] = -levels  # odd columns: the most negative pair sums
    a = torch.full((2, k), 127, dtype=torch.int8)  # (M, K): +128 inside the kernel → uint8 255
    if not torch.equal(torch._int_mm(a, w.t()), a.int() @ w.int().t()):
        return False
    ops = getattr(torch.ops, "onednn", None)
    if ops is None or not hasattr(ops, "qlinear_prepack"):
        return True
    xu = torch.full((2, k), 255, dtype=torch.uint8)  # zero point 128: codes +127
    packed = ops.qlinear_prepack(w, [2, k])
    y = ops.qlinear_pointwise(
        xu, 1.0, 128, packed, torch.ones(n), torch.zeros(n, dtype=torch.long), None, 1.0, 0, torch.float32, "none", [], ""
    )  # fmt: skip
    return torch.equal(y.double(), ((xu.long() - 128) @ w.long().t()).double())


@functools.cache
def probe() -> Int8Gemm:
    """This process's ``Int8Gemm`` (measured once: the kernels oneDNN dispatches do not change).
    Without ``torch._int_mm`` the screen is off anyway (``Int8Screen.available``)."""
    has_int_mm = hasattr(torch, "_int_mm")
    gemm = Int8Gemm(has_int_mm and products_exact(FULL_LEVELS), cpu_dot_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA", ""))
    if has_int_mm and not gemm.exact_full_range and not products_exact(SAFE_LEVELS):
        raise RuntimeError(f"CPU int8 GEMM is inexact even with weight codes ±{SAFE_LEVELS}: {gemm.describe()}")
    log.info(gemm.describe())
    return gemm

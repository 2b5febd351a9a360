"""What every kernel module shares: the optional Triton import and the dispatch rule.

Triton is optional (CPU CI may lack it). Each public kernel function runs its Triton kernel when
``use_triton(tensor)`` holds — a CUDA tensor with Triton importable, or any tensor under
``TRITON_INTERPRET=1`` (Triton's CPU interpreter, read when a kernel module is imported) — and its
``*_reference`` otherwise, so callers work on every device.
"""

from __future__ import annotations

import os

import torch

# Triton is genuinely optional, so this is the one kept import fallback: it is not among
# pyproject's dependencies, and CPU-only torch wheels (download.pytorch.org/whl/cpu) do not pull it
# in, yet every kernel then still runs through its ``*_reference``. The kernel modules define their
# @triton.jit functions only when this import succeeds.
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

HAS_TRITON = triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel can run on ``t``'s device."""
    return HAS_TRITON and (t.is_cuda or INTERPRET)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def even_tile(k: int, block: int, least: int = 256) -> int:
    """A K tile for a weight-streaming loop over ``k`` columns: ``block`` when it divides ``k`` (or
    ``k`` is smaller), else the largest power of two that divides ``k`` if it is at least ``least``
    (no masked tail: V4.1's q_lora 1280 and moe_intermediate 2304 end a 1024 tile a quarter full),
    else ``block``."""
    if k <= block or k % block == 0 or (k & -k) < least:
        return block
    return k & -k


def dot_precision(dtype: torch.dtype) -> str:
    """Exact fp32 products for fp32 inputs (tests ask 1e-4); bf16/fp16 use the tensor cores anyway.
    ``"interpret"`` tells ``mma`` to widen its operands (see there)."""
    if INTERPRET:
        return "interpret"
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few splits still exercise the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


if HAS_TRITON:
    # griddepcontrol (programmatic dependent launch) compiles for the GPU only
    _GDC = tl.constexpr(not INTERPRET)

    @triton.jit
    def launch_dependents():
        """Let a kernel launched after this one with ``launch_pdl`` start now (it waits for this
        kernel's completion with ``gdc_wait`` before touching its outputs); no effect otherwise."""
        if _GDC:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def gdc_wait():
        """Wait until the previous kernel (of a ``launch_pdl`` launch) has completed and flushed."""
        if _GDC:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def mma(a, b, PRECISION: tl.constexpr):
        """``tl.dot`` in fp32 accumulation; under the CPU interpreter (whose bf16 dot is wrong as of
        Triton 3.9) the operands are widened to fp32 first, which keeps their bf16 values exactly."""
        if PRECISION == "interpret":
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(a, b, input_precision=PRECISION)
        return out

"""Fused CPU loops (numba) for the small per-token parts of a step that eager PyTorch runs as
hundreds of tiny ops.

At decode on CPU a batch holds a few to a few dozen tokens, and the mHC mixing of one layer
(sigmoids, a 4×4 softmax, 20 Sinkhorn rounds) is ~120 PyTorch calls on ``(N, 4, 4)`` tensors:
the dispatch costs, not the arithmetic (likewise the ~12 ops of a partial RoPE, ``rope``).
``hc_mix`` does the same arithmetic in one compiled
loop per token, in fp32, in transformers' order (row-wise softmax, then columns, then ``iters-1``
rounds of rows and columns, each ``x / (sum + eps)``); only the rounding of ``exp`` may differ
from PyTorch's vectorised one by an ulp. Every token is computed alone, so results do not depend
on the batch. ``available()`` is False when numba is missing or fails: callers keep the eager path.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import numba
except ImportError:  # the eager path stays
    numba = None


def _hc_mix(
    mixes: np.ndarray, scale: np.ndarray, base: np.ndarray, hc: int, iters: int, hc_eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = mixes.shape[0]
    one, two = np.float32(1.0), np.float32(2.0)
    eps = np.float32(hc_eps)
    pre = np.empty((n, hc), np.float32)
    post = np.empty((n, hc), np.float32)
    comb = np.empty((n, hc, hc), np.float32)
    for t in range(n):
        for s in range(hc):
            pre[t, s] = one / (one + np.exp(-(mixes[t, s] * scale[0] + base[s]))) + eps
            post[t, s] = two * (one / (one + np.exp(-(mixes[t, hc + s] * scale[1] + base[hc + s]))))
        c = comb[t]
        for i in range(hc):  # softmax over j, + eps
            row_max = np.float32(-np.inf)
            for j in range(hc):
                k = 2 * hc + i * hc + j
                v = mixes[t, k] * scale[2] + base[k]
                c[i, j] = v
                row_max = max(row_max, v)
            total = np.float32(0.0)
            for j in range(hc):
                c[i, j] = np.exp(c[i, j] - row_max)
                total += c[i, j]
            for j in range(hc):
                c[i, j] = c[i, j] / total + eps
        _normalise_columns(c, hc, eps)
        for _ in range(iters - 1):
            for i in range(hc):  # rows
                total = np.float32(0.0)
                for j in range(hc):
                    total += c[i, j]
                total += eps
                for j in range(hc):
                    c[i, j] = c[i, j] / total
            _normalise_columns(c, hc, eps)
    return pre, post, comb


def _normalise_columns(c: np.ndarray, hc: int, eps: np.float32) -> None:
    for j in range(hc):
        total = np.float32(0.0)
        for i in range(hc):
            total += c[i, j]
        total += eps
        for i in range(hc):
            c[i, j] = c[i, j] / total


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    n, m, d = x.shape
    half = cos.shape[1]
    start = d - 2 * half
    out = x.copy()
    for t in range(n):
        for h in range(m):
            for i in range(half):
                even = x[t, h, start + 2 * i]
                odd = x[t, h, start + 2 * i + 1]
                c, s = cos[t, i], sin[t, i]
                out[t, h, start + 2 * i] = even * c - odd * s
                out[t, h, start + 2 * i + 1] = odd * c + even * s
    return out


if numba is not None:
    _normalise_columns = numba.njit(cache=True, nogil=True)(_normalise_columns)
    _hc_mix = numba.njit(cache=True, nogil=True)(_hc_mix)
    _rope = numba.njit(cache=True, nogil=True)(_rope)

_state = {"ok": None}


def available() -> bool:
    """True when the compiled loops can run here (compiled on first use, cached on disk)."""
    if _state["ok"] is None:
        ok = numba is not None
        if ok:
            try:
                _hc_mix(np.zeros((1, 24), np.float32), np.ones(3, np.float32), np.zeros(24, np.float32), 4, 2, 1e-6)
                _rope(np.zeros((1, 1, 4), np.float32), np.ones((1, 2), np.float32), np.zeros((1, 2), np.float32))
            except Exception:  # noqa: BLE001 - a broken numba/llvmlite install: keep the eager path
                ok = False
        _state["ok"] = ok
    return bool(_state["ok"])


def hc_mix(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layers.mix_gates`` in one loop: ``pre (N, hc)``, ``post (N, hc)``, ``comb (N, hc, hc)``
    from ``mixes (N, (2+hc)·hc)`` (fp32 CPU tensors)."""
    pre, post, comb = _hc_mix(
        mixes.detach().contiguous().numpy(), scale.detach().numpy(), base.detach().numpy(), hc, iters, hc_eps
    )
    return torch.from_numpy(pre), torch.from_numpy(post), torch.from_numpy(comb)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` for fp32 CPU ``x (N, ..., D)`` and ``cos/sin (N, R/2)`` in one loop: the
    same products and sums per channel pair (no fused multiply-add), so the same values."""
    n, d = x.shape[0], x.shape[-1]
    out = _rope(x.detach().reshape(n, -1, d).numpy(), cos.detach().contiguous().numpy(), sin.detach().contiguous().numpy())
    return torch.from_numpy(out).view(x.shape)

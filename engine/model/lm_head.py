"""The vocabulary projection, and exact greedy decoding without the full fp32 projection.

``LMHead.logits(h)`` is ``h @ Wᵀ`` in fp32 (CPU: through a pre-packed oneDNN weight).
``LMHead.argmax(h)`` returns the token a greedy request picks, the argmax of those logits, but on
CPU it first *screens* the vocabulary with an int8 projection (fbgemm, per-column symmetric
weights, dynamically quantized activations: a quarter of the bytes of the fp32 weight) and then
recomputes exactly only the columns that can still be the maximum:

- every screened logit is within a proven bound ``β`` of the exact one:
  ``|x·w − x̂·ŵ| ≤ Σ|x̂ᵢ|·|w−ŵ|ᵢ + Σ|x−x̂|ᵢ·|wᵢ| ≤ (‖x‖₁ + H·sₓ)·max(s_w)/2 + sₓ·max‖w‖₁``, with
  ``sₓ`` the activation step (the error of one activation is at most one step, zero-point nudge
  included) and ``s_w`` the per-column weight step (error at most half a step), plus slack for
  fp32 rounding in the requantisation;
- so the true maximum's screened value is ``≥ max(screen) − 2β``; the 128-column blocks whose
  screened maximum reaches that threshold are the candidates, recomputed in float64 (products of
  fp32 values are exact there) and the best one (lowest id on a tie) is the token.

Greedy tokens therefore do not depend on the screen (nor on the batch, whose range sets ``sₓ``):
they are the argmax of the exact logits. Rows whose candidates would be too many fall back to the
fp32 projection. Anything that needs logit values (logprobs, penalties, grammars, temperature)
uses ``logits``. Measured on one 2-core box thread, vocabulary 129,280, hidden 128: the screened
argmax costs ~1/3 of the fp32 projection plus its argmax at batch 8 (``python -m bench.lm_head_bench``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.layers import PackedLinear

BLOCK = 128  # columns per candidate block (amax over 128 contiguous floats is ~3x faster than over 32)
MAX_BLOCKS_PER_ROW = 64  # more candidates than this (on average) → the exact projection instead
ROW_COPY_BYTES = 256 << 20  # keep a row-major copy of a transposed lm_head up to this size


class Int8Screen:
    """An int8 copy of a ``(V, H)`` weight (one scale for the whole tensor) and the constants of
    the screen's error bound."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().double()  # (V, H)
        self.step = float(w.abs().max()) / 127.0 or 1.0  # weight quantisation step
        q = torch.round(w / self.step).clamp_(-127, 127).to(torch.int8).contiguous()  # (V, H) row-major
        self.qt = q.t()  # (H, V) view of (V, H): int_mm's fast layout
        self.packed = _onednn_prepack(q)  # oneDNN's blocked layout, for 2+ rows
        self.ones, self.zeros = torch.ones(w.shape[0]), torch.zeros(w.shape[0], dtype=torch.long)
        self.err_norm = float((w - q.double() * self.step).norm(dim=1).max())  # max_v ‖w_v − ŵ_v‖₂
        self.w_norm = float(w.norm(dim=1).max())  # max_v ‖w_v‖₂

    @staticmethod
    def available() -> bool:
        """True when this torch build has a CPU int8 GEMM (``torch._int_mm``)."""
        return hasattr(torch, "_int_mm")

    def screen(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Screened logits in integer units ``(B, V)`` (int32, or float32 holding exact integers:
        ``|screen| < 2²⁴`` for ``H ≤ 1040``) and each row's error bound in the same units ``(B,)``
        float64: ``|x·w_v − sₓ·s_w·screen_v| ≤ bound·sₓ·s_w``."""
        xd = x.double()
        sx = xd.abs().amax(dim=1, keepdim=True) / 127.0  # (B, 1) per-row activation step
        sx = torch.where(sx > 0, sx, torch.ones_like(sx))
        qx = torch.round(xd / sx).clamp_(-127, 127)  # (B, H)
        x_hat = qx * sx
        bound = x_hat.norm(dim=1) * self.err_norm + (xd - x_hat).norm(dim=1) * self.w_norm  # (B,)
        if self.packed is not None and x.shape[0] > 1:  # activations as uint8 around zero point 128
            acc = torch.ops.onednn.qlinear_pointwise(
                (qx + 128).to(torch.uint8), 1.0, 128, self.packed, self.ones, self.zeros, None, 1.0, 0, torch.float32, "none", [], ""
            )  # fmt: skip
        else:
            acc = torch._int_mm(qx.to(torch.int8), self.qt)  # (B, V) int32, exact
        return acc, bound * (1.0 + 1e-6) / (sx.squeeze(1) * self.step)


def _onednn_prepack(q: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's pre-packed int8 weight (measured 2x faster than ``_int_mm`` at 8 rows), or None
    where this torch build lacks the op or the products could leave fp32's exact integers."""
    ops = getattr(torch.ops, "onednn", None)
    if ops is None or not hasattr(ops, "qlinear_prepack") or q.shape[1] * 127 * 127 >= 1 << 24:
        return None
    try:
        return ops.qlinear_prepack(q, [8, q.shape[1]])
    except RuntimeError:
        return None


class LMHead:
    """``logits`` and exact greedy ``argmax`` over an ``nn.Linear(H, V)`` without bias."""

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear
        self._packed = PackedLinear(linear)
        self._screen: Int8Screen | None = None
        self._screen_key: tuple[int, int] | None = None
        self._row_copy: torch.Tensor | None = None  # see _rows_major
        self.screened_rows = 0  # rows answered by the screen (tests and benchmarks read these)
        self.fallback_rows = 0

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact fp32 logits ``(B, V)``."""
        return self._packed(hidden).float()

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of ``logits(hidden)`` per row, ``(B,)`` int64 (lowest id on an exact tie)."""
        screen = self._screener(hidden)
        if screen is None:
            return self.logits(hidden).argmax(-1)
        y, bound = screen.screen(hidden)
        B, V = y.shape
        full = V // BLOCK * BLOCK
        block_max = y[:, :full].view(B, -1, BLOCK).amax(-1)  # (B, nb)
        if full < V:
            block_max = torch.cat([block_max, y[:, full:].amax(-1, keepdim=True)], dim=1)
        thr = block_max.amax(-1).double() - 2 * bound  # (B,)
        rows, blocks = (block_max.double() >= thr.unsqueeze(1)).nonzero(as_tuple=True)  # candidate blocks
        if rows.numel() > MAX_BLOCKS_PER_ROW * B:
            self.fallback_rows += B
            return self.logits(hidden).argmax(-1)
        self.screened_rows += B
        cols = blocks.unsqueeze(1) * BLOCK + torch.arange(BLOCK)  # (K, BLOCK)
        cols = cols.clamp_(max=V - 1)  # the tail block repeats its last column: harmless
        keep = y[rows.unsqueeze(1), cols].double() >= thr[rows].unsqueeze(1)  # (K, BLOCK)
        rows = rows.unsqueeze(1).expand_as(cols)[keep]  # (C,) candidate (row, column) pairs
        cols = cols[keep]
        return self._best(hidden, rows, cols, B, V)

    def _best(self, hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, B: int, V: int) -> torch.Tensor:
        """Each row's best candidate column by exact (float64) logits, lowest id on a tie."""
        w = self._rows_major()
        if w is not None:
            w = w.index_select(0, cols)
        else:  # (V, H) is a view of an (H, V) tensor: gather along the storage's rows
            w = self.linear.weight.detach().t().index_select(1, cols).t()
        w = w.double()  # (C, H)
        vals = (w * hidden.double()[rows]).sum(dim=1)  # (C,)
        best = torch.full((B,), float("-inf"), dtype=torch.float64).scatter_reduce(0, rows, vals, "amax")
        winner = vals == best[rows]
        return torch.full((B,), V, dtype=torch.int64).scatter_reduce(0, rows[winner], cols[winner], "amin")

    def _rows_major(self) -> torch.Tensor | None:
        """The weight as a row-major ``(V, H)`` tensor for gathering candidate rows (10x faster
        than gathering from the model's transposed layout): the weight itself when it is one,
        else a copy made with the screen when it is at most ``ROW_COPY_BYTES``; None otherwise."""
        w = self.linear.weight.detach()
        if w.is_contiguous():
            return w
        if self._row_copy is None and w.numel() * w.element_size() <= ROW_COPY_BYTES:
            self._row_copy = w.contiguous()
        return self._row_copy

    def _screener(self, hidden: torch.Tensor) -> Int8Screen | None:
        w = self.linear.weight
        if hidden.device.type != "cpu" or hidden.dtype != torch.float32 or w.dtype != torch.float32 or hidden.dim() != 2:
            return None
        if not Int8Screen.available():
            return None
        key = (w.data_ptr(), w._version)
        if key != self._screen_key:  # loaders copy_ into the weight: rebuild on change
            self._screen = Int8Screen(w)
            self._screen_key = key
            self._row_copy = None
        return self._screen


class HeadRows:
    """A ``LogitSource`` (engine/sampling/sampler.py) over one step's last hidden states."""

    def __init__(self, head: LMHead, hidden: torch.Tensor) -> None:
        self.head = head
        self.hidden = hidden  # (B, H)

    def _rows(self, rows: list[int]) -> torch.Tensor:
        if len(rows) == self.hidden.shape[0]:
            return self.hidden
        return self.hidden.index_select(0, torch.as_tensor(rows, device=self.hidden.device))

    def subset(self, rows: list[int]) -> HeadRows:
        """The same source over ``rows`` only (in that order)."""
        return HeadRows(self.head, self._rows(rows))

    def logits(self, rows: list[int]) -> torch.Tensor:
        return self.head.logits(self._rows(rows))

    def argmax(self, rows: list[int]) -> torch.Tensor:
        return self.head.argmax(self._rows(rows)).cpu()

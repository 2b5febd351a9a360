"""The vocabulary projection, and exact greedy decoding without the full fp32 projection.

``LMHead.logits(h)`` is ``h @ Wᵀ`` in fp32 (CPU: through a pre-packed oneDNN weight).
``LMHead.argmax(h)`` returns the token a greedy request picks, the argmax of those logits, but on
CPU it first *screens* the vocabulary with an int8 projection (one weight scale, per-row
activation scale: a quarter of the bytes of the fp32 weight; from 2 rows on the screen's output
is requantised to uint8, a quarter of the bytes of a float32 output) and then recomputes exactly
only the columns that can still be the maximum:

- every screened logit is within a proven bound ``β`` of the exact one:
  ``|x·w − x̂·ŵ| ≤ ‖x̂‖·max‖w−ŵ‖ + ‖x−x̂‖·max‖w‖`` (Cauchy–Schwarz on each error term), plus
  slack for rounding; the uint8 output adds half a step (a saturated 255 is only a lower bound);
- so the true maximum's screened value is ``≥ max(screen) − margin``; the columns that reach
  that threshold are the candidates, recomputed in float64 (products of fp32 values are exact
  there) and the best one (lowest id on a tie) is the token. The search for them is one compiled
  pass (``cpu_fused.screen_pick``: block maxima, then only the blocks that reach the bar), or
  tensor ops over 128-column blocks where numba is missing.

The weight codes span ±127 where the CPU's int8 products are exact and ±63 where it sums byte
products pairwise into saturating int16 (AVX2 and AVX-512 without VNNI; ``int8_gemm`` measures
which): the bound assumes exact integer products, and ±63 keeps every pair sum inside int16.

Greedy tokens therefore do not depend on the screen (nor on the batch, whose range sets the
uint8 step): they are the argmax of the exact logits. Rows whose candidates would be too many
fall back to the fp32 projection. Anything that needs logit values (logprobs, penalties,
grammars, temperature) uses ``logits``. Measured on one 2-core box thread, vocabulary 129,280,
hidden 128: the screened argmax costs 1.5 ms at batch 8 and 4.4 ms at batch 32 (the compiled
candidate pass; 1.7 and 5.0 with the tensor-op one) against 6.4 and 16.9 ms for the fp32
projection plus its argmax.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model import cpu_fused, int8_gemm
from engine.model.layers import PackedLinear

BLOCK = 128  # columns per candidate block (amax over 128 contiguous floats is ~3x faster than over 32)
MAX_BLOCKS_PER_ROW = 64  # more candidates than this (on average) → the exact projection instead
ROW_COPY_BYTES = 256 << 20  # keep a row-major copy of a transposed lm_head up to this size


class Int8Screen:
    """An int8 copy of a ``(V, H)`` weight (one scale for the whole tensor) and the constants of
    the screen's error bound.

    ``levels``: the largest weight code, ``int8_gemm.probe().weight_levels`` by default — 127
    where this CPU's int8 products are exact over the full range (VNNI, AMX), 63 where they are
    summed pairwise into saturating int16 (AVX2, AVX-512 without VNNI)."""

    def __init__(self, weight: torch.Tensor, levels: int | None = None) -> None:
        self.levels = levels or int8_gemm.probe().weight_levels
        w = weight.detach().double()  # (V, H)
        self.step = float(w.abs().max()) / self.levels or 1.0  # weight quantisation step
        q = torch.round(w / self.step).clamp_(-self.levels, self.levels).to(torch.int8).contiguous()  # (V, H) row-major
        self.qt = q.t()  # (H, V) view of (V, H): int_mm's fast layout
        self.packed = _onednn_prepack(q, self.levels)  # oneDNN's blocked layout, for 2+ rows
        self.ones, self.zeros = torch.ones(w.shape[0]), torch.zeros(w.shape[0], dtype=torch.long)
        self.err_norm = float((w - q.double() * self.step).norm(dim=1).max())  # max_v ‖w_v − ŵ_v‖₂
        self.w_norm = float(w.norm(dim=1).max())  # max_v ‖w_v‖₂
        self.q_norm = float(q.double().norm(dim=1).max())  # max_v ‖ŵ_v/s_w‖₂: Cauchy–Schwarz cap
        self.top: float | None = None  # integer units mapped to 255 by the uint8 output (adaptive)
        self.unit = 1.0  # integer units per uint8 step of the last uint8 screen

    @staticmethod
    def available() -> bool:
        """True when this torch build has a CPU int8 GEMM (``torch._int_mm``)."""
        return hasattr(torch, "_int_mm")

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` as integers ``qx (B, H)`` (float64 holding integers in [-127, 127], per-row step
        ``sₓ = max|x|/127``) and the error bound in integer units ``(B,)`` float64:
        ``|x·w_v − sₓ·s_w·(qx·q_v)| ≤ bound·sₓ·s_w`` for every column ``v``."""
        xd = x.double()
        sx = xd.abs().amax(dim=1, keepdim=True) / 127.0  # (B, 1) per-row activation step
        sx = torch.where(sx > 0, sx, torch.ones_like(sx))
        qx = torch.round(xd / sx).clamp_(-127, 127)  # (B, H)
        x_hat = qx * sx
        bound = x_hat.norm(dim=1) * self.err_norm + (xd - x_hat).norm(dim=1) * self.w_norm  # (B,)
        return qx, bound * (1.0 + 1e-6) / (sx.squeeze(1) * self.step)

    def screen(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Screened logits ``(B, V)`` and a per-row margin ``(B,)`` float64 in the same units:
        the true argmax is among the columns whose value is ``≥ row max − margin``.

        2+ rows (oneDNN): uint8 values ``round(acc / u)`` clamped to [0, 255], ``acc = qx·q_v``
        and ``u = top / 255`` — a quarter of the bytes of a float32 output, which is most of the
        GEMM's cost at this width. Rounding moves a value by at most half a unit; a clamped 255
        only says ``acc ≥ 254.5·u``, so every saturated column stays a candidate; a row whose
        maximum is 0 has no lower bound and makes every column a candidate. ``top`` adapts to
        the largest row maximum seen (the first call uses the Cauchy–Schwarz cap
        ``max‖qx‖·max‖q_v‖``, which nothing can exceed). One row: int32 ``acc`` from
        ``torch._int_mm``, exact."""
        if self.packed is None or x.shape[0] < 2:
            qx, bound = self.quantize(x)
            return torch._int_mm(qx.to(torch.int8), self.qt), 2 * bound  # (B, V) int32, exact
        if cpu_fused.usable(x):  # the same numbers in one compiled call: uint8 codes qx + 128
            xu, bound, qx_norm = cpu_fused.quantize_rows(x, self.err_norm, self.w_norm, self.step)
        else:
            qx, bound = self.quantize(x)
            xu, qx_norm = (qx + 128).to(torch.uint8), float(qx.norm(dim=1).max())
        cap = qx_norm * self.q_norm
        unit = self.unit = (min(self.top, cap) if self.top else cap) / 255.0 or 1.0
        y = torch.ops.onednn.qlinear_pointwise(
            xu, 1.0, 128, self.packed, self.ones, self.zeros, None, unit, 0, torch.uint8, "none", [], ""
        )  # fmt: skip
        return y, 1.0 + 2e-3 + 2 * bound / unit

    def observe(self, row_max: torch.Tensor) -> None:
        """Adapt the uint8 range to a uint8 screen's row maxima ``(B,)``: the next call maps
        1.25× the largest to 255; after a saturated (or all-zero) row, back to the cap."""
        peak = int(row_max.max())
        self.top = peak * self.unit * 1.25 if 0 < peak < 255 else None


def _onednn_prepack(q: torch.Tensor, levels: int) -> torch.Tensor | None:
    """oneDNN's pre-packed int8 weight (measured 2x faster than ``_int_mm`` at 8 rows), or None
    where this torch build lacks the op or the products could leave fp32's exact integers."""
    ops = getattr(torch.ops, "onednn", None)
    if ops is None or not hasattr(ops, "qlinear_prepack") or q.shape[1] * 127 * levels >= 1 << 24:
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
        y, margin = screen.screen(hidden)
        B, V = y.shape
        rows_major = self._rows_major()
        if rows_major is not None and cpu_fused.available():  # one compiled pass over y
            picked = cpu_fused.screen_pick(y, margin, rows_major, hidden, MAX_BLOCKS_PER_ROW * BLOCK * B)
            if picked is not None:
                best, row_max = picked
                if y.dtype == torch.uint8:
                    screen.observe(row_max)
                if not bool((best == V).any()):
                    self.screened_rows += B
                    return best
            self.fallback_rows += B  # too many candidates, or a row without any (NaN/inf)
            return self.logits(hidden).argmax(-1)
        full = V // BLOCK * BLOCK
        block_max = y[:, :full].view(B, -1, BLOCK).amax(-1)  # (B, nb)
        if full < V:
            block_max = torch.cat([block_max, y[:, full:].amax(-1, keepdim=True)], dim=1)
        row_max = block_max.amax(-1)
        if y.dtype == torch.uint8:
            screen.observe(row_max)
        thr = row_max.double() - margin  # (B,)
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
        best = self._best(hidden, rows, cols, B, V)
        if bool((best == V).any()):  # a row without candidates (NaN/inf hidden states): no bound holds
            self.fallback_rows += B
            return self.logits(hidden).argmax(-1)
        return best

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

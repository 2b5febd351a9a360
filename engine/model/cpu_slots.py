"""Compiled loops (numba) of the host slot decoder (``host_decode.py``): the two parts of a
layer's attention step that read and write its slot pools.

- ``gather_attend``: ``attend.attend_with_sinks`` for a batch of decode tokens whose keys are
  rows of the window ring (found from slot and position), the step's own new keys (a verify's
  ``1 + k`` offsets of a slot in one pass, each seeing the offsets before it) and rows of the
  compressed-row pool, read in place (no gathered copies, no index tensors for the window); each
  key row read once for all heads. ``index_scores``: the CSA indexer's scores over a slot's rows,
  read in place.
- ``compress_step``: the step's tokens into a compressor (``Compressor.update`` at decode), in
  column order (a verify's offsets one after another): each token's projections into its slot's
  buffer and, right after a token whose window closes, the gated pooling, the kv norm and RoPE of
  ``Compressor.update``, the row written in place and (CSA) the window's first half kept as the
  next window's overlap.

Per token the arithmetic is the eager path's, in fp32 (``cpu_fused._exp``, ``cpu_fused._dot``:
rounding differs by an ulp or so); nothing depends on the other tokens of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model import cpu_fused
from engine.model.cpu_fused import _dot, _exp, _max, _sum


def _gather_attend(
    q: np.ndarray, ring: np.ndarray, fresh: np.ndarray, cols: int, slots: np.ndarray, positions: np.ndarray, window: int,
    rows: np.ndarray, row_at: np.ndarray, row_bias: np.ndarray, sinks: np.ndarray, scaling: float,
) -> np.ndarray:  # fmt: skip
    """``attend.attend_with_sinks`` with the keys read in place: query ``t`` (slot ``slots[t]`` at
    position ``p = positions[t]``) attends to its window, positions ``max(0, p-W+1) .. p`` in that
    order, then to ``rows[row_at[t, j]]`` (bias ``row_bias[t, j]``; 0 columns: no bias; ``row_at``
    with 0 columns: no rows); softmax with the per-head sink logit; ``q (n, nh, D)`` → ``(n, nh, D)``.

    Window keys come from the ring (``ring (S·W, D)``, entry ``slot·W + position % W``), except, with
    ``fresh (n, D)`` (0 rows: none), the keys not written there yet: the step's own columns are
    offset-major (``cols`` per offset), so query ``t`` at offset ``j = t // cols`` (position ``p``)
    reads ring positions up to ``p-j-1`` and the fresh keys of columns ``t - j·cols, .., t`` (its
    slot's offsets ``0 .. j``): a verify's offsets all in one pass, none overwriting a key another
    reads. A row whose logit is -inf gets exactly 0. Each key row is read once for all heads."""
    n, nh, d = q.shape
    e = row_at.shape[1]
    sc = np.float32(scaling)
    neg = np.float32(-np.inf)
    zero = np.float32(0.0)
    out = np.zeros((n, nh, d), np.float32)
    has_fresh = fresh.shape[0] > 0
    depth = n // cols + 1 if has_fresh else 0
    logit = np.empty((nh, window + depth + e), np.float32)
    key = np.empty(window, np.int64)  # ring entry of window key j
    side = np.empty((depth + e, d), np.float32)  # the query's keys after the ring's: fresh ones, then its rows
    for t in range(n):
        base, p = slots[t] * window, positions[t]
        first = max(0, p - window + 1)
        f = t // cols + 1 if has_fresh else 0  # fresh keys: positions p-f+1 .. p
        w = p - first + 1 - f  # window keys read from the ring
        at = base + first % window
        for j in range(w):  # the ring's entries in chronological order: at most one wrap
            key[j] = at
            at = at + 1 if at + 1 < base + window else base
        for j in range(f):
            side[j] = fresh[t - (f - 1 - j) * cols]
        for j in range(e):
            side[f + j] = rows[row_at[t, j]]
        wf = w + f
        m_all = wf + e
        for j in range(m_all):
            row = ring[key[j]] if j < w else side[j - w]
            b = row_bias[t, j - wf] if j >= wf and row_bias.shape[1] else zero
            for h in range(nh):
                logit[h, j] = _dot(q[t, h], row) * sc + b
        for h in range(nh):
            lh = logit[h, :m_all]
            m = _max(lh, sinks[h])
            for j in range(m_all):  # no reduction in these loops: they vectorise
                v = lh[j]
                pr = _exp(v - m)
                lh[j] = zero if v == neg else pr
            total = _exp(sinks[h] - m) + _sum(lh)
            for j in range(m_all):
                lh[j] = lh[j] / total
        o = out[t]
        j = 0
        while j + 4 <= m_all:  # four keys per pass over the output: a quarter of its loads and stores
            r0 = ring[key[j]] if j < w else side[j - w]
            r1 = ring[key[j + 1]] if j + 1 < w else side[j + 1 - w]
            r2 = ring[key[j + 2]] if j + 2 < w else side[j + 2 - w]
            r3 = ring[key[j + 3]] if j + 3 < w else side[j + 3 - w]
            for h in range(nh):
                p0, p1, p2, p3 = logit[h, j], logit[h, j + 1], logit[h, j + 2], logit[h, j + 3]
                for c in range(d):
                    o[h, c] += (p0 * r0[c] + p1 * r1[c]) + (p2 * r2[c] + p3 * r3[c])
            j += 4
        while j < m_all:
            r0 = ring[key[j]] if j < w else side[j - w]
            for h in range(nh):
                p0 = logit[h, j]
                for c in range(d):
                    o[h, c] += p0 * r0[c]
            j += 1
    return out


def gather_attend(
    q: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, window: int,
    rows: torch.Tensor | None, row_at: torch.Tensor | None, row_bias: torch.Tensor | None, sinks: torch.Tensor, scaling: float,
    fresh: torch.Tensor | None = None, cols: int = 1,
) -> torch.Tensor:  # fmt: skip
    """``_gather_attend`` on fp32 CPU tensors: ``ring (S·W, D)``, ``slots/positions (n,)`` int64,
    compressed ``rows (R, D)`` at ``row_at (n, E)`` with ``row_bias (n, E)`` (None: no rows / no
    bias); ``fresh (n, D)`` the columns' own keys, not in the ring yet (None: the ring holds them),
    ``cols`` columns per offset."""
    if row_at is None:
        rows_np, at_np = np.zeros((1, ring.shape[-1]), np.float32), np.zeros((q.shape[0], 0), np.int64)
    else:
        rows_np, at_np = rows.detach().numpy(), row_at.contiguous().numpy()
    fresh_np = np.zeros((0, ring.shape[-1]), np.float32) if fresh is None else fresh.detach().contiguous().numpy()
    out = _gather_attend(
        q.detach().contiguous().numpy(), ring.detach().numpy(), fresh_np, cols, slots.numpy(), positions.numpy(), window,
        rows_np, at_np, _NO_BIAS if row_bias is None else row_bias.detach().contiguous().numpy(), sinks.detach().numpy(), scaling,
    )  # fmt: skip
    return torch.from_numpy(out)


_NO_BIAS = np.zeros((0, 0), np.float32)


def _index_scores(
    q: np.ndarray, w: np.ndarray, rows: np.ndarray, row_base: np.ndarray, t: int, softmax_scale: float, weights_scaling: float,
) -> np.ndarray:  # fmt: skip
    """``Indexer.scores`` over rows ``row_base[i] .. row_base[i] + t - 1`` of ``rows (R, Di)`` read in
    place: ``Σ_h relu(q[i, h]·row)·softmax_scale·(w[i, h]·weights_scaling)``, summed over heads in
    order → ``(n, t)``."""
    n, hi = w.shape
    out = np.zeros((n, t), np.float32)
    ss = np.float32(softmax_scale)
    for i in range(n):
        for h in range(hi):
            wh = w[i, h] * np.float32(weights_scaling)
            for j in range(t):
                out[i, j] += max(_dot(q[i, h], rows[row_base[i] + j]), np.float32(0.0)) * ss * wh
    return out


def index_scores(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, row_base: torch.Tensor, t: int, softmax_scale: float, weights_scaling: float) -> torch.Tensor:
    """``_index_scores`` on fp32 CPU tensors: ``q (n, Hi, Di)``, ``w (n, Hi)``, ``rows (R, Di)``."""
    return torch.from_numpy(_index_scores(
        q.detach().contiguous().numpy(), w.detach().contiguous().numpy(), rows.detach().numpy(), row_base.numpy(), t,
        softmax_scale, weights_scaling,
    ))  # fmt: skip


def _top_rows(scores: np.ndarray, counts: np.ndarray, topk: int, chosen: np.ndarray, taken: np.ndarray, own: np.ndarray) -> None:
    """``decode.pick_rows`` without ``torch.topk``: each row ``i``'s best ``min(topk, counts[i])``
    columns of ``scores[i, :counts[i]]``, highest first, into ``chosen[i]`` (count in
    ``taken[i]``). ``own[i]`` False (``chosen[i]`` unset) when the row has a NaN or a tie across
    its cut (the k-th best equals the best left out): there the set depends on ``topk``'s tie
    order. Otherwise the set is ``topk``'s, in its order of scores; equal scores inside it are
    listed lowest column first (``topk`` may list them otherwise: the attention's sum over them
    then differs by rounding only)."""
    for i in range(scores.shape[0]):
        c = counts[i]
        k = min(topk, c)
        taken[i] = k
        own[i] = True
        out = chosen[i]
        n = 0  # columns held, best first
        left = -np.inf  # the best column left out so far
        row = scores[i]
        for j in range(c):
            v = row[j]
            if v != v:
                own[i] = False
                break
            if n == k:
                if v <= row[out[k - 1]]:
                    left = max(left, v)
                    continue
                left = max(left, row[out[k - 1]])
                n -= 1
            at = n
            while at > 0 and row[out[at - 1]] < v:
                out[at] = out[at - 1]
                at -= 1
            out[at] = j
            n += 1
        if not own[i]:
            continue
        if k < c and left == row[out[k - 1]]:
            own[i] = False


def top_rows(scores: torch.Tensor, counts: list[int], topk: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """``_top_rows`` on an fp32 ``scores (n, T)``: ``(n, k_max)`` int64 columns (row ``i``'s first
    ``taken[i]`` valid, ``k_max = min(topk, max(counts))``), ``taken``, and the rows left to
    ``torch.topk`` (a tie across the cut, a NaN; their columns unset)."""
    k_max = min(topk, max(counts))
    n = scores.shape[0]
    chosen = np.zeros((n, k_max), np.int64)
    taken = np.zeros(n, np.int64)
    own = np.zeros(n, np.bool_)
    _top_rows(scores.contiguous().numpy(), np.asarray(counts, np.int64), topk, chosen, taken, own)
    return torch.from_numpy(chosen), taken.tolist(), np.flatnonzero(~own).tolist()


def _compress_step(
    buf_kv: np.ndarray, buf_gate: np.ndarray, buf_at: np.ndarray, kv: np.ndarray, gate: np.ndarray, closes: np.ndarray,
    close_slots: np.ndarray, close_rows: np.ndarray, has_prev: np.ndarray, cos: np.ndarray,
    sin: np.ndarray, overlap_kv: np.ndarray, overlap_gate: np.ndarray, position_bias: np.ndarray,
    norm_w: np.ndarray, norm_eps: float, rows: np.ndarray,
) -> None:  # fmt: skip
    """``buf_kv/buf_gate (S+1, r, P)`` take ``kv/gate (n, P)`` at flat rows ``buf_at (n,)``, token by
    token; right after a token that closes its window (``closes[t]``, the ``i``-th to close: slot
    ``close_slots[i]``) the window pools its ``r``
    buffered tokens (CSA, ``overlap_kv`` with ``r`` rows: after the previous window's Ca, or
    nothing when ``has_prev[i]`` is 0) with a softmax over the gates + position bias per
    channel, then RMSNorm (``norm_w``) and RoPE (``cos/sin[i]``) into ``rows[close_rows[i]]``."""
    r, p = buf_kv.shape[1], buf_kv.shape[2]
    flat_kv = buf_kv.reshape(-1, p)
    flat_gate = buf_gate.reshape(-1, p)
    d = rows.shape[1]
    overlap = overlap_kv.shape[0] > 0
    first = r if overlap else 0  # slots before the window's own r (the previous window's Ca)
    neg = np.float32(-np.inf)
    pooled = np.empty(d, np.float32)
    g = np.empty(first + r, np.float32)
    i = -1  # the closing window last pooled
    for t in range(kv.shape[0]):  # in column order: a verify's offsets one after another
        flat_kv[buf_at[t]] = kv[t]
        flat_gate[buf_at[t]] = gate[t]
        if not closes[t]:
            continue
        i += 1
        s = close_slots[i]
        for c in range(d):
            k0 = d + c if overlap else c  # the window's own series: Cb (CSA) or the only one
            for k in range(first):
                g[k] = overlap_gate[s, k, c] if has_prev[i] else neg
            for k in range(r):
                g[first + k] = buf_gate[s, k, k0] + position_bias[k, k0]
            top = g[0]
            for k in range(1, first + r):
                top = max(top, g[k])
            total = np.float32(0.0)
            for k in range(first + r):
                g[k] = _exp(g[k] - top) if g[k] != neg else np.float32(0.0)
                total += g[k]
            acc = np.float32(0.0)
            for k in range(first):
                if has_prev[i]:
                    acc += overlap_kv[s, k, c] * (g[k] / total)
            for k in range(r):
                acc += buf_kv[s, k, k0] * (g[first + k] / total)
            pooled[c] = acc
        ss = np.float32(0.0)
        for c in range(d):
            ss += pooled[c] * pooled[c]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(norm_eps))
        out = rows[close_rows[i]]
        for c in range(d):
            out[c] = norm_w[c] * (pooled[c] * inv)
        half = cos.shape[1]
        start = d - 2 * half
        for j in range(half):
            even, odd = out[start + 2 * j], out[start + 2 * j + 1]
            out[start + 2 * j] = even * cos[i, j] - odd * sin[i, j]
            out[start + 2 * j + 1] = odd * cos[i, j] + even * sin[i, j]
        if overlap:
            for k in range(r):
                for c in range(d):
                    overlap_kv[s, k, c] = buf_kv[s, k, c]
                    overlap_gate[s, k, c] = buf_gate[s, k, c] + position_bias[k, c]


@dataclass(frozen=True)
class CompressArrays:
    """A compressor's slot pools (``static_decode.CompPool``) and weights as numpy views: made
    once, they share the tensors' memory."""

    buf_kv: np.ndarray  # (S+1, r, P)
    buf_gate: np.ndarray  # (S+1, r, P)
    overlap_kv: np.ndarray  # (S+1, r, d) CSA, (0, 0, 0) otherwise
    overlap_gate: np.ndarray
    rows: np.ndarray  # (R, d) flat
    position_bias: np.ndarray  # (r, P)
    norm_w: np.ndarray  # (d,)
    norm_eps: float


def compress_arrays(
    rows: torch.Tensor, buf_kv: torch.Tensor, buf_gate: torch.Tensor, overlap_kv: torch.Tensor | None,
    overlap_gate: torch.Tensor | None, position_bias: torch.Tensor, norm_w: torch.Tensor, norm_eps: float,
) -> CompressArrays:  # fmt: skip
    """``CompressArrays`` over fp32 CPU tensors (``overlap_*`` None: no overlap, HCA)."""
    return CompressArrays(
        buf_kv.numpy(), buf_gate.numpy(), _EMPTY3 if overlap_kv is None else overlap_kv.numpy(),
        _EMPTY3 if overlap_gate is None else overlap_gate.numpy(), rows.view(-1, rows.shape[-1]).numpy(),
        position_bias.detach().numpy(), norm_w.detach().numpy(), norm_eps,
    )  # fmt: skip


@dataclass(frozen=True)
class ClosingWindows:
    """One step's buffer rows and closing windows of one compression rate as numpy arrays,
    shared by every compressor of that rate."""

    buf_at: np.ndarray  # (n,) flat buffer row of each token
    closes: np.ndarray  # (n,) bool: the token closes its window
    slots: np.ndarray  # (m,) slot of each closing window, in column order
    rows: np.ndarray  # (m,) flat destination row
    has_prev: np.ndarray  # (m,) bool: a previous window exists
    cos: np.ndarray  # (m, rope/2) at each window's position
    sin: np.ndarray


def closing_windows(
    buf_at: torch.Tensor, closes: list[int], slots: torch.Tensor | None, rows: torch.Tensor | None, has_prev: torch.Tensor | None,
    cos: torch.Tensor | None, sin: torch.Tensor | None,
) -> ClosingWindows:  # fmt: skip
    """``ClosingWindows`` from int64 / fp32 tensors; ``closes``: the columns whose window closes
    (ascending), ``slots`` None when there is none, ``has_prev`` None when every closing window
    has a previous one."""
    flags = np.zeros(buf_at.shape[0], np.bool_)
    flags[closes] = True
    if slots is None:
        return ClosingWindows(buf_at.numpy(), flags, _NONE_I, _NONE_I, _NONE_B, _EMPTY2, _EMPTY2)
    prev = np.ones(slots.shape[0], np.bool_) if has_prev is None else has_prev.view(-1).numpy()
    return ClosingWindows(buf_at.numpy(), flags, slots.numpy(), rows.numpy(), prev, cos.contiguous().numpy(), sin.contiguous().numpy())


def compress_step(a: CompressArrays, w: ClosingWindows, kv: torch.Tensor, gate: torch.Tensor) -> None:
    """``_compress_step``: the tokens' projections ``kv, gate (n, P)`` into compressor ``a``'s
    buffers, the windows ``w`` closes pooled into its rows (all in place)."""
    _compress_step(
        a.buf_kv, a.buf_gate, w.buf_at, kv.contiguous().numpy(), gate.contiguous().numpy(), w.closes, w.slots, w.rows,
        w.has_prev, w.cos, w.sin, a.overlap_kv, a.overlap_gate, a.position_bias, a.norm_w, a.norm_eps, a.rows,
    )  # fmt: skip


_EMPTY2 = np.zeros((0, 0), np.float32)
_EMPTY3 = np.zeros((0, 0, 0), np.float32)
_NONE_I = np.zeros(0, np.int64)
_NONE_B = np.zeros(0, np.bool_)


_gather_attend = cpu_fused.numba.njit(cache=True, nogil=True, error_model="numpy")(_gather_attend)
_compress_step = cpu_fused.numba.njit(cache=True, nogil=True, error_model="numpy")(_compress_step)
_index_scores = cpu_fused.numba.njit(cache=True, nogil=True, error_model="numpy")(_index_scores)
_top_rows = cpu_fused.numba.njit(cache=True, nogil=True, error_model="numpy")(_top_rows)

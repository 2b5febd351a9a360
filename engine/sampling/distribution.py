"""Truncating a distribution (min-p, top-k, top-p) and drawing from it, batched over rows.

All functions work on temperature-scaled logits ``x`` (R, V) float32, in place where they say so;
a removed token gets -inf. Order (vLLM's): min-p, then top-k, then top-p over what top-k kept.

Batch invariance. Every reduction here is row-local and ordered the same whatever R is (max,
sums of 128-token blocks, cumsum, per-row topk/sort), so a row's result does not depend on its
neighbours — the property the seeded-sampling guarantee rests on. (A plain ``sum`` over a (1, V)
row is split across threads and rounds differently from the same row inside a larger batch, so it
is avoided.) Truncation works row by row on views, so no (R, V) temporaries are made for it.

Cost. A full sort of a 129k vocabulary costs ~6 ms per row on CPU, so top-p first looks for the
nucleus inside the ``candidates`` largest logits (``topk``), then 16 times as many, and sorts the
whole row only when the nucleus is wider still (flat distributions).
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")

# Drawing uses blocks of this many tokens: one float32 sum per block, float64 prefix sums over
# blocks, then a float64 cumsum inside the chosen block only. (A float32 cumsum over the whole
# row would lose the small tokens: at a running total of ~2e3 its rounding step is ~2e-4.)
BLOCK = 128


def apply_min_p(x: torch.Tensor, rows: list[int], min_p: list[float]) -> None:
    """Remove tokens with p < min_p * p_max, i.e. x < x_max + log(min_p), in the listed rows.

    Row by row on views: no (R, V) temporaries, and rows not listed are not touched.
    """
    for j, m in zip(rows, min_p):
        row = x[j]
        row.masked_fill_(row < row.max() + math.log(m), NEG_INF)


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int = 256) -> None:
    """Keep each row's top_k largest logits (0 = all), then the smallest prefix of those whose
    probability mass (renormalised over the top-k) reaches top_p (1 = all). In place, all rows.

    Ties at the cut-off are kept. top_k (R,) int64, top_p (R,) float32.
    """
    rows = list(range(x.shape[0]))
    mask_below(x, rows, top_k_top_p_thresholds(x, rows, top_k, top_p, candidates))


def mask_below(x: torch.Tensor, rows: list[int], thresholds: torch.Tensor) -> None:
    """x[rows[j]] < thresholds[j] -> -inf, row by row on views."""
    for j, t in zip(rows, thresholds.tolist()):
        row = x[j]
        row.masked_fill_(row < t, NEG_INF)


def top_k_top_p_thresholds(
    x: torch.Tensor, rows: list[int], top_k: torch.Tensor, top_p: torch.Tensor, candidates: int = 256
) -> torch.Tensor:
    """Per listed row, the smallest logit that top-k then top-p keep, (T,) (see apply_top_k_top_p).

    The nucleus is searched among the ``candidates`` largest logits, then 16 times as many, then
    the whole sorted row. ``x`` is read through row views, never copied.
    """
    vocab = x.shape[1]
    k_eff = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))  # (T,)
    full_mass = torch.zeros(len(rows), dtype=torch.float64)  # (T,) only for top-p without top-k
    for j in ((top_p < 1.0) & (k_eff == vocab)).nonzero().flatten().tolist():
        view = x[rows[j] : rows[j] + 1]  # (1, V)
        full_mass[j] = _row_mass(view, view.amax(-1))[0]
    thresh = torch.empty(len(rows), dtype=x.dtype)  # (T,)
    todo = list(range(len(rows)))
    while True:
        t, ok = _cutoffs(x, [rows[j] for j in todo], k_eff[todo], top_p[todo], full_mass[todo], candidates)
        thresh[todo] = t
        if bool(ok.all()) or candidates >= vocab:
            return thresh
        todo = [j for j, done in zip(todo, ok.tolist()) if not done]
        candidates = min(vocab, candidates * 16)


def _cutoffs(
    x: torch.Tensor, rows: list[int], k_eff: torch.Tensor, top_p: torch.Tensor, full_mass: torch.Tensor, candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per listed row the logit threshold (T,), and whether the top ``candidates`` decided it.

    ``full_mass``: sum(exp(x - max)) of rows with top-p and no top-k.
    """
    vocab = x.shape[1]
    use_p = top_p < 1.0  # (T,)
    need = torch.where(use_p, k_eff.clamp(max=candidates), k_eff)  # (T,)
    K = int(need.max())
    if K < vocab:
        vals = torch.stack([torch.topk(x[r], K, sorted=True).values for r in rows])  # (T, K)
    else:
        vals = torch.stack([torch.sort(x[r], descending=True).values for r in rows])  # (T, V)
    k_in = k_eff.clamp(max=K)  # (T,) top-k cut inside the candidates
    thresh = vals.gather(1, (k_in - 1).unsqueeze(1)).squeeze(1)  # (T,) top-k threshold
    resolved = (k_eff <= K) | use_p  # top-k only rows need their k-th value
    if bool(use_p.any()):
        cum = torch.cumsum(exp_shifted_(vals - vals[:, :1]), -1, dtype=torch.float64)  # (T, K)
        top_k_mass = cum.gather(1, (k_in - 1).unsqueeze(1)).squeeze(1)  # (T,)
        mass = torch.where(k_eff <= K, top_k_mass, full_mass)  # (T,) denominator of top-p
        target = (top_p.double() * mass).unsqueeze(1)  # (T, 1)
        cut = torch.searchsorted(cum, target).squeeze(1)  # (T,) first index reaching the target
        # Decided if the top-k lies inside the candidates (then the cut is inside it too), or if
        # there is no top-k and the nucleus ends inside the candidates.
        ok = (k_eff <= K) | ((k_eff == vocab) & (cut < K))
        cut = torch.minimum(cut, k_in - 1)
        p_thresh = vals.gather(1, cut.unsqueeze(1)).squeeze(1)  # (T,)
        thresh = torch.where(use_p, p_thresh, thresh)
        resolved = torch.where(use_p, ok, resolved)
    return thresh, resolved


def exp_shifted_(z: torch.Tensor) -> torch.Tensor:
    """exp(z) in place for z <= 0, with exp(z) := 0 below -80 (relative weight < 2e-35).

    CPU exp is ~4x slower on -inf and ~50x slower where the result underflows to a denormal
    (z < -87: low temperatures, masked rows), so z is clamped first and the floor zeroed after.
    """
    z.clamp_(min=-80.0).exp_()
    return torch.nn.functional.threshold_(z, 2e-35, 0.0)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of (R, C) float32, without the slow exp paths (new tensor)."""
    row_max = x.amax(-1, keepdim=True)  # (R, 1)
    log_mass = _row_mass(x, row_max.squeeze(1)).log().to(x.dtype).unsqueeze(1)  # (R, 1)
    return x - (row_max + log_mass)


def _row_mass(x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """sum(exp(x - row_max)) per row in float64, (R,), with a batch-independent order."""
    w = exp_shifted_(x - row_max.unsqueeze(1))  # (R, V)
    return _block_sums(w).sum(-1, dtype=torch.float64)


def _block_sums(w: torch.Tensor) -> torch.Tensor:
    """(R, V) -> (R, ceil(V / BLOCK)) float32 sums of consecutive blocks (zero-padded)."""
    rows, vocab = w.shape
    pad = (-vocab) % BLOCK
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.view(rows, -1, BLOCK).sum(-1)


def draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from softmax(x) per row with uniforms u (R,) float64 -> (R,) int64.

    Index = first token whose cumulative weight exceeds u * total, so a token of zero weight
    (-inf logit) is never drawn. Every row must have at least one finite logit.
    """
    rows, vocab = x.shape
    pad = (-vocab) % BLOCK
    w = torch.empty(rows, vocab + pad, dtype=x.dtype)  # (R, V + pad)
    w[:, vocab:] = 0.0  # padding weighs nothing
    exp_shifted_(torch.sub(x, x.amax(-1, keepdim=True), out=w[:, :vocab]))  # in [0, 1]
    wb = w.view(rows, -1, BLOCK)  # (R, NB, BLOCK)
    bsum = wb.sum(-1)  # (R, NB) float32: 128 terms in [0, 1], relative error ~1e-7
    bcdf = torch.cumsum(bsum, -1, dtype=torch.float64)  # (R, NB)
    target = u.unsqueeze(1) * bcdf[:, -1:]  # (R, 1)
    blk = torch.searchsorted(bcdf, target, right=True)  # (R, 1)
    # Rounding can put the target at or past the total: take the last block with any weight.
    blk = torch.minimum(blk, _last_true(bsum > 0))
    before = torch.where(blk > 0, bcdf.gather(1, (blk - 1).clamp(min=0)), torch.zeros_like(target))  # (R, 1)
    inner = wb.gather(1, blk.unsqueeze(2).expand(rows, 1, BLOCK)).squeeze(1)  # (R, BLOCK)
    icdf = torch.cumsum(inner, -1, dtype=torch.float64)  # (R, BLOCK)
    pos = torch.searchsorted(icdf, target - before, right=True)  # (R, 1)
    pos = torch.minimum(pos, _last_true(inner > 0))  # same rounding guard inside the block
    return (blk * BLOCK + pos).squeeze(1)


def _last_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True per row, (R, C) bool -> (R, 1) int64 (0 if none)."""
    width = mask.shape[1]
    return width - 1 - torch.argmax(mask.flip(1).to(torch.int8), dim=1, keepdim=True)

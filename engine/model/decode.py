"""Batched decode: attention for many sequences that each feed one token, in one pass.

The general path (``Attention._attend_sequence``) walks sequences one by one, ~30 small tensor
ops each per layer; at decode that Python and dispatch overhead is most of a step. Here a
decode batch of B sequences becomes padded tensors and a handful of batched ops:

- window keys ``(B, W, D)``: each sequence's last ``W-1`` keys, left-padded, plus the new key;
- compressed rows: HCA sees all of its ``(B, T, D)`` rows (right-padded); CSA scores all indexer
  rows ``(B, Hi, T)`` at once and gathers its top-k rows ``(B, k, D)``;
- one softmax with sinks over ``(B, nh, W + T|k)``; padded keys carry a -inf bias.

Why it is exact: at a decode step the new token sees exactly its window (the last ``W-1`` keys,
all within distance ``< W``) and every compressed row (a row exists only once its window is
complete, and the token closing a window sees it). Padded keys and the rows the indexer did not
pick get probability ``exp(-inf) = 0``, as they do in the general path's -inf bias, so only the
summation order of the softmax differs. The indexer's ``torch.topk`` runs on each sequence's own
row count (sequences grouped by count), so tie order is the general path's too.

Compressor state updates for one token per sequence are batched by buffer length
(``compress_decode``): appends are one ``cat`` per group, and the sequences whose window closes
this step pool it together with the same ops as ``Compressor.update``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.reference import attend_with_sinks, hide
from engine.model.rope import Rotary, apply_rope
from engine.model.state import CompressorState

if TYPE_CHECKING:
    from engine.model.attention import (
        Attention,
        Compressor,
        Indexer,
        Projected,
        SeqSlice,
    )


def decode_eligible(attn: Attention, s: SeqSlice) -> bool:
    """True when ``s`` feeds one token and its compressors are in the normal (non-replay) mode,
    i.e. ``rows·r + len(buffer) == position``: then after this token all rows are complete."""
    if s.end - s.start != 1:
        return False
    for comp in (s.state.comp, s.state.index):
        if comp is not None and (comp.windows is not None or comp.rows.shape[0] * attn.compressor.rate + comp.buf_kv.shape[0] != s.first_pos):
            return False
    return True


def attend_decode(attn: Attention, seqs: list[SeqSlice], p: Projected, rows: torch.Tensor | None, rotary: Rotary) -> torch.Tensor:
    """Attention output ``(B, nh, D)`` for decode sequences ``seqs`` (all ``decode_eligible``),
    whose tokens sit at rows ``rows`` of the projections (``None``: rows ``0..B-1``, all of them).
    Updates each sequence's window and compressor state like the general path."""
    take = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
    q, kv = take(p.q), take(p.kv)  # (B, nh, D), (B, D)
    win, win_bias = _window_keys(attn.window, seqs, kv)  # (B, W, D), (B, W) or None
    extra = extra_bias = None
    if attn.compressor is not None:
        compress_decode(attn.compressor, [s.state.comp for s in seqs], take(p.comp_kv), take(p.comp_gate), rotary)
        idx = attn.indexer
        if idx is not None:
            compress_decode(idx, [s.state.index for s in seqs], take(p.idx_kv), take(p.idx_gate), rotary)
            extra, extra_bias = _indexer_rows(idx, seqs, take(p.idx_q), take(p.idx_w), q.dtype)
        else:
            extra, extra_bias = _stack_rows([s.state.comp.rows for s in seqs], q.dtype)
    return attend_with_sinks(q, win, win_bias, extra, extra_bias, attn.sinks, attn.scaling)


def _window_keys(window: int, seqs: list[SeqSlice], kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each sequence's last ``W-1`` keys and its new key, ``(B, W, D)``, left-padded (bias -inf
    on padding, ``None`` when nothing is padded). Sets every ``swa`` to its new window, a view
    of the result (so the next step's ``stack`` reads it without an extra copy now)."""
    keep = window - 1
    prev = [s.state.swa[max(0, s.state.swa.shape[0] - keep) :] for s in seqs]
    counts = [t.shape[0] for t in prev]
    bias = None
    if all(c == keep for c in counts):
        keys = torch.cat([torch.stack(prev), kv.unsqueeze(1)], dim=1)  # (B, W, D)
    else:
        keys = kv.new_zeros(len(seqs), window, kv.shape[-1])
        for i, (t, c) in enumerate(zip(prev, counts)):
            if c:
                keys[i, keep - c : keep] = t
        keys[:, keep] = kv
        bias = hide(torch.arange(window, device=kv.device)[None, :] < torch.tensor([keep - c for c in counts], device=kv.device)[:, None], kv.dtype)
    if bias is None:  # every window full: the same slice for all, one unbind for the views
        for s, view in zip(seqs, keys[:, 1:].unbind(0)):
            s.state.swa = view  # the last W-1 keys
    else:
        for i, (s, c) in enumerate(zip(seqs, counts)):
            s.state.swa = keys[i, window - min(c + 1, keep) :]  # the last min(n+1, W-1) keys
    return keys, bias


def _stack_rows(tensors: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(B, T, D)`` right-padded stack of per-sequence rows ``(T_i, D)`` and its bias ``(B, T)``
    (-inf on padding; ``None`` when nothing is padded). ``(None, None)`` when every ``T_i`` is 0."""
    counts = [t.shape[0] for t in tensors]
    t_max = max(counts)
    if t_max == 0:
        return None, None
    if all(c == t_max for c in counts):
        return torch.stack(tensors), None
    ref = tensors[0]
    out = ref.new_zeros(len(tensors), t_max, ref.shape[-1])
    for i, (t, c) in enumerate(zip(tensors, counts)):
        if c:
            out[i, :c] = t
    return out, pad_bias(counts, t_max, dtype, ref.device)


def pad_bias(counts: list[int], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(B, width)``: 0 on the first ``counts[i]`` columns of row i, -inf after."""
    return hide(torch.arange(width, device=device)[None, :] >= torch.tensor(counts, device=device)[:, None], dtype)


def _indexer_rows(idx: Indexer, seqs: list[SeqSlice], q: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The compressed rows each CSA query attends: its indexer's top-k of all rows so far,
    gathered ``(B, k, D)``, with bias ``(B, k)`` (-inf on padding when a sequence has < k rows).

    Scores as ``Indexer.topk_rows`` (``Indexer.scores``, ``q (B, Hi, Di)``, ``w (B, Hi)``). At
    decode no row is in the future, so its -inf mask is empty; ``topk`` runs per group of
    sequences with the same row count, on exactly that many columns (its tie order depends on it).
    """
    idx_rows, _ = _stack_rows([s.state.index.rows for s in seqs], dtype)  # (B, T, Di)
    if idx_rows is None:
        return None, None
    counts = [s.state.index.rows.shape[0] for s in seqs]
    chosen, bias = pick_rows(idx, idx.scores(q, w, idx_rows), counts, dtype)
    comp_rows, _ = _stack_rows([s.state.comp.rows for s in seqs], dtype)  # (B, T, D)
    picked = comp_rows.gather(1, chosen.unsqueeze(-1).expand(-1, -1, comp_rows.shape[-1]))  # (B, k, D)
    return picked, bias


def pick_rows(idx: Indexer, scores: torch.Tensor, counts: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each query's top-k rows from its indexer ``scores (B, T)`` over ``counts[i]`` rows:
    ``(B, k)`` indices and bias ``(B, k)`` (-inf on padding when a sequence has < k rows, else
    None). ``topk`` runs per group of equal row counts on exactly that many columns."""
    k_max = min(idx.topk, max(counts))
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(counts):
        groups.setdefault(c, []).append(i)
    if len(groups) == 1:
        return scores[:, : counts[0]].topk(k_max, dim=-1).indices, None
    chosen = torch.zeros(len(counts), k_max, dtype=torch.long, device=scores.device)
    taken = [0] * len(counts)
    for c, members in groups.items():
        if c == 0:
            continue
        k = min(idx.topk, c)
        m = torch.tensor(members, device=scores.device)
        chosen[m, :k] = scores[m, :c].topk(k, dim=-1).indices
        for i in members:
            taken[i] = k
    bias = None if all(k == k_max for k in taken) else pad_bias(taken, k_max, dtype, scores.device)
    return chosen, bias


def compress_decode(comp: Compressor, states: list[CompressorState], kv: torch.Tensor, gate: torch.Tensor, rotary: Rotary) -> None:
    """``Compressor.update`` for B states that each get one token ``kv, gate (B, proj)``.

    Applies to states in the normal mode (``windows is None``). States with equal buffer
    lengths append together (one ``cat``); those whose window closes pool it together with the
    very ops of ``Compressor.update``, so the rows are the same.
    """
    groups: dict[int, list[int]] = {}
    for i, st in enumerate(states):
        groups.setdefault(st.buf_kv.shape[0], []).append(i)
    for n, members in groups.items():
        sub = states if len(members) == len(states) else [states[i] for i in members]
        if len(members) == len(states):
            g_kv, g_gate = kv, gate
        else:
            m = torch.tensor(members, device=kv.device)
            g_kv, g_gate = kv.index_select(0, m), gate.index_select(0, m)
        if n:
            g_kv = torch.cat([torch.stack([st.buf_kv for st in sub]), g_kv.unsqueeze(1)], dim=1)  # (G, n+1, proj)
            g_gate = torch.cat([torch.stack([st.buf_gate for st in sub]), g_gate.unsqueeze(1)], dim=1)
        else:
            g_kv, g_gate = g_kv.unsqueeze(1), g_gate.unsqueeze(1)
        if n + 1 < comp.rate:
            for st, b_kv, b_gate in zip(sub, g_kv.unbind(0), g_gate.unbind(0)):
                st.buf_kv, st.buf_gate = b_kv, b_gate
        else:
            _close_windows(comp, sub, g_kv, g_gate, rotary)


def _close_windows(comp: Compressor, states: list[CompressorState], ckv: torch.Tensor, graw: torch.Tensor, rotary: Rotary) -> None:
    """Pool one full window per state, ``ckv, graw (G, r, proj)``, and append its row."""
    r, d = comp.rate, comp.width
    prev_kv = prev_gate = None
    if comp.overlap:
        g = len(states)
        have = [j for j, st in enumerate(states) if st.overlap_kv is not None]
        if len(have) == g:
            prev_kv = torch.stack([st.overlap_kv for st in states])
            prev_gate = torch.stack([st.overlap_gate for st in states])
        else:
            prev_kv = ckv.new_zeros(g, r, d)
            prev_gate = torch.full((g, r, d), float("-inf"), dtype=comp.position_bias.dtype, device=ckv.device)
            for j in have:
                prev_kv[j], prev_gate[j] = states[j].overlap_kv, states[j].overlap_gate
    positions = torch.tensor([st.rows.shape[0] * r for st in states], device=ckv.device)
    rows, cgate = pool_windows(comp, ckv, graw, prev_kv, prev_gate, positions, rotary)
    if comp.overlap:
        overlap_kv, overlap_gate = ckv[..., :d].clone(), cgate[..., :d].clone()  # (G, r, d)
        for st, o_kv, o_gate in zip(states, overlap_kv.unbind(0), overlap_gate.unbind(0)):
            st.overlap_kv, st.overlap_gate = o_kv, o_gate
    empty = ckv.new_empty(0, ckv.shape[-1])
    for st, row in zip(states, rows.unsqueeze(1).unbind(0)):
        st.rows = torch.cat([st.rows, row])
        st.buf_kv, st.buf_gate = empty, empty


def pool_windows(
    comp: Compressor, ckv: torch.Tensor, graw: torch.Tensor, prev_kv: torch.Tensor | None, prev_gate: torch.Tensor | None,
    positions: torch.Tensor, rotary: Rotary,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The rows ``(G, d)`` of G full windows ``ckv, graw (G, r, proj)`` with the ops of
    ``Compressor.update``, roped at ``positions (G,)``, and the gates with the position bias
    (``(G, r, proj)``; CSA: its Ca part is the next window's overlap). CSA: ``prev_kv, prev_gate
    (G, r, d)`` the previous windows' Ca (zeros and -inf gates where there is none)."""
    r, d = comp.rate, comp.width
    cgate = graw + comp.position_bias  # (G, r, proj) fp32
    if comp.overlap:
        g = ckv.shape[0]
        pool_kv = ckv.new_empty(g, 2 * r, d)
        pool_gate = cgate.new_empty((g, 2 * r, d))
        pool_kv[:, r:] = ckv[..., d:]
        pool_gate[:, r:] = cgate[..., d:]
        pool_kv[:, :r] = prev_kv
        pool_gate[:, :r] = prev_gate
    else:
        pool_kv, pool_gate = ckv, cgate
    pooled = (pool_kv * pool_gate.softmax(dim=1, dtype=torch.float32).to(pool_kv.dtype)).sum(dim=1)  # (G, d)
    rows = comp.kv_norm(pooled)
    cos, sin = rotary.cos_sin(positions, rows.dtype)
    return apply_rope(rows, cos, sin), cgate

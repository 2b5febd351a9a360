"""Rewind of slot-pool state after a verify step fed ``1 + k`` tokens per slot and kept fewer.

A verify step (``StaticDecoder.verify``, ``HostDecoder.verify``) feeds each slot its next token
``t`` at position ``p`` and ``k`` drafts at ``p+1 .. p+k`` (``k + 1`` at most the smallest
compression rate and below the window), all offsets attending in one pass over the ring as it was
before the step (the new keys are written after it), so offset ``j`` writes:

- the window ring entry ``(p+j) % W`` (it held position ``p+j-W``, which a later step still needs
  when ``j`` is rejected);
- each compressor's buffer entry ``(p+j) % r`` (it may hold a token of the open window: with
  ``k + 1 <= r`` no two offsets of one step share an entry, so its value before the step is the
  right one);
- when ``p+j`` closes a window: that window's compressed row (index ``(p+j) // r``, past the kept
  row count, so never read, and written again when the window truly closes) and, CSA, the
  overlap (the previous window's Ca series), at most once per step.

``snapshot`` (inside the step, before its first write; fixed shapes, so a CUDA graph captures it)
copies those entries of offsets ``1..k``; ``restore`` (after acceptance, on the host's kept
counts) writes the rejected offsets' entries back, and the overlaps of slots whose rejected
offsets closed a window. The state is then exactly the one feeding only the kept tokens leaves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def snapshot(pools: Sequence, windows: Sequence[int], pos: torch.Tensor, slots: torch.Tensor, b: int) -> list[torch.Tensor]:
    """The entries offsets ``1..`` may overwrite. ``pos/slots (b·(1+k),)`` are the step's columns,
    offset-major (column ``j·b + i``: slot ``i``'s offset ``j``); per layer, in order: ring rows
    ``(b·k, D)``, then per compressor buffer rows kv, gate ``(b·k, P)`` and, CSA, the overlap kv,
    gate of the ``b`` slots ``(b, r, d)``."""
    dp, ds = pos[b:], slots[b:]
    out: list[torch.Tensor] = []
    for lp, w in zip(pools, windows):
        out.append(lp.swa.view(-1, lp.swa.shape[-1]).index_select(0, ds * w + dp % w))
        for cp in (lp.comp, lp.index):
            if cp is None:
                continue
            r = cp.buf_kv.shape[1]
            at = ds * r + dp % r
            out += [cp.buf_kv.view(-1, cp.buf_kv.shape[-1]).index_select(0, at), cp.buf_gate.view(-1, cp.buf_gate.shape[-1]).index_select(0, at)]
            if cp.overlap_kv is not None:
                out += [cp.overlap_kv.index_select(0, slots[:b]), cp.overlap_gate.index_select(0, slots[:b])]
    return out


def restore(
    pools: Sequence, windows: Sequence[int], snap: list[torch.Tensor], slots: Sequence[int], positions: Sequence[int],
    kept: Sequence[int], b: int, width: int,
) -> None:  # fmt: skip
    """Write back the entries of every rejected offset (``j >= kept[i]``, ``kept[i] >= 1``) of the
    first ``len(slots)`` slots of a verify of ``width`` columns per slot (``snapshot``'s layout)."""
    rej = [(j, i) for j in range(1, width) for i in range(len(slots)) if j >= kept[i]]
    if not rej:
        return
    dev = snap[0].device
    at = torch.tensor([(j - 1) * b + i for j, i in rej], device=dev)  # rows of the snapshot
    dp = torch.tensor([positions[i] + j for j, i in rej], device=dev)
    ds = torch.tensor([slots[i] for _, i in rej], device=dev)
    k = 0
    for lp, w in zip(pools, windows):
        lp.swa.view(-1, lp.swa.shape[-1]).index_copy_(0, ds * w + dp % w, snap[k].index_select(0, at))
        k += 1
        for cp in (lp.comp, lp.index):
            if cp is None:
                continue
            r = cp.buf_kv.shape[1]
            flat = ds * r + dp % r
            cp.buf_kv.view(-1, cp.buf_kv.shape[-1]).index_copy_(0, flat, snap[k].index_select(0, at))
            cp.buf_gate.view(-1, cp.buf_gate.shape[-1]).index_copy_(0, flat, snap[k + 1].index_select(0, at))
            k += 2
            if cp.overlap_kv is None:
                continue
            closed = sorted({i for j, i in rej if (positions[i] + j) % r == r - 1})  # a rejected offset closed a window
            if closed:
                rows = torch.tensor(closed, device=dev)
                dst = torch.tensor([slots[i] for i in closed], device=dev)
                cp.overlap_kv.index_copy_(0, dst, snap[k].index_select(0, rows))
                cp.overlap_gate.index_copy_(0, dst, snap[k + 1].index_select(0, rows))
            k += 2

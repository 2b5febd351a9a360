"""Top-k of each row of scores in one launch, ties to the lowest column (``torch.topk``'s set on CUDA).

``row_topk(scores (S, T) fp32, k)`` → ``(values (S, k), indices (S, k) int64)``: the ``k``
largest scores of each row, the lowest columns first among equal scores at the cut, listed in
ascending column order (``scores.topk(k, sorted=False)`` lists the same set in no stated order).
``row_topk_reference`` defines it: a stable descending sort, its first ``k``, by column.

The kernel, one program per row with the whole row in registers (``T`` ≤ ``MAX_T``; longer rows
take the reference): each score as a 32-bit key in the scores' order (the sign bit flipped for
positives, every bit for negatives, -0.0 as 0.0), the ``k``-th largest key found bit by bit from
the top (32 counts over the row), then every key above it and the first keys equal to it (a
prefix count), each written to its place by a prefix sum over the chosen ones. At V4.1's prefill
indexer (4096 × 4096 scores, k = 512): 0.21 ms a call against 0.33 ms for ``torch.topk``'s
multi-launch radix select (run 81, an H100; ``python -m kernels.topk``).
"""

from __future__ import annotations

import torch

from kernels._common import HAS_TRITON, next_pow2, use_triton

MAX_T = 8192  # the longest row held in one program's registers


def row_topk_reference(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: a stable descending sort (ties in column order), its first ``k``, by column."""
    idx = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k].sort(dim=-1).values
    return scores.gather(1, idx), idx


def row_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; ``k`` ≤ ``T``. fp32 rows of at most ``MAX_T`` on Triton, else the reference."""
    s, t = scores.shape
    assert 0 < k <= t, "k: 1..T"
    if not (use_triton(scores) and scores.dtype == torch.float32 and t <= MAX_T):
        return row_topk_reference(scores, k)
    scores = scores.contiguous()
    values = torch.empty(s, k, dtype=scores.dtype, device=scores.device)
    indices = torch.empty(s, k, dtype=torch.int64, device=scores.device)
    if s:
        block = next_pow2(t)
        _row_topk_kernel[(s,)](scores, values, indices, t, k, BLOCK=block, num_warps=max(4, min(16, block // 512)))
    return values, indices


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_topk_kernel(s_ptr, v_ptr, i_ptr, T, K, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < T
        x = tl.load(s_ptr + row * T + cols, mask=ok, other=0.0)
        bits = x.to(tl.uint32, bitcast=True)
        bits = tl.where(x == 0.0, tl.zeros_like(bits), bits)  # -0.0 ties with 0.0, as in torch.topk
        neg = (bits >> 31) != 0
        key = tl.where(neg, ~bits, bits | tl.full((), 0x80000000, tl.uint32))  # unsigned order = the scores' order
        key = tl.where(ok, key, tl.zeros_like(key))  # past the row: below every score (-inf's key is 0x007FFFFF)
        thr = tl.zeros((), dtype=tl.uint32)
        for b in tl.static_range(31, -1, -1):  # the largest key with at least K keys at or above it
            cand = thr | tl.full((), 1 << b, tl.uint32)
            n_at = tl.sum((key >= cand).to(tl.int32), axis=0)
            thr = tl.where(n_at >= K, cand, thr)
        above = key > thr
        tie = key == thr
        need = K - tl.sum(above.to(tl.int32), axis=0)
        take = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= need))
        pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(v_ptr + row * K + pos, x, mask=take)
        tl.store(i_ptr + row * K + pos, cols.to(tl.int64), mask=take)


__all__ = ["MAX_T", "row_topk", "row_topk_reference"]


def _bench(rows: int, cols: int, k: int, rep_ms: int = 50) -> dict:  # pragma: no cover - device only
    """``row_topk`` against ``torch.topk`` on CUDA over relu'd scores with a causal ``-inf`` tail
    (the indexer's ties): ms per call each (``do_bench`` over ``rep_ms``), and whether the column
    sets agree."""
    from triton.testing import do_bench

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    scores = torch.randn(rows, cols, device=dev, generator=g).relu()
    ar = torch.arange(cols, device=dev)
    scores = scores.masked_fill(ar[None, :] > torch.arange(rows, device=dev)[:, None] * cols // rows + 16, float("-inf"))
    same = torch.equal(row_topk(scores, k)[1], scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values)
    return {"device": torch.cuda.get_device_name(), "rows": rows, "cols": cols, "k": k, "same_set": same,
            "row_topk_ms": do_bench(lambda: row_topk(scores, k), rep=rep_ms),
            "torch_topk_ms": do_bench(lambda: scores.topk(k, dim=-1, sorted=False), rep=rep_ms)}  # fmt: skip


if __name__ == "__main__":  # pragma: no cover
    import argparse
    import json

    ap = argparse.ArgumentParser(description="row_topk against torch.topk (CUDA)")
    ap.add_argument("--shape", nargs=3, type=int, default=[4096, 4096, 512], metavar=("ROWS", "COLS", "K"))
    ap.add_argument("--out", help="write the row as JSON here")
    args = ap.parse_args()
    result = _bench(*args.shape)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

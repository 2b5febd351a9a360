"""The warp-specialised Hopper prefill attention (``kernels.prefill_attention_ws``) against the
fp32 reference and the Triton kernel it replaces: windows that start inside the padding, windows
not a multiple of the key tile, picks with holes (-1) and picks past a query's row count, one and
two blocks of 64 heads, the output's inverse RoPE as ``prefill_attention`` applies it; more
(query, head block) items than SMs, so each persistent program walks several, one-tile items
included."""

from __future__ import annotations

import pytest
import torch

from bench.kernel_helpers import TOL, kernel_test_device, poison, rel_err
from kernels.prefill import AttentionTuning, prefill_attention, prefill_attention_reference
from kernels.prefill_attention_ws import supported

pytestmark = pytest.mark.gpu
DEV = kernel_test_device()
TRITON_LAUNCH = AttentionTuning(block_h=64, block_n=64, num_warps=8, num_stages=2)  # the Triton kernel's 64-head launch


def _case(s: int, prev: int, w: int, h: int, n_rows: int, k: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    d = 512
    q = torch.randn(s, h, d, generator=g, device=DEV).bfloat16()
    pad = max(0, w - 1 - prev)
    keys = torch.randn(w - 1 + s, d, generator=g, device=DEV).bfloat16()
    keys[:pad] = float("nan")  # padding is never read
    sinks = torch.randn(h, generator=g, device=DEV)
    if not n_rows:
        return q, keys, pad, sinks, None, None, None
    rows = torch.randn(n_rows, d, generator=g, device=DEV).bfloat16()
    row_len = ((torch.arange(s, device=DEV) + prev + 1) // 2).clamp(max=n_rows).int()
    gc = torch.Generator().manual_seed(seed)
    row_idx = torch.full((s, k), -1, dtype=torch.int32)
    for i in range(s):
        n = int(row_len[i])
        pick = torch.randperm(max(n, 1), generator=gc)[: min(n, k)]
        place = torch.randperm(k, generator=gc)[: pick.numel()]
        row_idx[i, place] = pick.int()
        if i % 7 == 0 and n < n_rows:
            row_idx[i, 0] = n  # a row past this query's count: not visible
    return q, keys, pad, sinks, rows, row_len, row_idx.to(DEV)


@pytest.mark.parametrize(
    "s, prev, w, h, n_rows, k",
    [(300, 0, 128, 64, 0, 0), (300, 5, 128, 128, 400, 64), (257, 200, 128, 64, 600, 100), (130, 0, 100, 64, 90, 37), (600, 0, 64, 64, 0, 0)],
    ids=["window-only", "picks-two-head-blocks", "picks-straddle-tiles", "window-100", "one-tile-items"],
)
def test_ws_kernel_matches_the_reference_and_the_triton_kernel(s, prev, w, h, n_rows, k) -> None:
    q, keys, pad, sinks, rows, row_len, row_idx = _case(s, prev, w, h, n_rows, k, seed=s + w + h)
    if not supported(q, keys, rows):
        pytest.skip("needs a Hopper GPU and Gluon")
    scale = 512**-0.5
    want = prefill_attention_reference(
        q.float(), keys.float().nan_to_num(), pad, sinks, w, None if rows is None else rows.float(), row_len, row_idx, scale
    )  # fmt: skip
    poison(DEV)
    got = prefill_attention(q, keys, pad, sinks, w, rows, row_len, row_idx, scale)
    triton_kernel = prefill_attention(q, keys, pad, sinks, w, rows, row_len, row_idx, scale, tuning=TRITON_LAUNCH)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert rel_err(got, want) <= TOL[torch.bfloat16]
    assert rel_err(got, triton_kernel) <= rel_err(triton_kernel, want) * 2 + 1e-3  # the same math, other sum orders


def test_ws_kernel_undoes_the_output_rope_as_the_triton_kernel() -> None:
    q, keys, pad, sinks, rows, row_len, row_idx = _case(200, 3, 128, 64, 150, 64, seed=11)
    if not supported(q, keys, rows):
        pytest.skip("needs a Hopper GPU and Gluon")
    ang = torch.rand(200, 32, device=DEV) * 6.28
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    got = prefill_attention(q, keys, pad, sinks, 128, rows, row_len, row_idx, rope=(cos, sin), fold_q=0)
    triton_kernel = prefill_attention(q, keys, pad, sinks, 128, rows, row_len, row_idx, rope=(cos, sin), fold_q=0, tuning=TRITON_LAUNCH)
    plain = prefill_attention(q, keys, pad, sinks, 128, rows, row_len, row_idx, tuning=TRITON_LAUNCH)
    v4_form = prefill_attention(q, keys, pad, sinks, 128, rows, row_len, row_idx, q_norm_eps=1e-6, rope=(cos, sin), fold_q=0)
    assert torch.equal(v4_form, got)  # V4 passes its q norm's eps with fold_q=0: q is normed already
    assert rel_err(got, triton_kernel) <= 1e-2
    assert rel_err(got[..., :-64], plain[..., :-64]) <= 1e-2  # only the rope channels move
    assert rel_err(got[..., -64:], plain[..., -64:]) > 0.1

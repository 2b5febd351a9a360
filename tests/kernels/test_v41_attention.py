"""V4.1 decode attention over stored FP8/FP4 codes (``kernels.v41_attention``) against its
PyTorch reference, and the reference against attention over the engine's fake-quantised values.

GPU: ``pytest -m gpu tests/kernels/test_v41_attention.py``; on CPU the GPU tests run under
Triton's interpreter at small sizes (``tests/kernels/test_interpret.py``)."""

from __future__ import annotations

import pytest
import torch

from engine.model.v41.quant import fp4_compressed, fp8_window
from kernels.v41_attention import V41AttentionTuning, attention_splits, v41_decode_attention, v41_decode_attention_reference
from kernels.v41_kv import pack_fp4_rows, pack_fp8_window
from tests.kernels.interpreted import INTERPRETED, ON_GPU, run_gpu_tests_interpreted

DEV = "cuda" if ON_GPU else "cpu"


def _case(b: int, h: int, d: int, w: int, t: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = b + 1
    win = torch.randn(s, w, d, generator=g)
    rows = torch.randn(s, t, d, generator=g) * 2
    q = torch.randn(b, h, d, generator=g)
    win_len = torch.randint(1, w + 1, (b,), generator=g)
    win_len[0] = w
    slot = torch.randperm(s, generator=g)[:b]
    picks = torch.randint(0, t, (b, k), generator=g)
    picks[1:, k // 2 :] = -1  # rows without enough complete rows
    sinks = torch.randn(h, generator=g)
    return q, win, rows, win_len, slot, picks, sinks


def test_reference_is_attention_over_the_fake_quantised_values() -> None:
    q, win, rows, win_len, slot, picks, sinks = _case(3, 4, 64, 8, 10, 4)
    wq, we = pack_fp8_window(win)
    rq, rs = pack_fp4_rows(rows)
    got = v41_decode_attention_reference(q, wq, we, win_len, slot, rq, rs, picks, sinks, 0.125)
    for i in range(3):
        keys = torch.cat([fp8_window(win[slot[i], : win_len[i]]), fp4_compressed(rows[slot[i], picks[i][picks[i] >= 0]])])
        logits = torch.cat([q[i] @ keys.t() * 0.125, sinks[:, None]], dim=-1)
        want = torch.softmax(logits, dim=-1)[:, :-1] @ keys
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)


def _gpu_or_interpreter() -> None:
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (see tests/kernels/test_interpret.py)")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize("shape", [(3, 4, 64, 8, 10, 4), (2, 20, 32, 40, 70, 40)] if not ON_GPU else [(3, 4, 64, 8, 10, 4), (64, 64, 512, 128, 512, 512), (1, 64, 512, 128, 4096, 512)])
def test_kernel_matches_the_reference(shape, rows: bool) -> None:
    _gpu_or_interpreter()
    q, win, rws, win_len, slot, picks, sinks = (t.to(DEV) for t in _case(*shape))
    wq, we = pack_fp8_window(win)
    rq, rs = pack_fp4_rows(rws) if rows else (None, None)
    args = (q, wq, we, win_len, slot, rq, rs, picks if rows else None, sinks, shape[2] ** -0.5)
    got, want = v41_decode_attention(*args), v41_decode_attention_reference(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # a bf16 query: bf16 dots with the exact key values, the probabilities rounded to bf16 for
    # the value product (as the model's probs.to(keys.dtype)): within bf16 rounding of fp32
    half = v41_decode_attention(q.to(torch.bfloat16), *args[1:])
    want16 = v41_decode_attention_reference(q.to(torch.bfloat16).float(), *args[1:])
    torch.testing.assert_close(half, want16, rtol=2e-2, atol=2e-2)


def test_splits_fill_the_gpu_at_batch_1_and_not_at_batch_64() -> None:
    """V4.1-Flash widths (64 heads in blocks of 16, W = 128 and 512 picks in 32-row tiles = 20
    tiles) on 132 SMs: batch 1 splits its 4 programs into one per tile, batch 64's 256 programs
    run the single pass; layer 0 (the window's 4 tiles only) splits at most 4 ways."""
    assert attention_splits(1 * 4, 20, 132) == 20
    assert attention_splits(16 * 4, 20, 132) == 3
    assert attention_splits(64 * 4, 20, 132) == 1
    assert attention_splits(1 * 4, 4, 132) == 4
    assert attention_splits(1 * 4, 20, 132, V41AttentionTuning(max_splits=8)) == 8


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 3, 64])
@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize(
    "shape", [(3, 4, 64, 8, 10, 40), (1, 20, 32, 40, 70, 40)] if not ON_GPU else [(1, 64, 512, 128, 4096, 512), (64, 64, 512, 128, 512, 512), (5, 64, 512, 128, 700, 100)]
)
def test_split_kernel_matches_the_reference(shape, rows: bool, splits: int) -> None:
    """The key range split ``splits`` ways (capped at one split per tile; a split whose tiles hold
    no visible row contributes nothing), combined; on the GPU also cast to bf16 in the kernel."""
    _gpu_or_interpreter()
    q, win, rws, win_len, slot, picks, sinks = (t.to(DEV) for t in _case(*shape))
    win_len[-1] = 1  # a row whose later window tiles are all empty
    wq, we = pack_fp8_window(win)
    rq, rs = pack_fp4_rows(rws) if rows else (None, None)
    args = (q, wq, we, win_len, slot, rq, rs, picks if rows else None, sinks, shape[2] ** -0.5)
    tuning = V41AttentionTuning(block_n=16 if not ON_GPU else 32, fill=1e9, max_splits=splits)
    want = v41_decode_attention_reference(*args)
    got = v41_decode_attention(*args, tuning=tuning)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if ON_GPU:  # the interpreter's bf16 casts truncate
        half = v41_decode_attention(*args, out_dtype=torch.bfloat16, tuning=tuning)
        assert torch.equal(half, got.to(torch.bfloat16))  # the same fp32 result, cast once


"""``kernels.rope.rope_inplace`` against ``kernels.reference.apply_rope_inplace``: the same bits on
the GPU for bf16 rows and tables; within one bf16 ulp under Triton's interpreter (its bf16 casts
truncate); other dtypes take the eager form itself.

GPU: ``pytest -m gpu tests/kernels/test_rope.py``; on CPU under the interpreter through
``test_interpret.py``'s default V4.1 run."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import apply_rope_inplace
from kernels.rope import rope_inplace
from tests.kernels.interpreted import INTERPRETED, ON_GPU

DEVICE = "cuda" if ON_GPU else "cpu"


def _rows(shape: tuple[int, ...], rope: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)
    ang = torch.rand(shape[0], rope // 2, generator=g) * 6.3
    return x, ang.cos().to(dtype).to(DEVICE), ang.sin().to(dtype).to(DEVICE)


def test_other_dtypes_take_the_eager_form() -> None:
    x, cos, sin = _rows((7, 3, 16), 8, torch.float32, 1)
    want = apply_rope_inplace(x.clone(), cos, sin)
    got = x.clone()
    assert rope_inplace(got, cos, sin) is got and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(70, 5, 64), (45, 96), (1, 1, 32)])
def test_bf16_rows_rotate_in_place_as_the_eager_form(shape: tuple[int, ...]) -> None:
    """Rows of ``(N, G, D)`` and ``(N, D)`` (the partial RoPE of the last 32 channels, or all of
    them), rows past a program's last masked; the leading channels untouched."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    rope = 32
    x, cos, sin = _rows(shape, rope, torch.bfloat16, shape[0])
    want = apply_rope_inplace(x.clone(), cos, sin)
    got = x.clone()
    assert rope_inplace(got, cos, sin) is got
    assert torch.equal(got[..., :-rope], x[..., :-rope])
    if ON_GPU:
        assert torch.equal(got, want)
    else:  # the interpreter truncates where the GPU rounds to nearest
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)

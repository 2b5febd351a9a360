"""The fused CPU mHC mixing equals the eager PyTorch ops (engine/model/cpu_fused.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model import cpu_fused
from engine.model.layers import HyperConnection

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="numba is not usable here")


@pytest.mark.parametrize("n,iters", [(1, 20), (7, 20), (64, 3), (300, 1)])
def test_hc_mix_matches_eager(n: int, iters: int) -> None:
    cfg = SimpleNamespace(hc_mult=4, hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=32)
    hc = HyperConnection(cfg)
    g = torch.Generator().manual_seed(n)
    with torch.no_grad():
        hc.fn.normal_(0, 0.3, generator=g)
        hc.base.normal_(0, 1.0, generator=g)
        hc.scale.copy_(torch.tensor([1.2, 0.6, 2.0]))
    streams = torch.randn(n, 4, 32, generator=g) * 3
    with torch.inference_mode():
        hc.fused = True
        fused = hc(streams)
        hc.fused = False
        eager = hc(streams)
    for a, b in zip(fused, eager):  # past 64 tokens the RMS scale is folded into the product: rounding
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 if n <= 64 else 2e-5)


def test_hc_mix_is_per_token() -> None:
    """A token's mixing does not depend on the other tokens of the batch."""
    mixes = torch.randn(9, 24)
    base, scale = torch.randn(24), torch.ones(3)
    whole = cpu_fused.hc_mix(mixes, scale, base, 4, 20, 1e-6)
    alone = cpu_fused.hc_mix(mixes[4:5], scale, base, 4, 20, 1e-6)
    for a, b in zip(whole, alone):
        assert torch.equal(a[4:5], b)


@pytest.mark.parametrize("shape", [(5, 32), (3, 4, 32), (2, 3, 4, 16)])
def test_rope_matches_eager_bitwise(shape: tuple[int, ...]) -> None:
    from engine.model.rope import apply_rope_eager

    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g)
    angles = torch.rand(shape[0], 4, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    assert torch.equal(cpu_fused.rope(x, cos, sin), apply_rope_eager(x, cos, sin))
    view = x.transpose(0, 1) if len(shape) > 2 else x  # a non-contiguous input
    a = torch.rand(view.shape[0], 4, generator=g) * 6
    assert torch.equal(cpu_fused.rope(view, a.cos(), a.sin()), apply_rope_eager(view, a.cos(), a.sin()))


@pytest.mark.parametrize("n", [1, 5, 130])
def test_hc_merge_matches_eager_and_is_per_token(n: int) -> None:
    from engine.model.layers import hc_merge

    g = torch.Generator().manual_seed(n)
    mixes, base, scale = torch.randn(n, 24, generator=g), torch.randn(24, generator=g), torch.ones(3)
    _, post, comb = cpu_fused.hc_mix(mixes, scale, base, 4, 20, 1e-6)
    streams, block = torch.randn(n, 4, 32, generator=g), torch.randn(n, 32, generator=g)
    fused = hc_merge(post, comb, block, streams)
    torch.testing.assert_close(fused, hc_merge(post, comb, block, streams, fused=False), rtol=1e-5, atol=1e-6)
    assert torch.equal(fused[n // 2 : n // 2 + 1], hc_merge(post[n // 2 : n // 2 + 1], comb[n // 2 : n // 2 + 1], block[n // 2 : n // 2 + 1], streams[n // 2 : n // 2 + 1]))


@pytest.mark.parametrize("shape", [(1, 128), (7, 4, 32), (64, 512)])
def test_rms_norm_matches_eager(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(shape[0])
    x, w = torch.randn(*shape, generator=g) * 3, torch.rand(shape[-1], generator=g) + 0.5
    eager = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(cpu_fused.rms_norm(x, None, 1e-6), eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cpu_fused.rms_norm(x, w, 1e-6), w * eager, rtol=1e-5, atol=1e-6)
    assert torch.equal(cpu_fused.rms_norm(x[:1], w, 1e-6), cpu_fused.rms_norm(x, w, 1e-6)[:1])  # per row

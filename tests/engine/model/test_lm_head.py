"""The screened greedy argmax (engine/model/lm_head.py) is the exact argmax of the logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.model import cpu_fused, int8_gemm
from engine.model.lm_head import BLOCK, HeadRows, Int8Screen, LMHead

pytestmark = pytest.mark.skipif(not Int8Screen.available(), reason="no CPU int8 GEMM in this torch")

# The weight ranges this process's int8 GEMM multiplies exactly: ±63 everywhere, ±127 with VNNI/AMX.
# (tests/engine/model/test_int8_gemm.py runs this file again with oneDNN capped at AVX2.)
EXACT_LEVELS = [int8_gemm.FULL_LEVELS, int8_gemm.SAFE_LEVELS] if int8_gemm.probe().exact_full_range else [int8_gemm.SAFE_LEVELS]


@pytest.fixture(autouse=True, params=EXACT_LEVELS, ids=lambda lv: f"codes{lv}")
def weight_levels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Every test runs with each weight range whose products are exact on this machine."""
    gemm = int8_gemm.probe()
    forced = int8_gemm.Int8Gemm(request.param == int8_gemm.FULL_LEVELS, gemm.cpu_dot_flags, gemm.onednn_isa_cap)
    monkeypatch.setattr("engine.model.lm_head.int8_gemm.probe", lambda: forced)
    return request.param


@pytest.fixture(autouse=True, params=["compiled", "tensor-ops"])
def candidate_pass(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs with the compiled candidate pass (``cpu_fused.screen_pick``) and with the
    tensor-op one (the path where numba is missing or the weight has no row-major copy)."""
    if request.param == "tensor-ops":
        monkeypatch.setattr("engine.model.lm_head.cpu_fused.available", lambda: False)


def head_with(weight: torch.Tensor, transposed_storage: bool = False) -> LMHead:
    """``transposed_storage``: the weight is a ``(V, H)`` view of an ``(H, V)`` tensor, as the
    model stores lm_head on CPU."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    if transposed_storage:
        lin.weight = nn.Parameter(weight.t().contiguous().t())
    else:
        lin.weight.data.copy_(weight)
    return LMHead(lin)


def exact_argmax(head: LMHead, x: torch.Tensor) -> torch.Tensor:
    return (x.double() @ head.linear.weight.detach().double().t()).argmax(-1)


@pytest.mark.parametrize("vocab,transposed", [(4099, False), (8192, False), (8192, True)])  # tail block; whole blocks
def test_bound_holds_and_argmax_is_exact(vocab: int, transposed: bool) -> None:
    g = torch.Generator().manual_seed(0)
    head = head_with(torch.randn(vocab, 64, generator=g) * 0.02, transposed)
    for trial in range(150):
        b = int(torch.randint(1, 24, (1,), generator=g))
        x = torch.randn(b, 64, generator=g) * float(torch.rand(1, generator=g) * 4 + 0.01)
        if trial % 3 == 0:  # outlier channels widen the activation step
            x[:, int(torch.randint(0, 64, (1,), generator=g))] *= 25
        screen = head._screener(x)
        assert screen is not None
        qx, bound = screen.quantize(x)
        acc = qx @ screen.qt.double()  # (B, V) the integer products the screen's GEMM computes
        xd = x.double()
        unit = xd.abs().amax(1) / 127 * screen.step  # (B,) value of one integer unit
        exact = xd @ head.linear.weight.detach().double().t()
        err = (acc * unit.unsqueeze(1) - exact).abs().amax(1)
        assert bool((err <= bound * unit).all()), f"trial {trial}: error {err} over bound {bound * unit}"
        assert torch.equal(head.argmax(x), exact_argmax(head, x)), f"trial {trial}"
    assert head.screened_rows > 0


@pytest.mark.parametrize("top", [1.0, 50.0, 1e9])  # every column saturated; some; a coarse range
def test_uint8_range_saturated_or_coarse_stays_exact(top: float) -> None:
    g = torch.Generator().manual_seed(2)
    head = head_with(torch.randn(6000, 48, generator=g) * 0.03)
    x = torch.randn(6, 48, generator=g)
    screen = head._screener(x)
    assert screen is not None and screen.packed is not None
    for _ in range(3):  # the forced range, then the adapted ones
        screen.top = top
        y, _ = screen.screen(x)
        assert y.dtype == torch.uint8
        assert torch.equal(head.argmax(x), exact_argmax(head, x))
        top = screen.top or top


@pytest.mark.skipif(int8_gemm.probe().exact_full_range, reason="this GEMM sums int8 products exactly (VNNI/AMX)")
def test_saturating_pair_sums_would_pick_the_wrong_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where byte products are summed pairwise into saturating int16 (AVX2), weight codes ±127
    make the screen rank a smaller logit first; the probed ±63 range picks the exact argmax."""
    w = torch.full((256, 64), 0.001)
    w[3] = 0.02  # the exact winner: logit 1.28; its codes 127 saturate every pair sum
    w[200] = 0.01  # logit 0.64; its codes 64 stay under the int16 limit and outrank column 3
    x = torch.ones(2, 64)  # activation codes 127 (uint8 255 inside the kernel)
    assert head_with(w).argmax(x).tolist() == [3, 3] == exact_argmax(head_with(w), x).tolist()
    gemm = int8_gemm.probe()
    claims_exact = int8_gemm.Int8Gemm(True, gemm.cpu_dot_flags, gemm.onednn_isa_cap)  # the screen before the probe
    monkeypatch.setattr("engine.model.lm_head.int8_gemm.probe", lambda: claims_exact)
    assert head_with(w).argmax(x).tolist() == [200, 200]


def test_ties_pick_the_lowest_id_like_argmax() -> None:
    w = torch.randn(3 * BLOCK + 5, 16) * 0.1
    w[7] = w[40] = w[3 * BLOCK + 2] = torch.full((16,), 0.5)  # identical best columns
    head = head_with(w)
    x = torch.ones(4, 16)
    assert head.argmax(x).tolist() == [7, 7, 7, 7]
    assert head.logits(x).argmax(-1).tolist() == [7, 7, 7, 7]


def test_zero_input_and_near_ties_fall_back_or_stay_exact() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2048, 32, generator=g) * 0.05
    w[100] = w[1500] + 1e-7  # a near tie the int8 screen cannot separate
    head = head_with(w)
    x = torch.cat([torch.zeros(1, 32), w[1500:1501] * 10, torch.randn(3, 32, generator=g)])
    assert torch.equal(head.argmax(x), exact_argmax(head, x))


def test_weight_change_rebuilds_the_screen() -> None:
    head = head_with(torch.randn(1000, 32) * 0.02)
    x = torch.randn(2, 32)
    head.argmax(x)
    with torch.no_grad():
        head.linear.weight.copy_(torch.randn(1000, 32) * 0.02)
    assert torch.equal(head.argmax(x), exact_argmax(head, x))


def test_head_rows_selects_rows() -> None:
    head = head_with(torch.randn(500, 16) * 0.05)
    hidden = torch.randn(5, 16)
    rows = HeadRows(head, hidden)
    assert torch.equal(rows.argmax([4, 1]), exact_argmax(head, hidden[[4, 1]]))
    assert torch.allclose(rows.logits([2]), head.logits(hidden[[2]]))


def test_non_finite_hidden_states_fall_back_to_the_projection() -> None:
    head = head_with(torch.randn(3000, 16) * 0.05)
    x = torch.randn(4, 16)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    got = head.argmax(x)
    assert torch.equal(got, head.logits(x).argmax(-1)) and bool((got < 3000).all())


@pytest.mark.skipif(not cpu_fused.available(), reason="numba missing")
def test_compiled_quantize_matches_the_tensor_ops() -> None:
    """``cpu_fused.quantize_rows`` (the uint8 screen's input) gives the codes, bounds and largest
    code norm of ``Int8Screen.quantize``, a zero row included."""
    g = torch.Generator().manual_seed(7)
    screen = Int8Screen(torch.randn(300, 48, generator=g))
    x = torch.randn(9, 48, generator=g) * torch.logspace(-3, 2, 9)[:, None]
    x[4] = 0.0
    qx, bound = screen.quantize(x)
    xu, bound_c, top = cpu_fused.quantize_rows(x, screen.err_norm, screen.w_norm, screen.step)
    assert torch.equal(xu, (qx + 128).to(torch.uint8))
    torch.testing.assert_close(bound_c, bound, rtol=1e-12, atol=0)
    assert top == pytest.approx(float(qx.norm(dim=1).max()), rel=1e-12)

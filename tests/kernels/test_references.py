"""The kernels' PyTorch references against the model core they stand in for (CPU, fp32).

Each ``*_reference`` re-states a piece of ``engine.model`` in the kernels' batched layouts; these
tests pin that the restatement computes the same thing, so the GPU tests (kernel vs reference)
transfer to the model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.reference import attend_with_sinks
from engine.model.attention import Attention, Compressor, Indexer
from engine.model.config import CSA, HCA, ModelConfig
from engine.model.moe import Experts, Router
from engine.model.rope import Rotary, apply_rope
from engine.model.tiny import tiny_config_dict
from kernels.compressor import gated_pool, gated_pool_reference
from kernels.decode_attention import decode_attention, decode_attention_reference
from kernels.indexer import (
    indexer_scores_reference,
    indexer_topk,
    indexer_topk_reference,
)
from kernels.moe import moe_experts, moe_experts_reference, route, route_reference
from bench.kernel_helpers import attn_inputs, pool_inputs, verify_attn_inputs


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_dict(tiny_config_dict("tiny"))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n_swa,n_rows", [(128, 40), (7, 0), (128, 3)])
def test_decode_attention_reference_matches_attend(cfg, n_swa, n_rows) -> None:
    """One decode query: window + top-k compressed rows + sinks, as the model's ``attend_with_sinks``."""
    g = _gen(n_swa + n_rows)
    attn = Attention(cfg, 1, torch.float32)  # a CSA layer
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(attn.n_heads, generator=g))
    h, d, w = attn.n_heads, attn.head_dim, attn.window
    pos = 500 if n_swa == w else n_swa - 1  # a window not yet full: the sequence is that short
    q = torch.randn(1, h, d, generator=g)
    keys = torch.randn(n_swa, d, generator=g)  # positions pos-n_swa+1 .. pos
    key_pos = torch.arange(pos - n_swa + 1, pos + 1)
    rows = torch.randn(n_rows, d, generator=g)
    chosen = torch.randperm(n_rows, generator=g)[: n_rows // 2]
    extra = rows[chosen.sort().values][None] if chosen.numel() else None  # (1, k, D) the chosen rows
    want = attend_with_sinks(q, keys[None], None, extra, None, attn.sinks.detach(), attn.scaling)

    ring = torch.randn(3, w, d, generator=g)  # slot 2 holds the window, token p at p % W
    ring[2, key_pos % w] = keys
    idx = torch.full((1, 32), -1, dtype=torch.int32)
    idx[0, torch.randperm(32, generator=g)[: chosen.numel()]] = chosen.int()
    got = decode_attention_reference(
        q, ring, torch.tensor([n_swa]), attn.sinks.detach(), rows=rows, row_start=torch.tensor([0]),
        row_len=torch.tensor([n_rows]), row_idx=idx, swa_slot=torch.tensor([2]), scale=attn.scaling,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_indexer_reference_matches_select(cfg) -> None:
    g = _gen(1)
    idx = Indexer(cfg, 4, torch.float32)
    hi, di, k = idx.n_heads, idx.width, idx.topk
    for pos in (7, 60, 203):
        t = (pos + 1) // 4  # rows complete at a decode step
        q = torch.randn(1, hi, di, generator=g)
        wts = torch.randn(1, hi, generator=g)
        rows = torch.randn(t, di, generator=g)
        top, valid = idx.topk_rows(q, wts, rows, torch.tensor([pos]))  # the model's selection
        scale = idx.softmax_scale * idx.weights_scaling
        top = indexer_topk_reference(q, wts, rows, torch.tensor([0]), torch.tensor([t]), k, scale)
        chosen = sorted(top[0][top[0] >= 0].tolist())
        assert chosen == sorted(top[0][valid[0]].tolist())
        # the scores themselves, against select's formula spelled out
        want = (F.relu(q[0] @ rows.t()) * idx.softmax_scale * wts[0][:, None] * idx.weights_scaling).sum(0)
        got = indexer_scores_reference(q, wts, rows, torch.tensor([0]), torch.tensor([t]), scale)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer_type", [CSA, HCA])
def test_gated_pool_reference_matches_compressor(cfg, layer_type) -> None:
    """Pool every window of a 2-chunk stream; norm + RoPE on top give ``Compressor.update``'s rows."""
    g = _gen(2)
    rate = 4 if layer_type == CSA else 8
    overlap = layer_type == CSA
    comp = Compressor(cfg.hidden_size, cfg.head_dim, rate, overlap, cfg.rms_norm_eps, torch.float32)
    with torch.no_grad():
        comp.position_bias.copy_(torch.randn(comp.position_bias.shape, generator=g))
        comp.kv_norm.weight.copy_(1 + 0.1 * torch.randn(cfg.head_dim, generator=g))
    rotary = Rotary(cfg.rope_compress, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
    n_tok = 6 * rate + 3
    kv = torch.randn(n_tok, comp.kv_proj.out_features, generator=g)
    gate = 2 * torch.randn(n_tok, comp.kv_proj.out_features, generator=g)
    st = comp.empty_state(torch.float32, torch.device("cpu"))
    comp.update(st, kv[: 2 * rate + 1], gate[: 2 * rate + 1], rotary)
    comp.update(st, kv[2 * rate + 1 :], gate[2 * rate + 1 :], rotary)

    n = n_tok // rate
    win = torch.arange(n) * rate
    prev = torch.where(win > 0, win - rate, -1)
    pooled = gated_pool_reference(kv, gate, comp.position_bias.detach(), win, prev, overlap)
    cos, sin = rotary.cos_sin(win, torch.float32)
    torch.testing.assert_close(apply_rope(comp.kv_norm(pooled), cos, sin), st.rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hashed", [False, True])
def test_route_reference_matches_router(cfg, hashed) -> None:
    g = _gen(3)
    router = Router(cfg, hashed, torch.float32)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hashed:
            router.tid2eid.copy_(torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(cfg.vocab_size)]))
        else:
            router.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=g))
    x = torch.randn(11, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=g)
    want_w, want_i = router(x, ids)
    kw = {"tid2eid": router.tid2eid, "token_ids": ids} if hashed else {"bias": router.e_score_correction_bias}
    got_w, got_i = route_reference(F.linear(x, router.weight), router.top_k, router.scaling, **kw)
    order_w, order_g = want_i.sort(-1).indices, got_i.sort(-1).indices
    assert torch.equal(want_i.gather(1, order_w), got_i.gather(1, order_g))
    torch.testing.assert_close(got_w.gather(1, order_g), want_w.gather(1, order_w))


def test_moe_experts_reference_matches_experts(cfg) -> None:
    g = _gen(4)
    experts = Experts(cfg, torch.float32)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g))
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.1)
    x = torch.randn(9, cfg.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=g)
    want = experts(x, w, idx)
    got = moe_experts_reference(x, w, idx, experts.gate_up_proj.detach(), experts.down_proj.detach(), experts.limit)
    # Experts runs small CPU batches densely (all experts in two GEMMs, engine/model/moe.py): the
    # same sums in another order, so equal to fp32 rounding rather than bitwise
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_public_functions_fall_back_to_references_on_cpu() -> None:
    """Without CUDA (and without the interpreter) each kernel entry point runs its reference."""
    from kernels import _common

    if _common.INTERPRET:
        pytest.skip("the interpreter runs the Triton path on CPU")
    inp = attn_inputs(2, 4, 32, 8, "csa", [10, 3], 4, torch.float32)
    torch.testing.assert_close(decode_attention(**inp.args()), decode_attention_reference(**inp.args()))
    kv, gate, bias, win, prev = pool_inputs([2, 1], 4, 16, True, torch.float32)
    torch.testing.assert_close(gated_pool(kv, gate, bias, win, prev, True), gated_pool_reference(kv, gate, bias, win, prev, True))
    q, wts, rows = torch.randn(2, 4, 16), torch.randn(2, 4), torch.randn(30, 16)
    start, n = torch.tensor([0, 12]), torch.tensor([12, 18])
    assert torch.equal(indexer_topk(q, wts, rows, start, n, 5, 0.1), indexer_topk_reference(q, wts, rows, start, n, 5, 0.1))
    logits, bias_e = torch.randn(5, 8), torch.randn(8)
    for a, b in zip(route(logits, 2, 1.5, bias_e), route_reference(logits, 2, 1.5, bias_e)):
        assert torch.equal(a, b)
    x, gu, dn = torch.randn(5, 16), torch.randn(8, 12, 16), torch.randn(8, 16, 6)
    wi, ii = route_reference(logits, 2, 1.5, bias_e)
    torch.testing.assert_close(moe_experts(x, wi, ii, gu, dn, 10.0), moe_experts_reference(x, wi, ii, gu, dn, 10.0))


@pytest.mark.parametrize("mode", ["swa", "hca", "csa"])
def test_multi_query_decode_attention_is_the_offsets_in_order(mode: str) -> None:
    """The multi-query form (ring before the step + fresh keys, one call for every offset) gives
    what offset after offset gives, each writing its key into the ring before it attends."""
    b, width, w = 4, 4, 8
    args, first = verify_attn_inputs(b, width, 4, 16, w, mode, [5, 0, 9, 3], 4, torch.float32, seed=3)
    got = decode_attention_reference(**args)
    ring = args["swa"].clone()
    plain = {k: v for k, v in args.items() if k not in ("swa_end", "fresh", "fresh_cols", "swa")}
    for j in range(width):
        at = torch.arange(j * b, (j + 1) * b)
        for i in range(b):
            ring[int(args["swa_slot"][at[i]]), (first[i] + j) % w] = args["fresh"][at[i]]
        cols = {k: (v[at] if isinstance(v, torch.Tensor) and k != "rows" and k != "sinks" else v) for k, v in plain.items()}
        cols["swa_len"] = torch.tensor([min(p + j + 1, w) for p in first], dtype=torch.int32)
        want = decode_attention_reference(swa=ring, **cols)
        torch.testing.assert_close(got[at], want)


def _compress_case(cfg, layer_type, seed: int):
    """A compressor with random bias and norm weight, its rotary, and random projections of
    ``n`` tokens for each of 3 sequences (started at different points)."""
    g = _gen(seed)
    rate = 4 if layer_type == CSA else 8
    comp = Compressor(cfg.hidden_size, cfg.head_dim, rate, layer_type == CSA, cfg.rms_norm_eps, torch.float32)
    with torch.no_grad():
        comp.position_bias.copy_(torch.randn(comp.position_bias.shape, generator=g))
        comp.kv_norm.weight.copy_(1 + 0.1 * torch.randn(cfg.head_dim, generator=g))
    rotary = Rotary(cfg.rope_compress, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
    n = 5 * rate + 2
    p = comp.kv_proj.out_features
    return comp, rotary, torch.randn(3, n, p, generator=g), 2 * torch.randn(3, n, p, generator=g)


@pytest.mark.parametrize("layer_type", [CSA, HCA])
@pytest.mark.parametrize("width", [1, 3])
def test_compress_step_reference_matches_compressor(cfg, layer_type, width: int) -> None:
    """``kernels.fused.compress_step_reference`` (the static step's compressors off Triton, and
    the kernel's reference) fed token by token (``width`` 1), or ``width`` tokens per call as a
    verify's offset-major columns (windows then close inside a call, at every offset), into slot
    pools gives ``Compressor.update``'s rows, buffer and overlap for each sequence."""
    from kernels.fused import compress_step_reference

    comp, rotary, kv, gate = _compress_case(cfg, layer_type, 4)
    r, d, p = comp.rate, comp.width, kv.shape[-1]
    n = kv.shape[1]
    slots, tc = torch.tensor([2, 0, 3]), n // r + 1
    rows = torch.zeros(5, tc + 1, d)
    buf_kv, buf_gate = torch.zeros(5, r, p), torch.zeros(5, r, p)
    ov_kv = torch.full((5, r, d), 7.0) if comp.overlap else None  # stale values: a first window must not read them
    ov_gate = torch.full((5, r, d), 7.0) if comp.overlap else None
    every = torch.arange(n + 1)
    cos_tab, sin_tab = rotary.cos_sin(every, torch.float32)
    for t in range(0, n, width):
        at = slice(t, min(t + width, n))  # offsets of this call: columns offset-major
        w = at.stop - t
        compress_step_reference(
            kv[:, at].transpose(0, 1).reshape(3 * w, p), gate[:, at].transpose(0, 1).reshape(3 * w, p),
            torch.arange(t, t + w).repeat_interleave(3), slots.repeat(w), buf_kv, buf_gate, ov_kv, ov_gate,
            comp.position_bias.detach(), comp.kv_norm.weight.detach(), comp.kv_norm.eps, cos_tab, sin_tab, rows, cols=3,
        )  # fmt: skip
    for i, s in enumerate(slots.tolist()):
        st = comp.empty_state(torch.float32, torch.device("cpu"))
        comp.update(st, kv[i], gate[i], rotary)
        torch.testing.assert_close(rows[s, : n // r], st.rows, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(buf_kv[s, : n % r], st.buf_kv)
        if comp.overlap:
            torch.testing.assert_close(ov_kv[s], st.overlap_kv)
            torch.testing.assert_close(ov_gate[s], st.overlap_gate)


def test_decode_attention_off_triton_applies_the_folded_passes() -> None:
    """Without Triton, ``decode_attention``'s ``q_norm_eps`` / ``rope`` / ``rope_out`` keywords run
    as the ``fused.norm_rope`` passes they fold (q normalised and rotated, output un-rotated)."""
    from kernels import _common
    from kernels.fused import norm_rope_reference

    if _common.INTERPRET:
        pytest.skip("the interpreter runs the Triton path on CPU")
    inp = attn_inputs(3, 4, 32, 8, "hca", [5, 0, 7], 0, torch.float32, seed=2)
    ang = torch.rand(50, 8, generator=_gen(3)) * 6.28
    cos, sin = ang.cos(), ang.sin()
    pos = torch.tensor([4, 40, 0])
    q = norm_rope_reference(inp.q, None, 2, 1e-6, cos, sin, pos)
    want = norm_rope_reference(decode_attention_reference(**{**inp.args(), "q": q}), None, 0, 0.0, cos, sin, pos, sign=-1.0)
    got = decode_attention(**inp.args(), q_norm_eps=1e-6, rope=(cos, sin), rope_pos=pos, fold_q=1)
    torch.testing.assert_close(got, want)
    plain = decode_attention(**inp.args(), rope=(cos, sin), rope_pos=pos, fold_q=0)  # only the output's undo
    torch.testing.assert_close(plain, norm_rope_reference(decode_attention_reference(**inp.args()), None, 0, 0.0, cos, sin, pos, sign=-1.0))

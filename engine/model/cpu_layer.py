"""One decoder layer's decode step on the CPU in eight compiled calls (numba) around the attention.

A CPU decode step is a few dozen tokens, so the eager layer (``DecoderLayer.blocks``) costs its
~200 PyTorch calls and module dispatches, not its arithmetic: ~0.7 ms per layer at one token.
Here the parts around the slot attention are each one compiled loop over the tokens:

1. ``_block_input``: the mHC input of the attention block (unweighted RMS norm of the flattened
   streams, the mixes, ``cpu_fused._hc_mix``'s gates, the collapse) and ``input_layernorm``;
2. ``_project_x`` and ``_project_q``: every projection of the normalised input, ``q_a_norm``,
   the ``q_b`` projections of attention and indexer, the q head norm, the kv norm, RoPE on q,
   kv and the indexer queries;
3. the caller's attention over its own state (``HostDecoder``: ``cpu_slots``' loops);
4. ``_attn_output``: RoPE undone on the values, the grouped ``o_a`` and ``o_b`` projections;
   then ``cpu_fused._merge`` (the stream merge), ``_block_input`` again for the MoE block;
5. ``_moe``: the router (score or hash), then ``cpu_fused._experts`` (routed + shared).

The arithmetic is the eager layer's, in fp32; every product is a dot over a contiguous row of
the model's own weight (``cpu_fused._dot``: vectorised, partial sums in a fixed order), so the
values differ from BLAS's by rounding only, and no token's result depends on the others in the
batch. The weights are numpy views of the parameters, nothing is copied: in-place writes show
(loaders ``copy_`` in), as in ``StaticDecoder``'s CUDA graphs; a model whose parameter tensors
are replaced needs a new decoder. ``pack`` returns None (the caller keeps
``DecoderLayer.blocks``) when numba is unavailable or a weight is not a contiguous fp32 CPU
tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from engine.model import cpu_fused
from engine.model.attention import Projected

SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


class HCWeights(NamedTuple):
    """One mHC input plus the block's RMSNorm, as ``_block_input`` takes them."""

    fn: np.ndarray  # ((2+hc)·hc, hc·H) mixes weight
    scale: np.ndarray  # (3,)
    base: np.ndarray  # ((2+hc)·hc,)
    hc: int
    iters: int
    hc_eps: float
    norm_eps: float
    ln_w: np.ndarray  # (H,) the block's RMSNorm weight
    ln_eps: float


class LayerWeights(NamedTuple):
    """A decoder layer's weights (numpy views) as the compiled loops take them."""

    attn_hc: HCWeights
    ffn_hc: HCWeights
    proj: tuple[np.ndarray, ...]  # (rows, H): q_a, kv, compressor kv, gate, indexer kv, gate, weights
    q_proj: tuple[np.ndarray, np.ndarray]  # q_b (nh·D, qr), indexer q_b (Hi·Di, qr)
    norms: tuple[np.ndarray, float, np.ndarray, float, float]  # q_a_norm w, eps; kv_norm w, eps; q head eps
    heads: tuple[int, int, int, int]  # nh, D, Hi, Di (Hi = Di = 0 without an indexer)
    out_proj: tuple[np.ndarray, np.ndarray]  # o_a (G·o_lora, nh·D/G), o_b (H, G·o_lora)
    groups: int
    gate: np.ndarray  # (E, H) router weight
    bias: np.ndarray  # (E,) score correction bias (zeros for hash routing)
    tid2eid: np.ndarray  # (V, k) hash routing table, (0, k) for score routing
    routing: tuple[int, int, int, float]  # hashed, scoring code, top k, scaling
    experts: tuple[np.ndarray, ...]  # cpu_fused.pack_experts
    limit: float


def _np(w: torch.Tensor) -> np.ndarray:
    return w.detach().numpy()


def _hc_weights(hc, norm) -> HCWeights:
    return HCWeights(_np(hc.fn), _np(hc.scale), _np(hc.base), hc.hc, hc.iters, hc.hc_eps, hc.norm_eps, _np(norm.weight), norm.eps)


def usable(layer: torch.nn.Module) -> bool:
    """Whether ``pack`` can take ``layer``: numba runs, every weight is a contiguous fp32 CPU
    tensor and the scoring function is known."""
    return (
        cpu_fused.available() and layer.mlp.gate.scoring_func in SCORING
        and all(p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous() for p in layer.parameters())
    )  # fmt: skip


def pack(layer: torch.nn.Module) -> LayerWeights | None:
    """``layer``'s weights for ``decode_layer``, or None where it cannot run it (``usable``)."""
    if not usable(layer):
        return None
    attn, moe = layer.self_attn, layer.mlp
    comp, idx = attn.compressor, attn.indexer
    none = np.zeros((0, attn.q_a_proj.in_features), np.float32)
    proj = [_np(attn.q_a_proj.weight), _np(attn.kv_proj.weight)]
    proj += [_np(comp.kv_proj.weight), _np(comp.gate_proj.weight)] if comp is not None else [none, none]
    if idx is not None:
        proj += [_np(idx.kv_proj.weight), _np(idx.gate_proj.weight), _np(idx.scorer.weights_proj.weight)]
        q_idx, hi, di = _np(idx.q_b_proj.weight), idx.n_heads, idx.width
    else:
        proj += [none, none, none]
        q_idx, hi, di = np.zeros((0, attn.q_b_proj.in_features), np.float32), 0, 0
    gate = moe.gate
    e, k = gate.weight.shape[0], gate.top_k
    bias = np.zeros(e, np.float32) if gate.hash_routed else _np(gate.e_score_correction_bias)
    tid2eid = gate.tid2eid.detach().to(torch.int64).numpy() if gate.hash_routed else np.zeros((0, k), np.int64)
    ex, sh = moe.experts, moe.shared_experts
    return LayerWeights(
        _hc_weights(layer.attn_hc, layer.input_layernorm), _hc_weights(layer.ffn_hc, layer.post_attention_layernorm),
        tuple(proj), (_np(attn.q_b_proj.weight), q_idx),
        (_np(attn.q_a_norm.weight), attn.q_a_norm.eps, _np(attn.kv_norm.weight), attn.kv_norm.eps, attn.eps),
        (attn.n_heads, attn.head_dim, hi, di), (_np(attn.o_a_proj.weight), _np(attn.o_b_proj.weight)), attn.o_groups,
        _np(gate.weight), bias, tid2eid, (int(gate.hash_routed), SCORING[gate.scoring_func], k, float(gate.scaling)),
        cpu_fused.pack_experts(ex.gate_up_proj, ex.down_proj, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight),
        float(ex.limit),
    )  # fmt: skip


def decode_layer(
    w: LayerWeights, streams: np.ndarray, token_ids: np.ndarray, cos: np.ndarray, sin: np.ndarray,
    attend: Callable[[Projected], torch.Tensor],
) -> np.ndarray:  # fmt: skip
    """One layer on ``streams (n, hc, H)`` (fp32, contiguous) → the new streams. ``cos/sin (n,
    rope_dim/2)`` are the layer's RoPE tables at the tokens' positions; ``attend`` maps the
    projections to the attention output ``(n, nh, D)`` (and keeps its own state)."""
    h = w.attn_hc
    post, comb, x = _block_input(streams, h.fn, h.scale, h.base, h.hc, h.iters, h.hc_eps, h.norm_eps, h.ln_w, h.ln_eps)
    qa_w, qa_eps, kvn_w, kv_eps, q_eps = w.norms
    nh, d, hi, di = w.heads
    xs = _project_x(x, *w.proj)
    q, kv, idx_q = _project_q(xs[0], xs[1], qa_w, qa_eps, *w.q_proj, kvn_w, kv_eps, q_eps, nh, d, hi, di, cos, sin)
    out = attend(Projected(torch.from_numpy(q), torch.from_numpy(kv), *(_series(a) for a in xs[2:6]), _series(idx_q), _series(xs[6])))
    a = _attn_output(out.contiguous().numpy(), cos, sin, *w.out_proj, w.groups)
    streams = cpu_fused._merge(post, comb, a, streams)
    h = w.ffn_hc
    post, comb, x = _block_input(streams, h.fn, h.scale, h.base, h.hc, h.iters, h.hc_eps, h.norm_eps, h.ln_w, h.ln_eps)
    hashed, scoring, k, scaling = w.routing
    y = _moe(x, token_ids, w.gate, w.bias, w.tid2eid, hashed, scoring, k, scaling, *w.experts, w.limit)
    return cpu_fused._merge(post, comb, y, streams)


def _series(a: np.ndarray) -> torch.Tensor | None:
    """A projection as ``Projected`` holds it: None where the layer has no such part."""
    return torch.from_numpy(a) if a.size else None


def _block_input(
    streams: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, hc: int, iters: int,
    hc_eps: float, norm_eps: float, ln_w: np.ndarray, ln_eps: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """``HyperConnection.forward`` then the block's RMSNorm: ``post (n, hc)``, ``comb`` (as
    ``cpu_fused._merge`` takes it) and the normalised block input ``(n, H)``."""
    n = streams.shape[0]
    width = streams.shape[1] * streams.shape[2]
    flat = streams.reshape(n, width)
    m = fn.shape[0]
    mixes = np.empty((n, m), np.float32)
    row = np.empty(width, np.float32)
    for t in range(n):
        inv = cpu_fused._inv_rms(flat[t], norm_eps)
        for c in range(width):
            row[c] = flat[t, c] * inv
        for o in range(m):
            mixes[t, o] = cpu_fused._dot(row, fn[o])
    pre, post, comb = cpu_fused._hc_mix(mixes, scale, base, hc, iters, hc_eps)
    x = cpu_fused._collapse(pre, streams)
    return post, comb, cpu_fused._rms_norm(x, ln_w, ln_eps, True)


def _final_hidden(
    streams: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, hc_eps: float, norm_eps: float,
    ln_w: np.ndarray, ln_eps: float,
) -> np.ndarray:  # fmt: skip
    """``HyperHead.forward`` then the model's final RMSNorm: the streams' weights
    ``sigmoid(fn·rmsnorm(flat)·scale + base) + hc_eps``, the weighted sum of the streams, normed
    → ``(n, H)``."""
    n, hc = streams.shape[0], streams.shape[1]
    width = hc * streams.shape[2]
    flat = streams.reshape(n, width)
    pre = np.empty((hc, n), np.float32)
    row = np.empty(width, np.float32)
    one = np.float32(1.0)
    for t in range(n):
        inv = cpu_fused._inv_rms(flat[t], norm_eps)
        for c in range(width):
            row[c] = flat[t, c] * inv
        for s in range(hc):
            z = cpu_fused._dot(row, fn[s]) * scale[0] + base[s]
            pre[s, t] = one / (one + np.exp(-z)) + np.float32(hc_eps)
    return cpu_fused._rms_norm(cpu_fused._collapse(pre, streams), ln_w, ln_eps, True)


def final_hidden(model: torch.nn.Module, streams: np.ndarray) -> torch.Tensor:
    """``model.model.norm(model.model.hc_head(streams))`` in one compiled call (fp32 CPU)."""
    head, norm = model.model.hc_head, model.model.norm
    return torch.from_numpy(_final_hidden(
        streams, _np(head.hc_fn), _np(head.hc_scale), _np(head.hc_base), head.eps, head.norm_eps, _np(norm.weight), norm.eps,
    ))  # fmt: skip


def _rows_dot(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x (n, K) @ w (O, K)ᵀ``, each entry one ``cpu_fused._dot``."""
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    for t in range(x.shape[0]):
        for o in range(w.shape[0]):
            out[t, o] = cpu_fused._dot(x[t], w[o])
    return out


def _project_x(
    x: np.ndarray, q_a: np.ndarray, kv: np.ndarray, comp_kv: np.ndarray, comp_gate: np.ndarray,
    idx_kv: np.ndarray, idx_gate: np.ndarray, idx_w: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Every projection of the normalised block input ``x (n, H)`` (absent ones have 0 rows)."""
    return (
        _rows_dot(x, q_a), _rows_dot(x, kv), _rows_dot(x, comp_kv), _rows_dot(x, comp_gate),
        _rows_dot(x, idx_kv), _rows_dot(x, idx_gate), _rows_dot(x, idx_w),
    )  # fmt: skip


def _project_q(
    q_a: np.ndarray, kv_raw: np.ndarray, qa_w: np.ndarray, qa_eps: float, q_b: np.ndarray, idx_q_b: np.ndarray,
    kvn_w: np.ndarray, kv_eps: float, q_eps: float, nh: int, d: int, hi: int, di: int, cos: np.ndarray, sin: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The rest of ``Attention._project``: ``q_a_norm``, ``q (n, nh, D)`` normed per head and
    roped, ``kv (n, D)`` normed and roped, indexer queries ``(n, Hi, Di)`` roped."""
    n = q_a.shape[0]
    q_res = cpu_fused._rms_norm(q_a, qa_w, qa_eps, True)
    q = _rows_dot(q_res, q_b).reshape(n, nh, d)
    for t in range(n):
        for hd in range(nh):
            inv = cpu_fused._inv_rms(q[t, hd], q_eps)
            for c in range(d):
                q[t, hd, c] = q[t, hd, c] * inv
    cpu_fused._rope_in_place(q, cos, sin, 1.0)
    kv = cpu_fused._rms_norm(kv_raw, kvn_w, kv_eps, True).reshape(n, 1, d)
    cpu_fused._rope_in_place(kv, cos, sin, 1.0)
    idx_q = _rows_dot(q_res, idx_q_b).reshape(n, hi, di)
    cpu_fused._rope_in_place(idx_q, cos, sin, 1.0)
    return q, kv.reshape(n, d), idx_q


def _attn_output(out: np.ndarray, cos: np.ndarray, sin: np.ndarray, o_a: np.ndarray, o_b: np.ndarray, groups: int) -> np.ndarray:
    """``Attention._output(apply_rope(out, cos, -sin))``: the values' rotation undone, then the
    grouped ``o_a`` (group ``g``: rows ``g·o_lora ..`` of ``o_a`` over heads ``g·nh/G ..``) and
    ``o_b`` → ``(n, H)``."""
    n, nh, d = out.shape
    o = out.copy()
    cpu_fused._rope_in_place(o, cos, sin, -1.0)
    flat = o.reshape(n, nh * d)
    in_g = nh * d // groups
    lora = o_a.shape[0] // groups
    a = np.empty((n, o_a.shape[0]), np.float32)
    for t in range(n):
        for g in range(groups):
            for j in range(lora):
                a[t, g * lora + j] = cpu_fused._dot(flat[t, g * in_g : (g + 1) * in_g], o_a[g * lora + j])
    return _rows_dot(a, o_b)


def _moe(
    x: np.ndarray, token_ids: np.ndarray, gate: np.ndarray, bias: np.ndarray, tid2eid: np.ndarray, hashed: int,
    scoring: int, k: int, scaling: float, gate_up: np.ndarray, down: np.ndarray, shared_gate: np.ndarray,
    shared_up: np.ndarray, shared_down: np.ndarray, limit: float,
) -> np.ndarray:  # fmt: skip
    """``MoE.forward``: router scores (sqrtsoftplus, sigmoid or softmax of the gate logits), the
    experts from ``tid2eid`` (hashed) or the top ``k`` of scores + bias (lowest id first on a
    tie), weights = chosen scores / (their sum + 1e-20) · scaling; then routed + shared experts."""
    n = x.shape[0]
    e = gate.shape[0]
    logits = _rows_dot(x, gate)
    weights = np.empty((n, k), np.float32)
    indices = np.empty((n, k), np.int64)
    scores = np.empty(e, np.float32)
    taken = np.zeros(e, np.bool_)
    one = np.float32(1.0)
    for t in range(n):
        if scoring == 0:
            for j in range(e):
                v = logits[t, j]
                scores[j] = np.sqrt(v if v > np.float32(20.0) else np.log1p(np.exp(v)))
        elif scoring == 1:
            for j in range(e):
                scores[j] = one / (one + np.exp(-logits[t, j]))
        else:
            top = logits[t, 0]
            for j in range(1, e):
                top = max(top, logits[t, j])
            total = np.float32(0.0)
            for j in range(e):
                scores[j] = np.exp(logits[t, j] - top)
                total += scores[j]
            for j in range(e):
                scores[j] = scores[j] / total
        if hashed:
            for j in range(k):
                indices[t, j] = tid2eid[token_ids[t], j]
        else:
            taken[:] = False
            for j in range(k):
                best = -1
                for c in range(e):
                    if not taken[c] and (best < 0 or scores[c] + bias[c] > scores[best] + bias[best]):
                        best = c
                taken[best] = True
                indices[t, j] = best
        total = np.float32(0.0)
        for j in range(k):
            total += scores[indices[t, j]]
        for j in range(k):
            weights[t, j] = scores[indices[t, j]] / (total + np.float32(1e-20)) * np.float32(scaling)
    return cpu_fused._experts(x, weights, indices, gate_up, down, shared_gate, shared_up, shared_down, limit)


_jit = cpu_fused.numba.njit(cache=True, nogil=True, error_model="numpy")
_rows_dot = _jit(_rows_dot)
_block_input = _jit(_block_input)
_final_hidden = _jit(_final_hidden)
_project_x = _jit(_project_x)
_project_q = _jit(_project_q)
_attn_output = _jit(_attn_output)
_moe = _jit(_moe)

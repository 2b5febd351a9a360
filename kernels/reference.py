"""The plain PyTorch math of the model core that the Triton kernels implement, in one leaf module
(it imports nothing of the project): the model (``engine/model``) computes with it and the
kernels' references and tests compare against it, so ``kernels`` never imports ``engine``.

- ``attend_with_sinks`` / ``hide``: softmax attention with per-head sinks over per-query key
  lists, shared by the general path (``attention.py``, one sequence's chunk) and the batched
  decode path (``decode.py``, one token of many sequences): both hand each query exactly the keys
  it may see;
- ``mix_gates`` / ``sinkhorn`` / ``collapse``: the mHC hyper-connection gates and stream collapse;
- ``score``: MoE router scores from gate logits;
- ``apply_rope_eager`` / ``unweighted_rms_norm_eager``: RoPE and weightless RMSNorm in PyTorch ops
  (the model's versions dispatch fp32 CPU tensors to compiled loops with the same values).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hide(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias: -inf where ``mask`` is True, 0 elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def attend_with_sinks(
    q: torch.Tensor,
    win: torch.Tensor,
    win_bias: torch.Tensor | None,
    extra: torch.Tensor | None,
    extra_bias: torch.Tensor | None,
    sinks: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Softmax attention with per-head sinks where every query has its own keys (= values).

    ``q (M, nh, D)``; ``win (M, W, D)`` each query's window keys (may be a strided view);
    ``extra`` its compressed rows, ``(M, E, D)`` per query or ``(E, D)`` shared by all; biases
    ``(M, W)`` / ``(M, E)`` additive (-inf hides a key) or None. → ``(M, nh, D)``.
    Logits in q's dtype, softmax with the fp32 sink column in the promoted dtype.
    """
    parts = [torch.matmul(q, win.transpose(1, 2)) * scaling]  # (M, nh, W)
    if win_bias is not None:
        parts[0] = parts[0] + win_bias.unsqueeze(1)
    if extra is not None:
        parts.append(torch.matmul(q, extra.transpose(-1, -2)) * scaling)  # (M, nh, E)
        if extra_bias is not None:
            parts[1] = parts[1] + extra_bias.unsqueeze(1)
    sink = sinks.view(1, -1, 1).expand(q.shape[0], -1, 1)  # fp32, promotes the logits
    dtype = torch.promote_types(q.dtype, sink.dtype)
    combined = torch.cat([*(x.to(dtype) for x in parts), sink], dim=-1)  # (M, nh, W + E + 1)
    # softmax subtracts the row max itself: subtracting it first (as transformers does) gives
    # bitwise the same probabilities (the max element becomes exactly 0), so it is not repeated
    probs = torch.softmax(combined, dim=-1).to(q.dtype)
    w = win.shape[1]
    out = torch.matmul(probs[..., :w], win)  # (M, nh, D)
    if extra is not None:
        out = out + torch.matmul(probs[..., w:-1], extra)
    return out


def mix_gates(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC gates from ``mixes (N, (2+hc)*hc)`` (fp32): ``pre (N, hc)``, ``post (N, hc)`` and the
    doubly-stochastic ``comb (N, hc, hc)`` (eager PyTorch; the reference of the fused versions
    ``cpu_fused.hc_mix`` and ``kernels.mhc.hc_mix``)."""
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + eps
    return pre, post, sinkhorn(comb, iters, eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn normalisation of ``comb (N, hc, hc)``: columns, then ``iters - 1`` rounds of rows
    and columns, each ``x / (sum + eps)``.

    Runs on an ``(hc, hc, N)`` copy, so every sum and division streams along the token axis
    instead of over rows of 4: same operations in the same order (bitwise the same result),
    measured 6x faster at N=2048. Returns an ``(N, hc, hc)`` view.
    """
    c = comb.permute(1, 2, 0).contiguous()  # (hc_i, hc_j, N)
    c = c / (c.sum(dim=0, keepdim=True) + eps)
    for _ in range(iters - 1):
        c.div_(c.sum(dim=1, keepdim=True).add_(eps))  # rows: sum over j
        c.div_(c.sum(dim=0, keepdim=True).add_(eps))  # columns: sum over i
    return c.permute(2, 0, 1)


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``Σ_s pre[:, s] · streams[:, s]`` in fp32 → ``(N, H)`` in the streams' dtype. A batched
    ``(1, hc) @ (hc, H)`` product per token: the same sum as multiply-then-sum, in one op."""
    return torch.bmm(pre.unsqueeze(1), streams.float()).squeeze(1).to(streams.dtype)



def score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Router scores from gate logits: sqrtsoftplus (V4), sigmoid or softmax."""
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")



def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The trailing ``2·cos.shape[-1]`` channels of ``x`` rotated, in ``x``'s dtype."""
    rope_dim = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c = cos.float().reshape(shape)
    s = sin.float().reshape(shape)
    rope = x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)


def apply_rope_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` in PyTorch ops (any device and dtype)."""
    return torch.cat([x[..., : -2 * cos.shape[-1]], _rotated(x, cos, sin)], dim=-1)


def apply_rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope_eager`` written into ``x``'s rope channels (the same values; the other
    channels are not copied: for a large ``x`` the caller owns) → ``x``."""
    x[..., -2 * cos.shape[-1] :] = _rotated(x, cos, sin)
    return x


def unweighted_rms_norm_eager(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weight in PyTorch ops; the scale is computed in fp32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)

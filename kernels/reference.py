"""The attention kernel of the model core: softmax with per-head sinks over per-query key lists.

Shared by the general path (``attention.py``, one sequence's chunk) and the batched decode path
(``decode.py``, one token of many sequences): both hand each query exactly the keys it may see.
"""

from __future__ import annotations

import torch


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

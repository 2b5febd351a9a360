"""Logit rules before the draw: ``logit_bias``, ``min_tokens``, the reasoning cap, and the
repetition, frequency and presence penalties, each batched over the rows that ask for it.

``logit_bias`` (OpenAI): ``l[token] += bias`` for each (token, bias) pair of the request.
``min_tokens`` (vLLM): while fewer output tokens than ``min_tokens`` exist, EOS and the request's
``stop_token_ids`` get ``-inf``, so the request cannot end by a stop token before then.
The reasoning cap (``max_reasoning_tokens``: Anthropic's ``thinking.budget_tokens``): once that
many output tokens are out and the reasoning is still open, every token but ``reasoning_end_id``
(``</think>``) gets ``-inf``, so the answer starts there.

Semantics (the order vLLM applies them in):
- repetition (vLLM / CTRL): for every token in prompt + output so far, a logit ``l > 0`` becomes
  ``l / r`` and ``l <= 0`` becomes ``l * r``;
- frequency and presence (OpenAI): over output tokens only,
  ``l -= frequency * count + presence * (count > 0)``.
Each row costs one ``torch.unique`` of its tokens; the updates of all rows are one gather and one
scatter over the flat logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.state import SamplingState


def apply_logit_rules(logits: torch.Tensor, rows: Sequence[int], states: Sequence[SamplingState], eos_ids: Sequence[int]) -> None:
    """``logit_bias``, ``min_tokens`` and the reasoning cap on ``logits[rows]`` in place;
    ``states[j]`` is ``rows[j]``'s."""
    flat_logits = logits.view(-1)  # (B * V,)
    vocab = logits.shape[1]
    idx: list[int] = []
    bias: list[float] = []
    banned: list[int] = []
    for row, s in zip(rows, states):
        base = row * vocab
        for token, b in s.params.logit_bias:
            idx.append(base + token)
            bias.append(b)
        if s.step < s.params.min_tokens:
            banned += [base + t for t in (*eos_ids, *s.params.stop_token_ids)]
    if idx:
        flat_logits.index_add_(0, torch.tensor(idx, dtype=torch.int64), torch.tensor(bias, dtype=logits.dtype))
    if banned:
        flat_logits[torch.tensor(banned, dtype=torch.int64)] = float("-inf")
    for row, s in zip(rows, states):
        if s.reasoning_due:
            logits[row].fill_(float("-inf"))
            logits[row, s.params.reasoning_end_id] = 0.0  # the one token left


def apply_penalties(logits: torch.Tensor, rows: Sequence[int], states: Sequence[SamplingState]) -> None:
    """Penalise ``logits[rows]`` in place; ``states[j]`` belongs to ``rows[j]``.

    Works on the sparse set of (row, token) pairs that occur, as flat indices ``row * V + token``
    into ``logits.view(-1)``: one ``unique`` (with counts) over all rows' tokens, one gather, one
    scatter. The cost grows with the tokens seen, not with B * V.
    """
    B, vocab = logits.shape
    flat_logits = logits.view(-1)  # (B * V,)

    rep = [j for j, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if rep:
        r_of_row = torch.ones(B, dtype=logits.dtype)  # (B,)
        parts = []
        for j in rep:
            s, base = states[j], rows[j] * vocab
            r_of_row[rows[j]] = s.params.repetition_penalty
            parts.append(s.output_ids() + base)
            if s.prompt_ids is not None:
                parts.append(s.prompt_ids + base)
        idx = torch.unique(torch.cat(parts))  # (N,) distinct (row, token) in prompt or output
        r = r_of_row[idx // vocab]  # (N,)
        v = flat_logits[idx]
        flat_logits[idx] = torch.where(v > 0, v / r, v * r)

    fp = [j for j, s in enumerate(states) if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0]
    if fp:
        freq = torch.zeros(B, dtype=logits.dtype)  # (B,)
        pres = torch.zeros(B, dtype=logits.dtype)  # (B,)
        for j in fp:
            freq[rows[j]] = states[j].params.frequency_penalty
            pres[rows[j]] = states[j].params.presence_penalty
        flat = torch.cat([states[j].output_ids() + rows[j] * vocab for j in fp])  # (N,)
        idx, counts = torch.unique(flat, return_counts=True)  # (U,) distinct, so -= is well defined
        row = idx // vocab
        flat_logits[idx] -= freq[row] * counts.to(logits.dtype) + pres[row]

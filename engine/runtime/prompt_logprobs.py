"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token scored by the model's state
before it.

A prefill chunk feeds positions ``[c, c + n)`` of a sequence; the final hidden state at position
``p`` gives the distribution of token ``p + 1``, so the chunk scores prompt tokens ``c + 1 ..
c + n`` (those still inside the prompt; the last prompt position predicts the first output token,
which the sampler handles). Values are the raw ``log_softmax`` of the fp32 logits (as vLLM and
OpenAI report them: no temperature, penalties or grammar). The logits are made a slice of rows at
a time, so a long chunk costs ``SLICE_ROWS x V`` floats of memory, not ``n x V``.

Every prompt position must run through the model to be scored, so a sequence that asks is never
restored from the prefix cache (``EngineCore`` skips the lookup); its units are still saved.
"""

from __future__ import annotations

import torch

from deepserve.protocol import TokenLogprob
from engine.model.lm_head import LMHead

SLICE_ROWS = 256  # hidden rows turned into logits at once


def score(head: LMHead, hidden: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """``targets[i]``'s log probability, 1-based rank and ``top`` best alternatives under the
    distribution of ``hidden[i]`` (``hidden``: ``(M, H)``, one row per target)."""
    assert hidden.shape[0] == len(targets), "one hidden row per scored token"
    out: list[TokenLogprob] = []
    for a in range(0, len(targets), SLICE_ROWS):
        b = min(a + SLICE_ROWS, len(targets))
        lp = torch.log_softmax(head.logits(hidden[a:b]).float(), dim=-1)  # (S, V)
        ids = torch.tensor(targets[a:b], dtype=torch.long, device=lp.device).unsqueeze(1)  # (S, 1)
        chosen = lp.gather(1, ids)  # (S, 1)
        ranks = (lp > chosen).sum(dim=1).add_(1).tolist()  # (S,)
        top_v, top_i = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())  # (S, top)
        for v, r, tv, ti in zip(chosen.squeeze(1).tolist(), ranks, top_v.tolist(), top_i.tolist()):
            out.append(TokenLogprob(v, list(zip(ti, tv)), r))
    return out


def record(entries: list[TokenLogprob | None], tokens: list[int], start: int, hidden: torch.Tensor, head: LMHead, top: int) -> None:
    """Fill the entries a chunk scores: it fed ``tokens[start : start + n]`` and produced
    ``hidden`` ``(n, H)``; ``entries`` has one slot per prompt token (slot 0 stays None)."""
    m = min(hidden.shape[0], len(entries) - 1 - start)  # rows whose next token is in the prompt
    if m <= 0:
        return
    entries[start + 1 : start + 1 + m] = score(head, hidden[:m], tokens[start + 1 : start + 1 + m], top)

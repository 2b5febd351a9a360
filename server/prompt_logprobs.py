"""Prompt log probabilities at the gateway: vLLM's ``prompt_logprobs`` and completions ``echo``.

The engine sends, on a request's first event, one ``TokenLogprob`` per prompt token when
``SamplingParams.prompt_logprobs`` asks (``engine/runtime/prompt_logprobs.py``): the first
``None``, the others the raw ``log_softmax`` value, rank and best alternatives. Two renderings:
- vLLM's ``prompt_logprobs`` (chat: on the answer; completions: on each choice): per prompt
  position ``None`` or ``{token id: {logprob, rank, decoded_token}}``, the prompt token first,
  then the ``k`` best (the prompt token once, if it is among them);
- OpenAI's legacy completions ``echo`` + ``logprobs``: the echoed tokens' ``token_logprobs``
  (the first null, as OpenAI reports it) and ``top_logprobs`` (token string -> logprob).
The field is read by ``server.extensions`` (not with ``stream``, as in vLLM: 400); streaming
``echo`` + ``logprobs`` works.
"""

from __future__ import annotations

import json
from typing import Any

from deepserve.protocol import TokenLogprob
from server.decode import scored_entries
from server.errors import EngineFailed
from server.generation import Run
from server.model import ModelCatalog

def _entries(catalog: ModelCatalog, ids: list[int], lps: list[TokenLogprob | None], top: int) -> list[dict[str, Any]]:
    """The processor's entry (token, logprob, top_logprobs with ``top`` alternatives) per prompt
    token; fewer when the prompt ends inside a UTF-8 character."""
    return scored_entries(catalog, ids, [(0.0, []) if lp is None else (lp.logprob, lp.top[:top]) for lp in lps])[1]


def vllm_format(catalog: ModelCatalog, ids: list[int], lps: list[TokenLogprob | None], top: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` list for prompt ``ids``."""
    entries = _entries(catalog, ids, lps, top)
    out: list[dict[str, Any] | None] = []
    for i, lp in enumerate(lps):
        if lp is None:
            out.append(None)
            continue
        entry = entries[i] if i < len(entries) else {"token": None, "top_logprobs": []}
        alts = entry["top_logprobs"]
        pos = {str(ids[i]): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": entry["token"]}}
        for rank, (tid, value) in enumerate(lp.top[:top], start=1):
            decoded = alts[rank - 1]["token"] if rank <= len(alts) else None
            pos.setdefault(str(tid), {"logprob": value, "rank": rank, "decoded_token": decoded})
        out.append(pos)
    return out


def legacy_echo(
    catalog: ModelCatalog, ids: list[int], lps: list[TokenLogprob | None], top: int, skip: int
) -> tuple[list[str], list[float | None], list[dict[str, float] | None]]:
    """(tokens, token_logprobs, top_logprobs) of the echoed prompt ``ids[skip:]`` (``skip``: a
    BOS the client did not send); the first echoed token has null, as in OpenAI's legacy format."""
    entries = _entries(catalog, ids, lps, top)[skip:]
    logprobs: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for entry in entries[1:]:
        logprobs.append(entry["logprob"])
        tops.append({t["token"]: t["logprob"] for t in entry["top_logprobs"]})
    return [e["token"] for e in entries], logprobs[: len(entries)], tops[: len(entries)]


def of_run(catalog: ModelCatalog, run: Run, top: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of a finished run's prompt (``EngineFailed`` if the engine sent none)."""
    if run.prompt_logprobs is None:
        raise EngineFailed("The engine returned no prompt logprobs.")
    return vllm_format(catalog, run.req.prompt_token_ids, run.prompt_logprobs, top)


def with_chat_prompt_logprobs(text: str, catalog: ModelCatalog, run: Run) -> str:
    """A chat answer's JSON with vLLM's top-level ``prompt_logprobs`` when the request asked."""
    top = run.req.sampling.prompt_logprobs
    if top is None:
        return text
    answer = json.loads(text)
    answer["prompt_logprobs"] = of_run(catalog, run, top)
    return json.dumps(answer, ensure_ascii=False, separators=(",", ":"))

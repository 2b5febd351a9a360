"""Token ids -> text outside a protocol answer, through deepseek-recipe's plain-text processor.

``text_processor`` is the processor ``/v1/completions`` streams through (no thinking, no tool
parsing, the client's stop strings); ``decode_tokens`` the text and per-token strings of ids
(``/detokenize``, echo, ``token_strs``), ``scored_entries`` the same with each token's logprob and
its alternatives' strings (prompt logprobs); ``matched_stop`` which stop string ended an answer, for
``include_stop_str_in_output`` (the processor drops the string it matched).
"""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe as dr

from server.model import ModelCatalog


def text_processor(catalog: ModelCatalog, stop: list[str], rid: str) -> Any:
    conv = dr.ConversationRequest(dr.Conversation([], thinking_mode=False), dr.ModelVersion.DeepseekV4Pro)
    options = dr.ParsingOptions(parse_tool_calls=False, stop_sequences=stop)
    return dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(conv, rid, ""), options, catalog.tokenizer)


def decode_tokens(catalog: ModelCatalog, ids: list[int]) -> tuple[str, list[str]]:
    """(text, one string per token) of ``ids``."""
    text, entries = scored_entries(catalog, ids, [(0.0, ())] * len(ids))
    return text, [e["token"] for e in entries]


def scored_entries(catalog: ModelCatalog, ids: list[int], scores: list[tuple[float, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """(text, one Chat Completions logprobs entry per token) of ``ids`` with ``scores[i]`` =
    (logprob, [(token id, logprob), ...] alternatives): each entry has ``token``, ``logprob`` and
    ``top_logprobs`` (``[{token, logprob, bytes}]``, the alternatives' strings in their order);
    ids that end inside a UTF-8 character get no entry."""
    proc = text_processor(catalog, [], "decode")
    chunks = proc.push(dr.InferenceChunk.ready())
    chunks += proc.push(dr.InferenceChunk.tokens(ids, scores))
    chunks += proc.finish()
    text: list[str] = []
    entries: list[dict[str, Any]] = []
    for c in chunks:
        choice = json.loads(c.to_json())["choices"][0]
        text.append(choice["delta"].get("content") or "")
        entries += (choice.get("logprobs") or {}).get("content") or ()
    return "".join(text), entries


def matched_stop(catalog: ModelCatalog, stops: list[str], ids: list[int], before: int) -> str:
    """The stop string that ended an answer whose output is ``ids``, the match completed by the
    tokens from ``before`` on (the last batch pushed): of the stops occurring in the decoded text
    and ending inside that batch's text, the earliest; "" when none does."""
    if not stops or not ids:
        return ""
    full = decode_tokens(catalog, ids)[0]
    earlier = len(decode_tokens(catalog, ids[:before])[0]) if before else 0
    best: tuple[int, str] | None = None
    for s in stops:
        at = full.find(s, max(0, earlier - len(s) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, s)
    return best[1] if best else ""

"""Chat Completions answers as the spec has them, from deepseek-recipe's per-choice chunks.

The recipe answers one choice and puts ``usage`` on its finish chunk whether or not the client
asked. This module reshapes its JSON:
- ``n`` choices: choice ``i``'s chunks get ``index: i``; a whole answer merges the choices, its
  usage counting the prompt once and the completions of every choice (as OpenAI and vLLM do);
- streamed usage: without ``stream_options.include_usage`` no chunk carries usage; with it every
  chunk has ``usage: null`` and a last chunk has ``choices: []`` and the summed usage; with vLLM's
  ``continuous_usage_stats`` too, every chunk carries the usage so far;
- ``parallel_tool_calls: false``: only the first tool call of a choice is kept;
- vLLM's chat ``echo``: the last message's text, when it is the assistant's, starts the answer;
- vLLM's ``include_stop_str_in_output``: the matched stop string ends the content;
- ``reasoning_tokens`` at most ``completion_tokens`` (deepseek-recipe 0.2.0 at times counts one
  reasoning token more than were generated, on answers cut off inside the reasoning).
Chunks that need none of this are passed on as the recipe wrote them (no JSON round trip).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from server.extensions import Extras


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def merge_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """One usage for several choices of one prompt: prompt counted once, completions summed."""
    total = copy.deepcopy(usages[0])
    for u in usages[1:]:
        total["completion_tokens"] = total.get("completion_tokens", 0) + u.get("completion_tokens", 0)
        details = u.get("completion_tokens_details") or {}
        mine = total.get("completion_tokens_details")
        if isinstance(mine, dict):
            for key, value in details.items():
                if isinstance(value, int) and isinstance(mine.get(key), int):
                    mine[key] += value
    total["total_tokens"] = total.get("prompt_tokens", 0) + total.get("completion_tokens", 0)
    details = total.get("completion_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
        details["reasoning_tokens"] = min(details["reasoning_tokens"], total.get("completion_tokens", 0))
    return total


def echo_text(body: dict[str, Any]) -> str:
    """vLLM's chat ``echo``: the last message's text when its role is ``assistant``, else ""."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return ""
    last = messages[-1]
    if last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _first_tool_only(holder: dict[str, Any]) -> None:
    calls = holder.get("tool_calls")
    if isinstance(calls, list) and len(calls) > 1:
        holder["tool_calls"] = calls[:1]


_COMPLETION = re.compile(r'"completion_tokens":\s*(\d+)')
_REASONING = re.compile(r'"reasoning_tokens":\s*(\d+)')


def _reasoning_overcounted(text: str) -> bool:
    """Whether an answer's usage says more reasoning than completion tokens (read off its text:
    a single answer is passed on without parsing otherwise)."""
    c, r = _COMPLETION.search(text), _REASONING.search(text)
    return c is not None and r is not None and int(r[1]) > int(c[1])


def merge_answers(texts: list[str], extras: Extras, echo: str, stops: list[str] | None = None) -> str:
    """The whole answer from each choice's recipe response JSON (one per choice); ``stops[i]``:
    the stop string choice ``i`` matched, kept in its content (include_stop_str_in_output)."""
    stops = stops or [""] * len(texts)
    if len(texts) == 1 and not echo and extras.parallel_tool_calls and not stops[0] and not _reasoning_overcounted(texts[0]):
        return texts[0]
    answers = [json.loads(t) for t in texts]
    out = answers[0]
    choices = []
    for i, answer in enumerate(answers):
        for choice in answer.get("choices") or ():
            choice["index"] = i
            message = choice.get("message") or {}
            if echo or stops[i]:
                message["content"] = echo + (message.get("content") or "") + stops[i]
            if not extras.parallel_tool_calls:
                _first_tool_only(message)
            choices.append(choice)
    out["choices"] = choices
    usages = [a["usage"] for a in answers if isinstance(a.get("usage"), dict)]
    if usages:
        out["usage"] = merge_usage(usages)
    return dumps(out)


@dataclass
class ChatStreamShaper:
    """Reshapes streamed chunk JSON choice by choice; ``final()`` is the usage chunk, if asked.

    ``usage_now(i)``: (prompt tokens, completion tokens so far) of choice ``i``, for
    ``continuous_usage_stats``; ``stop_text(i)``: the stop string choice ``i`` matched (or ""),
    added to its finishing delta.
    """

    extras: Extras
    echo: str = ""
    usage_now: Callable[[int], tuple[int, int]] | None = None
    stop_text: Callable[[int], str] | None = None
    _usages: dict[int, dict[str, Any]] = field(default_factory=dict)
    _started: set[int] = field(default_factory=set)
    _last: dict[str, Any] | None = None  # id / created / model of the last finish chunk

    def shape(self, i: int, text: str) -> str:
        ex = self.extras
        first = i not in self._started
        if first:
            self._started.add(i)
        needs = (
            ex.n > 1 or (ex.include_usage and ex.continuous_usage) or (first and bool(self.echo))
            or '"usage":{' in text or (not ex.parallel_tool_calls and '"tool_calls"' in text)
            or (self.stop_text is not None and '"finish_reason":"stop"' in text)
        )
        if not needs:
            return text
        chunk = json.loads(text)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usages[i] = usage
            self._last = {k: chunk.get(k) for k in ("id", "object", "created", "model", "system_fingerprint")}
        if ex.include_usage:
            chunk["usage"] = self._continuous(i) if ex.continuous_usage else None
        else:
            chunk.pop("usage", None)
        for choice in chunk.get("choices") or ():
            choice["index"] = i
            delta = choice.get("delta") or {}
            if first and self.echo:
                delta["content"] = self.echo + (delta.get("content") or "")
            if self.stop_text is not None and choice.get("finish_reason") == "stop":
                stop = self.stop_text(i)
                if stop:
                    delta["content"] = (delta.get("content") or "") + stop
            if not ex.parallel_tool_calls:
                calls = delta.get("tool_calls")
                if isinstance(calls, list):
                    kept = [c for c in calls if c.get("index", 0) == 0]
                    if kept:
                        delta["tool_calls"] = kept
                    else:
                        delta.pop("tool_calls")
        return dumps(chunk)

    def _continuous(self, i: int) -> dict[str, Any] | None:
        if self.usage_now is None:
            return None
        prompt, completion = self.usage_now(i)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def final(self) -> str | None:
        """The spec's last chunk (``choices: []`` and the usage) when ``include_usage`` asks."""
        if not self.extras.include_usage or not self._usages or self._last is None:
            return None
        usage = merge_usage([self._usages[i] for i in sorted(self._usages)])
        return dumps({**self._last, "choices": [], "usage": usage})

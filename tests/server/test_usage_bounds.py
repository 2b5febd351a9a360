"""Usage adds up: ``reasoning_tokens`` never exceeds ``completion_tokens`` in a Chat Completions
answer, also where deepseek-recipe's own usage over-counts the reasoning (as 0.2.0 does on
answers cut off inside it)."""

from __future__ import annotations

import json

from server.chat_shape import ChatStreamShaper, merge_answers, merge_usage
from server.extensions import Extras


def _answer(completion: int, reasoning: int) -> str:
    usage = {"prompt_tokens": 9, "completion_tokens": completion, "total_tokens": 9 + completion, "completion_tokens_details": {"reasoning_tokens": reasoning}}
    return json.dumps({"id": "x", "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length"}], "usage": usage}, separators=(",", ":"))


def test_a_whole_answer_bounds_reasoning_by_completion() -> None:
    extras = Extras()
    ok = _answer(5, 3)
    assert merge_answers([ok], extras, "") == ok  # nothing to fix: passed on as written
    fixed = json.loads(merge_answers([_answer(5, 6)], extras, ""))
    assert fixed["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5
    both = json.loads(merge_answers([_answer(5, 6), _answer(2, 3)], extras, ""))["usage"]
    assert both["completion_tokens"] == 7 and both["completion_tokens_details"]["reasoning_tokens"] == 7


def test_the_streamed_usage_chunk_is_bounded_too() -> None:
    assert merge_usage([json.loads(_answer(4, 5))["usage"]])["completion_tokens_details"]["reasoning_tokens"] == 4
    shaper = ChatStreamShaper(Extras(include_usage=True), "")
    shaper.shape(0, _answer(4, 5))
    assert json.loads(shaper.final())["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4

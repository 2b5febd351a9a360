"""Keeping a streamed answer's first tool call only (Anthropic ``disable_parallel_tool_use``,
Responses ``parallel_tool_calls: false``): the events of every later call are dropped and the
items after them renumbered, so the indices a client sees stay contiguous."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FirstCallOnly:
    """The index each streamed item is sent under (None: the item is a dropped call)."""

    _seen: bool = False
    _sent: dict[int, int | None] = field(default_factory=dict)  # streamed index -> sent (None: dropped)

    def index(self, index: int, opens: bool, is_call: bool) -> int | None:
        """The index to send an event of item ``index`` under; ``opens``: the event that starts the
        item, ``is_call``: that item is a tool call."""
        if opens:
            dropped = is_call and self._seen
            self._seen = self._seen or is_call
            self._sent[index] = None if dropped else sum(v is not None for v in self._sent.values())
        return self._sent.get(index, index)


def first_call_only(items: Iterable[Any], is_call: Callable[[Any], bool]) -> list[Any]:
    """A whole answer's ``items`` without the calls after the first (``is_call``)."""
    out, seen = [], False
    for item in items:
        if is_call(item):
            if seen:
                continue
            seen = True
        out.append(item)
    return out

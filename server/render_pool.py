"""Prompt rendering off the event loop: request conversion and tokenisation in a bounded pool.

deepseek-recipe's conversion and prompt encoding, and the tokenizer's ``encode``, are native code
that releases the GIL: a 1M-character prompt takes ~0.5 s to encode on one core, which on the
event loop would stall every other request and stream for that long. ``RenderPool.run`` runs such
work on a fixed number of threads (``threads``), so the loop keeps serving. Bodies smaller than
``inline_bytes`` are rendered inline instead: they take well under a millisecond, need no thread
hop, and so never queue behind huge prompts that occupy the pool.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class RenderPool:
    """``threads`` rendering threads; see the module docstring."""

    def __init__(self, threads: int, inline_bytes: int) -> None:
        if threads < 1 or inline_bytes < 0:
            raise ValueError("a render pool needs threads >= 1 and inline_bytes >= 0")
        self.inline_bytes = inline_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="render")

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` for a request body of ``size`` bytes: inline when small, else on the pool
        (its exceptions raised here)."""
        if size < self.inline_bytes:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Stop the threads once the work already handed to them is done."""
        self._pool.shutdown(wait=False, cancel_futures=True)

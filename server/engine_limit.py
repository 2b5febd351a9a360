"""One context length: the gateway's is its engine's (``deepserve gateway --engine-url``).

A worker, and a router service over its workers (the smallest of theirs), report the engine's
``max_model_len`` on ``GET /load`` (``LoadReport.max_model_len``). The gateway asks until it gets
one (its engine may start after it) and then serves that length: model cards, ``/tokenize``, and
the resolution of a default ``max_tokens`` (context minus prompt) all use it, so a request the
gateway lets through is one the engine can take. A ``--max-model-len`` given to the gateway that
is larger than the engine's is clamped to it (with a warning); a smaller one is kept.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Awaitable, Callable

from server.model import ModelCatalog
from server.state import Gateway

log = logging.getLogger(__name__)

ContextProbe = Callable[[], Awaitable[int]]  # the engine's context length; 0 or an error: not known yet


def adopted(catalog: ModelCatalog, configured: int | None, engine_len: int) -> ModelCatalog:
    """``catalog`` serving the engine's context length ``engine_len`` (``configured``: the
    gateway's own ``max_model_len``, kept when smaller)."""
    if configured is not None and configured > engine_len:
        log.warning("--max-model-len %d exceeds the engine's %d: serving %d", configured, engine_len, engine_len)
    length = engine_len if configured is None else min(configured, engine_len)
    return catalog if length == catalog.context_len else replace(catalog, context_len=length)


async def learn(gw: Gateway, probe: ContextProbe, interval_s: float = 1.0) -> None:
    """Ask ``probe`` every ``interval_s`` until it reports a length, then adopt it."""
    while True:
        try:
            engine_len = await probe()
        except Exception as exc:  # any transport failure: the engine is not up yet
            log.debug("engine context length not known yet: %s", exc)
            engine_len = 0
        if engine_len > 0:
            gw.catalog = adopted(gw.catalog, gw.config.max_model_len, engine_len)
            log.info("context length %d (the engine's %d)", gw.catalog.context_len, engine_len)
            return
        await asyncio.sleep(interval_s)

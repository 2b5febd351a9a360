"""DP-aware, cache-aware router with separate prefill and decode pools.

Module map (a request's path top to bottom):

- ``router.py``: ``Router``: admission, placement, sending, retries, migration, abort.
- ``placement.py``: ``Placer`` / ``Pools``: which pool(s) and which rank (pure).
- ``policies/``: one file per policy, ``registry.py`` name -> class, ``base.py`` the interface
  (``Policy``, ``RouteRequest``, ``RankView``), ``dp.py`` DP-group helpers.
- ``kv_index.py``: which ranks hold which KV units (KV events + own placements).
- ``registry.py``: workers, health, circuit breakers (``circuit_breaker.py``), load accounting.
- ``worker_client.py``: the HTTP client of one worker; its generate call goes over a
  ``transport.py`` ``Transport`` (deadlines, errors): ``http1.py`` (ours, the default) or
  ``aiohttp_transport.py`` (the library's); ``admission.py``: the bounded queue.
- ``service.py`` / ``cli.py``: ``deepserve router``, served through ``serving.py``'s ``Server``:
  ``http_server.py`` (a small httptools HTTP/1.1 server, the default) or ``aiohttp_server.py``
  (the library's); ``config.py``; ``metrics.py``; ``errors.py``.

Names are imported lazily so that ``router.policies`` (used by the simulator) pulls in no
network stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Router": "router.router",
    "RouterConfig": "router.config",
    "PolicyConfig": "router.config",
    "RouterMetrics": "router.metrics",
    "WorkerClient": "router.worker_client",
    "WorkerRegistry": "router.registry",
    "KVIndex": "router.kv_index",
    "Placer": "router.placement",
    "Pools": "router.placement",
    "Policy": "router.policies.base",
    "RankView": "router.policies.base",
    "RouteRequest": "router.policies.base",
    "create_policy": "router.policies.registry",
    "RouterError": "router.errors",
    "NoWorkerAvailable": "router.errors",
    "Overloaded": "router.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'router' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

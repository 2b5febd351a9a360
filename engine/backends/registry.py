"""Backend registry: name → factory (``deepserve engine --backend NAME``).

Factories are imported when asked for, so naming a backend never imports another one's
dependencies (DeepInfer's ``_C`` extension needs CUDA on SM100).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from engine.backends.base import BackendContext, BackendFactory, BackendGroup
from engine.errors import EngineError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

# name -> "module:function" of its factory
_FACTORIES: dict[str, str] = {
    "reference": "engine.backends.reference.factory:build_reference",
    "deepinfer": "engine.backends.deepinfer.factory:build_deepinfer",
}


def names() -> tuple[str, ...]:
    """The registered backend names."""
    return tuple(_FACTORIES)


def factory(name: str) -> BackendFactory:
    """The factory registered under ``name``; ``EngineError`` for an unknown name."""
    try:
        target = _FACTORIES[name]
    except KeyError:
        raise EngineError(f"unknown engine backend {name!r} (known: {', '.join(_FACTORIES)})") from None
    module, func = target.split(":")
    return getattr(import_module(module), func)


def build_backend(name: str, ctx: BackendContext, registry: CollectorRegistry | None) -> BackendGroup:
    """Build the ranks a worker serves with the backend ``name`` (metrics into ``registry``)."""
    return factory(name)(ctx, registry)

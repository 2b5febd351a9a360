"""Backends the contract suite runs on here: the reference engine on the tiny checkpoint, and
the DeepInfer adapter over the stand-in of DeepInfer's Python surface (deepinfer_standin.py:
NOT DeepInfer, which cannot run without SM100)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from deepserve.protocol import Role
from engine.backends.base import EngineBackend
from engine.backends.deepinfer.backend import DeepInferBackend, DeepInferTypes
from engine.backends.deepinfer.bridge import KVBridge
from engine.backends.deepinfer.engines import ENGINE_TYPES, Hooks, engine_classes
from engine.backends.deepinfer.factory import read_output
from engine.backends.deepinfer.layout import DeepInferEnv, cache_layout
from engine.backends.reference.backend import ReferenceBackend
from engine.kv_connector import KVConnector
from engine.model.loader import load_model
from engine.runtime.builder import build_engine
from engine.runtime.config import EngineConfig
from kvstore import KVStoreConfig, build_store
from kvstore.store import TieredStore
from tests.engine.backends import deepinfer_standin as si

BACKENDS = ["reference", "deepinfer-standin"]


@dataclass
class Made:
    """A backend rank built for a test, with the store it writes and its key fingerprint."""

    backend: EngineBackend
    store: TieredStore
    fingerprint: str


def make_standin(role: Role, store: TieredStore, env: DeepInferEnv | None = None, dp_rank: int = 0) -> Made:
    """The DeepInfer adapter for ``role`` over a stand-in engine (decode engines: no extra-state ring)."""
    if env is None:
        env = si.StandInConfig().env if role != "decode" else DeepInferEnv()
    config = si.StandInConfig(env=env)
    layout = cache_layout(si.STANDIN_CONFIG, env)
    bridge = KVBridge(store, layout, layout.fingerprint("standin"), dp_rank)
    engines: list[si.StandInLLMEngine] = []
    hooks = Hooks(dp_rank=dp_rank, bridge=bridge, make_cache=si.StandInCache, new_event=si.Event, read_output=lambda ptr: read_output(engines[0].outputs, ptr))
    engine = engine_classes(si.StandInLLMEngine)[role](config, log_stats=False, engine_type=si.EngineType[ENGINE_TYPES[role]], hooks=hooks)
    engines.append(engine)
    types = DeepInferTypes(si.SamplingParams, si.SequenceStatus.RUNNING)
    return Made(DeepInferBackend(engine, hooks, role, types, max_model_len=4096), store, bridge.fingerprint)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32", progress=False)


@pytest.fixture(params=BACKENDS)
def make(request, tiny_model_dir) -> Callable[[Role], Made]:
    """``make(role)``: a fresh backend rank of the parametrised kind, with its own memory store.
    The reference backend has no role-specific engine: every role is its mixed engine."""
    kind = request.param

    def build(role: Role = "mixed") -> Made:
        store = build_store(KVStoreConfig(tiers=("memory",)))
        if kind == "deepinfer-standin":
            return make_standin(role, store)
        model = request.getfixturevalue("tiny_model")
        kv = KVConnector(store, model, snapshot_interval_units=1)
        core = build_engine(tiny_model_dir, EngineConfig(static_decode=False), model=model, kv=kv)
        return Made(ReferenceBackend(core), store, kv.fingerprint)

    return build

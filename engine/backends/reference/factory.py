"""The reference backend's factory (what the worker built itself before backends): one loaded model, one ``EngineCore`` per DP rank, all in this
process (the worker's engine thread steps them one after another)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from engine.backends.base import BackendContext, BackendGroup
from engine.backends.reference.backend import ReferenceBackend
from engine.kv_connector import KVConnector
from engine.runtime.builder import (
    build_sampler,
    configure_cpu_allocator,
    configure_cpu_threads,
    family_engine_config,
    fit_state_budget,
    load_any_model,
)
from engine.runtime.engine_core import EngineCore
from engine.runtime.metrics import EngineMetricFamilies, EngineMetrics

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


def build_reference(ctx: BackendContext, registry: CollectorRegistry | None) -> BackendGroup:
    """Load the checkpoint once and build ``ctx.dp`` cores over it (state budget split evenly);
    with ``ctx.expert_parallel`` > 1, that many rank processes instead (``ep_group``)."""
    if ctx.expert_parallel > 1:
        from engine.backends.reference.ep_group import build_expert_parallel

        return build_expert_parallel(ctx, registry)
    if ctx.device == "cpu":
        configure_cpu_threads()
        configure_cpu_allocator()
    model = load_any_model(ctx.model_dir, dtype=ctx.dtype, device=ctx.device, weights=ctx.engine.weights, load_format=ctx.engine.load_format)
    families = EngineMetricFamilies(registry)
    engine_cfg = replace(family_engine_config(model, ctx.engine), role=ctx.role)
    store = None
    if engine_cfg.kv_cache != "off":
        from kvstore import KVStoreConfig, build_store

        store = build_store(KVStoreConfig.from_env(), registry=registry)
    cores = []
    for rank in range(ctx.dp):
        metrics = EngineMetrics(families, ctx.served_model_name, rank)
        kv = None
        if store is not None:
            kv = KVConnector(
                store,
                model,
                read=engine_cfg.kv_cache in ("read", "readwrite"),
                write=engine_cfg.kv_cache in ("write", "readwrite"),
                snapshot_interval_units=engine_cfg.snapshot_interval_units,
                bounded_replay_tokens=engine_cfg.bounded_replay_tokens,
                metrics=metrics,
                dp_rank=rank,
            )
        cores.append(EngineCore(model, build_sampler(model, ctx.model_dir), engine_cfg, kv=kv, metrics=metrics, dp_rank=rank))
    fit_state_budget(cores, model, engine_cfg)  # GPU: measured after every core's graphs are captured
    if cores[0].static is not None and model.device.type == "cpu":  # compile the CPU step's kernels before /health answers 200
        cores[0].static.warm_up()
    fingerprint = cores[0].kv.fingerprint if isinstance(cores[0].kv, KVConnector) else ""
    return BackendGroup(
        ranks=[ReferenceBackend(c) for c in cores],
        unit_tokens=model.config.unit_tokens,
        fingerprint=fingerprint,
        store=store,
        lockstep=False,
        close=store.close if store is not None else (lambda: None),
    )

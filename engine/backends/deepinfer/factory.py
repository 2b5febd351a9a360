"""The ``deepinfer`` backend's factory: the one module that imports DeepInfer (SM100 / Ascend 950).

One worker process = one DP rank (``ctx.dp_rank`` of ``ctx.dp``), DeepInfer's process model: its
ranks step in lockstep through their own collectives, so the group is ``lockstep=True``. Set
``CUDA_VISIBLE_DEVICES`` (and ``MASTER_ADDR`` / ``MASTER_PORT`` for the DP group) in the process
environment before it starts: DeepInfer reads them when it initialises (docs/DEEPINFER.md).

Untested here: nothing of DeepInfer imports without CUDA on SM100; the adapter's logic is tested
against ``tests/engine/backends/deepinfer_standin.py``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from engine.backends.base import BackendContext, BackendGroup
from engine.backends.deepinfer.backend import DeepInferBackend, DeepInferTypes
from engine.backends.deepinfer.bridge import KVBridge
from engine.backends.deepinfer.engines import ENGINE_TYPES, Hooks, RawOutput, engine_classes
from engine.backends.deepinfer.layout import DeepInferEnv, cache_layout
from engine.errors import EngineError
from engine.model.v41.config import V41Config
from engine.runtime.metrics import EngineMetricFamilies, EngineMetrics

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)


class EngineCache:
    """``CacheAccess`` over a real engine: ``driver_worker.cache_engine`` and DeepInfer's
    ``GPUCacheInterface`` state helpers. ``block_ids`` needs ``Sequence.block_table``, which the
    0.1.0 release does not expose (the optional patch in docs/DEEPINFER.md adds it)."""

    def __init__(self, engine: Any) -> None:
        from deepinfer.worker.cache_engine import GPUCacheInterface

        self.iface = GPUCacheInterface
        self.cache_engine = engine.driver_worker.cache_engine

    def block_ids(self, seq: Any) -> list[int]:
        return list(seq.block_table)

    def block(self, block_id: int) -> torch.Tensor:
        return self.cache_engine.gpu_blocks[block_id]

    def stored_windows(self, state_cache: torch.Tensor, state_id: int, position: int) -> torch.Tensor:
        return self.iface.select_state_slice_to_store(state_id, position, state_cache)

    def decode_state(self, state_id: int, position: int) -> torch.Tensor:
        return self.iface.select_state_slice_to_store(state_id, position, self.cache_engine.gpu_states, TO_CE=True)

    def load_windows(self, state_id: int, position: int, windows: torch.Tensor) -> None:
        states = self.cache_engine.gpu_states
        self.iface.load_state_from_store_to_prefill_cache(state_id, position, windows.to(states.device), states)

    def load_decode_state(self, state_id: int, state: torch.Tensor) -> None:
        self.cache_engine.gpu_states[state_id, : state.numel()].copy_(state)

    def states(self) -> torch.Tensor:
        return self.cache_engine.gpu_states


def read_output(request_output: Any, ptr: int) -> RawOutput:
    """A ``RequestOutput`` pointer's fields through its static getters (``_C/engine.pyi``)."""
    ro = request_output
    return RawOutput(
        request_id=ro.get_request_id(ptr),
        token_id=int(ro.get_token_id(ptr)),
        finished=bool(ro.get_finished(ptr)),
        finish_reason=str(ro.get_finish_reason(ptr)),
        logprob=float(ro.get_token_logprobs(ptr)),
        top=list(zip(ro.get_top_token_ids(ptr), ro.get_top_logprobs(ptr), strict=False)),
    )


def build_deepinfer(ctx: BackendContext, registry: CollectorRegistry | None) -> BackendGroup:
    """Build this process's DeepInfer engine for ``ctx.role`` and DP rank ``ctx.dp_rank``."""
    if ctx.dp > 1 and ctx.dp_rank is None:
        raise EngineError("the deepinfer backend runs one process per DP rank: give --dp-rank (0 .. dp-1)")
    rank = ctx.dp_rank or 0
    try:
        from deepinfer._C.engine import RequestOutput, Sequence, SequenceStatus
        from deepinfer.engine.arg_utils import EngineArgs
        from deepinfer.engine.engine_type import EngineType
        from deepinfer.engine.llm_engine import LLMEngine
        from deepinfer.sampling_params import SamplingParams
    except ImportError as exc:
        raise EngineError(f"the deepinfer backend needs DeepInfer built on this node (docs/DEEPINFER.md): {exc}") from exc
    cfg = V41Config.from_dir(ctx.model_dir)
    env = DeepInferEnv.from_environ(os.environ)
    layout = cache_layout(cfg, env, fp4_kv=cfg.use_fp4_sparse_kv)
    blocks_visible = hasattr(Sequence, "block_table")
    if ctx.role != "mixed" and not blocks_visible:
        raise EngineError("prefill/decode roles move block rows, and this DeepInfer does not expose Sequence.block_table (apply the patch in docs/DEEPINFER.md)")
    store = bridge = None
    if ctx.engine.kv_cache != "off" and blocks_visible:
        if ctx.role != "decode" and not env.prefill_store_extra_state:
            raise EngineError("storing prompt units needs DEEPINFER_PREFILL_STORE_EXTRA_STATE=1 (the window at the last whole unit is read after the prompt)")
        from kvstore import KVStoreConfig, build_store

        store = build_store(KVStoreConfig.from_env(), registry=registry)
        mode = ctx.engine.kv_cache
        read = mode in ("read", "readwrite") and (env.yoco_truncation_mode != "off" or layout.swa_dropped_layers == 0)
        bridge = KVBridge(store, layout, layout.fingerprint(cfg.fingerprint()), rank, read=read, write=mode in ("write", "readwrite") or ctx.role == "prefill")
    elif ctx.engine.kv_cache != "off":
        log.warning("deepinfer: no Sequence.block_table in this build, so no KV store (mixed role only, no prefix hits)")
    hooks = Hooks(
        dp_rank=rank,
        bridge=bridge,
        make_cache=EngineCache,
        new_event=torch.cuda.Event,
        read_output=lambda ptr: read_output(RequestOutput, ptr),
        snapshot_interval_units=ctx.engine.snapshot_interval_units,
    )
    e = ctx.engine
    args = EngineArgs(
        model=ctx.model_dir,
        served_model_name=ctx.served_model_name,
        max_model_len=e.max_model_len,
        data_parallel_size=ctx.dp,
        expert_parallel_size=ctx.expert_parallel or ctx.dp,
        engine_rank=rank,
        gpu_memory_utilization=e.gpu_memory_utilization,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_num_seqs=e.max_num_seqs,
        stop_preempted_request=ctx.role == "decode",  # a COMPLETION engine cannot recompute
        engine_type=EngineType[ENGINE_TYPES[ctx.role]],
        chunked_prefill=True,
    )
    engine = engine_classes(LLMEngine)[ctx.role](*args.create_engine_configs(), log_stats=True, engine_type=args.engine_type, hooks=hooks)
    metrics = EngineMetrics(EngineMetricFamilies(registry), ctx.served_model_name, rank)
    backend = DeepInferBackend(engine, hooks, ctx.role, DeepInferTypes(SamplingParams, SequenceStatus.RUNNING), e.max_model_len, metrics)

    def close() -> None:
        engine.close()
        if store is not None:
            store.close()

    return BackendGroup(ranks=[backend], unit_tokens=128, fingerprint=bridge.fingerprint if bridge else "", store=store, lockstep=True, close=close)

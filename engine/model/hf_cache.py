"""Export our per-sequence state to ``transformers``' ``DynamicCache`` and import it back.

This makes parity checkable across implementations: a prefix computed here continues in
``transformers`` (and the other way round) with the same logits. ``transformers`` is a test /
tooling dependency only, imported lazily.
"""

from __future__ import annotations

from typing import Any

from engine.model.model import DeepseekV4ForCausalLM
from engine.model.state import CompressorState, SequenceState

_BRANCHES = (("compressor", "comp"), ("indexer", "index"))


def to_dynamic_cache(model: DeepseekV4ForCausalLM, state: SequenceState, hf_config: Any) -> Any:
    """A batch-1 ``DynamicCache`` holding the same state as ``state``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_config)
    for layer, st in zip(cache.layers, state.layers):
        swa = st.swa[None, None]  # (1, 1, n, D)
        layer.dtype, layer.device = swa.dtype, swa.device
        layer.keys = swa.clone()
        layer.values = layer.keys
        layer.is_initialized = True
        layer.cumulative_length = state.num_tokens
        for name, attr in _BRANCHES:
            comp: CompressorState | None = getattr(st, attr)
            if comp is None or name not in getattr(layer, "compressed_kv", {}):
                continue
            layer.compressed_kv[name] = comp.rows[None].clone()
            layer.buffer_kv[name] = comp.buf_kv[None].clone()
            layer.buffer_gate[name] = comp.buf_gate[None].clone()
            layer.entry_count[name] = comp.rows.shape[0]
            if hasattr(layer, "overlap_kv"):
                layer.overlap_kv[name] = None if comp.overlap_kv is None else comp.overlap_kv[None].clone()
                layer.overlap_gate[name] = None if comp.overlap_gate is None else comp.overlap_gate[None].clone()
    return cache


def from_dynamic_cache(model: DeepseekV4ForCausalLM, cache: Any, token_ids: list[int]) -> SequenceState:
    """Our state for batch row 0 of ``cache``, which has consumed ``token_ids``."""
    state = model.new_state()
    state.num_tokens = len(token_ids)
    state.token_ids = list(token_ids)
    for layer, st in zip(cache.layers, state.layers):
        st.swa = layer.keys[0, 0].clone() if layer.is_initialized and layer.keys.numel() else st.swa
        for name, attr in _BRANCHES:
            comp: CompressorState | None = getattr(st, attr)
            if comp is None:
                continue
            if layer.compressed_kv.get(name) is not None:
                comp.rows = layer.compressed_kv[name][0].clone()
            if layer.buffer_kv.get(name) is not None:
                comp.buf_kv = layer.buffer_kv[name][0].clone()
                comp.buf_gate = layer.buffer_gate[name][0].clone()
            if hasattr(layer, "overlap_kv") and layer.overlap_kv.get(name) is not None:
                comp.overlap_kv = layer.overlap_kv[name][0].clone()
                comp.overlap_gate = layer.overlap_gate[name][0].clone()
    return state



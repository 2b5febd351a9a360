"""DeepInfer's KV cache byte layout for a V4.1 model, computed from our ``V41Config``.

This is the arithmetic of DeepInfer 0.1.0's ``worker/cache_engine.py`` (``KVCacheManager``,
``StateBlock``) and ``hugging_face/config.py`` (which layers are sources, where the YOCO
consumer layers begin), written out here so records can be checked and moved without CUDA.

**GPU block** (one per 128 tokens, ``KVSTORE_GRAIN``; every ratio divides it), for each main layer
in order that owns compressed KV (a KV-source layer, ratio r ∈ {1, 2}), two regions, each
padded to 32 bytes::

    ica  (128/r rows, Di/2 + Di/32 bytes)   FP4 indexer keys + UE8M0 scale per 32  (68 B at Di=128)
    ca   (128/r rows, 288 or 528 bytes)     main KV: FP4 (512 e2m1 + 32 e4m3 scales per 16) = 288,
                                            or MXFP8 (512 e4m3 + 16 UE8M0 per 32) = 528

then the whole block padded to lcm(128, ca row bytes). Layers that read a source's KV own nothing.
The byte counts here are at the released head_dim 512 / index_head_dim 128; every row format
scales with its width (``fp8_row_bytes``, ``fp4_row_bytes``), so tiny checkpoints get the same
layout in small.

**State slot** (one per sequence), from low to high address::

    stored SWA   layers [0, n_prefill_layer): ring × 528 B each (FP8 window rows), padded to 32
    dropped SWA  YOCO consumer layers [n_prefill_layer, n_layer) and the DFlash (MTP) layers
    compressor   fp32 state of the ratio > 1 source layers: (r + backtracking - 1) × 2 × 512 × 4 B

padded to lcm(32, 528). The slot's rings are the kvstore ring (window + backtracking, plus the
extra-state margin when ``DEEPINFER_PREFILL_STORE_EXTRA_STATE``); what is *persisted* (a snapshot,
``select_state_slice_to_store(TO_CE=False)``) is the stored SWA region in the inference ring size
(window + backtracking); what a prefill engine hands a decode engine (``TO_CE=True``) is every
region in inference sizes (``total_bytes_inference``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from engine.model.v41.config import V41Config

KVSTORE_GRAIN = 128  # DeepInfer persists KV only at multiples of this many tokens


def fp8_row_bytes(d: int) -> int:
    """A window (or MXFP8 main) KV row of ``d`` channels: e4m3 data + a UE8M0 scale per 32 (V41_FORMAT)."""
    return d + d // 32


def fp4_row_bytes(d: int, block: int) -> int:
    """An FP4 row of ``d`` channels: e2m1 pairs + a scale byte per ``block`` (main KV: 16, e4m3,
    V41_FP4_FORMAT; indexer keys: 32, UE8M0)."""
    return d // 2 + d // block


SWA_ROW_BYTES = fp8_row_bytes(512)  # 528 at the released head_dim
BLOCK_ALIGN = 128  # ModelMetadata.kvcache_align_to
YocoMode = Literal["off", "mask", "compact"]


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def _flag(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class DeepInferEnv:
    """The ``DEEPINFER_*`` settings the layout depends on (defaults as in DeepInfer's environ.py)."""

    use_nextn_decode: int = 5
    max_backtracking_tokens: int = 0  # DeepInfer raises it to use_nextn_decode + 1
    prefill_store_extra_state: bool = False
    prefill_store_extra_size: int = 128
    yoco_truncation_mode: YocoMode = "off"
    yoco_keep_tokens: int = 0

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> DeepInferEnv:
        mode = env.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "off")
        if mode not in ("off", "mask", "compact"):
            raise ValueError(f"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE must be off, mask or compact, not {mode!r}")
        return cls(
            use_nextn_decode=int(env.get("DEEPINFER_USE_NEXTN_DECODE", "5")),
            max_backtracking_tokens=int(env.get("DEEPINFER_MAX_BACKTRACKING_TOKENS", "0") or 0),
            prefill_store_extra_state=_flag(env.get("DEEPINFER_PREFILL_STORE_EXTRA_STATE")),
            prefill_store_extra_size=int(env.get("DEEPINFER_PREFILL_STORE_EXTRA_SIZE", "128")),
            yoco_truncation_mode=mode,  # type: ignore[arg-type]
            yoco_keep_tokens=int(env.get("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "0") or 0),
        )

    @property
    def backtracking(self) -> int:
        return max(self.max_backtracking_tokens, self.use_nextn_decode + 1)


@dataclass(frozen=True)
class BlockRegion:
    """One layer's rows inside a GPU block: ``rows`` × ``row_bytes`` at byte ``offset``."""

    layer: int
    name: Literal["ica", "ca"]
    offset: int
    rows: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def tensor_name(self) -> str:
        return f"L{self.layer}.{self.name}"


@dataclass(frozen=True)
class CacheLayout:
    """Where every byte of a DeepInfer V4.1 block and state slot is (see the module docstring)."""

    regions: tuple[BlockRegion, ...]
    block_bytes: int  # one GPU block, padded
    ca_row_bytes: int
    kv_format: Literal["fp4", "mxfp8"]  # the main (compressed) KV rows
    swa_row_bytes: int  # one FP8 window row
    n_prefill_layer: int
    swa_layers: int  # every runtime layer (main + DFlash) has a SWA ring
    swa_stored_layers: int
    ring_inference: int
    ring_kvstore: int
    compress_state_bytes: int
    state_slot_bytes: int  # one GPU state slot (kvstore ring sizes)
    state_size_to_disk: int  # a snapshot's stored windows
    total_bytes_inference: int  # the full decode-side state a prefill hands over

    @property
    def block_data_bytes(self) -> int:
        """Bytes of one block's rows without the trailing pad (what a block record holds)."""
        return sum(r.nbytes for r in self.regions)

    @property
    def swa_dropped_layers(self) -> int:
        return self.swa_layers - self.swa_stored_layers

    def fingerprint(self, model_fingerprint: str) -> str:
        """Key fingerprint: records are only interchangeable under the same layout."""
        return f"{model_fingerprint}-di-{self.kv_format}-w{self.ring_inference}-b{self.block_bytes}"


def n_prefill_layer(cfg: V41Config) -> int:
    """The first ratio-1 layer (DeepInfer's ``_n_prefill_layer``): the YOCO consumers start there."""
    return cfg.first_decoder_layer


def cache_layout(cfg: V41Config, env: DeepInferEnv = DeepInferEnv(), fp4_kv: bool = True) -> CacheLayout:
    """The layout DeepInfer allocates for ``cfg`` under ``env`` (``fp4_kv``: ``use_fp4_sparse_kv``)."""
    d = cfg.head_dim
    ca_row = fp4_row_bytes(d, 16) if fp4_kv else fp8_row_bytes(d)
    ica_row = fp4_row_bytes(cfg.index_head_dim, 32)
    swa_row = fp8_row_bytes(d)
    regions: list[BlockRegion] = []
    offset = 0
    for layer in sorted(cfg.kv_source_layer_ids):  # sources own both the indexer keys and the KV
        rows = KVSTORE_GRAIN // cfg.compress_ratios[layer]
        for name, row in (("ica", ica_row), ("ca", ca_row)):
            regions.append(BlockRegion(layer, name, offset, rows, row))  # type: ignore[arg-type]
            offset += _pad(rows * row, 32)
    block_bytes = _pad(offset, math.lcm(BLOCK_ALIGN, ca_row))

    first_consumer = n_prefill_layer(cfg)
    swa_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    stored = first_consumer
    ring_inf = cfg.sliding_window + env.backtracking
    extra = env.prefill_store_extra_size + (max(0, env.yoco_keep_tokens) if env.yoco_truncation_mode != "off" else 0)
    ring_kv = ring_inf + (extra if env.prefill_store_extra_state else 0)
    compress = 0
    for layer in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[layer]
        if r > 1:
            compress += (r + max(0, env.backtracking - 1)) * 2 * d * 4
    slot_align = math.lcm(32, swa_row)
    swa_kv = swa_layers * _pad(ring_kv * swa_row, 32)
    swa_inf = swa_layers * _pad(ring_inf * swa_row, 32)
    return CacheLayout(
        regions=tuple(regions),
        block_bytes=block_bytes,
        ca_row_bytes=ca_row,
        kv_format="fp4" if fp4_kv else "mxfp8",
        swa_row_bytes=swa_row,
        n_prefill_layer=first_consumer,
        swa_layers=swa_layers,
        swa_stored_layers=stored,
        ring_inference=ring_inf,
        ring_kvstore=ring_kv,
        compress_state_bytes=compress,
        state_slot_bytes=_pad(swa_kv + compress, slot_align),
        state_size_to_disk=stored * _pad(ring_inf * swa_row, 32),
        total_bytes_inference=_pad(swa_inf + compress, slot_align),
    )

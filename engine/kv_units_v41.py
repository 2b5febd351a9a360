"""DeepSeek-V4.1 KV-store units: a ``V41SequenceState`` ⇄ block and snapshot records.

Grain: 128 tokens (DeepInfer's ``KVSTORE_GRAIN``; every V4.1 ratio divides it). Rows are stored
in DeepInfer's byte layout (``engine.backends.deepinfer.layout``), encoded by ``row_codec``
(D = head_dim, Di = index_head_dim, r = a source's ratio, W = window, L = layers):

- **block** (unit ``i``): one GPU block's regions, for every KV-source layer ``l`` the rows of
  tokens ``[128i, 128(i+1))``: ``L{l}.ica`` ``(128/r, Di/2 + Di/32)`` FP4 indexer keys (zeros where
  the source runs no indexer) and ``L{l}.ca`` ``(128/r, D/2 + D/16)`` FP4 compressed KV (or
  ``(128/r, D + D/32)`` MXFP8 where the config's ``use_fp4_sparse_kv`` is false), uint8; the layers
  reading a source's KV own nothing.
- **snapshot** (after ``n = 128j`` tokens): ``windows`` ``(L, min(n, W-1), D + D/32)`` every layer's
  window ring as FP8 rows (all layers, so resume is exact; DeepInfer's own snapshot keeps only
  the layers before the first ratio-1 one and replays the rest), ``L{l}.buf_kv`` / ``L{l}.buf_gate``
  ``(< r, D)`` fp32, the open group of every ratio > 1 source (empty at 128-aligned ends), and
  ``engram`` ``(≤ N-1,)`` int64, the last compressed token ids; ``meta.tokens`` = n.

Blocks + the snapshot after them restore the state exactly. Blocks alone restore the sources'
rows and keys; the engine then replays the tokens from a unit boundary before them (the
compressors skip the tokens they hold rows for), which refills the windows (``replay_start``):
exact once every layer's window has been recomputed (``layers × (W-1)`` tokens back). Bounded
replay (opt-in, ``keep`` = DeepInfer's ``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``): the encoder
layers replay exactly as far as the decoder needs, the decoder layers (from the first ratio-1
layer) only the prefix's last ``keep`` tokens, their windows starting empty there (DeepInfer's
visibility rectangle); approximate, so such a state stores no snapshots (its blocks are exact:
the decoder's KV source reads the encoder's exact output).
The key fingerprint covers every layout switch: the architecture (``V41Config.fingerprint``:
window, ratios, KV/index sources, engram sizes), DeepInfer's layout (main KV format, ring, block
bytes), this module's ``FORMAT`` and row formats, the model dtype and, for engram checkpoints,
the tokenizer's compressed token map.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from engine.backends.deepinfer.layout import KVSTORE_GRAIN, cache_layout
from engine.model.v41.config import V41Config
from engine.model.v41.model import DeepseekV41ForCausalLM
from engine.model.v41.row_codec import FP4_INDEX, FP4_MAIN, FP8_WINDOW, MXFP8_MAIN, RowFormat, decode_rows, encode_rows
from engine.model.v41.state import V41SequenceState
from kvstore.record import Record

FORMAT = "v41u1"


def main_format(cfg: V41Config) -> RowFormat:
    """The compressed-KV row format ``cfg`` selects (``use_fp4_sparse_kv``)."""
    return FP4_MAIN if cfg.use_fp4_sparse_kv else MXFP8_MAIN


def unsupported(cfg: V41Config) -> str | None:
    """Why ``cfg``'s caches have no record format (None: they have one)."""
    if cfg.unit_tokens != KVSTORE_GRAIN:
        return f"V4.1 KV units need compress ratios dividing {KVSTORE_GRAIN}, got {sorted(set(cfg.compress_ratios))}"
    for name, d, fmt in (("head_dim", cfg.head_dim, FP8_WINDOW), ("head_dim", cfg.head_dim, main_format(cfg)), ("index_head_dim", cfg.index_head_dim, FP4_INDEX)):
        if not fmt.fits(d):
            return f"{name} {d} is not quantised in blocks of {fmt.block} (the model leaves it unquantised)"
    return None


class V41Units:
    """Builds and applies the V4.1 records of one model (see the module docstring);
    ``bounded_replay_tokens`` > 0: blocks-only resumes replay the decoder layers over that many
    tokens only (at least the window)."""

    unit = KVSTORE_GRAIN
    replays = True

    def __init__(self, model: DeepseekV41ForCausalLM, bounded_replay_tokens: int = 0) -> None:
        cfg = model.config
        problem = unsupported(cfg)
        if problem:
            raise ValueError(problem)
        if bounded_replay_tokens < 0:
            raise ValueError("bounded_replay_tokens must be >= 0 (0 = exact replay)")
        if bounded_replay_tokens and bounded_replay_tokens < cfg.sliding_window:
            raise ValueError(f"bounded_replay_tokens {bounded_replay_tokens} must cover the window ({cfg.sliding_window} tokens)")
        if bounded_replay_tokens and cfg.first_decoder_layer == cfg.num_hidden_layers:
            raise ValueError("bounded replay bounds the decoder (ratio-1) layers, and this model has none")
        self.model, self.cfg, self.keep = model, cfg, bounded_replay_tokens
        self.main = main_format(cfg)
        self.layout = cache_layout(cfg, fp4_kv=cfg.use_fp4_sparse_kv)  # the main KV format the model computes
        self.dtype_name = str(model.dtype).removeprefix("torch.")
        formats = "-".join(f"{f.block}{'e2m1' if f.fp4 else 'e4m3'}{'e4m3' if f.e4m3_scale else 'ue8m0'}" for f in (FP8_WINDOW, self.main, FP4_INDEX))
        parts = [self.layout.fingerprint(cfg.fingerprint()), FORMAT, formats, self.dtype_name]
        if model.hasher is not None:  # the hashes run over this tokenizer's compressed ids
            parts.append(hashlib.blake2b(model.hasher.token_map.numpy().tobytes(), digest_size=8).hexdigest())
        self.fingerprint = "-".join(parts)

    # ---- save -------------------------------------------------------------------------
    def block_tensors(self, state: V41SequenceState, unit_idx: int) -> dict[str, torch.Tensor]:
        """The block record of unit ``unit_idx`` (its rows must be complete in ``state``)."""
        out = {}
        for region in self.layout.regions:
            src = state.sources[region.layer]
            a = unit_idx * region.rows
            if region.name == "ca":
                out[region.tensor_name] = encode_rows(src.rows[a : a + region.rows], self.main)
            elif src.keys is not None:
                out[region.tensor_name] = encode_rows(src.keys[a : a + region.rows], FP4_INDEX)
            else:
                out[region.tensor_name] = torch.zeros(region.rows, region.row_bytes, dtype=torch.uint8)
            assert tuple(out[region.tensor_name].shape) == (region.rows, region.row_bytes), f"{region.tensor_name} off the layout"
        return out

    def snapshot_tensors(self, state: V41SequenceState) -> dict[str, torch.Tensor]:
        """The snapshot record of ``state`` (after a whole number of units)."""
        out = {"windows": torch.stack([encode_rows(w, FP8_WINDOW) for w in state.windows])}  # (L, ring, D + D/32)
        for layer, src in sorted(state.sources.items()):
            if self.cfg.compress_ratios[layer] > 1:
                out[f"L{layer}.buf_kv"], out[f"L{layer}.buf_gate"] = src.buf_kv.float().cpu(), src.buf_gate.float().cpu()
        out["engram"] = torch.tensor(state.engram, dtype=torch.long)
        return out

    def snapshot_meta(self, state: V41SequenceState) -> dict[str, int]:
        return {"tokens": state.num_tokens}

    def stores_snapshot(self, state: V41SequenceState) -> bool:
        """Whether ``state`` may be stored as a snapshot: not after a bounded replay (approximate)."""
        return state.decoder_from == 0

    # ---- replay -----------------------------------------------------------------------
    def replay_start(self, prefix: int) -> int:
        """First token to recompute when ``prefix`` tokens (whole units) resume from blocks alone,
        on a unit boundary so every compressor restarts on a group boundary. Exact: ``layers ×
        (W-1)`` back (layer ``l``'s window is exact once ``l+1`` windows of recomputed tokens
        passed through it). Bounded: the encoder layers' ``E × (W-1)`` before the ``keep``
        tokens the decoder replays, so the decoder's inputs are exact there."""
        cfg, w = self.cfg, self.cfg.sliding_window - 1
        back = cfg.first_decoder_layer * w + self.keep if self.keep else cfg.num_hidden_layers * w
        return max(0, prefix - back) // self.unit * self.unit

    # ---- restore ----------------------------------------------------------------------
    def apply(self, state: V41SequenceState, blocks: Sequence[Record], snap: Record | None, tokens: Sequence[int]) -> None:
        """Fill the fresh ``state`` from the blocks and the snapshot after ``tokens`` (``snap=None``:
        a replay from ``len(tokens)``, a unit boundary at or before the blocks' end: the sources
        get every block's rows, the windows start empty); ``ValueError`` on any record that does
        not fit (the caller treats it as a miss)."""
        n, cfg, dev, dtype = len(tokens), self.cfg, self.model.device, self.model.dtype
        if n % self.unit or len(blocks) * self.unit < n or (snap is not None and len(blocks) * self.unit != n):
            raise ValueError(f"blocks of {len(blocks) * self.unit} tokens cannot resume a prefix of {n}")
        if snap is not None:
            self._apply_snapshot(state, snap, n)
        elif self.keep and len(blocks) * self.unit - self.keep > n:
            state.decoder_from = len(blocks) * self.unit - self.keep
        for region in self.layout.regions:
            src = state.sources[region.layer]
            raws = [b.tensors[region.tensor_name] for b in blocks]
            if any(tuple(r.shape) != (region.rows, region.row_bytes) for r in raws):
                raise ValueError(f"block {region.tensor_name} does not fit the layout {(region.rows, region.row_bytes)}")
            raw = torch.cat(raws)
            if region.name == "ca":
                src.rows = decode_rows(raw, cfg.head_dim, self.main).to(dev, dtype)
            elif src.keys is not None:
                src.keys = decode_rows(raw, cfg.index_head_dim, FP4_INDEX).to(dev, dtype)
        if self.model.hasher is not None:
            history = self.model.hasher.history(list(tokens))
            if snap is not None and state.engram != history:
                raise ValueError("snapshot engram history does not match its tokens")
            state.engram = history
        state.num_tokens, state.token_ids = n, list(tokens)

    def _apply_snapshot(self, state: V41SequenceState, snap: Record, n: int) -> None:
        """The windows, open compressor groups and engram history of a snapshot after ``n`` tokens."""
        cfg, dev, dtype = self.cfg, self.model.device, self.model.dtype
        if snap.header.meta.get("tokens", n) != n:
            raise ValueError(f"snapshot of {snap.header.meta.get('tokens')} tokens for a prefix of {n}")
        windows = snap.tensors["windows"]
        ring = min(n, cfg.sliding_window - 1)
        if tuple(windows.shape) != (cfg.num_hidden_layers, ring, FP8_WINDOW.row_bytes(cfg.head_dim)):
            raise ValueError(f"snapshot windows {tuple(windows.shape)} do not fit this model")
        state.windows = [decode_rows(w, cfg.head_dim, FP8_WINDOW).to(dev, dtype) for w in windows]
        for layer, src in state.sources.items():
            if cfg.compress_ratios[layer] > 1:
                src.buf_kv = snap.tensors[f"L{layer}.buf_kv"].to(dev, torch.float32)
                src.buf_gate = snap.tensors[f"L{layer}.buf_gate"].to(dev, torch.float32)
        state.engram = snap.tensors["engram"].tolist()

    # ---- sizes (the connector's cost model) ----------------------------------------------
    @property
    def block_bytes(self) -> int:
        return self.layout.block_data_bytes

    @property
    def snapshot_bytes(self) -> int:
        cfg = self.cfg
        return cfg.num_hidden_layers * (cfg.sliding_window - 1) * FP8_WINDOW.row_bytes(cfg.head_dim)

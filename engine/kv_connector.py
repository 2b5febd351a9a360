"""Moves sequence state between an engine and the KV store, in cache units.

What a record holds is the model family's (``Units``: ``V4Units`` below for DeepSeek-V4,
``engine.kv_units_v41.V41Units`` for V4.1, DeepInfer's byte layout); keys, the save schedule,
lookup and the cost model are shared. V4 as the example:

Units are ``U = cfg.unit_tokens`` (128) tokens; unit ``i`` of a prompt is keyed by
``kvstore.keys.chain_keys`` (prefix-chained, so equal prefixes share keys). Two record kinds:

- **block** ``key_i``: for each compressing layer ``l`` the rows of tokens ``[iU, (i+1)U)``:
  ``L{l}.comp`` ``(U/r, D)`` and, for CSA, ``L{l}.index`` ``(U/4, Di)``, in the model dtype.
- **snapshot** ``snap(key_j)``: the boundary state after ``jU`` tokens: ``L{l}.swa`` ``(≤W-1, D)``,
  and for compressing layers ``L{l}.{comp,index}.{buf_kv,buf_gate,overlap_kv,overlap_gate}``
  (buffers are empty at aligned ends since every rate divides U; overlaps are ``(r, D)``).

Saved at the prompt's last whole unit (the scheduler ends a chunk there), and at every unit
boundary decode crosses (every ``snapshot_interval_units``, 0 = none; the last one is the output's end).
Restored from the longest run of present blocks that ends in a snapshot strictly before the last
prompt token (the engine must compute at least one token to sample), exactly. Without any
snapshot, blocks alone resume exactly by replaying ``layers × (W-1)`` tokens over the cached rows
(``Units.replay_start``), or approximately with V4.1's bounded replay when asked for
(``bounded_replay_tokens``; such a state stores blocks but no snapshots). A hit is taken only when
loading is predicted to be faster than recomputing: ``load = bytes / load_bw + units × latency``
versus ``recompute = tokens / prefill_tps``, both rates measured online (EMA).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence as Seq
from typing import Any, Protocol

import torch

from engine.model.model import DeepseekV4ForCausalLM
from engine.model.state import SequenceState
from engine.runtime.sequence import Sequence
from kvstore.keys import ROOT_KEY, chain_keys
from kvstore.record import Record, RecordHeader
from kvstore.store import TieredStore

log = logging.getLogger(__name__)

_COMP_FIELDS = ("buf_kv", "buf_gate", "overlap_kv", "overlap_gate")


def snapshot_key(unit_key: str) -> str:
    """Key of the boundary snapshot taken right after the unit keyed ``unit_key``."""
    return hashlib.blake2b(f"snapshot:{unit_key}".encode(), digest_size=16).hexdigest()


class Units(Protocol):
    """A model family's KV records: what a block and a snapshot hold, and how a state is rebuilt."""

    unit: int  # tokens per unit
    replays: bool  # whether blocks alone resume a state (by replaying tokens over them)
    fingerprint: str  # covers everything the records' layout depends on
    block_bytes: int
    snapshot_bytes: int

    def block_tensors(self, state: Any, unit_idx: int) -> dict[str, torch.Tensor]: ...

    def snapshot_tensors(self, state: Any) -> dict[str, torch.Tensor]: ...

    def snapshot_meta(self, state: Any) -> dict[str, int]: ...

    def apply(self, state: Any, blocks: Seq[Record], snap: Record | None, tokens: Seq[int]) -> None: ...

    def replay_start(self, prefix: int) -> int: ...

    def stores_snapshot(self, state: Any) -> bool: ...


class V4Units:
    """DeepSeek-V4's records (the module docstring): model-dtype rows and boundary buffers."""

    replays = True

    def __init__(self, model: DeepseekV4ForCausalLM) -> None:
        cfg = model.config
        self.model, self.unit = model, cfg.unit_tokens
        self.fingerprint = f"{cfg.fingerprint()}-{str(model.dtype).replace('torch.', '')}"
        self.rates = [cfg.layer_rate(i) for i in range(cfg.num_hidden_layers)]

    def apply(self, state: SequenceState, blocks: Seq[Record], snap: Record | None, tokens: Seq[int]) -> None:
        """Fill ``state`` from block records and the snapshot (``snap=None``: a replay from
        ``len(tokens)``, compressors keep the cached rows and skip the windows before them)."""
        dev, start = self.model.device, len(tokens)
        for li, layer in enumerate(state.layers):
            if snap is not None:
                layer.swa = snap.tensors[f"L{li}.swa"].to(dev)
            for part in ("comp", "index"):
                comp = getattr(layer, part)
                if comp is None:
                    continue
                comp.rows = torch.cat([b.tensors[f"L{li}.{part}"] for b in blocks]).to(dev)
                if snap is None:
                    comp.windows = start // self.rates[li]
                    continue
                comp.buf_kv = snap.tensors[f"L{li}.{part}.buf_kv"].to(dev)
                comp.buf_gate = snap.tensors[f"L{li}.{part}.buf_gate"].to(dev)
                if f"L{li}.{part}.overlap_kv" in snap.tensors:
                    comp.overlap_kv = snap.tensors[f"L{li}.{part}.overlap_kv"].to(dev)
                    comp.overlap_gate = snap.tensors[f"L{li}.{part}.overlap_gate"].to(dev)
        state.num_tokens = start
        state.token_ids = list(tokens)

    def block_tensors(self, state: SequenceState, unit_idx: int) -> dict[str, torch.Tensor]:
        out = {}
        for li, layer in enumerate(state.layers):
            rate = self.rates[li]
            if rate == 0:
                continue
            a, b = unit_idx * self.unit // rate, (unit_idx + 1) * self.unit // rate
            out[f"L{li}.comp"] = layer.comp.rows[a:b].cpu()
            if layer.index is not None:
                out[f"L{li}.index"] = layer.index.rows[a:b].cpu()
        return out

    def snapshot_tensors(self, state: SequenceState) -> dict[str, torch.Tensor]:
        out = {}
        for li, layer in enumerate(state.layers):
            out[f"L{li}.swa"] = layer.swa.cpu()
            for part in ("comp", "index"):
                comp = getattr(layer, part)
                if comp is None:
                    continue
                for name in _COMP_FIELDS:
                    t = getattr(comp, name)
                    if t is not None:
                        out[f"L{li}.{part}.{name}"] = t.cpu()
        return out

    def snapshot_meta(self, state: SequenceState) -> dict[str, int]:
        return {}

    def stores_snapshot(self, state: SequenceState) -> bool:
        return True

    def replay_start(self, prefix: int) -> int:
        """``layers × (W-1)`` tokens before ``prefix``, down to a unit boundary: layer ``l``'s
        window is exact once ``l+1`` windows of recomputed tokens have passed through it, and
        every compressor restarts on a window boundary."""
        cfg = self.model.config
        return max(0, prefix - cfg.num_hidden_layers * (cfg.sliding_window - 1)) // self.unit * self.unit

    @property
    def block_bytes(self) -> int:
        from engine.runtime.state_pool import state_bytes

        return state_bytes(self.model.config, self.model.dtype)[0]

    @property
    def snapshot_bytes(self) -> int:
        from engine.runtime.state_pool import state_bytes

        return state_bytes(self.model.config, self.model.dtype)[1]


def units_for(model: Any, bounded_replay_tokens: int = 0) -> Units:
    """The record builder of ``model``'s family (``bounded_replay_tokens``: V4.1 only)."""
    if isinstance(model, DeepseekV4ForCausalLM):
        if bounded_replay_tokens:
            raise ValueError("bounded replay bounds V4.1's decoder (ratio-1) layers; DeepSeek-V4 has none")
        return V4Units(model)
    from engine.kv_units_v41 import V41Units

    return V41Units(model, bounded_replay_tokens)


class KVConnector:
    """Saves and restores one engine's sequence state through a ``TieredStore``."""

    def __init__(
        self,
        store: TieredStore,
        model: DeepseekV4ForCausalLM,
        read: bool = True,
        write: bool = True,
        snapshot_interval_units: int = 1,
        metrics: object | None = None,
        bounded_replay_tokens: int = 0,
        dp_rank: int | None = None,
    ) -> None:
        """``dp_rank``: the engine's DP rank, named in the store's KV events for what it stores
        (None: the store's default rank). ``bounded_replay_tokens`` > 0: V4.1's bounded replay
        of blocks-only resumes (``engine.kv_units_v41``; approximate), 0: exact replay."""
        if snapshot_interval_units < 0:
            raise ValueError("snapshot_interval_units must be >= 0 (0 = no decode snapshots)")
        self.store = store
        self.read, self.write = read, write
        self.units = units_for(model, bounded_replay_tokens)
        self.unit = self.units.unit
        self.dtype_name = str(model.dtype).replace("torch.", "")
        self.fingerprint = self.units.fingerprint
        self.interval = snapshot_interval_units  # 0: snapshots at the prompt's last unit only
        self.dp_rank = dp_rank
        self.metrics = metrics
        # online cost model (EMA); conservative starting points
        self.prefill_tps = 2000.0  # tokens/s this engine prefills
        self.load_bw = 500e6  # bytes/s the store delivers
        self.load_latency = 0.0005  # s per record

    # ---- keys -------------------------------------------------------------------------
    def keys(self, tokens: list[int]) -> list[str]:
        return chain_keys(tokens, self.unit, self.fingerprint)

    def snapshot_stop(self, seq: Sequence) -> int | None:
        """Where the first prefill chunk should stop so the prompt's last whole unit is saved."""
        if not self.write:
            return None
        # the last whole unit strictly before the final token: an identical later prompt can
        # resume there and still has a token to compute (a unit ending exactly at the prompt's
        # end is saved too, when the prefill reaches it)
        end = ((len(seq.tokens) - 1) // self.unit) * self.unit
        return end if end > seq.num_computed else None

    # ---- restore ----------------------------------------------------------------------
    def restore(self, seq: Sequence, model: DeepseekV4ForCausalLM) -> None:
        if not self.read:
            return
        seq.kv_checked = True
        keys = self.keys(seq.tokens[: len(seq.tokens) - 1])  # leave >= 1 token to compute
        if self.metrics is not None:
            self.metrics.on_prefix_lookup(len(seq.tokens), 0)
        if not keys:
            return
        present = self.store.longest_prefix(keys)
        snap = next((j for j in range(present, 0, -1) if self.store.contains(snapshot_key(keys[j - 1]))), 0)
        if snap:
            self._restore_units(seq, model, keys, snap, snapshot=True)
        elif present and self.units.replays:
            self._restore_units(seq, model, keys, present, snapshot=False)

    def _restore_units(self, seq: Sequence, model: DeepseekV4ForCausalLM, keys: list[str], units: int, snapshot: bool) -> None:
        """Load ``units`` blocks (+ the snapshot after them, or set up a replay) into ``seq``."""
        start = units * self.unit if snapshot else self.units.replay_start(units * self.unit)
        if start == 0:
            return  # a replay from token 0 saves nothing
        est_bytes = units * self.units.block_bytes + (self.units.snapshot_bytes if snapshot else 0)
        load_s = est_bytes / self.load_bw + (units + 1) * self.load_latency
        if load_s >= start / self.prefill_tps:
            return  # recomputing is predicted to be faster: treat as a miss
        t0 = time.perf_counter()
        wanted = keys[:units] + ([snapshot_key(keys[units - 1])] if snapshot else [])
        records = self.store.get_many(wanted, dp_rank=self.dp_rank)
        if any(r is None for r in records):
            return  # evicted or corrupt in between: a miss, never a wrong state
        state = model.new_state()
        try:
            self.units.apply(state, records[:units], records[units] if snapshot else None, seq.tokens[:start])
        except (KeyError, RuntimeError, ValueError) as exc:
            log.warning("kv restore of %s failed (%s); recomputing", seq.request_id, exc)
            return
        nbytes = sum(r.nbytes for r in records)
        self.load_bw = 0.8 * self.load_bw + 0.2 * nbytes / max(time.perf_counter() - t0, 1e-6)
        seq.state = state
        seq.num_computed = start
        seq.num_cached = min(start, seq.num_prompt)
        seq.saved_upto = start
        if self.metrics is not None:
            self.metrics.on_prefix_lookup(0, seq.num_cached)

    # ---- save -------------------------------------------------------------------------
    def save_due(self, seq: Sequence) -> bool:
        """Whether ``save`` would store something now (``num_computed`` ends a unit to store)."""
        n = seq.num_computed
        if not self.write or n % self.unit or n == 0 or n <= seq.saved_upto:
            return False
        return n == seq.snapshot_at or (self.interval > 0 and not (n // self.unit) % self.interval)

    def save(self, seq: Sequence, model: DeepseekV4ForCausalLM) -> None:
        """Store every whole unit up to ``seq.num_computed`` not yet saved, with a snapshot at its
        end when ``num_computed`` sits exactly on a unit boundary (the only place it is exact)."""
        if seq.state is None or not self.save_due(seq):
            return
        n = seq.num_computed
        try:
            items = self._records(seq, n)
        except ValueError as exc:  # a row the record format cannot hold exactly: store nothing
            log.warning("kv save of %s skipped (%s)", seq.request_id, exc)
            return
        self.store.put_many(items, dp_rank=self.dp_rank)
        seq.saved_upto = n

    def _records(self, seq: Sequence, n: int) -> list[tuple[str, RecordHeader, dict[str, torch.Tensor]]]:
        """The block records of the units of ``seq.tokens[:n]`` not stored yet and the snapshot at
        ``n`` (none for a state the units do not store as one)."""
        keys = self.keys(seq.tokens[:n])
        items = []
        for i in range(seq.saved_upto // self.unit, len(keys)):
            if self.store.contains(keys[i]):
                continue
            header = RecordHeader("block", self.fingerprint, self.dtype_name, i * self.unit, (i + 1) * self.unit,
                                  parent=keys[i - 1] if i else ROOT_KEY, key=keys[i])  # fmt: skip
            items.append((keys[i], header, self.units.block_tensors(seq.state, i)))
        if not self.units.stores_snapshot(seq.state):
            return items  # an approximate state (bounded replay): its exact blocks only
        snap_header = RecordHeader("snapshot", self.fingerprint, self.dtype_name, 0, n, parent=keys[-1],
                                   meta=self.units.snapshot_meta(seq.state), key=snapshot_key(keys[-1]))  # fmt: skip
        items.append((snapshot_key(keys[-1]), snap_header, self.units.snapshot_tensors(seq.state)))
        return items

    # ---- cost model -------------------------------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Feed the recompute side of the cost model with a measured prefill step."""
        if tokens >= 16 and seconds > 0:
            self.prefill_tps = 0.8 * self.prefill_tps + 0.2 * tokens / seconds

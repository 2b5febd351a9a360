"""DeepInfer cache bytes ⇄ ``kvstore`` records (the V4.1 byte layout, ``layout.CacheLayout``).

Three records, every tensor ``uint8`` holding DeepInfer's bytes unchanged:

- **block** (key: the unit's chained key, ``kvstore.keys.chain_keys`` at 128 tokens): one GPU
  block's rows, per KV-source layer ``l``: ``L{l}.ica`` ``(128/r, 68)`` and ``L{l}.ca``
  ``(128/r, 288|528)``; the block's trailing pad is not stored.
- **snapshot** (key: ``snapshot_key(unit key)``, as the reference engine's): the stored windows
  after a 128-aligned prefix, ``swa`` ``(stored layers, ring, 528)`` — what
  ``select_state_slice_to_store(TO_CE=False)`` returns, in inference ring size.
- **hand-off** (a ``snapshot`` record with ``meta.handoff = 1``, key ``handoff_key``): what a
  PROMPT engine gives a COMPLETION engine for one request: ``state`` ``(total_bytes_inference,)``
  (``TO_CE=True``: stored and dropped windows, compressor state), ``blocks`` ``(n, block_bytes)``
  every block of the prompt in order (the partial last one too), ``meta.first_token``.
"""

from __future__ import annotations

import hashlib

import torch

from engine.backends.deepinfer.layout import CacheLayout
from kvstore.keys import ROOT_KEY
from kvstore.record import Record, RecordHeader


def handoff_key(fingerprint: str, request_id: str) -> str:
    """Key of a request's prefill→decode hand-off record."""
    return hashlib.blake2b(f"handoff:{fingerprint}:{request_id}".encode(), digest_size=16).hexdigest()


def block_tensors(layout: CacheLayout, block: torch.Tensor) -> dict[str, torch.Tensor]:
    """One GPU block's rows as named views: ``block`` ``(block_bytes,)`` uint8."""
    assert block.dtype == torch.uint8 and block.numel() == layout.block_bytes, "a block is (block_bytes,) uint8"
    return {r.tensor_name: block[r.offset : r.offset + r.nbytes].view(r.rows, r.row_bytes) for r in layout.regions}


def write_block(layout: CacheLayout, record: Record, block: torch.Tensor) -> None:
    """Copy a block record's rows into a GPU block ``(block_bytes,)`` (the reverse of ``block_tensors``)."""
    for r in layout.regions:
        rows = record.tensors[r.tensor_name]
        if tuple(rows.shape) != (r.rows, r.row_bytes):
            raise ValueError(f"block record {r.tensor_name} has shape {tuple(rows.shape)}, layout wants {(r.rows, r.row_bytes)}")
        block[r.offset : r.offset + r.nbytes].copy_(rows.reshape(-1))


def block_header(layout: CacheLayout, fingerprint: str, unit: int, key: str, parent: str) -> RecordHeader:
    start = unit * 128
    return RecordHeader("block", fingerprint, f"deepinfer-{layout.kv_format}", start, start + 128, parent=parent, key=key)


def snapshot_tensors(layout: CacheLayout, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stored windows ``(state_size_to_disk,)`` uint8 as ``swa`` ``(layers, ring, 528)``."""
    assert windows.numel() == layout.state_size_to_disk, f"stored windows are {layout.state_size_to_disk} bytes, got {windows.numel()}"
    per_layer = layout.state_size_to_disk // max(layout.swa_stored_layers, 1)
    rows = windows.view(layout.swa_stored_layers, per_layer)[:, : layout.ring_inference * layout.swa_row_bytes]
    return {"swa": rows.reshape(layout.swa_stored_layers, layout.ring_inference, layout.swa_row_bytes)}


def snapshot_windows(layout: CacheLayout, record: Record) -> torch.Tensor:
    """A snapshot record's windows back as the ``(state_size_to_disk,)`` buffer DeepInfer loads."""
    swa = record.tensors["swa"]
    if tuple(swa.shape) != (layout.swa_stored_layers, layout.ring_inference, layout.swa_row_bytes):
        raise ValueError(f"snapshot swa has shape {tuple(swa.shape)}, layout wants {(layout.swa_stored_layers, layout.ring_inference, layout.swa_row_bytes)}")
    per_layer = layout.state_size_to_disk // max(layout.swa_stored_layers, 1)
    out = torch.zeros(layout.swa_stored_layers, per_layer, dtype=torch.uint8)
    out[:, : layout.ring_inference * layout.swa_row_bytes] = swa.reshape(layout.swa_stored_layers, -1)
    return out.view(-1)


def snapshot_header(layout: CacheLayout, fingerprint: str, end: int, key: str, parent: str) -> RecordHeader:
    return RecordHeader("snapshot", fingerprint, f"deepinfer-{layout.kv_format}", 0, end, parent=parent, key=key)


def handoff_record(
    layout: CacheLayout, fingerprint: str, key: str, num_tokens: int, first_token: int, state: torch.Tensor, blocks: torch.Tensor
) -> tuple[RecordHeader, dict[str, torch.Tensor]]:
    """Header and tensors of a hand-off: ``state`` ``(total_bytes_inference,)``, ``blocks`` ``(n, block_bytes)``."""
    assert state.numel() == layout.total_bytes_inference, f"decode-side state is {layout.total_bytes_inference} bytes, got {state.numel()}"
    assert blocks.dim() == 2 and blocks.shape[1] == layout.block_bytes, "blocks are (n, block_bytes)"
    assert blocks.shape[0] == -(-num_tokens // 128), f"{num_tokens} tokens need {-(-num_tokens // 128)} blocks, got {blocks.shape[0]}"
    meta = {"handoff": 1, "first_token": int(first_token), "blocks": int(blocks.shape[0])}
    header = RecordHeader("snapshot", fingerprint, f"deepinfer-{layout.kv_format}", 0, num_tokens, parent=ROOT_KEY, key=key, meta=meta)
    return header, {"state": state.reshape(-1), "blocks": blocks}

"""DeepInfer's V4.1 KV byte layout (engine/backends/deepinfer/layout.py) against the arithmetic of
DeepInfer 0.1.0's worker/cache_engine.py for the released Flash config (40 layers: 0-1 sliding,
2-19 ratio 2, 20-39 ratio 1; KV sources 2, 8, 14, 20; 3 MTP layers; window 128), and the records
built from it (records.py)."""

from __future__ import annotations

import torch

from engine.backends.deepinfer.layout import DeepInferEnv, cache_layout
from engine.backends.deepinfer.records import (
    block_header,
    block_tensors,
    handoff_key,
    handoff_record,
    snapshot_header,
    snapshot_tensors,
    snapshot_windows,
    write_block,
)
from engine.model.v41.config import V41Config
from kvstore.record import decode_record, encode_record

FLASH = V41Config()


def test_row_formats_are_cache_commons() -> None:
    layout = cache_layout(FLASH)
    # V41_FP4_FORMAT: 512 e2m1 (256 B) + 512/16 e4m3 scales = 288; FP4 indexer: 128/2 + 128/32 = 68
    assert {(r.name, r.row_bytes) for r in layout.regions} == {("ica", 68), ("ca", 288)}
    # V41_FORMAT (MXFP8): 512 e4m3 + 512/32 UE8M0 = 528
    assert {r.row_bytes for r in cache_layout(FLASH, fp4_kv=False).regions if r.name == "ca"} == {528}


def test_flash_block_is_890_bytes_per_token() -> None:
    layout = cache_layout(FLASH)
    assert [(r.layer, r.name, r.rows) for r in layout.regions] == [
        (2, "ica", 64), (2, "ca", 64), (8, "ica", 64), (8, "ca", 64),
        (14, "ica", 64), (14, "ca", 64), (20, "ica", 128), (20, "ca", 128),
    ]  # fmt: skip
    ratio2 = 64 * 68 + 64 * 288  # 4352 + 18432, both already 32-aligned
    ratio1 = 128 * 68 + 128 * 288
    assert layout.block_data_bytes == 3 * ratio2 + ratio1 == 113920 == 890 * 128
    assert layout.regions[1].offset == 4352 and layout.regions[2].offset == ratio2
    assert layout.block_bytes == 99 * 1152 == 114048  # padded to lcm(128, 288)
    assert cache_layout(FLASH, fp4_kv=False).block_bytes == 46 * 4224  # lcm(128, 528) = 4224


def test_flash_state_slot() -> None:
    layout = cache_layout(FLASH)  # environ.py defaults: nextn 5, so backtracking 6
    assert layout.n_prefill_layer == 20  # the first ratio-1 layer: YOCO consumers from there
    assert (layout.swa_layers, layout.swa_stored_layers) == (43, 20)  # 40 main + 3 MTP; 0..19 stored
    assert layout.ring_inference == layout.ring_kvstore == 128 + 6
    assert layout.state_size_to_disk == 20 * 134 * 528 == 1415040  # 70752 B per layer, 32-aligned
    assert layout.compress_state_bytes == 3 * (2 + 6 - 1) * 2 * 512 * 4  # ratio-2 sources' fp32 state
    # every SWA ring + compressor state, padded to lcm(32, 528) = 1056
    assert layout.total_bytes_inference == layout.state_slot_bytes == 2963 * 1056
    assert 2962 * 1056 < 43 * 70752 + 86016 <= 2963 * 1056


def test_extra_state_widens_the_kvstore_ring_only() -> None:
    env = DeepInferEnv(prefill_store_extra_state=True, yoco_truncation_mode="compact", yoco_keep_tokens=140)
    layout = cache_layout(FLASH, env)
    assert layout.ring_kvstore == 134 + 128 + 140 and layout.ring_inference == 134
    assert layout.state_slot_bytes == 8725 * 1056  # 43 * 402 * 528 + 86016, padded
    assert layout.state_size_to_disk == 1415040 and layout.total_bytes_inference == 2963 * 1056
    assert layout.fingerprint("m") == cache_layout(FLASH).fingerprint("m")  # records interchange


def test_the_environment_is_read_like_deepinfers() -> None:
    env = DeepInferEnv.from_environ({"DEEPINFER_USE_NEXTN_DECODE": "0", "DEEPINFER_PREFILL_STORE_EXTRA_STATE": "1", "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "140"})
    assert (env.backtracking, env.prefill_store_extra_state, env.yoco_keep_tokens) == (1, True, 140)
    assert DeepInferEnv.from_environ({"DEEPINFER_MAX_BACKTRACKING_TOKENS": "9"}).backtracking == 9


def test_block_and_snapshot_records_round_trip_through_the_record_format() -> None:
    layout = cache_layout(FLASH)
    gen = torch.Generator().manual_seed(0)
    block = torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8, generator=gen)
    tensors = block_tensors(layout, block)
    assert tensors["L20.ca"].shape == (128, 288) and tensors["L2.ica"].shape == (64, 68)
    record = decode_record(encode_record(block_header(layout, "fp", 3, "k3", "k2"), tensors))
    assert (record.header.kind, record.header.token_start, record.header.token_end) == ("block", 384, 512)
    back = torch.zeros_like(block)
    write_block(layout, record, back)
    data = torch.zeros_like(block, dtype=torch.bool)
    for r in layout.regions:
        data[r.offset : r.offset + r.nbytes] = True
    assert torch.equal(back[data], block[data]) and not back[~data].any()  # rows moved, pad not stored
    windows = torch.randint(0, 256, (layout.state_size_to_disk,), dtype=torch.uint8, generator=gen)
    snap = snapshot_tensors(layout, windows)
    assert snap["swa"].shape == (20, 134, 528)
    assert torch.equal(snapshot_windows(layout, decode_record(encode_record(snapshot_header(layout, "fp", 256, "s", "k"), snap))), windows)


def test_a_handoff_record_holds_state_blocks_and_first_token() -> None:
    layout = cache_layout(FLASH)
    state = torch.ones(layout.total_bytes_inference, dtype=torch.uint8)
    blocks = torch.zeros(3, layout.block_bytes, dtype=torch.uint8)
    key = handoff_key("fp", "req-1")
    header, tensors = handoff_record(layout, "fp", key, 300, 42, state, blocks)
    assert header.meta == {"handoff": 1, "first_token": 42, "blocks": 3} and header.token_end == 300 and header.key == key
    assert key != handoff_key("fp", "req-2") and key != handoff_key("fp2", "req-1")
    assert set(tensors) == {"state", "blocks"}

"""``bench.v41_slice_bench``'s decode variants: option strings → ``V41SlotTuning`` (issue 22's sweeps)."""

from __future__ import annotations

from bench.v41_slice_bench import parse_variants, prefill_tuning, slot_tuning
from engine.model.v41.slot_decode import V41SlotTuning


def test_options_set_only_the_fields_they_name() -> None:
    dflt = V41SlotTuning()
    assert slot_tuning({}) == dflt
    (name, kv), (name2, kv2) = parse_variants("wide:attn=16x64x8,hcs=32;cuda:dgemv=0,pdl=0,gemv=64")
    t = slot_tuning(kv)
    assert name == "wide" and (t.attention.block_h, t.attention.block_n, t.attention.num_warps) == (16, 64, 8)
    assert (t.attention.fill, t.attention.max_splits, t.hc_splits) == (dflt.attention.fill, dflt.attention.max_splits, 32)
    assert t.moe_gemv == dflt.moe_gemv and t.dense_gemv == dflt.dense_gemv
    t2 = slot_tuning(kv2)
    assert name2 == "cuda" and not t2.dense_gemv and not t2.gemv_pdl and t2.moe_gemv.max_slots == 64 and t2.attention == dflt.attention
    full = slot_tuning({"attn": "32x16x2x2.5x8"})
    assert (full.attention.block_h, full.attention.block_n, full.attention.num_warps, full.attention.fill, full.attention.max_splits) == (32, 16, 2, 2.5, 8)


def test_expert_gemv_sites_and_prefill_gemm_options() -> None:
    """``up=``/``down=`` set the expert GEMV configs, ``fuse=0`` the unfused mHC sites, ``side=0`` no side stream; a prefill
    variant's ``up=``/``down=`` the fast path's grouped GEMM configs (``torch``: ``_grouped_mm``), ``attn=`` its attention launch."""
    from engine.model.v41.attention import V41_TUNING

    t = slot_tuning({"down": "4x1024x4", "fuse": "0", "side": "0"})
    assert t.moe_gemv.down == (4, 1024, 4) and t.moe_gemv.up is None and not t.fuse_sites and not t.side_stream
    assert slot_tuning({}).fuse_sites and slot_tuning({}).side_stream
    assert prefill_tuning({"up": "128.128.64.8.3"}, V41_TUNING).expert_gemm == ((128, 128, 64, 8, 3), None)
    assert prefill_tuning({"down": "torch"}, V41_TUNING).expert_gemm == (None, None)  # the torch GEMMs, on any device
    attn = prefill_tuning({"attn": "64.32.8.2"}, V41_TUNING)
    assert attn.expert_gemm == V41_TUNING.expert_gemm and (attn.attention.block_h, attn.attention.block_n, attn.attention.num_warps, attn.attention.num_stages) == (64, 32, 8, 2)

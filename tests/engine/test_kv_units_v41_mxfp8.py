"""DeepSeek-V4.1 with MXFP8 compressed KV: a fixture checkpoint copied with DeepInfer's config
switch ``use_fp4_sparse_kv: false``. The model rounds its compressed rows with the window's
quantiser (e4m3 per 32 channels, UE8M0 scales: DeepInfer's ``V41_FORMAT`` holds both), so the
switch changes the model's numbers; block records hold those rows as DeepInfer's MXFP8 rows
(``D + D/32`` bytes, 528 at D = 512); the fingerprint differs from the FP4 checkpoint's; a prefix
resumes exactly, from a snapshot and from blocks alone.

What is not verified here: the ``transformers`` reference has no such switch (it always rounds
the compressed KV to FP4), so no reference numbers exist for an MXFP8 checkpoint; the rounding is
the window quantiser that the FP4 fixtures already hold to the reference."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from deepserve.protocol import GenerateRequest
from engine.backends.deepinfer.layout import cache_layout
from engine.kv_connector import snapshot_key
from engine.kv_units_v41 import V41Units
from engine.model.v41.loader import load_v41_model
from engine.model.v41.quant import fp8_window
from engine.model.v41.row_codec import FP4_MAIN, MXFP8_MAIN, encode_rows
from engine.runtime.sequence import Sequence
from tests.engine.model.v41.conftest import CASES, fixture_case
from tests.engine.test_kv_units_v41 import _assert_same, _engine, _prompt, _run, _store, _stored

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> tuple[str, object, object, dict]:
    """(MXFP8 checkpoint dir, its model, the FP4 original's model, reference.json)."""
    ckpt, ref = fixture_case(request.param)
    dst = tmp_path_factory.mktemp(f"mxfp8-{request.param}")
    for f in ckpt.iterdir():
        shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["use_fp4_sparse_kv"] = False
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst), load_v41_model(dst, dtype="float32"), load_v41_model(ckpt, dtype="float32"), ref


def test_the_switch_rounds_the_compressed_kv_to_mxfp8(case) -> None:
    """Every source's rows are MXFP8 values (the window quantiser leaves them as they are), not
    FP4 ones, and the logits move away from the FP4 checkpoint's."""
    _, model, fp4, ref = case
    assert not model.config.use_fp4_sparse_kv and fp4.config.use_fp4_sparse_kv
    prompt = _prompt(ref, 200, 11)
    st, st4 = model.new_state(), fp4.new_state()
    logits, logits4 = model([(st, prompt)]), fp4([(st4, prompt)])
    for src in st.sources.values():
        assert torch.equal(fp8_window(src.rows), src.rows)
        encode_rows(src.rows, MXFP8_MAIN)  # exact MXFP8 bytes (raises otherwise)
        with pytest.raises(ValueError, match="grid"):
            encode_rows(src.rows, FP4_MAIN)
    assert (logits - logits4).abs().max() > 1e-3


def test_records_hold_mxfp8_rows_under_their_own_fingerprint(case) -> None:
    """The blocks' ``ca`` regions are ``D + D/32``-byte MXFP8 rows (DeepInfer's layout with
    ``use_fp4_sparse_kv`` false), and no key is shared with the FP4 checkpoint."""
    _, model, fp4, ref = case
    cfg = model.config
    prompt = _prompt(ref, 260, 12)
    conn = _stored(model, prompt)
    layout = cache_layout(cfg, fp4_kv=False)
    assert layout.kv_format == "mxfp8" and layout.ca_row_bytes == cfg.head_dim + cfg.head_dim // 32
    block = conn.store.get(conn.keys(prompt[:256])[0])
    want = {r.tensor_name: (r.rows, r.row_bytes) for r in layout.regions}
    assert {n: tuple(t.shape) for n, t in block.tensors.items()} == want
    assert V41Units(model).fingerprint != V41Units(fp4).fingerprint
    assert conn.keys(prompt[:256]) != _stored(fp4, prompt).keys(prompt[:256])
    assert cache_layout(replace(cfg, head_dim=512), fp4_kv=False).ca_row_bytes == 528  # the released width


def test_a_prefix_resumes_exactly(case) -> None:
    """Through the engine: from the prompt's snapshot, and from its blocks alone (exact replay),
    the cold run's tokens and logprobs."""
    ckpt, model, _, ref = case
    first = _prompt(ref, 300, 13)
    engine = _engine(ckpt, model, _store())
    out1 = _run(engine, "a", first)
    second = first + out1[0] + _prompt(ref, 70, 14)
    got = _run(engine, "b", second)
    assert got[2] == 256
    _assert_same(got, _run(_engine(ckpt, model, _store()), "cold", second))
    assert engine.kv.store.remove(snapshot_key(engine.kv.keys(first[:256])[-1]))
    third = first[:256] + _prompt(ref, 40, 15)
    seq = Sequence(request=GenerateRequest("q", third), sampling=None, tokens=list(third), num_prompt=len(third))  # type: ignore[arg-type]
    engine.kv.restore(seq, model)
    assert seq.num_computed == 128 and seq.state.sources  # blocks only: a replay of the last unit
    got = _run(engine, "c", third)
    assert got[2] == 128
    _assert_same(got, _run(_engine(ckpt, model, _store()), "cold", third))

"""The model core's fast paths against its general path (fp32, CPU): same logits, same states.

- batched decode attention (``decode.py``) vs the per-sequence path, on sequences in every
  situation at once: fresh, shorter than the window, mid-window, closing CSA/HCA windows, with
  prefill chunks in the same batch, and in kv-replay mode (which must fall back);
- the indexer's grouped top-k on exact score ties vs ``Indexer.topk_rows``;
- the transposed Sinkhorn vs its plain formula (bitwise);
- ``PackedLinear`` (the oneDNN lm_head) vs ``F.linear``.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine.model.attention import SeqSlice
from engine.model.decode import _indexer_rows, decode_eligible
from engine.model.layers import PackedLinear
from kernels.reference import sinkhorn
from engine.model.loader import load_model
from engine.model.state import SequenceState

TOL = 1e-5
# prompt lengths around every boundary of both presets (W=128/16, CSA r=4, HCA r=128/8)
LENGTHS = [0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 127, 128, 129, 255, 256, 300]


@pytest.fixture(scope="module", params=["tiny_model_dir", "small_windows_model_dir"])
def model(request: pytest.FixtureRequest):
    return load_model(request.getfixturevalue(request.param), dtype="float32", progress=False)


def _ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(2, 129280) for _ in range(n)]


def _prefilled(model, lengths: list[int], seed: int) -> list[SequenceState]:
    rng = random.Random(seed)
    states = [model.new_state() for _ in lengths]
    model.set_fast_paths(False)
    chunks = [(st, _ids(n, rng)) for st, n in zip(states, lengths) if n]
    model(chunks)
    return states


def _run(model, states: list[SequenceState], steps: list[list[list[int]]], fast: bool) -> list[torch.Tensor]:
    model.set_fast_paths(fast)
    try:
        return [model(list(zip(states, step))) for step in steps]
    finally:
        model.set_fast_paths(True)


def _assert_states_close(a: list[SequenceState], b: list[SequenceState]) -> None:
    for sa, sb in zip(a, b):
        assert sa.num_tokens == sb.num_tokens and sa.token_ids == sb.token_ids
        for la, lb in zip(sa.layers, sb.layers):
            pairs = [(la.swa, lb.swa)]
            for ca, cb in ((la.comp, lb.comp), (la.index, lb.index)):
                if ca is None:
                    continue
                assert ca.windows == cb.windows
                pairs += [(ca.rows, cb.rows), (ca.buf_kv, cb.buf_kv), (ca.buf_gate, cb.buf_gate)]
                assert (ca.overlap_kv is None) == (cb.overlap_kv is None)
                if ca.overlap_kv is not None:
                    pairs += [(ca.overlap_kv, cb.overlap_kv), (ca.overlap_gate, cb.overlap_gate)]
            for x, y in pairs:
                assert x.shape == y.shape
                assert x.numel() == 0 or (x - y).abs().max().item() <= TOL


def test_decode_batch_matches_general_path(model) -> None:
    """140 decode steps of 17 sequences at every kind of position (crossing window, CSA and HCA
    boundaries), batched vs one by one: logits and every state tensor agree."""
    base = _prefilled(model, LENGTHS, seed=1)
    rng = random.Random(2)
    steps = [[_ids(1, rng) for _ in LENGTHS] for _ in range(140)]
    general = [s.clone() for s in base]
    fast = [s.clone() for s in base]
    want = _run(model, general, steps, fast=False)
    got = _run(model, fast, steps, fast=True)
    worst = max((a - b).abs().max().item() for a, b in zip(want, got))
    assert worst <= TOL, worst
    _assert_states_close(general, fast)


def test_decode_batch_mixed_with_prefill_chunks(model) -> None:
    """Decode tokens batched while other sequences of the same step feed multi-token chunks."""
    base = _prefilled(model, [0, 9, 130, 40, 200, 6], seed=3)
    rng = random.Random(4)
    steps = []
    for t in range(24):
        step = [_ids(1, rng) for _ in base]
        step[t % len(base)] = _ids(1 + (7 * t) % 11, rng)  # one sequence prefills a chunk
        steps.append(step)
    general = [s.clone() for s in base]
    fast = [s.clone() for s in base]
    want = _run(model, general, steps, fast=False)
    got = _run(model, fast, steps, fast=True)
    assert max((a - b).abs().max().item() for a, b in zip(want, got)) <= TOL
    _assert_states_close(general, fast)


def test_replay_mode_falls_back(model) -> None:
    """A compressor replaying over cached rows (``windows`` set) is not decode-eligible."""
    st = _prefilled(model, [40], seed=5)[0]
    for li, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        s = SeqSlice(st.layers[li], 0, 1, st.num_tokens)
        assert decode_eligible(attn, s)
        if st.layers[li].comp is not None:
            st.layers[li].comp.windows = 0
            assert not decode_eligible(attn, s)
            st.layers[li].comp.windows = None
        assert not decode_eligible(attn, SeqSlice(st.layers[li], 0, 2, st.num_tokens))


def test_indexer_groups_break_ties_like_topk_rows(tiny_model_dir) -> None:
    """Exact score ties (all-zero indexer rows) at several row counts: the batched selection picks
    the very rows ``topk_rows`` picks for each sequence alone."""
    model = load_model(tiny_model_dir, dtype="float32", progress=False)
    attn = next(layer.self_attn for layer in model.model.layers if layer.self_attn.indexer is not None)
    idx, r = attn.indexer, attn.compressor.rate
    g = torch.Generator().manual_seed(6)
    seqs, qs, ws, want = [], [], [], []
    for n_rows in (3, 16, 17, 40, 40, 90):
        st = attn.empty_state(torch.float32, torch.device("cpu"))
        st.index.rows = torch.zeros(n_rows, idx.width)
        st.index.rows[: n_rows // 3] = torch.randn(n_rows // 3, idx.width, generator=g)  # some non-ties
        st.comp.rows = torch.randn(n_rows, attn.head_dim, generator=g)
        pos = n_rows * r - 1  # the token that closed the last window
        seqs.append(SeqSlice(st, 0, 1, pos))
        q = torch.randn(1, idx.n_heads, idx.width, generator=g)
        w = torch.randn(1, idx.n_heads, generator=g)
        top, valid = idx.topk_rows(q, w, st.index.rows, torch.tensor([pos]))
        assert bool(valid.all())
        want.append(st.comp.rows[top[0]])
        qs.append(q)
        ws.append(w)
    picked, bias = _indexer_rows(idx, seqs, torch.cat(qs), torch.cat(ws), torch.float32)
    for i, rows in enumerate(want):
        k = rows.shape[0]
        assert torch.equal(picked[i, :k], rows)
        if bias is not None:
            assert bool((bias[i, k:] == float("-inf")).all()) and bool((bias[i, :k] == 0).all())


@pytest.mark.parametrize("n", [1, 3, 32, 2048])
def test_sinkhorn_matches_plain_formula(n: int) -> None:
    eps, iters = 1e-6, 20
    comb = torch.softmax(3 * torch.randn(n, 4, 4, generator=torch.Generator().manual_seed(n)), dim=-1) + eps
    want = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        want = want / (want.sum(dim=-1, keepdim=True) + eps)
        want = want / (want.sum(dim=-2, keepdim=True) + eps)
    assert torch.equal(sinkhorn(comb, iters, eps), want)


def test_packed_linear_matches_linear() -> None:
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(128, 5000, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(5000, 128, generator=g) * 0.05)
    packed = PackedLinear(lin)
    for rows in (1, 2, 5, 32, 70):
        x = torch.randn(rows, 128, generator=g)
        assert (packed(x) - F.linear(x, lin.weight)).abs().max().item() <= TOL
    with torch.no_grad():  # a new weight (a reload) is packed again
        lin.weight.mul_(2)
    x = torch.randn(8, 128, generator=g)
    assert (packed(x) - F.linear(x, lin.weight)).abs().max().item() <= TOL

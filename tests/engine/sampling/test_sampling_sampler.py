"""Sampler: greedy, truncation support, penalties, seeds, logprobs, stop rule (CPU, no grammar)."""

from __future__ import annotations

import math

import pytest
import torch

from deepserve.protocol import SamplingParams
from engine.sampling import Sampler, SamplerConfig, SamplingState, check_finish, request_uniform
from engine.sampling.penalties import apply_penalties

V = 512  # small vocabulary: the statistics need thousands of rows per call
EOS = 7
NEG = -30.0  # "everything else": present, but too unlikely to be drawn in these tests


def sampler(**kw) -> Sampler:
    return Sampler(SamplerConfig(kw.pop("vocab_size", V), kw.pop("eos", (EOS,)), seed=0, **kw))


def peaked_logits(n_rows: int, head: list[float]) -> torch.Tensor:
    """(n_rows, V): tokens 100.. get ``head`` logits, the rest NEG."""
    row = torch.full((V,), NEG)
    row[100 : 100 + len(head)] = torch.tensor(head)
    return row.expand(n_rows, V).clone()


def draw_many(p: SamplingParams, head: list[float], n: int = 4000) -> torch.Tensor:
    """Tokens of n single-step requests with seeds 0..n-1, sampled in one batch."""
    s = sampler()
    states = [s.new_state(SamplingParams(**{**p.__dict__, "seed": i}), [1, 2]) for i in range(n)]
    return s.sample(peaked_logits(n, head), states).token_ids


# -- greedy ---------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    s = sampler()
    logits = torch.randn(16, V, generator=torch.Generator().manual_seed(0))
    states = [s.new_state(SamplingParams(temperature=0.0), [1]) for _ in range(16)]
    out = s.sample(logits.clone(), states)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert all(st.step == 1 for st in states)


def test_tiny_temperature_is_greedy():
    s = sampler()
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    states = [s.new_state(SamplingParams(temperature=1e-7, seed=i), [1]) for i in range(4)]
    assert torch.equal(s.sample(logits.clone(), states).token_ids, logits.argmax(-1))


# -- truncation: the kept support, and frequencies inside it --------------------------------------

HEAD = [2.0, 1.5, 1.0, 0.5, 0.0]  # softmax: .40 .24 .15 .09 .05 (+ rest)


def head_probs(head: list[float], temperature: float = 1.0) -> torch.Tensor:
    return torch.softmax(torch.tensor(head) / temperature, 0)


def assert_support(tokens: torch.Tensor, kept: int, probs: torch.Tensor | None = None):
    """Exactly tokens 100..100+kept-1 occur; with probs, their frequencies match (5 sigma)."""
    counts = torch.bincount(tokens, minlength=V)
    assert set(counts.nonzero().flatten().tolist()) == set(range(100, 100 + kept))
    if probs is not None:
        n = tokens.numel()
        p = probs[:kept] / probs[:kept].sum()
        freq = counts[100 : 100 + kept].double() / n
        sigma = (p * (1 - p) / n).sqrt()
        assert ((freq - p).abs() <= 5 * sigma + 1e-9).all(), (freq, p)


def test_plain_temperature_frequencies():
    tokens = draw_many(SamplingParams(temperature=0.7), HEAD)
    assert_support(tokens, 5, head_probs(HEAD, 0.7))


def test_top_k_keeps_k_best():
    tokens = draw_many(SamplingParams(top_k=3), HEAD)
    assert_support(tokens, 3, head_probs(HEAD))


def test_top_p_keeps_smallest_prefix_reaching_p():
    # cumulative: .40 .64 .79 .88 .93 -> top_p .7 keeps three tokens
    tokens = draw_many(SamplingParams(top_p=0.7), HEAD)
    assert_support(tokens, 3, head_probs(HEAD))


def test_top_p_renormalises_after_top_k():
    # inside the top 4 (mass .88): .45 .27 .17 -> .72 after two tokens: top_p .7 keeps two
    tokens = draw_many(SamplingParams(top_k=4, top_p=0.7), HEAD)
    assert_support(tokens, 2, head_probs(HEAD))


def test_min_p_relative_to_top_token():
    # p / p_max: 1, .61, .37, .22, .14 -> min_p .3 keeps three
    tokens = draw_many(SamplingParams(min_p=0.3), HEAD)
    assert_support(tokens, 3, head_probs(HEAD))


def test_top_p_falls_back_to_full_sort_for_wide_nuclei():
    s = Sampler(SamplerConfig(V, (EOS,), seed=0, top_p_candidates=8))
    logits = torch.zeros(1, V)  # uniform: the nucleus of p=.5 is 256 tokens, wider than 8
    tokens = []
    states = [s.new_state(SamplingParams(top_p=0.5, seed=i), [1]) for i in range(2000)]
    tokens = s.sample(logits.expand(2000, V).clone(), states).token_ids
    assert tokens.unique().numel() > 200  # more than the 8 candidates were kept


def test_truncation_matches_a_sort_reference():
    from engine.sampling.distribution import apply_top_k_top_p

    gen = torch.Generator().manual_seed(3)
    for scale in (0.5, 3.0, 10.0):
        x = torch.randn(6, 4096, generator=gen) * scale
        top_k = torch.tensor([0, 50, 0, 3000, 200, 1])
        top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 0.5])
        got = x.clone()
        apply_top_k_top_p(got, top_k, top_p, candidates=64)
        for i in range(6):
            ref = x[i].clone()
            if top_k[i] > 0:
                ref[ref < ref.topk(int(top_k[i])).values[-1]] = -math.inf
            if top_p[i] < 1:
                vals = ref.sort(descending=True).values
                cum = torch.softmax(vals.double(), 0).cumsum(0)
                cut = int(torch.searchsorted(cum, torch.tensor([float(top_p[i])], dtype=torch.float64)))
                ref[ref < vals[cut]] = -math.inf
            assert torch.equal(torch.isfinite(got[i]), torch.isfinite(ref)), (scale, i)


# -- penalties ------------------------------------------------------------------------------------


def test_penalties_match_hand_computation():
    s = Sampler(SamplerConfig(8, (7,), seed=0))
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    st = s.new_state(p, prompt_token_ids=[1, 2], output_token_ids=[2, 2, 5])
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.5]])
    apply_penalties(logits, [0], [st])
    # repetition over prompt+output {1, 2, 5}: 2 -> 1, -1 -> -2, -2 -> -4
    # then output counts {2: 2, 5: 1}: token 2: -2 - (0.5 * 2 + .25); token 5: -4 - (0.5 + .25)
    assert logits.tolist() == [[1.0, 1.0, -3.25, 0.5, 3.0, -4.75, 0.0, 1.5]]


def test_penalties_touch_only_their_rows():
    s = Sampler(SamplerConfig(8, (7,), seed=0))
    plain = s.new_state(SamplingParams(), [1, 2], [2, 3])
    pres = s.new_state(SamplingParams(presence_penalty=1.0), [1, 2], [2, 3])
    freq = s.new_state(SamplingParams(frequency_penalty=1.0), [4], [3, 3, 3])
    rep = s.new_state(SamplingParams(repetition_penalty=4.0), [0], [6])
    logits = torch.ones(5, 8)
    before = logits.clone()
    apply_penalties(logits, [1, 2, 4], [pres, freq, rep])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[3], before[3])
    assert logits[1].tolist() == [1, 1, 0, 0, 1, 1, 1, 1]  # presence over outputs only, not prompt
    assert logits[2].tolist() == [1, 1, 1, -2, 1, 1, 1, 1]
    assert logits[4].tolist() == [0.25, 1, 1, 1, 1, 1, 0.25, 1]
    del plain


def test_penalties_change_greedy_choice():
    s = Sampler(SamplerConfig(8, (7,), seed=0))
    st = s.new_state(SamplingParams(temperature=0.0, frequency_penalty=2.0), [0], [4])
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.5, 3.0, 0.0, 0.0, 0.0]])
    assert s.sample(logits, [st]).token_ids.tolist() == [3]  # 4 had 3.0, now 1.0


# -- seeds ----------------------------------------------------------------------------------------


def request_logits(key: int, step: int) -> torch.Tensor:
    """The logits 'the model' gives request ``key`` at ``step`` (whatever batch it is in)."""
    return torch.randn(V, generator=torch.Generator().manual_seed(key * 1000 + step)) * 2.0


OTHERS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.5, top_k=20),
    SamplingParams(top_p=0.8, seed=99),
    SamplingParams(min_p=0.2),
    SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, seed=5),
    SamplingParams(repetition_penalty=1.3, temperature=1.3),
    SamplingParams(top_k=5, top_p=0.9, min_p=0.05, seed=7),
    SamplingParams(logprobs=True, top_logprobs=3),
]


def run_batch(order: list[int], n_steps: int = 12) -> dict[int, tuple[list[int], list[float]]]:
    """Run requests (key 0 = the seeded target) batched in ``order``; tokens and logprobs."""
    s = sampler()
    target = SamplingParams(temperature=0.8, top_p=0.95, top_k=100, frequency_penalty=0.2, seed=1234, logprobs=True)
    states = {k: s.new_state(target if k == 0 else OTHERS[k % len(OTHERS)], [3, 4, 5]) for k in order}
    result: dict[int, tuple[list[int], list[float]]] = {k: ([], []) for k in order}
    for step in range(n_steps):
        logits = torch.stack([request_logits(k, step) for k in order])  # (B, V)
        out = s.sample(logits, [states[k] for k in order])
        for k, t, lp in zip(order, out.token_ids.tolist(), out.logprobs):
            result[k][0].append(t)
            result[k][1].append(lp.logprob if lp else 0.0)
    return result


def test_seeded_request_reproducible_across_batches():
    alone = run_batch([0])[0]
    batched = run_batch(list(range(16)))[0]
    reordered = run_batch([9, 3, 15, 0, 12, 1, 7, 14, 2, 11, 5, 8, 13, 4, 10, 6])[0]
    assert alone == batched == reordered
    assert len(set(alone[0])) > 3  # it did sample, not a constant


def test_different_seeds_differ():
    s = sampler()
    logits = torch.zeros(2, V)
    a, b = (s.new_state(SamplingParams(seed=x), [1]) for x in (1, 2))
    ta, tb = [], []
    for _ in range(5):
        out = s.sample(logits.clone(), [a, b]).token_ids.tolist()
        ta.append(out[0])
        tb.append(out[1])
    assert ta != tb


def test_resumed_state_continues_the_same_stream():
    s = sampler()
    p = SamplingParams(temperature=0.9, presence_penalty=0.5, repetition_penalty=1.1, seed=42, max_tokens=100)
    full = s.new_state(p, [1, 2, 3])
    tokens = [s.sample(request_logits(1, i).unsqueeze(0), [full]).token_ids.item() for i in range(10)]
    resumed = s.new_state(p, [1, 2, 3], output_token_ids=tokens[:6])
    assert resumed.step == 6
    again = [s.sample(request_logits(1, i).unsqueeze(0), [resumed]).token_ids.item() for i in range(6, 10)]
    assert again == tokens[6:]


def test_request_uniform_is_a_pure_function():
    assert request_uniform(7, 3) == request_uniform(7, 3)
    draws = [request_uniform(11, i) for i in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01


def test_unseeded_requests_get_distinct_seeds():
    s = sampler()
    seeds = {s.new_state(SamplingParams(), [1]).seed for _ in range(100)}
    assert len(seeds) == 100


# -- logprobs -------------------------------------------------------------------------------------


def test_raw_logprobs_are_model_log_softmax():
    s = sampler()
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=gen) * 3
    ps = [
        SamplingParams(temperature=0.5, top_k=10, presence_penalty=1.0, logprobs=True, top_logprobs=20, seed=1),
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    states = [s.new_state(p, [1], [int(logits[0].argmax())]) for p in ps]
    expect = torch.log_softmax(logits, -1)
    out = s.sample(logits.clone(), states)
    for i in (0, 1):
        lp = out.logprobs[i]
        assert lp.logprob == pytest.approx(expect[i, out.token_ids[i]].item(), abs=1e-6)
    top = out.logprobs[0].top
    assert len(top) == 20 and out.logprobs[1].top == []
    assert [t for t, _ in top] == expect[0].topk(20).indices.tolist()
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert out.logprobs[2] is None


def test_processed_logprobs_are_of_the_sampled_distribution():
    s = Sampler(SamplerConfig(V, (EOS,), seed=0, logprobs_mode="processed"))
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, V, generator=gen) * 3
    ps = [
        SamplingParams(temperature=0.5, top_k=4, logprobs=True, top_logprobs=6, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=True, top_logprobs=2),
    ]
    states = [s.new_state(p, [5]) for p in ps]
    scaled = logits[0] / 0.5
    kept = scaled.masked_fill(scaled < scaled.topk(4).values[-1], -math.inf)
    pen = logits[1].clone()
    pen[5] = pen[5] / 2.0 if pen[5] > 0 else pen[5] * 2.0
    out = s.sample(logits.clone(), states)
    lp0, lp1 = out.logprobs
    assert lp0.logprob == pytest.approx(torch.log_softmax(kept, 0)[out.token_ids[0]].item(), abs=1e-5)
    assert len(lp0.top) == 4  # only the 4 kept tokens have a finite logprob
    assert sum(math.exp(v) for _, v in lp0.top) == pytest.approx(1.0, abs=1e-5)
    assert [v for _, v in lp0.top] == sorted((v for _, v in lp0.top), reverse=True)
    assert lp1.logprob == pytest.approx(torch.log_softmax(pen, 0).max().item(), abs=1e-5)


# -- stop rule ------------------------------------------------------------------------------------


def eos_logits(n: int = 1) -> torch.Tensor:
    row = torch.zeros(V)
    row[EOS] = 10.0
    return row.expand(n, V).clone()


def test_eos_stops():
    s = sampler()
    st = s.new_state(SamplingParams(temperature=0.0, max_tokens=5), [1])
    out = s.sample(eos_logits(), [st])
    assert out.token_ids.tolist() == [EOS] and out.finish_reasons == ["stop"] and st.finished


def test_ignore_eos_runs_to_length():
    s = sampler()
    st = s.new_state(SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), [1])
    reasons = [s.sample(eos_logits(), [st]).finish_reasons[0] for _ in range(3)]
    assert reasons == [None, None, "length"]
    assert st.output_ids().tolist() == [EOS] * 3


def test_stop_token_ids_stop_even_with_ignore_eos():
    s = sampler()
    st = s.new_state(SamplingParams(temperature=0.0, stop_token_ids=(100,), ignore_eos=True), [1])
    logits = torch.zeros(1, V)
    logits[0, 100] = 5.0
    assert s.sample(logits, [st]).finish_reasons == ["stop"]


def test_max_tokens_counts_resumed_output():
    s = sampler()
    st = s.new_state(SamplingParams(temperature=0.0, max_tokens=4), [1], output_token_ids=[20, 21, 22])
    assert s.sample(torch.zeros(1, V), [st]).finish_reasons == ["length"]


def test_multiple_eos_ids():
    s = sampler(eos=(EOS, 9))
    st = s.new_state(SamplingParams(temperature=0.0), [1])
    logits = torch.zeros(1, V)
    logits[0, 9] = 3.0
    assert s.sample(logits, [st]).finish_reasons == ["stop"]


def test_check_finish_order():
    p = SamplingParams(max_tokens=2, stop_token_ids=(5,))
    assert check_finish(p, 5, 2, {1}) == "stop"  # stop beats length
    assert check_finish(p, 1, 2, {1}) == "stop"
    assert check_finish(p, 3, 2, {1}) == "length"
    assert check_finish(p, 3, 1, {1}) is None
    assert check_finish(p, 3, 1, {1}, grammar_terminated=True) == "stop"
    assert check_finish(p, 3, 1, {1}, grammar_rejected=True) == "error"


def test_finished_state_cannot_be_sampled_again():
    s = sampler()
    st = s.new_state(SamplingParams(temperature=0.0), [1])
    s.sample(eos_logits(), [st])
    with pytest.raises(AssertionError):
        s.sample(eos_logits(), [st])


def test_config_validation():
    with pytest.raises(ValueError):
        SamplerConfig(10, (10,))
    with pytest.raises(ValueError):
        SamplerConfig(10, ())
    with pytest.raises(ValueError):
        SamplerConfig(10, (1,), logprobs_mode="bogus")  # type: ignore[arg-type]


def test_state_output_buffer_grows():
    st = SamplingState(params=SamplingParams(), seed=1)
    for t in range(100):
        st.record(t)
    assert st.output_ids().tolist() == list(range(100)) and st.step == 100


# -- the draw itself ------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab,n", [(129280, 1000), (1000, 6000)])  # whole blocks; a padded last block
def test_draw_frequencies_across_blocks(vocab, n):
    from engine.sampling.distribution import draw

    ids = [0, 127, 128, vocab // 2, vocab - 1]
    logits = torch.full((vocab,), -math.inf)
    logits[ids] = torch.tensor([0.0, 1.0, -1.0, 0.5, 2.0])
    u = torch.tensor([request_uniform(3, i) for i in range(n)], dtype=torch.float64)
    tokens = torch.cat([draw(logits.expand(len(c), vocab), c) for c in u.split(250)])
    counts = torch.bincount(tokens, minlength=vocab)
    assert set(counts.nonzero().flatten().tolist()) == set(ids)
    p = torch.softmax(logits[ids], 0).double()
    freq = counts[ids].double() / n
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt()).all(), (freq, p)


def test_extreme_logits_and_low_temperature():
    s = sampler()
    logits = torch.full((2, V), -1e4)  # far below exp's underflow
    logits[:, 200] = 50.0
    logits[:, 201] = 49.9
    logits[1, 300] = -math.inf
    states = [s.new_state(SamplingParams(temperature=0.01, seed=i, logprobs=True), [1]) for i in range(2)]
    out = s.sample(logits, states)
    assert out.token_ids.tolist() == [200, 200]  # 0.1 apart at T=0.01: e^-10
    assert all(math.isfinite(lp.logprob) for lp in out.logprobs)


def test_batch_invariance_holds_with_two_threads():
    """Full-vocabulary rows: a row alone is where torch splits reductions across threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        vocab = 129280
        gen = torch.Generator().manual_seed(8)
        rows = torch.randn(6, vocab, generator=gen) * 3
        ps = [
            SamplingParams(temperature=0.7, seed=1, logprobs=True, top_logprobs=5),
            SamplingParams(top_p=0.9, seed=2),
            SamplingParams(top_k=30, min_p=0.01, seed=3),
            SamplingParams(temperature=0.0),
            SamplingParams(top_p=0.5, top_k=5000, seed=4, repetition_penalty=1.2),
            SamplingParams(seed=5),
        ]

        def run(order):
            s = Sampler(SamplerConfig(vocab, (EOS,), seed=0))
            states = [s.new_state(ps[k], [1, 2, 3]) for k in order]
            out = s.sample(rows[order].clone(), states)
            return {k: (t, lp.logprob if lp else None) for k, t, lp in zip(order, out.token_ids.tolist(), out.logprobs)}

        together = run([3, 0, 5, 1, 4, 2])
        for k in range(6):
            assert run([k])[k] == together[k], k
    finally:
        torch.set_num_threads(before)


# -- logit sources: plain greedy rows skip the logits ---------------------------------------------


class RecordingSource:
    """A ``LogitSource`` over fixed logits that records which rows were asked for what."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.full = logits
        self.logit_rows: list[list[int]] = []
        self.argmax_rows: list[list[int]] = []

    def logits(self, rows: list[int]) -> torch.Tensor:
        self.logit_rows.append(rows)
        return self.full[rows].clone()

    def argmax(self, rows: list[int]) -> torch.Tensor:
        self.argmax_rows.append(rows)
        return self.full[rows].argmax(-1)


def test_logit_source_gives_the_tensor_path_result():
    """Mixed batch: plain greedy, greedy with logprobs, seeded random, penalised greedy. The
    source path asks the logits only of the rows that need them, and gives the same output."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.9, seed=3),
    ]
    a, b = sampler(), sampler()
    out_tensor = a.sample(logits.clone(), [a.new_state(p, [1, 2, 100]) for p in params])
    source = RecordingSource(logits)
    out_source = b.sample(source, [b.new_state(p, [1, 2, 100]) for p in params])
    assert torch.equal(out_tensor.token_ids, out_source.token_ids)
    assert out_tensor.logprobs == out_source.logprobs
    assert out_tensor.finish_reasons == out_source.finish_reasons
    assert source.argmax_rows == [[0, 4]]
    assert source.logit_rows == [[1, 2, 3, 5]]


def test_logit_source_all_plain_greedy_never_makes_logits():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6))
    s = sampler()
    source = RecordingSource(logits)
    out = s.sample(source, [s.new_state(SamplingParams(temperature=0.0, max_tokens=1), [1]) for _ in range(3)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert source.logit_rows == [] and out.finish_reasons == ["length"] * 3


def test_device_logits_source_matches_the_tensor_path():
    """``DeviceLogits`` (what a GPU logits tensor is wrapped in) gives the tensor path's result;
    checked here with host tensors, its code is device-agnostic."""
    from engine.sampling.sampler import DeviceLogits

    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(9))
    logits[3, 17] = logits[3, 400] = logits[3].max() + 1.0  # a tie: the first index wins
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=2), SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]  # fmt: skip
    a, b = sampler(), sampler()
    ref = a.sample(logits.clone(), [a.new_state(p, [1]) for p in params])
    got = b.sample(DeviceLogits(logits.clone()), [b.new_state(p, [1]) for p in params])
    assert torch.equal(ref.token_ids, got.token_ids) and ref.logprobs == got.logprobs
    assert got.token_ids[3] == 17

"""A tiny V4.1 checkpoint whose DSpark draft layers predict: ``tiny_mtp``'s synthetic language.

The language (``engine.model.tiny_mtp``): a seeded successor permutation ``f`` over ``vocab``
token ids, ``t_{i+1} = f(t_i)``. The random backbone stays frozen; training fits what reads it:

1. the lm_head rows of the language's tokens on the final hidden states (``tiny_mtp.fit_head``),
   so the model's greedy continuation of a sentence is ``f``;
2. every DSpark weight, on the frozen backbone's target-layer features: an anchor ``t_a`` with the
   context of positions ``< a`` drafts ``t_{a+1} .. t_{a+L}`` (teacher-forced Markov inputs), plus
   the confidence head on whether each position's draft is right.

Both losses are the language's softmax plus one constant logit for the rest of the vocabulary
(``tiny_mtp.language_loss``); the report checks greedy drafting on the full vocabulary. Seeded
and single-threaded where it matters. Cost: a few seconds on one CPU core (``2 · mtp_steps``
draft steps of ``2 · batch`` blocks, ``TrainConfig``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.tiny_mtp import TrainConfig, fit_head, language_loss, rest_logit, sentence
from engine.model.v41.dspark import DSpark, DSparkDrafter
from engine.model.v41.model import DeepseekV41ForCausalLM


@dataclass(frozen=True)
class DSparkReport:
    """Greedy accuracy on the full vocabulary after training."""

    head_accuracy: float  # the model: argmax at p == t_{p+1}
    draft_accuracy: float  # DSpark: block position j == t_{a+1+j}, over sampled anchors
    seconds: float


def train_tiny_dspark(model: DeepseekV41ForCausalLM, dspark: DSpark, cfg: TrainConfig) -> DSparkReport:
    """Fit the language's lm_head rows and the DSpark layers in place (module docstring)."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    starts = (torch.randint(0, cfg.vocab, (cfg.sentences,), generator=gen) + cfg.first_id).tolist()
    data = [sentence(cfg, s, cfg.seq_len) for s in starts]
    with torch.inference_mode():
        rows = model([(model.new_state(), ids) for ids in data], logits="taps")  # (sentences·T, 1 + taps, H)
    rows = [r.clone() for r in rows.split(cfg.seq_len)]  # ordinary tensors, usable in autograd
    lang = torch.arange(cfg.first_id, cfg.first_id + cfg.vocab)
    rest = rest_logit(model, cfg.vocab)
    hidden = torch.cat([r[:-1, 0] for r in rows])
    fit_head(model, hidden, torch.tensor([t - cfg.first_id for ids in data for t in ids[1:]]), lang, rest, cfg)
    _fit_dspark(model, dspark, rows, data, lang, rest, cfg, gen)
    return DSparkReport(_head_accuracy(model, rows, data), _draft_accuracy(model, dspark, rows, data, cfg), time.perf_counter() - t0)


def _samples(data: list[list[int]], width: int, count: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """``count`` (sentence, anchor) pairs with a whole block of targets after the anchor."""
    s = torch.randint(0, len(data), (count,), generator=gen).tolist()
    a = torch.randint(1, len(data[0]) - width, (count,), generator=gen).tolist()
    return list(zip(s, a))


def _context(model: DeepseekV41ForCausalLM, dspark: DSpark, rows: list[torch.Tensor], picks: list[tuple[int, int]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each draft layer's context keys of every pick (the last ``W - 1`` positions before its anchor)."""
    keep = model.config.sliding_window - 1
    per_pick = []
    for s, a in picks:
        pos = torch.arange(max(0, a - keep), a)
        per_pick.append([(k, pos) for k in dspark.context_keys(model, rows[s][pos, 1:], pos)])
    return [[p[j] for p in per_pick] for j in range(len(dspark.layers))]


def _fit_dspark(
    model: DeepseekV41ForCausalLM, dspark: DSpark, rows: list[torch.Tensor], data: list[list[int]],
    lang: torch.Tensor, rest: float, cfg: TrainConfig, gen: torch.Generator,
) -> None:  # fmt: skip
    width = dspark.config.dspark_block_size
    head_rows = model.lm_head.weight.detach()[lang]  # (Lg, H) frozen
    last = dspark.layers[-1]
    markov = last.markov_head
    # the Markov head's language rows only (its V × r tables would make every Adam step cost)
    w1 = markov.markov_w1.weight.detach()[lang].clone().requires_grad_(True)  # (Lg, r)
    w2 = markov.markov_w2.weight.detach()[lang].clone().requires_grad_(True)
    tables = {id(markov.markov_w1.weight), id(markov.markov_w2.weight)}
    opt = torch.optim.Adam([p for p in dspark.parameters() if id(p) not in tables] + [w1, w2], lr=cfg.lr)
    for _ in range(2 * cfg.mtp_steps):  # blocks learn slower than V4's one-token MTP
        picks = _samples(data, width, 2 * cfg.batch, gen)
        anchors = torch.tensor([data[s][a] for s, a in picks])
        x, hidden = dspark.block(model, _context(model, dspark, rows, picks), anchors, torch.tensor([a for _, a in picks]))
        prev = torch.tensor([data[s][a + j] for s, a in picks for j in range(width)])  # teacher-forced Markov inputs
        targets = torch.tensor([data[s][a + j + 1] - cfg.first_id for s, a in picks for j in range(width)])
        m = w1[prev - cfg.first_id]  # (B·L, r)
        feats = torch.cat([hidden.flatten(0, 1), m], dim=-1)
        w = torch.cat([head_rows, w2], dim=-1)  # (Lg, H + r)
        loss = language_loss(feats, w, targets, rest)
        with torch.no_grad():
            right = ((feats @ w.t()).argmax(-1) == targets).float()
        conf = last.confidence_head.proj(torch.cat([x.flatten(0, 1), m], dim=-1))[:, 0]
        opt.zero_grad()
        (loss + 0.1 * F.binary_cross_entropy_with_logits(conf, right)).backward()
        opt.step()
    with torch.no_grad():
        markov.markov_w1.weight[lang] = w1.detach()
        markov.markov_w2.weight[lang] = w2.detach()


@torch.inference_mode()
def _head_accuracy(model: DeepseekV41ForCausalLM, rows: list[torch.Tensor], data: list[list[int]]) -> float:
    got = model.head.logits(torch.cat([r[:-1, 0] for r in rows[:4]])).argmax(-1)
    return float((got == torch.tensor([t for ids in data[:4] for t in ids[1:]])).float().mean())


@torch.inference_mode()
def _draft_accuracy(model: DeepseekV41ForCausalLM, dspark: DSpark, rows: list[torch.Tensor], data: list[list[int]], cfg: TrainConfig) -> float:
    """Greedy drafting (``DSparkDrafter``) from a fed context, on the full vocabulary."""
    drafter, width = DSparkDrafter(model, dspark), dspark.config.dspark_block_size
    picks = _samples(data, width, 16, torch.Generator().manual_seed(cfg.seed + 2))
    states = [drafter.new_state() for _ in picks]
    anchors = drafter.feed(states, [rows[s][:a] for s, a in picks], [data[s][1 : a + 1] for s, a in picks], [0] * len(picks))
    blocks = drafter.draft(states, anchors, width)
    right = [b.tokens[j] == data[s][a + 1 + j] for b, (s, a) in zip(blocks, picks) for j in range(width)]
    return sum(right) / len(right)

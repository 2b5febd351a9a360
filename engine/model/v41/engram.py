"""Engram conditional memory of DeepSeek-V4.1: n-gram hashes looked up and gated into the streams.

At every position the last ``N = engram_max_ngram_size`` token ids (mapped through the
checkpoint tokenizer's *compressed* vocabulary, where tokens that normalise alike share an id)
are hashed as the 2..N-grams ending there, each over ``engram_n_heads`` heads; every
(n-gram size, head) pair owns a disjoint bucket range of prime size, the primes drawn in
order above ``engram_vocab_size`` and never reused. The hashes are exact integer arithmetic:
per layer and look-back a fixed odd multiplier (from ``numpy``'s PCG64 seeded ``10007·layer``),
XOR-accumulated, modulo the bucket's prime, plus the bucket's offset in the layer's table.

A sequence's engram state is its last ``N - 1`` compressed ids: positions before the start of
the sequence hash as the pad id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.errors import CheckpointError
from engine.model.v41.config import V41Config

MULTIPLIER_SEED = 10007  # per-layer RNG seed factor of the hash multipliers


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for ``n < 3.3·10²⁴`` (the first 13 prime bases)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in bases:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def compressed_token_map(tokenizer_json: str | Path) -> tuple[list[int], int]:
    """``(id → compressed id, compressed vocabulary size)`` for a ``tokenizer.json``.

    Each token's decoded text is normalised (NFKC, NFD, accents stripped, lower case, runs of
    whitespace to one space, stripped — a token that is exactly one space stays one space);
    tokens with equal normalised text share a compressed id, numbered in order of first
    appearance. A token that decodes to a partial UTF-8 sequence is keyed by its raw form.
    """
    from tokenizers import Regex, Tokenizer, normalizers

    keep_space = "\ue000"  # private-use stand-in, so Strip() keeps a lone space
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep_space),
        normalizers.Strip(), normalizers.Replace(keep_space, " "),
    ])  # fmt: skip
    tok = Tokenizer.from_file(str(tokenizer_json))
    ids: dict[str, int] = {}
    out = []
    for token_id in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([token_id], skip_special_tokens=False)
        key = tok.id_to_token(token_id) if "\ufffd" in text else (normalizer.normalize_str(text) or text)
        out.append(ids.setdefault(key, len(ids)))
    return out, len(ids)


@dataclass(frozen=True)
class NgramHasher:
    """The hash tables' layout and the token map of one checkpoint (see the module docstring)."""

    token_map: torch.Tensor  # (V_tok,) long: token id → compressed id
    pad_id: int  # compressed id of engram_pad_id
    multipliers: torch.Tensor  # (L, N) long, odd
    primes: torch.Tensor  # (L, N-1, heads) long
    offsets: torch.Tensor  # (L, (N-1)·heads) long: each bucket's first row in its layer's table
    max_ngram: int

    @classmethod
    def build(cls, cfg: V41Config, tokenizer_json: str | Path) -> NgramHasher:
        token_map, size = compressed_token_map(tokenizer_json)
        if size != cfg.engram_compressed_vocab_size:
            raise CheckpointError(
                f"{tokenizer_json}: its compressed vocabulary has {size} entries but the config's "
                f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size} (wrong tokenizer for this checkpoint)"
            )
        if cfg.engram_pad_id >= len(token_map):
            raise CheckpointError(f"{tokenizer_json}: engram_pad_id {cfg.engram_pad_id} is outside the tokenizer")
        n, heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
        used: set[int] = set()
        primes = []
        for _ in cfg.engram_layer_ids:
            per_layer = []
            for _ in range(n - 1):
                row, p = [], cfg.engram_vocab_size - 1
                for _ in range(heads):
                    p += 1
                    while p in used or not is_prime(p):
                        p += 1
                    used.add(p)
                    row.append(p)
                per_layer.append(row)
            primes.append(per_layer)
        prime_t = torch.tensor(primes, dtype=torch.long).reshape(len(cfg.engram_layer_ids), n - 1, heads)
        flat = prime_t.flatten(1)  # (L, (N-1)·heads)
        offsets = torch.cumsum(flat, dim=1) - flat
        bound = max(1, (np.iinfo(np.int64).max // size) // 2)  # keeps id · multiplier in int64
        mults = [np.random.default_rng(MULTIPLIER_SEED * layer).integers(0, bound, size=(n,), dtype=np.int64) * 2 + 1 for layer in cfg.engram_layer_ids]
        for i, rows in enumerate(cfg.engram_num_embeddings):
            if int(flat[i].sum()) > rows:
                raise CheckpointError(f"engram layer {cfg.engram_layer_ids[i]}: buckets need {int(flat[i].sum())} rows, table has {rows}")
        return cls(
            token_map=torch.tensor(token_map, dtype=torch.long),
            pad_id=token_map[cfg.engram_pad_id],
            multipliers=torch.from_numpy(np.stack(mults)),
            primes=prime_t,
            offsets=offsets,
            max_ngram=n,
        )

    def history(self, token_ids: list[int]) -> list[int]:
        """The compressed ids a sequence carries after ``token_ids``: its last ``N - 1``."""
        keep = self.max_ngram - 1
        return self.token_map[torch.tensor(token_ids[-keep:] if keep else [], dtype=torch.long)].tolist()

    def hash_ids(self, history: list[int], token_ids: torch.Tensor) -> torch.Tensor:
        """Row ids ``(S, L, (N-1)·heads)`` of the ``S`` new tokens, given the sequence's
        ``history`` (its last ≤ N-1 compressed ids before them; fewer = the sequence start)."""
        keep = self.max_ngram - 1
        new = self.token_map.to(token_ids.device)[token_ids]  # (S,)
        pad = torch.full((keep - len(history),), self.pad_id, dtype=torch.long, device=new.device)
        seq = torch.cat([pad, torch.tensor(history, dtype=torch.long, device=new.device), new])  # (N-1+S,)
        window = seq.unfold(0, self.max_ngram, 1).flip(-1)  # (S, N): [t, t-1, ..., t-N+1]
        products = window[:, None, :] * self.multipliers.to(new.device)  # (S, L, N)
        rolling = products[..., 0]
        cols = []
        for i in range(1, self.max_ngram):
            rolling = torch.bitwise_xor(rolling, products[..., i])  # the (i+1)-gram's hash, (S, L)
            cols.append(rolling[..., None] % self.primes[:, i - 1].to(new.device))  # (S, L, heads)
        return torch.cat(cols, dim=-1) + self.offsets.to(new.device)  # (S, L, (N-1)·heads)


class Engram(nn.Module):
    """One layer's engram: table rows → one key per stream and a shared value, gated by how well
    each stream matches its key (sigmoid of the signed square root of a normalised dot)."""

    GATE_FLOOR = 1e-6  # |dot| floor under the square root

    def __init__(self, cfg: V41Config, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.slot = cfg.engram_layer_ids.index(layer_idx)  # this layer's index in the hash output
        self.hc, self.hidden = cfg.hc_mult, cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.embed = nn.Embedding(cfg.engram_num_embeddings[self.slot], cfg.engram_head_dim, dtype=dtype)
        self.wkv = nn.Linear(cols * cfg.engram_head_dim, cfg.hidden_size * (cfg.hc_mult + 1), bias=False, dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden_size, dtype=torch.float32))
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden_size, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """``streams (N, hc, H)``, ``hash_ids (N, cols)`` → the updated streams ``(N, hc, H)``."""
        kv = self.wkv(self.embed(hash_ids).flatten(-2))  # (N, (hc+1)·H)
        key, value = kv.split([self.hc * self.hidden, self.hidden], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.hidden))  # (N, hc, H)
        h = streams.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)  # (N, hc)
        dot = (h * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.hidden**-0.5  # (N, hc)
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(self.GATE_FLOOR).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)

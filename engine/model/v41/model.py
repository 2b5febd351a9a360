"""The DeepSeek-V4.1 causal LM over a batch of variable-length sequence chunks.

``forward(chunks)`` takes ``(V41SequenceState, new token ids)`` pairs — a whole prompt, a prefill
chunk or one decode token each — with the same contract as V4's model: token-wise parts
(projections, MoE, mHC, engram) on the flattened ``(N, ...)`` tokens, attention per sequence,
states updated in place. A one-shot prefill is one chunk on a fresh state, so the full forward
and the cached decode path are the same code.

Single-pass mHC: each site (attention, FFN) computes ``pre / post / comb`` from one projection
of its input streams, but collapses its input with the ``pre`` the *previous* site computed
(the first site of the stack collapses stream 0 only; the last ``pre`` collapses the output).
There is no V4 ``hc_head``.

Bounded replay (a state with ``decoder_from`` past a chunk's first position, see
``V41SequenceState``): the encoder layers run on every token; at the first decoder layer the
batch is compacted to the rows from ``decoder_from`` on, as DeepInfer's YOCO compaction does, and
the decoder layers run on those only. A chunk left without decoder rows returns its last
encoder-side row (a replay chunk that does not end the prompt: never sampled).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from engine.model.batch_ids import ids_positions
from engine.model.layers import replicate_streams
from engine.model.lm_head import LMHead
from engine.model.rope import Rotary
from engine.model.v41.attention import V41_TUNING, Attention, Chunk, Shared, V41Tuning
from engine.model.v41.config import V41Config
from engine.model.v41.engram import Engram, NgramHasher
from engine.model.v41 import prefill as fast_path
from engine.model.v41.layers import MoE, HyperSite, RMSNorm, collapse
from engine.model.v41.prefill import use_fast
from engine.model.v41.state import V41SequenceState


class DecoderLayer(nn.Module):
    """Engram (on its layers), then attention and MoE, each inside a single-pass mHC site."""

    def __init__(self, cfg: V41Config, layer_idx: int, dtype: torch.dtype, tuning: V41Tuning = V41_TUNING) -> None:
        super().__init__()
        self.tuning = tuning
        self.attn = Attention(cfg, layer_idx, dtype, tuning)
        self.ffn = MoE(cfg, dtype)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.engram = Engram(cfg, layer_idx, dtype) if layer_idx in cfg.engram_layer_ids else None
        self.hc_attn = HyperSite(cfg)
        self.hc_ffn = HyperSite(cfg)

    def forward(
        self, streams: torch.Tensor, pre: torch.Tensor, hash_ids: torch.Tensor | None, positions: torch.Tensor,
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], rotary: Rotary, chunks: list[Chunk],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``streams (N, hc, H)`` and the previous site's ``pre (N, hc)`` → the new streams and
        this layer's FFN-site ``pre``."""
        if self.engram is not None:
            assert hash_ids is not None, "engram layers need the hash ids"
            streams = self.engram(streams, hash_ids[:, self.engram.slot])
        ops = fast_path.FAST if use_fast(self.tuning.fast, streams) else fast_path.GENERAL
        attn_pre, post, comb = ops.gates(self.hc_attn, streams)
        x = ops.collapse_norm(pre, streams, self.attn_norm)  # (N, H)
        streams = ops.expand(self.attn(x, positions, ropes, rotary, chunks), streams, post, comb)
        ffn_pre, post, comb = ops.gates(self.hc_ffn, streams)
        x = ops.collapse_norm(attn_pre, streams, self.ffn_norm)
        return ops.expand(ops.moe(self.ffn, x, self.tuning.expert_gemm), streams, post, comb), ffn_pre


class DeepseekV41Model(nn.Module):
    """Embedding, decoder layers and the final norm (native names: ``embed``, ``layers``, ``norm``)."""

    def __init__(self, cfg: V41Config, dtype: torch.dtype, tuning: V41Tuning = V41_TUNING) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, dtype, tuning) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV41ForCausalLM(nn.Module):
    """The whole V4.1 text model. ``hasher`` (engram checkpoints) is bound by the loader from the
    checkpoint's own tokenizer; ``mtp`` keeps the DSpark draft layers' tensors (not yet used)."""

    def __init__(
        self, cfg: V41Config, dtype: torch.dtype = torch.float32, hasher: NgramHasher | None = None, tuning: V41Tuning = V41_TUNING
    ) -> None:
        super().__init__()
        if cfg.engram_layer_ids and hasher is None:
            raise ValueError("an engram model needs the NgramHasher of its checkpoint's tokenizer")
        self.config, self.dtype, self.hasher = cfg, dtype, hasher
        self.model = DeepseekV41Model(cfg, dtype, tuning)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.rotary = {
            "main": Rotary(cfg.rope_main, cfg.qk_rope_head_dim, cfg.max_position_embeddings),
            "compress": Rotary(cfg.rope_compress, cfg.qk_rope_head_dim, cfg.max_position_embeddings),
        }
        self.mtp: dict[str, torch.Tensor] = {}
        self.head = LMHead(self.lm_head)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_state(self) -> V41SequenceState:
        """An empty state for a new sequence, on the model's device and dtype."""
        d, dev = self.config.head_dim, self.device
        windows = [torch.empty(0, d, dtype=self.dtype, device=dev) for _ in self.model.layers]
        sources = {i: layer.attn.empty_source(self.dtype, dev) for i, layer in enumerate(self.model.layers) if layer.attn.compressor is not None}
        return V41SequenceState(windows, sources)  # type: ignore[arg-type]

    @torch.inference_mode()
    def forward(
        self, chunks: Sequence[tuple[V41SequenceState, Sequence[int]]],
        logits: Literal["last", "all", "hidden", "hidden_all", "taps"] = "last",
    ) -> torch.Tensor:  # fmt: skip
        """Run every chunk's new tokens through the model, updating each state.

        Returns float32 logits ``(B, V)`` of each chunk's last token, ``(N, V)`` of every token
        with ``logits="all"``, or the last tokens' final hidden states ``(B, H)`` with
        ``logits="hidden"`` (for ``self.head``), every token's ``(N, H)`` with ``"hidden_all"``.
        ``"taps"`` (speculative verify, ``dspark.py``): ``(N, 1 + len(dspark_target_layer_ids), H)``,
        every token's final hidden state then the mean over the hc streams of each target layer's
        input; zeros for the rows a bounded replay does not compute past ``first_decoder_layer``.
        """
        cfg, device = self.config, self.device
        spans, n = [], 0
        for state, ids in chunks:
            if len(ids) == 0:
                raise ValueError("every chunk needs at least one token")
            spans.append((n, n + len(ids)))
            n += len(ids)
        token_ids, positions = ids_positions(chunks, n, cfg.vocab_size, device)  # (N,) each, no sync
        hash_ids = None
        if self.hasher is not None:
            hash_ids = torch.cat([self.hasher.hash_ids(st.engram, token_ids[a:b]) for (st, _), (a, b) in zip(chunks, spans)])  # (N, L, cols)
        embeds = self.model.embed(token_ids)  # (N, H)
        streams = replicate_streams(embeds, cfg.hc_mult)  # (N, hc, H)
        pre = torch.zeros(n, cfg.hc_mult, dtype=torch.float32, device=device)  # (N, hc): one-hot first mix
        pre[:, 0] = 1.0
        ropes = {kind: rot.cos_sin(positions, embeds.dtype) for kind, rot in self.rotary.items()}
        parts = [Chunk(st, a, b, Shared(), st.num_tokens) for (st, _), (a, b) in zip(chunks, spans)]
        ends = [b - 1 for _, b in spans]  # each chunk's last row in the current layout (None: none)
        encoder_out = None
        taps = {layer: j for j, layer in enumerate(cfg.dspark_target_layer_ids)} if logits == "taps" else {}
        out = torch.zeros(n, 1 + len(taps), cfg.hidden_size, dtype=embeds.dtype, device=device) if taps else None
        idx = None  # the rows still computed (None: all)
        for i, layer in enumerate(self.model.layers):
            if i == cfg.first_decoder_layer and any(p.first_pos < p.state.decoder_from for p in parts):
                if logits in ("all", "hidden_all"):
                    raise ValueError("a bounded replay computes no decoder rows before decoder_from: not every token has logits")
                encoder_out = streams, pre
                kept, parts, ends = decoder_rows(parts)
                idx = torch.tensor(kept, dtype=torch.long, device=device)
                if not kept:
                    break  # no chunk reaches decoder_from yet: the decoder layers have nothing to do
                streams, pre, positions = streams[idx], pre[idx], positions[idx]
                hash_ids = None if hash_ids is None else hash_ids[idx]
                ropes = {kind: (cos[idx], sin[idx]) for kind, (cos, sin) in ropes.items()}
            if i in taps:
                _put(out, taps[i] + 1, idx, streams.float().mean(dim=1).to(streams.dtype))  # type: ignore[arg-type]
            streams, pre = layer(streams, pre, hash_ids, positions, ropes, self.rotary["compress"], parts)

        for state, ids in chunks:
            state.num_tokens += len(ids)
            state.token_ids.extend(ids)
            if self.hasher is not None:
                state.engram = self.hasher.history(state.token_ids)
        if out is not None:
            if idx is None or idx.numel():
                _put(out, 0, idx, self.model.norm(collapse(pre, streams)))
            return out
        if logits not in ("all", "hidden_all"):
            if encoder_out is None:
                last = torch.tensor(ends, device=device)
                streams, pre = streams[last], pre[last]
            else:  # a chunk without decoder rows: its last encoder-side row
                pick = [(streams, pre, e) if e is not None else (*encoder_out, b - 1) for e, (_, b) in zip(ends, spans)]
                streams = torch.stack([s[r] for s, _, r in pick])
                pre = torch.stack([p[r] for _, p, r in pick])
        hidden = self.model.norm(collapse(pre, streams))  # (B or N, H)
        return hidden if logits in ("hidden", "hidden_all") else self.head.logits(hidden)


def _put(out: torch.Tensor, col: int, rows: torch.Tensor | None, values: torch.Tensor) -> None:
    """``out[rows, col] = values`` (``rows`` None: every row)."""
    if rows is None:
        out[:, col] = values
    else:
        out[rows, col] = values


def decoder_rows(parts: list[Chunk]) -> tuple[list[int], list[Chunk], list[int | None]]:
    """A bounded replay's compaction at the first decoder layer: the flattened rows the decoder
    layers compute (each chunk's tokens from its state's ``decoder_from`` on), the chunks with
    rows in that compact layout, and each chunk's last compact row (None: it has none)."""
    rows: list[int] = []
    compact: list[Chunk] = []
    ends: list[int | None] = []
    for p in parts:
        skip = min(max(0, p.state.decoder_from - p.first_pos), p.end - p.start)
        a = len(rows)
        rows.extend(range(p.start + skip, p.end))
        if len(rows) == a:
            ends.append(None)
            continue
        sh = p.shared  # per-query picks follow their rows (a new KV source replaces them anyway)
        top = None if sh.top is None else (sh.top[0][skip:], sh.top[1][skip:])
        cands = None if sh.candidates is None else sh.candidates[skip:]
        compact.append(Chunk(p.state, a, len(rows), Shared(sh.rows, sh.keys, top, cands), p.first_pos + skip))
        ends.append(len(rows) - 1)
    return rows, compact, ends

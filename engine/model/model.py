"""The DeepSeek-V4 causal LM over a batch of variable-length sequence chunks.

``forward(chunks)`` takes ``(SequenceState, new token ids)`` pairs — a prefill chunk, a whole
prompt or one decode token each — flattens all tokens into one ``(N, ...)`` axis for the
token-wise parts (projections, MoE, mHC) and lets attention walk each sequence's own state
(``attention.Attention._attend_sequence``). No padding of the token axis, so mixed lengths batch
exactly. States are updated in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from engine.model.attention import Attention, SeqSlice
from engine.model.batch_ids import ids_positions
from engine.model.config import ModelConfig
from engine.model.layers import (
    HyperConnection,
    HyperHead,
    RMSNorm,
    hc_merge,
    replicate_streams,
)
from engine.model.lm_head import LMHead
from engine.model.moe import MoE, MoETuning
from engine.model.rope import Rotary
from engine.model.state import SequenceState
from kernels.prefill import PrefillTuning


@dataclass(frozen=True)
class ModelTuning:
    """The model's kernel settings, given where it is built (``load_model``) and passed down to
    each layer: the Triton prefill path's launches and the experts' path choice. The defaults are
    the measured choices; benches and tests build the model with others."""

    prefill: PrefillTuning = field(default_factory=PrefillTuning)
    moe: MoETuning = field(default_factory=MoETuning)


TUNING = ModelTuning()  # the default


def _rows(tab: tuple[torch.Tensor, torch.Tensor], first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tab[0][first : first + n], tab[1][first : first + n]


class DecoderLayer(nn.Module):
    """Attention and MoE blocks, each wrapped in a hyper-connection over ``hc`` streams."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, tuning: ModelTuning = TUNING, fp4_experts: bool = False) -> None:
        super().__init__()
        self.hc_pre = tuning.prefill.hc_pre  # the Triton mHC input's launch
        self.self_attn = Attention(cfg, layer_idx, dtype, tuning.prefill)
        self.mlp = MoE(cfg, layer_idx, dtype, tuning.moe, fp4_experts)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(
        self,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotary: Rotary,
        seqs: list[SeqSlice],
    ) -> torch.Tensor:
        return self.blocks(streams, token_ids, lambda x: self.self_attn(x, positions, rope, rotary, seqs))

    def blocks(self, streams: torch.Tensor, token_ids: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Both blocks on ``streams (N, hc, H)``; ``attend`` maps the normalised attention input
        ``(N, H)`` to the attention output (the general path, or a slot decoder's own state)."""
        if self.self_attn.use_fast_prefill(streams):  # CUDA bf16/fp16: Triton mHC input + norm
            from kernels import prefill as kp

            post, comb, x = kp.hc_pre_norm(self.attn_hc, self.input_layernorm, streams, self.hc_pre)
            streams = hc_merge(post, comb, attend(x), streams)
            post, comb, x = kp.hc_pre_norm(self.ffn_hc, self.post_attention_layernorm, streams, self.hc_pre)
            return hc_merge(post, comb, self.mlp(x, token_ids), streams)
        post, comb, x = self.attn_hc(streams)  # streams (N, hc, H)
        streams = hc_merge(post, comb, attend(self.input_layernorm(x)), streams, self.attn_hc.fused)
        post, comb, x = self.ffn_hc(streams)
        return hc_merge(post, comb, self.mlp(self.post_attention_layernorm(x), token_ids), streams, self.ffn_hc.fused)


class DeepseekV4Model(nn.Module):
    """Embedding, decoder layers, final hyper-head and norm (transformers' ``model.*`` names)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tuning: ModelTuning = TUNING, fp4_experts: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, dtype, tuning, fp4_experts) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)


class DeepseekV4ForCausalLM(nn.Module):
    """The whole model. ``mtp`` holds the multi-token-prediction weights (kept, not yet used)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, tuning: ModelTuning = TUNING, fp4_experts: bool = False) -> None:
        """``fp4_experts``: the routed experts will hold the checkpoint's FP4 tensors (``Experts.fp4``,
        set by the loader), so their dense parameters are never allocated."""
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.tuning = tuning
        self.model = DeepseekV4Model(cfg, dtype, tuning, fp4_experts)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        if self.lm_head.weight.device.type == "cpu":
            # Store lm_head as a transposed view of a contiguous (H, V) tensor: CPU BLAS then runs
            # x @ Wᵀ as a plain (B, H) @ (H, V) GEMM, measured 3.5x faster at batch 1 and ~15% at
            # batch 32 than the (V, H) layout on a 129k vocabulary. Same values; loaders copy_ in.
            t = torch.empty(cfg.hidden_size, cfg.vocab_size, dtype=dtype)  # (H, V)
            self.lm_head.weight = nn.Parameter(t.t())  # (V, H) view
        self.rotary = {
            "main": Rotary(cfg.rope_main, cfg.qk_rope_head_dim, cfg.max_position_embeddings),
            "compress": Rotary(cfg.rope_compress, cfg.qk_rope_head_dim, cfg.max_position_embeddings),
        }
        self.mtp: dict[str, torch.Tensor] = {}
        self.head = LMHead(self.lm_head)  # logits, and exact greedy argmax through an int8 screen

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def set_fast_paths(self, enabled: bool) -> None:
        """Turn the exact fast paths (compiled mHC and experts on CPU) on or off (tests compare both)."""
        for layer in self.model.layers:
            layer.attn_hc.fused = layer.ffn_hc.fused = layer.mlp.fused = enabled

    def set_tuning(self, tuning: ModelTuning) -> None:
        """Give every layer ``tuning``'s settings (benches compare settings on one set of weights)."""
        self.tuning = tuning
        for layer in self.model.layers:
            layer.hc_pre = tuning.prefill.hc_pre
            layer.self_attn.prefill = tuning.prefill
            layer.mlp.experts.tuning = tuning.moe

    def new_state(self) -> SequenceState:
        """An empty state for a new sequence, on the model's device and dtype."""
        layers = [layer.self_attn.empty_state(self.dtype, self.device) for layer in self.model.layers]
        return SequenceState(layers=layers)

    @torch.inference_mode()
    def forward(
        self,
        chunks: Sequence[tuple[SequenceState, Sequence[int]]],
        logits: Literal["last", "all", "hidden", "hidden_all", "streams"] = "last",
    ) -> torch.Tensor:
        """Run every chunk's new tokens through the model, updating each state.

        Returns float32 logits: ``(B, V)`` of each chunk's last token, or ``(N, V)`` of every
        token (chunks concatenated in order) with ``logits="all"``; with ``logits="hidden"`` the
        last tokens' final hidden states ``(B, H)``, for ``self.head`` (``logits``/``argmax``),
        with ``"hidden_all"`` every token's ``(N, H)`` (prompt logprobs, scored in slices); with
        ``"streams"`` every token's final residual streams ``(N, hc, H)`` before the hyper-head
        (the MTP layer's input; ``final_hidden`` turns rows of them into the head's input).
        """
        device = self.device
        cfg = self.config
        seq_slices: list[tuple[SequenceState, int, int]] = []
        n = 0
        for state, new_ids in chunks:
            if len(new_ids) == 0:
                raise ValueError("every chunk needs at least one token")
            seq_slices.append((state, n, n + len(new_ids)))
            n += len(new_ids)
        token_ids, positions = ids_positions(chunks, n, cfg.vocab_size, device)  # (N,) each, no sync
        embeds = self.model.embed_tokens(token_ids)  # (N, H)
        streams = replicate_streams(embeds, cfg.hc_mult)  # (N, hc, H)
        first = chunks[0][0].num_tokens
        if device.type == "cuda" and len(chunks) == 1:  # one chunk: rows of the cached tables, no launch
            ropes = {kind: _rows(rot.table(first + n, embeds.dtype, device), first, n) for kind, rot in self.rotary.items()}
        else:
            ropes = {kind: rot.cos_sin(positions, embeds.dtype) for kind, rot in self.rotary.items()}
        for li, layer in enumerate(self.model.layers):
            seqs = [SeqSlice(st.layers[li], a, b, st.num_tokens) for st, a, b in seq_slices]
            kind = layer.self_attn.rope_kind
            streams = layer(streams, token_ids, positions, ropes[kind], self.rotary["compress"], seqs)

        for state, new_ids in chunks:
            state.num_tokens += len(new_ids)
            state.token_ids.extend(new_ids)
        if logits == "streams":  # every token's final residual streams (N, hc, H): the MTP layer's input
            return streams
        every = logits in ("all", "hidden_all")
        if not every and len(chunks) == 1:
            streams = streams[n - 1 :]  # a view: no index copy
        elif not every:
            # non_blocking: a blocking copy would wait for every layer's kernels before the head's
            # small kernels are queued (~1 ms of idle GPU at the end of an 8K prefill, run 9)
            streams = streams[torch.tensor([b - 1 for _, _, b in seq_slices]).to(device, non_blocking=True)]
        hidden = self.final_hidden(streams)  # (B or N, H)
        return hidden if logits in ("hidden", "hidden_all") else self.head.logits(hidden)

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The head's input ``(N, H)`` from final streams ``(N, hc, H)``: the hyper-head, then the norm."""
        return self.model.norm(self.model.hc_head(streams))

"""DSpark: DeepSeek-V4.1's draft layers (``num_nextn_predict_layers``, the checkpoint's ``mtp.*``).

What public sources show (no reference implementation is in our fixtures): ``transformers``'
``DeepseekV41TextConfig`` (huggingface/transformers,
src/transformers/models/deepseek_v41/configuration_deepseek_v41.py) gives the fields — draft layers
after the backbone, ``dspark_block_size`` tokens drafted per block (semi-autoregressive), a noise
token filling the block's non-anchor positions, target layers whose attention input (mean over the
hc streams) feeds the drafter, a rank-``dspark_markov_rank`` Markov head, the draft layers' own MoE
and a confidence head for variable-length verification. The V4 DSpark ports read to learn the
wiring (mlx-vlm's ``speculative/drafters/deepseek_v4_dspark`` drafter and an MLX bind test of the
released V4 drafter, both ported from deepseek-ai's DeepSpec reference) show: stage 0's
``main_proj`` / ``main_norm`` fuse the concatenated target features into one context row per
position; each stage attends with its own window-only attention from the block's queries over
``[context keys in a sliding window, the block's own keys]``; the last stage carries the final
``norm``, ``markov_head.markov_w1`` (embedding ``V × r``) / ``markov_w2`` (``r → V``) and
``confidence_head.proj`` (``H + r → 1``); the block's tokens are picked one by one, position
``j``'s logits being the head's plus ``markov_w2(markov_w1(prev))`` for the token before it.

The design settled on here (where the sources are silent or V4-specific, chosen to be
self-consistent; the output's exactness never depends on it, only acceptance does):

- a sequence that consumed positions ``< n`` and sampled ``g`` (not fed yet) drafts the block
  ``[g, noise × (L-1)]`` at positions ``n .. n+L-1`` (``L = dspark_block_size``); block output
  ``j`` proposes the token at ``n + 1 + j``, so one block gives up to ``L`` drafts;
- context: position ``p``'s row ``main_norm(main_proj(concat_t mean_hc(input of target layer t at
  p)))`` (the target layer's input streams before its engram; the released targets have none),
  turned by each draft layer into a key ``kv_norm(wkv(row))`` rotated at ``p`` (the main rope, as
  a window-only layer), the last ``W - 1`` kept per layer (``DSparkState``); keys are not
  FP8-rounded (a draft cache only);
- attention: the block's queries see the context keys inside the sliding window of their
  position and every key of the block (bidirectional inside the block, as DFlash-style drafters);
  V4.1's per-head sinks enlarge the softmax denominator; values are the keys, un-rotated after;
- mHC: V4.1's single-pass sites (each site's ``pre`` collapses the next site's input; the block
  starts from stream 0 and the last ``pre`` collapses the output, no ``hc_head``), the MoE
  V4.1's with ``dspark_n_routed_experts`` / ``dspark_num_experts_per_tok``;
- heads: the target's embedding and lm_head; confidence ``σ(proj([x_j, markov_w1(prev_j)]))``
  with ``x_j`` the collapsed output before ``norm``; drafting is greedy;
- variable-length verification (opt-in ``threshold``): the block is cut before the first
  position whose running product of confidences falls below it (one draft at least).

Names, as far as the public sources show the released ``mtp.*`` layout: ``mtp.{i}.attn.*``,
``mtp.{i}.ffn.*`` (``gate.weight`` / ``gate.bias``, ``experts.{e}.w1/w2/w3``, ``shared_experts``),
``mtp.{i}.attn_norm`` / ``ffn_norm``, ``mtp.{i}.hc_attn_{fn,base,scale}`` / ``hc_ffn_*``,
``mtp.0.main_proj`` / ``main_norm``, ``mtp.{last}.norm`` / ``markov_head.markov_w{1,2}`` /
``confidence_head.proj`` (assumed: the V4 ports' names carried over; no ``hc_head_*`` in V4.1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import CheckpointError
from engine.model.layers import GroupedLinear, replicate_streams
from engine.model.v41.config import V41Config
from engine.model.v41.layers import MoE, HyperSite, RMSNorm, collapse, expand
from engine.model.v41.model import DeepseekV41ForCausalLM
from kernels.reference import apply_rope_eager as apply_rope

_HC = re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$")
_SKIP = re.compile(r"\.ffn\.gate\.bias_vl$")  # the routers' image-span bias: text serving only


@dataclass
class DSparkState:
    """One sequence's draft context: per draft layer the rotated keys ``(C, D)`` of its last
    ``C ≤ W - 1`` context positions ``positions (C,)``; ``next_pos``: the anchor's position."""

    keys: list[torch.Tensor]
    positions: torch.Tensor
    next_pos: int = 0


@dataclass
class Block:
    """A drafted block: ``tokens`` (one per position) and the confidence head's scores."""

    tokens: list[int]
    confidence: list[float]


class DraftAttention(nn.Module):
    """A draft layer's window-only attention (V4.1's parameter names), over context keys + the block."""

    def __init__(self, cfg: V41Config, dtype: torch.dtype) -> None:
        super().__init__()
        h, qr, d = cfg.hidden_size, cfg.q_lora_rank, cfg.head_dim
        self.n_heads, self.head_dim, self.window, self.o_groups = cfg.num_attention_heads, d, cfg.sliding_window, cfg.o_groups
        self.scaling = d**-0.5
        self.wq_a = nn.Linear(h, qr, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(qr, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(qr, self.n_heads * d, bias=False, dtype=dtype)
        self.wkv = nn.Linear(h, d, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = GroupedLinear(self.n_heads * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups, dtype)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, h, bias=False, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))

    def keys(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotated keys (= values) ``(S, D)`` of rows ``x (S, H)``."""
        return apply_rope(self.kv_norm(self.wkv(x)), *rope)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, width: int,
        ctx: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # fmt: skip
        """``x (B·L, H)``: ``B`` blocks of ``width`` rows at ``positions``; ``ctx[b]``: block
        ``b``'s context keys and their positions → ``(B·L, H)``."""
        n = x.shape[0]
        q = apply_rope(self.wq_b(self.q_norm(self.wq_a(x))).view(n, self.n_heads, self.head_dim), *rope)  # (N, nh, D)
        kv = self.keys(x, rope)  # (N, D)
        outs = []
        for b, (ckeys, cpos) in enumerate(ctx):
            rows = slice(b * width, (b + 1) * width)
            pos = positions[rows]
            keys = torch.cat([ckeys, kv[rows]])  # (C + L, D)
            seen = cpos[None, :] > pos[:, None] - self.window  # (L, C): inside each query's window
            mask = torch.zeros(width, keys.shape[0], dtype=torch.float32, device=x.device)
            mask[:, : ckeys.shape[0]] = mask[:, : ckeys.shape[0]].masked_fill(~seen, float("-inf"))
            outs.append(self._attend(q[rows], keys, mask))
        out = apply_rope(torch.cat(outs), rope[0], -rope[1])  # undo the rotation the values picked up as keys
        return self.wo_b(self.wo_a(out.view(n, self.o_groups, -1)).flatten(1))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``q (L, nh, D)`` over ``keys (K, D)`` with the additive ``mask (L, K)`` and the sinks."""
        logits = torch.einsum("lhd,kd->hlk", q.float(), keys.float()) * self.scaling + mask  # (nh, L, K)
        sinks = self.attn_sink.float()[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]  # the sink only in the denominator
        return torch.einsum("hlk,kd->lhd", probs, keys.float()).to(q.dtype)  # (L, nh, D)


class MarkovHead(nn.Module):
    """``markov_w2(markov_w1(prev))``: a rank-``r`` bias of the next token's logits on the previous token."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank, dtype=dtype)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False, dtype=dtype)


class ConfidenceHead(nn.Module):
    """``σ(proj([x, markov_w1(prev)]))``: how likely the position's draft is accepted."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False, dtype=dtype)


class DraftLayer(nn.Module):
    """One draft layer: attention and MoE inside V4.1's single-pass mHC sites; the first also
    fuses the target features (``main_proj`` / ``main_norm``), the last carries the heads."""

    def __init__(self, cfg: V41Config, n_taps: int, dtype: torch.dtype, first: bool, last: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.attn = DraftAttention(cfg, dtype)
        self.ffn = MoE(cfg, dtype)
        self.attn_norm, self.ffn_norm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.hc_attn, self.hc_ffn = HyperSite(cfg), HyperSite(cfg)
        if first:
            self.main_proj = nn.Linear(n_taps * h, h, bias=False, dtype=dtype)
            self.main_norm = RMSNorm(h, cfg.rms_norm_eps)
        if last:
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, dtype)
            self.confidence_head = ConfidenceHead(h + cfg.dspark_markov_rank, dtype)

    def forward(
        self, streams: torch.Tensor, pre: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
        width: int, ctx: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``streams (N, hc, H)`` and the previous site's ``pre`` → new streams and this layer's FFN-site ``pre``."""
        attn_pre, post, comb = self.hc_attn.gates(streams)
        x = self.attn_norm(collapse(pre, streams))
        streams = expand(self.attn(x, rope, positions, width, ctx), streams, post, comb)
        ffn_pre, post, comb = self.hc_ffn.gates(streams)
        x = self.ffn_norm(collapse(attn_pre, streams))
        return expand(self.ffn(x), streams, post, comb), ffn_pre


class DSpark(nn.Module):
    """The draft layers (``module_name`` maps their parameters to release names)."""

    def __init__(self, cfg: V41Config, dtype: torch.dtype) -> None:
        super().__init__()
        n, taps = cfg.num_nextn_predict_layers, cfg.dspark_target_layer_ids
        if n < 1 or not taps or any(not 0 <= t < cfg.num_hidden_layers for t in taps):
            raise CheckpointError(f"config: DSpark needs num_nextn_predict_layers >= 1 and dspark_target_layer_ids in [0, {cfg.num_hidden_layers})")
        if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size or cfg.dspark_block_size < 1:
            raise CheckpointError("config: dspark_noise_token_id must be a token id and dspark_block_size >= 1")
        draft_cfg = replace(cfg, n_routed_experts=cfg.dspark_n_routed_experts, num_experts_per_tok=cfg.dspark_num_experts_per_tok)
        self.config, self.dtype = cfg, dtype
        self.layers = nn.ModuleList([DraftLayer(draft_cfg, len(taps), dtype, i == 0, i == n - 1) for i in range(n)])

    @classmethod
    def from_model(cls, model: DeepseekV41ForCausalLM) -> DSpark:
        """The draft layers from ``model.mtp`` (the checkpoint's ``mtp.*``); ``CheckpointError``
        when there are none or they are incomplete."""
        if not model.mtp:
            raise CheckpointError("the checkpoint has no DSpark draft layers (mtp.* tensors)")
        with torch.device(model.device):
            dspark = cls(model.config, model.dtype)
        dspark.load_release(model.mtp)
        return dspark.eval()

    def load_release(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy release-named tensors (``mtp.{i}.*``, dequantised) into the parameters; all needed."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for key, t in tensors.items():
            if _SKIP.search(key):
                continue
            name = internal_name(key)
            if name not in params:
                raise CheckpointError(f"unexpected DSpark tensor {key!r}")
            if tuple(t.shape) != tuple(params[name].shape):
                raise CheckpointError(f"DSpark tensor {key!r} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(t.to(params[name].dtype))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(f"missing DSpark tensor {release_name(missing[0])!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))

    def release_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters under their release names (``load_release``'s inverse)."""
        return {release_name(name): p.detach().contiguous() for name, p in self.named_parameters()}

    def new_state(self) -> DSparkState:
        d, dev = self.config.head_dim, self.layers[0].main_proj.weight.device
        return DSparkState([torch.empty(0, d, dtype=self.dtype, device=dev) for _ in self.layers], torch.empty(0, dtype=torch.long, device=dev))

    def context_keys(self, model: DeepseekV41ForCausalLM, feats: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Each draft layer's keys ``(S, D)`` of the target features ``feats (S, taps, H)`` at ``positions (S,)``."""
        first = self.layers[0]
        rows = first.main_norm(first.main_proj(feats.flatten(1).to(self.dtype)))  # (S, H)
        rope = model.rotary["main"].cos_sin(positions, rows.dtype)
        return [layer.attn.keys(rows, rope) for layer in self.layers]

    def block(
        self, model: DeepseekV41ForCausalLM, ctx: list[list[tuple[torch.Tensor, torch.Tensor]]], anchors: torch.Tensor, anchor_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block per sequence: ``ctx[layer][b]`` its context keys and positions, ``anchors (B,)``
        at ``anchor_pos (B,)`` → the collapsed outputs ``x (B, L, H)`` and head inputs ``norm(x)``."""
        cfg = self.config
        b, width = anchors.shape[0], cfg.dspark_block_size
        ids = torch.full((b, width), cfg.dspark_noise_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        positions = (anchor_pos[:, None] + torch.arange(width, device=anchors.device)).flatten()  # (B·L,)
        embeds = model.model.embed(ids.flatten())  # (B·L, H)
        streams = replicate_streams(embeds, cfg.hc_mult)
        pre = torch.zeros(streams.shape[0], cfg.hc_mult, dtype=torch.float32, device=embeds.device)
        pre[:, 0] = 1.0
        rope = model.rotary["main"].cos_sin(positions, embeds.dtype)
        for layer, c in zip(self.layers, ctx):
            streams, pre = layer(streams, pre, rope, positions, width, c)
        x = collapse(pre, streams)  # (B·L, H)
        return x.view(b, width, -1), self.layers[-1].norm(x).view(b, width, -1)


def internal_name(key: str) -> str:
    """The ``DSpark`` parameter of a release name (``mtp.{i}.…``, optionally ``model.``-prefixed)."""
    rest = re.sub(r"^(model\.)?mtp\.", "layers.", key)
    return _HC.sub(r".hc_\1.\2", rest)


def release_name(name: str) -> str:
    """The release name of a ``DSpark`` parameter (``internal_name``'s inverse)."""
    return re.sub(r"\.hc_(attn|ffn)\.(fn|base|scale)$", r".hc_\1_\2", "mtp." + name.removeprefix("layers."))


class DSparkDrafter:
    """Drafts blocks with DSpark for the speculative decoder (the same seam as V4's ``mtp.Drafter``).

    ``feed`` takes each sequence's new verify rows (``forward(logits="taps")`` rows: column 0, the
    final hidden state, is not used) at positions ``first_pos..`` and the tokens after them, keeps
    the last ``W - 1`` context keys per layer, and returns the anchors (each last row's next
    token); ``propose`` drafts one block per sequence from there (``threshold``: module docstring).
    """

    def __init__(self, model: DeepseekV41ForCausalLM, dspark: DSpark, threshold: float | None = None) -> None:
        self.model, self.dspark, self.threshold = model, dspark, threshold
        self.keep = model.config.sliding_window - 1

    def new_state(self) -> DSparkState:
        return self.dspark.new_state()

    @torch.inference_mode()
    def feed(self, states: list[DSparkState], rows: list[torch.Tensor], next_ids: list[list[int]], first_pos: list[int]) -> torch.Tensor:
        """Fold the rows ``(S_i, 1 + taps, H)`` into each context; the anchors ``(B,)``."""
        for st, r, ids, p in zip(states, rows, next_ids, first_pos):
            skip = max(0, len(ids) - self.keep)
            pos = torch.arange(p + skip, p + len(ids), device=r.device)
            for j, k in enumerate(self.dspark.context_keys(self.model, r[skip:, 1:], pos)):
                st.keys[j] = torch.cat([st.keys[j], k])[-self.keep :]
            st.positions = torch.cat([st.positions, pos])[-self.keep :]
            st.next_pos = p + len(ids)
        return torch.tensor([ids[-1] for ids in next_ids], dtype=torch.long, device=self.model.device)

    @torch.inference_mode()
    def draft(self, states: list[DSparkState], anchors: torch.Tensor, k: int) -> list[Block]:
        """One block per sequence, its first ``k ≤ dspark_block_size`` tokens and their confidences."""
        assert 1 <= k <= self.dspark.config.dspark_block_size, f"k {k} exceeds the DSpark block"
        ctx = [[(st.keys[j], st.positions) for st in states] for j in range(len(self.dspark.layers))]
        pos = torch.tensor([st.next_pos for st in states], device=anchors.device)
        x, hidden = self.dspark.block(self.model, ctx, anchors, pos)  # (B, L, H) each
        base = self.model.head.logits(hidden[:, :k].flatten(0, 1)).view(len(states), k, -1)  # (B, k, V) fp32
        last = self.dspark.layers[-1]
        prev, tokens, conf = anchors, [], []
        for j in range(k):
            m = last.markov_head.markov_w1(prev)  # (B, r)
            prev = (base[:, j] + last.markov_head.markov_w2(m).float()).argmax(-1)
            tokens.append(prev)
            conf.append(torch.sigmoid(last.confidence_head.proj(torch.cat([x[:, j], m], dim=-1)).float()[:, 0]))
        tok, cf = torch.stack(tokens, 1).tolist(), torch.stack(conf, 1).tolist()
        return [Block([int(t) for t in a], c) for a, c in zip(tok, cf)]

    def propose(self, states: list[DSparkState], anchors: torch.Tensor, k: int) -> list[list[int]]:
        """``k`` drafts per sequence, each block cut by the confidence ``threshold`` when one is set."""
        out = []
        for b in self.draft(states, anchors, k):
            n, run = len(b.tokens), 1.0
            if self.threshold is not None:
                for j, c in enumerate(b.confidence):
                    run *= c
                    if run < self.threshold:
                        n = max(1, j)
                        break
            out.append(b.tokens[:n])
        return out

"""DeepSeek-V4's multi-token-prediction (MTP) layer as a draft model.

What the layer consumes (settled from DeepSeek's V4 reference ``inference/model.py``, ``MTPBlock``):
for an entry at position ``p`` it takes ``h_p``, the main model's final residual *streams* at ``p``
``(hc, H)`` — per-stream rows, before the main hyper-head collapses them — and the id of the token
at ``p + 1``; then

    x = e_proj(enorm(embed(t_{p+1})))[None] + h_proj(hnorm(h_p))      # (hc, H), e broadcast over streams
    x = Block(x)                                                       # mHC-wrapped sliding-window attention + MoE
    logits(t_{p+2}) = head(norm(hc_head(x)))                           # the MTP's own hc_head and norm

with the embedding and the lm_head shared with the main model (``hnorm`` normalises every stream on
its own). The block is an ordinary V4 decoder layer with a compress ratio of 0 (the release's
``compress_ratios`` ends with the MTP's 0) and score-routed experts, so its only per-sequence state is
its sliding window (``LayerState.swa``). Chained drafting feeds the block's output streams back as
the next entry's ``h`` (there is one MTP layer; the release trains one depth).

A key of the window depends only on its own entry (projections of the entry's input), and an
entry's output sees the keys of the ``W`` entries ending at it, so feeding only the last ``W``
entries of a long prompt gives exactly the outputs and the window that feeding all of them does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import nn

from engine.errors import CheckpointError
from engine.model.attention import SeqSlice
from engine.model.config import SLIDING, ModelConfig
from engine.model.layers import HyperHead, RMSNorm
from engine.model.loader import to_hf_name
from engine.model.model import DecoderLayer, DeepseekV4ForCausalLM
from engine.model.state import LayerState

_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_OWN = {"enorm.weight", "hnorm.weight", "norm.weight", "e_proj.weight", "h_proj.weight"}
_HEAD = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}


class Entry(NamedTuple):
    """One sequence's MTP input: entries at positions ``first_pos ..`` of ``state``'s window."""

    state: LayerState
    first_pos: int
    streams: torch.Tensor  # (S, hc, H) main-model (or previous MTP) output streams at those positions
    next_ids: list[int]  # (S,) the token after each position


def block_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with the MTP block appended as layer ``num_hidden_layers`` (sliding, score-routed)."""
    return replace(
        cfg,
        num_hidden_layers=cfg.num_hidden_layers + 1,
        layer_types=(*cfg.layer_types, SLIDING),
        mlp_layer_types=(*cfg.mlp_layer_types, "moe"),
    )


class MTPLayer(nn.Module):
    """The MTP layer's own weights; embedding, rotary tables and lm_head come from the main model."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm, self.norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.e_proj = nn.Linear(h, h, bias=False, dtype=dtype)
        self.h_proj = nn.Linear(h, h, bias=False, dtype=dtype)
        self.block = DecoderLayer(block_config(cfg), cfg.num_hidden_layers, dtype)
        self.hc_head = HyperHead(cfg)
        self.dtype = dtype

    @classmethod
    def from_model(cls, model: DeepseekV4ForCausalLM) -> MTPLayer:
        """The layer built from ``model.mtp`` (the checkpoint's ``mtp.0.*`` tensors, release names);
        raises ``CheckpointError`` when the checkpoint has none or they are incomplete."""
        if not model.mtp:
            raise CheckpointError("the checkpoint has no MTP layer (mtp.0.* tensors)")
        with torch.device(model.device):
            layer = cls(model.config, model.dtype)
        layer.load_release(model.mtp)
        return layer.eval()

    def load_release(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy release-named tensors (``mtp.0.*``, dequantised) into the parameters; every one
        must be present (experts stacked as the main layers store them)."""
        params = dict(self.named_parameters())
        params.update(dict(self.named_buffers()))
        experts: dict[int, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for key, t in tensors.items():
            rest = re.sub(r"^(model\.)?mtp\.0\.", "", key)
            m = _EXPERT.match(rest)
            if m:
                experts.setdefault(int(m.group(1)), {})[m.group(2)] = t
                continue
            name = module_name(rest)
            if name not in params:
                raise CheckpointError(f"unexpected MTP tensor {key!r}")
            _copy(params[name], t, key)
            loaded.add(name)
        ex = self.block.mlp.experts
        n = ex.gate_up_proj.shape[0]
        if sorted(experts) != list(range(n)) or any(set(w) != {"w1", "w2", "w3"} for w in experts.values()):
            raise CheckpointError(f"MTP experts incomplete (need w1/w2/w3 for {n} experts)")
        _copy(ex.gate_up_proj, torch.stack([torch.cat([experts[e]["w1"], experts[e]["w3"]]) for e in range(n)]), "mtp experts w1/w3")
        _copy(ex.down_proj, torch.stack([experts[e]["w2"] for e in range(n)]), "mtp experts w2")
        loaded |= {"block.mlp.experts.gate_up_proj", "block.mlp.experts.down_proj"}
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(f"missing MTP tensor for {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))

    def release_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters under their release names (``mtp.0.*``, experts one by one): the
        inverse of ``load_release``, for writing a checkpoint."""
        by_module: dict[str, str] = {}
        out: dict[str, torch.Tensor] = {}
        ex = self.block.mlp.experts
        inter = ex.down_proj.shape[-1]
        for e in range(ex.gate_up_proj.shape[0]):
            gate_up = ex.gate_up_proj[e].detach()
            out[f"mtp.0.ffn.experts.{e}.w1.weight"] = gate_up[:inter].contiguous()
            out[f"mtp.0.ffn.experts.{e}.w3.weight"] = gate_up[inter:].contiguous()
            out[f"mtp.0.ffn.experts.{e}.w2.weight"] = ex.down_proj[e].detach().contiguous()
        for rest in _release_names(self):
            by_module[module_name(rest)] = rest
        tensors = dict(self.named_parameters())
        tensors.update(dict(self.named_buffers()))
        for name, t in tensors.items():
            if name.startswith("block.mlp.experts."):
                continue
            out["mtp.0." + by_module[name]] = t.detach().contiguous()
        return out

    def new_state(self) -> LayerState:
        """An empty sliding window for one sequence."""
        return self.block.self_attn.empty_state(self.dtype, self.e_proj.weight.device)

    def forward(self, model: DeepseekV4ForCausalLM, entries: list[Entry]) -> torch.Tensor:
        """The block's output streams ``(N, hc, H)`` of every entry (entries concatenated in order);
        each entry's window state is updated in place."""
        streams = torch.cat([e.streams for e in entries]) if len(entries) > 1 else entries[0].streams  # (N, hc, H)
        ids = [t for e in entries for t in e.next_ids]
        device = streams.device
        token_ids = torch.tensor(ids, dtype=torch.long, device=device)  # (N,)
        positions = torch.tensor([e.first_pos + j for e in entries for j in range(len(e.next_ids))], device=device)  # (N,)
        x = self.inputs(model, token_ids, streams)  # (N, hc, H)
        seqs, n = [], 0
        for e in entries:
            seqs.append(SeqSlice(e.state, n, n + len(e.next_ids), e.first_pos))
            n += len(e.next_ids)
        rope = model.rotary["main"].cos_sin(positions, x.dtype)
        return self.block(x, token_ids, positions, rope, model.rotary["compress"], seqs)

    def inputs(self, model: DeepseekV4ForCausalLM, token_ids: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The block's input streams ``(N, hc, H)``: ``e_proj(enorm(embed(t)))`` broadcast over the
        streams plus ``h_proj(hnorm(h))`` (module docstring)."""
        return self.e_proj(self.enorm(model.model.embed_tokens(token_ids))).unsqueeze(1) + self.h_proj(self.hnorm(streams))

    def hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The head's input ``(N, H)`` from MTP output streams: its own hyper-head and norm."""
        return self.norm(self.hc_head(streams))


def module_name(rest: str) -> str:
    """The ``MTPLayer`` parameter of a release name without its ``mtp.0.`` prefix (not experts)."""
    if rest in _OWN:
        return rest
    if rest in _HEAD:
        return _HEAD[rest]
    return "block." + to_hf_name(f"layers.0.{rest}").removeprefix("model.layers.0.")


def _release_names(layer: MTPLayer) -> list[str]:
    """Every non-expert release name (without ``mtp.0.``) of the layer's parameters."""
    from engine.model.random_checkpoint import mtp_specs

    a = layer.block.self_attn
    cfg = {
        "hidden_size": layer.e_proj.in_features, "hc_mult": layer.hc_head.hc_fn.shape[0], "num_attention_heads": a.n_heads,
        "head_dim": a.head_dim, "q_lora_rank": a.q_a_proj.out_features, "o_groups": a.o_groups,
        "o_lora_rank": a.o_b_proj.in_features // a.o_groups, "n_routed_experts": 0, "moe_intermediate_size": 0,
    }  # fmt: skip
    return [s.name.removeprefix("mtp.0.") for s in mtp_specs(cfg) if s.kind not in ("fp8_scale", "fp4_scale")]


def _copy(target: torch.Tensor, tensor: torch.Tensor, key: str) -> None:
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(f"MTP tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))


@dataclass
class DraftState:
    """One sequence's drafting state: the MTP window and where its next entry goes; ``slot``: the
    window lives in that slot of a ``slots.mtp_pool.MTPPool`` instead (``window`` is stale then)."""

    window: LayerState
    next_pos: int = 0  # position of the next entry (entries before it are in the window or too old)
    slot: int | None = None


class Drafter:
    """Proposes ``k`` greedy draft tokens per sequence with the MTP layer, chained.

    ``propose`` takes each sequence's new real entries (positions whose main-model streams and next
    token are now known), feeds them into its window (kept), then chains ``k - 1`` more entries on
    the MTP's own output streams and drafted tokens; those chained entries are dropped from the
    window again (the window is a replaced tensor, so keeping the reference restores it).
    """

    def __init__(self, model: DeepseekV4ForCausalLM, layer: MTPLayer) -> None:
        self.model, self.layer = model, layer
        self.window = model.config.sliding_window

    def new_state(self) -> DraftState:
        return DraftState(self.layer.new_state())

    @torch.inference_mode()
    def feed(self, states: list[DraftState], streams: list[torch.Tensor], next_ids: list[list[int]], first_pos: list[int]) -> torch.Tensor:
        """Feed real entries (``streams[i] (S_i, hc, H)`` at positions ``first_pos[i]..``; only the
        last ``W`` matter, module docstring); returns the output streams of each sequence's last entry ``(B, hc, H)``."""
        entries = []
        for st, s, ids, p in zip(states, streams, next_ids, first_pos):
            skip = max(0, len(ids) - self.window)
            entries.append(Entry(st.window, p + skip, s[skip:], ids[skip:]))
            st.next_pos = p + len(ids)
        out = self.layer(self.model, entries)  # (N, hc, H)
        ends = torch.tensor([len(e.next_ids) for e in entries]).cumsum(0) - 1
        return out[ends.to(out.device)]

    @torch.inference_mode()
    def propose(self, states: list[DraftState], last: torch.Tensor, k: int) -> list[list[int]]:
        """``k`` drafts per sequence from the output streams ``last (B, hc, H)`` of each one's last
        real entry: the first from those, the rest chained; the windows end as they began."""
        kept = [st.window.swa for st in states]
        drafts: list[list[int]] = [[] for _ in states]
        cur = last
        for j in range(k):
            tokens = self.model.head.argmax(self.layer.hidden(cur)).tolist()  # (B,)
            for d, t in zip(drafts, tokens):
                d.append(int(t))
            if j + 1 < k:
                entries = [Entry(st.window, st.next_pos + j, cur[i : i + 1], [tokens[i]]) for i, st in enumerate(states)]
                cur = self.layer(self.model, entries)  # (B, hc, H)
        for st, swa in zip(states, kept):
            st.window.swa = swa
        return drafts

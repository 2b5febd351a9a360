"""DeepSeek-V4.1 decode over fixed slots: host-sync-free, fixed-shape steps, one CUDA graph per
batch-size bucket (V4's ``engine/model/static_decode.py`` for the V4.1 family).

Every sequence lives in a *slot* of preallocated pools (``S`` slots plus scratch slot ``S``, which
padded rows of a bucket point at); D = head_dim, Di = index_head_dim, W = sliding window, r a KV
source's compress ratio, ``Tc = max_tokens // r``:

- every layer: the window ring, FP8 codes ``win_q (S+1, W, D)`` and ue8m0 exponents
  ``win_e (S+1, W, D/32)``, token ``p`` at ``p % W``;
- every KV-source layer: the shared compressed KV (rotated at its group's first position), packed
  e2m1 codes ``rows_q (S+1, Tc+1, D/2)`` and e4m3 scales ``rows_s (S+1, Tc+1, D/16)``; the
  indexer keys (a source that is also an index source) ``keys_q (S+1, Tc+1, Di/2)`` and ue8m0
  exponents ``keys_e (S+1, Tc+1, Di/32)``; row ``Tc`` a scratch row; ``buf_kv / buf_gate (S+1, r,
  D)`` fp32 projections of the open group (ratio > 1), token ``p`` at ``p % r``;
- engram checkpoints: ``history (S+1, N-1)`` the last ``N-1`` compressed token ids (the pad id
  before a sequence's start).

Codes and scales are ``kernels.v41_kv``'s (the bytes of ``row_codec``'s FP8_WINDOW / FP4_MAIN /
FP4_INDEX rows, kept as uint8: 528, 288 and 68 B a row at the released widths), so the pools hold
exactly the values of the general path's ``V41SequenceState``: ``load`` encodes them
(``row_codec.encode_rows``, which refuses values off their grid), ``export`` decodes them. The
slots need whole blocks (``head_dim``, ``index_head_dim`` multiples of 32) and FP4 compressed KV;
other checkpoints keep the general path (``ValueError`` at construction).

The step is the general path's math, layer by layer, with the batch as the leading axis:
projections, engram, mHC and MoE on the ``b`` rows; a source's group closing at token ``p``
(``p % r == r-1``) pooled for every row, packed and written by ``index_copy_`` to row ``p // r``
(the scratch row for the others); the indexer scores all ``Tc`` columns (``-inf`` from each row's
count of complete rows on), level one (candidate blocks) and level two (top ``index_topk``) with
fixed ``k``; attention is one masked softmax with the sinks over [the window, the chosen rows].
What the general path's ``Shared`` hands from layer to layer (the group's picks and candidate
blocks) is reset at every KV source, as there. Where Triton runs (CUDA; ``kernels``) the step's
glue is a few kernels instead of the general path's ~250 small PyTorch launches a layer (batch 1
is launch-bound):

- the indexer scores and the attention: ``kernels.v41_indexer`` / ``kernels.v41_attention`` over
  the codes, dequantised in registers (fp32 accumulation; the attention's key range split across
  programs at small batches, ``V41SlotTuning.attention``), the output cast in the kernel;
- each mHC site: the input norm and dot as split-K partials (``kernels.fused.hc_pre_parts``), the
  gates and Sinkhorn (``kernels.mhc.hc_mix_parts``), collapse + the block's norm and expand
  (``kernels.v41_mhc``; a lone ``RMSNorm`` is ``collapse_norm`` of one stream with weight 1);
  with ``V41SlotTuning.fuse_sites`` the gates beside the collapse in one launch
  (``v41_mhc.mix_collapse_norm``);
- with ``V41SlotTuning.side_stream`` (CUDA) branches that do not feed the next kernel run on
  side streams, captured as parallel graph branches: the step's index tensors next to the first
  mHC site; next to the q projection the KV window write, a KV source's compressor, and the
  indexer's query and then (after that compressor's keys) its picks, each on its own stream;
  the shared expert's SwiGLU rows (``moe_gemv.shared_act``) next to the router;
- RoPE (and its inverse on the attention output): ``kernels.fused.norm_rope`` from the rotaries'
  position tables (``Rotary.table``), the compressor's group start as ``pos // r · r``;
- routed + shared experts of at most ``V41SlotTuning.moe_gemv.max_slots`` (token, pick) pairs:
  ``kernels.moe_gemv`` (two weight-streaming GEMV kernels that read only the picked experts'
  rows); above, in bf16, ``kernels.moe.moe_experts`` (grouped, no host sync). Both apply the
  routing weight after the down projection instead of before it and add the picks in routing
  order (fp32 sums; other last bits than ``MoE.forward``);
- at batch 1 (``V41SlotTuning.dense_gemv``) the dense projections (the attention's, the
  grouped ``o_a`` as gemv's groups, the compressors', the indexer's, the router's fp32 logits)
  and the lm_head through ``kernels.gemv`` (one weight stream, no split-K reduce) instead of
  cuBLAS: H200 4-layer Flash-width slice, b=1 2.32 → 2.22 ms (NOTES run 36);
- the router after its logits: ``kernels.moe.route`` (scores, bias, top-k, weights in one launch);
- the index tensors several layers share (window slots, group rows, complete-row counts): once a
  step (``_once``);
- a ratio > 1 source's open group: its buffers written and pooled in one kernel (``pool_group``);
- the KV writes: each token's window KV, compressed row and indexer keys packed and stored
  straight into their pool rows, and the indexer query's FP4 rounding, one kernel each
  (``kernels.v41_pack``, the same codes as ``kernels.v41_kv``'s packers with ``index_copy_``).

Elsewhere the codes are unpacked and the step runs the general path's PyTorch ops on the same
values: one gathered matmul per (token, pick) for the experts, summed in expert order as
``MoE.forward`` does. The experts' weights are stacked once (``(E, 2I, H)`` gate|up and ``(E, H,
I)`` down) and the model's expert parameters become views of the stacks, so the weights are held once.

Same numbers as the general path in fp32 (tests: same greedy tokens, logprobs within 1e-4 on the
fixtures). Known difference, as in V4's static decoder: ``topk`` over ``Tc`` columns may break exact
score ties at the cut differently from the general path's over the rows so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.layers import replicate_streams
from engine.model.static_decode import BUCKETS, bucket_for
from engine.model.slots.graphs import branch, capture
from engine.model.v41.attention import candidate_blocks
from engine.model.v41.layers import RMSNorm, collapse, expand
from engine.model.v41.model import DeepseekV41ForCausalLM
from engine.model.v41.quant import fp4_indexer
from engine.model.v41.row_codec import FP4_INDEX, FP4_MAIN, FP8_WINDOW, encode_rows
from engine.model.v41.state import SourceState, V41SequenceState
from kernels import v41_mhc
from kernels._common import use_triton
from kernels.fused import hc_pre_parts, norm_rope
from kernels.gemv import gemv
from kernels.mhc import hc_mix_parts
from kernels.moe import SCORING_FUNCS, has_grouped_mm, moe_experts, route
from kernels.moe_gemv import MoEGemvTuning, moe_gemv, shared_act, use_gemv
from kernels.reference import apply_rope_eager as apply_rope
from kernels.v41_attention import V41AttentionTuning, v41_decode_attention
from kernels.v41_indexer import v41_indexer_scores
from kernels.v41_kv import unpack_fp4_keys, unpack_fp4_rows, unpack_fp8_window
from kernels.v41_pack import fp4_indexer_quant, pool_group, write_fp4_keys, write_fp4_rows, write_fp8_window

E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True)
class V41SlotTuning:
    """The kernel path's settings (module docstring), given where the decoder is built.
    ``attention``: the decode attention's tiles and key-range splits (from the batch);
    ``moe_gemv``: when (``max_slots`` routed pairs at most) and how the experts take the GEMV
    kernels; ``hc_splits``: split-K ways of each mHC site's input dot at most (as V4's
    ``DecodeTuning.hc_splits``); ``dense_gemv``: the dense projections at batch 1 through
    ``kernels.gemv`` (a programmatic dependent launch with ``gemv_pdl``) instead of cuBLAS, as
    V4's ``DecodeTuning.dense_gemv``; ``fuse_sites``: each mHC site's gates and collapse in one
    launch (``v41_mhc.mix_collapse_norm``); ``side_stream``: on CUDA the branches that do not
    feed the next kernel fork onto a side stream (module docstring), as V4's."""

    attention: V41AttentionTuning = field(default_factory=V41AttentionTuning)
    moe_gemv: MoEGemvTuning = field(default_factory=MoEGemvTuning)
    hc_splits: int = 64
    dense_gemv: bool = True
    gemv_pdl: bool = True
    fuse_sites: bool = True
    side_stream: bool = True


@dataclass
class SourcePool:
    """One KV-source layer's pools for all slots (module docstring; codes as uint8)."""

    ratio: int
    rows_q: torch.Tensor  # (S+1, Tc+1, D/2) packed e2m1
    rows_s: torch.Tensor  # (S+1, Tc+1, D/16) e4m3 bytes
    keys_q: torch.Tensor | None  # (S+1, Tc+1, Di/2) packed e2m1
    keys_e: torch.Tensor | None  # (S+1, Tc+1, Di/32) ue8m0
    buf_kv: torch.Tensor | None  # (S+1, r, D) fp32, ratio > 1
    buf_gate: torch.Tensor | None  # (S+1, r, D) fp32

    def rows(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The slots' rows as values ``(b, Tc, D)`` (the scratch row left out)."""
        return unpack_fp4_rows(self.rows_q[slots, :-1], self.rows_s[slots, :-1].view(E4M3)).to(dtype)

    def keys(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The slots' indexer keys as values ``(b, Tc, Di)``."""
        return unpack_fp4_keys(self.keys_q[slots, :-1], self.keys_e[slots, :-1]).to(dtype)


def _u8(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8, device=device)


class V41SlotDecoder:
    """Slot pool + fixed-shape decode step of a ``DeepseekV41ForCausalLM`` (module docstring); a
    ``engine.model.slots.SlotDecoder[V41SequenceState]`` (no verify steps).

    ``max_slots`` sequences of up to ``max_tokens`` tokens each. ``use_graphs`` (default: on
    CUDA) captures one CUDA graph per bucket on its first use. ``step`` returns float32 logits
    ``(n, V)``; with graphs the graph's output buffer, valid until the next step."""

    output = "logits"
    verify_width = 1  # no speculative verify steps for V4.1 yet

    def __init__(
        self, model: DeepseekV41ForCausalLM, max_slots: int, max_tokens: int,
        use_graphs: bool | None = None, buckets: Sequence[int] = BUCKETS,
        experts: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None, kernels: bool | None = None,
        tuning: V41SlotTuning = V41SlotTuning(),
    ) -> None:  # fmt: skip
        """``experts``: per layer the ``(gate_up, down)`` stacks the model's expert parameters
        already are views of (a builder that made them so); None: stacked here. ``kernels``: the
        step's Triton kernels (module docstring; None: where Triton runs), set by ``tuning``."""
        self.model, self.cfg = model, model.config
        self.device, self.dtype = model.device, model.dtype
        self.max_slots, self.max_tokens, self.scratch = max_slots, max_tokens, max_slots
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.buckets = tuple(sorted({b for b in buckets if b < max_slots} | {max_slots}))
        cfg, s1, dev, dt = self.cfg, max_slots + 1, self.device, self.dtype
        if cfg.head_dim % 32 or cfg.index_head_dim % 32 or not cfg.use_fp4_sparse_kv:
            raise ValueError("the V4.1 slots store FP8/FP4 codes: head_dim and index_head_dim must be multiples of 32, compressed KV FP4")
        d, di, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
        with torch.inference_mode():
            self.win_q = [_u8((s1, w, d), dev) for _ in model.model.layers]  # e4m3 bytes
            self.win_e = [_u8((s1, w, d // 32), dev) for _ in model.model.layers]
            self.sources: dict[int, SourcePool] = {}
            for i in cfg.kv_source_layer_ids:
                r, tc = cfg.compress_ratios[i], max_tokens // cfg.compress_ratios[i]
                index = i in cfg.index_source_layer_ids
                keys = (_u8((s1, tc + 1, di // 2), dev), _u8((s1, tc + 1, di // 32), dev)) if index else (None, None)
                bufs = [torch.zeros(s1, r, d, dtype=torch.float32, device=dev) for _ in range(2)] if r > 1 else [None, None]
                self.sources[i] = SourcePool(r, _u8((s1, tc + 1, d // 2), dev), _u8((s1, tc + 1, d // 16), dev), *keys, *bufs)
            keep = cfg.engram_max_ngram_size - 1 if model.hasher is not None else 0
            self.history = torch.zeros(s1, keep, dtype=torch.long, device=dev)
            h = model.hasher  # its tables on the device once (a graph cannot copy them in)
            self._hash = None if h is None else tuple(t.to(dev) for t in (h.token_map, h.multipliers, h.primes, h.offsets))
            self._inputs = torch.zeros(3, self.buckets[-1], dtype=torch.long, device=dev)  # ids, positions, slots
        self._experts = list(experts) if experts is not None else self._stack_experts()
        for layer in model.model.layers:  # made now, not by a later prefill: captured graphs hold the weights' addresses
            layer.ffn.shared_gate_up()
        self.tuning = tuning
        self.grouped_moe = use_triton(self._inputs) and has_grouped_mm(dt)
        self.kernels = use_triton(self._inputs) if kernels is None else kernels  # the step's glue in Triton (module docstring)
        self.dense_gemv = self.kernels and tuning.dense_gemv
        side = tuning.side_stream and dev.type == "cuda"  # the side streams of _attention's branches
        self._streams = {name: torch.cuda.Stream(dev) for name in ("kv", "compress", "index")} if side else {}
        if self.kernels:
            with torch.inference_mode():  # the rotaries' tables and a column of ones, built before any capture
                self._tables = {kind: rot.table(max_tokens, dt, dev) for kind, rot in model.rotary.items()}
                self._ones = torch.ones(self.buckets[-1], 1, dtype=torch.float32, device=dev)  # (b, 1): one stream, weight 1
        self.num_tokens = [0] * max_slots
        self.token_ids: list[list[int]] = [[] for _ in range(max_slots)]
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._memo: dict[tuple, torch.Tensor] = {}  # see _once

    def _stack_experts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's routed-expert stacks (``MoE.stack``: the parameters become views of them)."""
        return [layer.ffn.stack() for layer in self.model.model.layers]

    def nbytes(self) -> int:
        """Bytes of the slot pools."""
        ts = [*self.win_q, *self.win_e, self.history]
        for sp in self.sources.values():
            ts += [t for t in (sp.rows_q, sp.rows_s, sp.keys_q, sp.keys_e, sp.buf_kv, sp.buf_gate) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    # ---- state import / export -------------------------------------------------------------
    @torch.inference_mode()
    def load(self, slot: int, state: V41SequenceState) -> None:
        """Copy a general-path state (after prefill) into ``slot``; ``ValueError`` for a state the
        slots cannot hold (a bounded replay's, one mid-replay, one with no room left)."""
        n, cfg = state.num_tokens, self.cfg
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} outside [0, {self.max_slots})")
        if n >= self.max_tokens:
            raise ValueError(f"state of {n} tokens leaves no room in a {self.max_tokens}-token slot")
        if state.decoder_from:
            raise ValueError("a bounded-replay state cannot be loaded into a slot")
        for i, sp in self.sources.items():
            src = state.sources[i]
            if src.rows.shape[0] * sp.ratio + src.buf_kv.shape[0] != n:
                raise ValueError("only states whose compressors hold exactly their tokens can be loaded")
        w, d, di, dev = cfg.sliding_window, cfg.head_dim, cfg.index_head_dim, self.device
        encoded = []  # every encoding first: one that fails (ValueError) leaves the slot untouched
        for win in state.windows:
            m = min(win.shape[0], w - 1, n)
            encoded.append((m, encode_rows(win[win.shape[0] - m :], FP8_WINDOW).to(dev)))
        rows = {}
        for i, sp in self.sources.items():
            src = state.sources[i]
            keys = encode_rows(src.keys, FP4_INDEX).to(dev) if sp.keys_q is not None else None
            rows[i] = (encode_rows(src.rows, FP4_MAIN).to(dev), keys)
        for (m, raw), q, e in zip(encoded, self.win_q, self.win_e):
            if m:
                at = torch.arange(n - m, n, device=dev) % w
                q[slot, at], e[slot, at] = raw[:, :d], raw[:, d:]
        for i, sp in self.sources.items():
            src, (raw, keys) = state.sources[i], rows[i]
            t = src.rows.shape[0]
            sp.rows_q[slot, :t], sp.rows_s[slot, :t] = raw[:, : d // 2], raw[:, d // 2 :]
            if keys is not None:
                sp.keys_q[slot, :t], sp.keys_e[slot, :t] = keys[:, : di // 2], keys[:, di // 2 :]
            if sp.buf_kv is not None:
                nb = src.buf_kv.shape[0]
                sp.buf_kv[slot, :nb] = src.buf_kv  # token p at p % r: a group starts at index 0
                sp.buf_gate[slot, :nb] = src.buf_gate
        if self.history.shape[1]:
            hist = self.model.hasher.history(state.token_ids)
            pad = [self.model.hasher.pad_id] * (self.history.shape[1] - len(hist))
            self.history[slot] = torch.tensor(pad + hist, dtype=torch.long)
        self.num_tokens[slot] = n
        self.token_ids[slot] = list(state.token_ids)

    @torch.inference_mode()
    def export(self, slot: int) -> V41SequenceState:
        """``slot``'s state as a general-path ``V41SequenceState`` (copies)."""
        n, w = self.num_tokens[slot], self.cfg.sliding_window
        m = min(n, w - 1)
        at = torch.arange(n - m, n, device=self.device) % w
        windows = [unpack_fp8_window(q[slot, at].view(E4M3), e[slot, at]).to(self.dtype) for q, e in zip(self.win_q, self.win_e)]
        sources = {}
        one = torch.tensor([slot], device=self.device)
        for i, sp in self.sources.items():
            t = n // sp.ratio
            nb = n - t * sp.ratio
            rows = sp.rows(one, self.dtype)[0, :t].clone()
            keys = None if sp.keys_q is None else sp.keys(one, self.dtype)[0, :t].clone()
            if sp.buf_kv is None:
                buf = torch.empty(0, self.cfg.head_dim, dtype=torch.float32, device=self.device)
                sources[i] = SourceState(rows, keys, buf, buf.clone())
            else:
                sources[i] = SourceState(rows, keys, sp.buf_kv[slot, :nb].clone(), sp.buf_gate[slot, :nb].clone())
        ids = list(self.token_ids[slot])
        engram = self.model.hasher.history(ids) if self.model.hasher is not None else []
        return V41SequenceState(windows, sources, engram, n, ids)

    def free(self, slot: int) -> None:
        self.num_tokens[slot] = 0
        self.token_ids[slot] = []

    # ---- the step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, slots: Sequence[int], token_ids: Sequence[int], bucket: int | None = None) -> torch.Tensor:
        """One decode token per listed slot → float32 logits ``(n, V)``; ``bucket`` forces the
        padded batch size (one of ``self.buckets``, at least ``n``)."""
        n = len(slots)
        if n != len(token_ids) or (n == 0 and bucket is None) or len(set(slots)) != n:
            raise ValueError("one token per slot, each slot once, at least one slot (or a bucket)")
        if any(self.num_tokens[s] >= self.max_tokens for s in slots):
            raise ValueError(f"a slot is full ({self.max_tokens} tokens)")
        if bucket is not None and (bucket not in self.buckets or bucket < n):
            raise ValueError(f"bucket {bucket} is not a bucket of at least {n} rows")
        b = bucket_for(n, self.buckets) if bucket is None else bucket
        if self.use_graphs and b not in self._graphs:
            self._capture(b)
        pad = b - n
        host = torch.tensor(
            [list(token_ids) + [0] * pad, [self.num_tokens[s] for s in slots] + [0] * pad, list(slots) + [self.scratch] * pad],
            dtype=torch.long,
        )  # fmt: skip
        self._inputs[:, :b].copy_(host, non_blocking=self.device.type == "cuda")
        if self.use_graphs:
            graph, out = self._graphs[b]
            graph.replay()
        else:
            out = self._forward(b)
        for s, t in zip(slots, token_ids):
            self.num_tokens[s] += 1
            self.token_ids[s].append(int(t))
        return out[:n]

    @torch.inference_mode()  # the slot buffers are inference tensors
    def capture_graphs(self) -> None:
        """Capture every bucket's step graph now (else each on its first step); without graphs
        a no-op."""
        if not self.use_graphs:
            return
        for b in self.buckets:
            if b not in self._graphs:
                self._capture(b)

    def _capture(self, b: int) -> None:
        """Warm up and capture bucket ``b`` on scratch inputs (they touch only the scratch slot)."""
        init = torch.zeros(3, b, dtype=torch.long)
        init[2] = self.scratch
        self._inputs[:, :b] = init.to(self.device)
        self._graphs[b] = capture(lambda: self._forward(b), self.device)

    def _forward(self, b: int) -> torch.Tensor:
        """The step over the first ``b`` input columns → float32 logits ``(b, V)``."""
        model, cfg = self.model, self.cfg
        ids, pos, slots = self._inputs[0, :b], self._inputs[1, :b], self._inputs[2, :b]  # (b,) each
        self._memo = {}  # this step's index tensors, each computed once for the layers that share it (_once)
        hash_ids = self._engram_hashes(ids, slots) if self.history.shape[1] else None
        embeds = model.model.embed(ids)  # (b, H)
        streams = replicate_streams(embeds, cfg.hc_mult)  # (b, hc, H)
        pre = torch.zeros(b, cfg.hc_mult, dtype=torch.float32, device=ids.device)  # (b, hc): one-hot first mix
        pre[:, 0] = 1.0
        ropes = None if self.kernels else {kind: rot.cos_sin(pos, embeds.dtype) for kind, rot in model.rotary.items()}
        group: dict = {}  # the KV group: its source layer, its rows (unpacked when asked), picks, candidates
        with branch(self._streams.get("kv")) as indices_ready:  # next to the first mHC site
            self._indices(pos, slots)
        for i, layer in enumerate(model.model.layers):
            if layer.engram is not None:
                streams = layer.engram(streams, hash_ids[:, layer.engram.slot])
            attn_pre, post, comb, x = self._site(layer.hc_attn, layer.attn_norm, pre, streams)  # x (b, H)
            if i == 0:
                indices_ready()
            streams = self._expand(self._attention(i, layer.attn, x, pos, slots, ropes, group), streams, post, comb)
            ffn_pre, post, comb, x = self._site(layer.hc_ffn, layer.ffn_norm, attn_pre, streams)
            streams, pre = self._expand(self._moe(i, layer.ffn, x), streams, post, comb), ffn_pre
        hidden = self._collapse_norm(model.model.norm, pre, streams)
        if self._gemv(hidden):  # LMHead.logits: F.linear, then fp32
            return gemv(hidden, model.lm_head.weight, out_dtype=torch.float32, pdl=self.tuning.gemv_pdl)
        return model.head.logits(hidden)  # (b, V)

    def _once(self, key: tuple, make) -> torch.Tensor:
        """The step's index tensor ``key`` (``make()`` the first time a layer asks in this step):
        the positions' window slots, the groups' rows and counts are the same for every layer
        of a window or a compress ratio."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def _window_at(self, w: int, pos: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Each row's flat slot in a ``w``-token window ring → ``(b,)``."""
        return self._once(("window_at", w), lambda: slots * w + pos % w)

    def _window_len(self, w: int, pos: torch.Tensor) -> torch.Tensor:
        """Each row's filled window length → ``(b,)``."""
        return self._once(("window_len", w), lambda: torch.clamp(pos + 1, max=w))

    def _row_at(self, r: int, tc: int, pos: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Each row's flat compressed row in a ratio-``r`` pool of ``tc`` rows: the group ``pos``
        closes, else (open) the slot's scratch row ``tc`` → ``(b,)``."""

        def make() -> torch.Tensor:
            row = torch.div(pos, r, rounding_mode="floor")
            return slots * (tc + 1) + (row if r == 1 else torch.where(pos % r == r - 1, row, tc))

        return self._once(("row_at", r, tc), make)

    def _complete(self, r: int, pos: torch.Tensor) -> torch.Tensor:
        """Each row's count of complete ratio-``r`` groups → ``(b,)``."""
        return self._once(("complete", r), lambda: torch.div(pos + 1, r, rounding_mode="floor"))

    def _indices(self, pos: torch.Tensor, slots: torch.Tensor) -> None:
        """Every index tensor the step's layers ask (``_once``), computed up front (on a side
        stream next to the first mHC site, with side streams)."""
        for layer in self.model.model.layers:
            attn = layer.attn
            self._window_at(attn.window, pos, slots)
            self._window_len(attn.window, pos)
            if attn.compressor is not None:
                sp = self.sources[attn.layer_idx]
                self._row_at(sp.ratio, sp.rows_q.shape[1] - 1, pos, slots)
            if attn.indexer is not None:
                self._complete(attn.indexer.ratio, pos)

    def _gemv(self, x: torch.Tensor) -> bool:
        """Whether a dense projection of ``x (b, ·)`` runs through ``kernels.gemv`` (one token)."""
        return self.dense_gemv and x.shape[0] == 1

    def _linear(self, lin: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``lin(x)`` (no bias); at one token ``kernels.gemv`` (one rounding to ``x``'s dtype)."""
        return gemv(x, lin.weight, pdl=self.tuning.gemv_pdl) if self._gemv(x) else lin(x)

    def _linear32(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x.float(), w.float())`` (fp32); at one token ``kernels.gemv`` over ``w`` as
        stored (the same products, no fp32 copy of ``w``; other summation order)."""
        if self._gemv(x):
            return gemv(x, w, out_dtype=torch.float32, pdl=self.tuning.gemv_pdl, round_to_x=False)
        return F.linear(x.float(), w.float())

    def _collapse_norm(self, norm: RMSNorm, pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """``norm(collapse(pre, streams))`` → ``(b, H)``: one kernel with the kernels."""
        if not self.kernels:
            return norm(collapse(pre, streams))
        return v41_mhc.collapse_norm(pre, streams, norm.weight, norm.eps)

    def _expand(self, x: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``layers.expand``: one kernel with the kernels."""
        return v41_mhc.expand(x, streams, post, comb) if self.kernels else expand(x, streams, post, comb)

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)`` of ``x (b, n)``; with the kernels ``collapse_norm`` of the one stream ``x``
        with weight 1 (the collapse is then exact: its one product is by 1, its cast a no-op)."""
        if not self.kernels:
            return norm(x)
        return v41_mhc.collapse_norm(self._ones[: x.shape[0]], x.unsqueeze(1), norm.weight, norm.eps)

    def _rope(
        self, x: torch.Tensor, kind: str, pos: torch.Tensor, ropes: dict | None, group_of: int = 1, inverse: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """``apply_rope`` of ``x (b, ..., D)`` at each row's ``(pos // group_of) · group_of`` by the
        ``kind`` rotary (``inverse``: by ``-sin``); with the kernels ``norm_rope`` from its table, else
        the step's ``ropes`` (``cos_sin`` of ``pos``; of the group starts when ``group_of > 1``)."""
        if self.kernels:
            cos, sin = self._tables[kind]
            flat = x.reshape(x.shape[0], -1, x.shape[-1])  # (b, G, D)
            return norm_rope(flat, None, 0, 0.0, cos, sin, pos, group_of, -1.0 if inverse else 1.0).view(x.shape)
        cos, sin = ropes[kind] if group_of == 1 else self.model.rotary[kind].cos_sin(pos - pos % group_of, x.dtype)
        return apply_rope(x, cos, -sin if inverse else sin)

    def _site(
        self, site, norm: RMSNorm, pre: torch.Tensor, streams: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """An mHC site before a block: ``HyperSite.gates`` (pre, post, comb) and the block's input
        ``norm(collapse(pre, streams))`` with the previous site's ``pre``. With the kernels the
        gates come from split-K partials of the norm and dot (``hc_pre_parts``) and
        ``mix_gates``' math in a kernel, instead of ~100 small ops; with ``fuse_sites`` the gates
        and the collapse share one launch."""
        if not self.kernels:
            return (*site.gates(streams), norm(collapse(pre, streams)))
        parts = hc_pre_parts(streams, site.fn, max_splits=self.tuning.hc_splits)  # (b, S, MP): dots with the raw streams, Σx²
        k = streams.shape[1] * streams.shape[2]  # the norm's scale applied to the dots (same math, other last bits)
        gates = (parts, k, site.norm_eps, site.scale, site.base, site.hc, site.iters, site.hc_eps)
        if self.tuning.fuse_sites:
            return v41_mhc.mix_collapse_norm(*gates, pre, streams, norm.weight, norm.eps)
        return (*hc_mix_parts(*gates), v41_mhc.collapse_norm(pre, streams, norm.weight, norm.eps))

    def _engram_hashes(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``NgramHasher.hash_ids`` of one new token per row → ``(b, L, cols)``; advances each
        slot's history."""
        token_map, multipliers, primes, offsets = self._hash
        seq = torch.cat([self.history[slots], token_map[ids, None]], dim=1)  # (b, N)
        self.history.index_copy_(0, slots, seq[:, 1:])
        products = seq.flip(-1)[:, None, :] * multipliers  # (b, L, N): [t, t-1, ...]
        rolling, cols = products[..., 0], []
        for k in range(1, seq.shape[1]):
            rolling = torch.bitwise_xor(rolling, products[..., k])  # the (k+1)-gram's hash, (b, L)
            cols.append(rolling[..., None] % primes[:, k - 1])  # (b, L, heads)
        return torch.cat(cols, dim=-1) + offsets

    def _attention(
        self, i: int, attn, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] | None, group: dict,
    ) -> torch.Tensor:  # fmt: skip
        """``Attention.forward`` of one token per row: ``x (b, H)`` → ``(b, H)``; ``ropes``: the
        step's ``cos_sin`` per rotary (None with the kernels)."""
        b, nh, d, w = x.shape[0], attn.n_heads, attn.head_dim, attn.window
        kind = attn.rope_kind
        q_res = self._norm(attn.q_norm, self._linear(attn.wq_a, x))  # (b, qr)
        win_q, win_e = self.win_q[i], self.win_e[i]
        with branch(self._streams.get("kv")) as join_kv:  # the window write, next to the q projection
            kv = self._rope(self._norm(attn.kv_norm, self._linear(attn.wkv, x)), kind, pos, ropes)  # (b, D)
            write_fp8_window(kv, win_q, win_e, self._window_at(w, pos, slots), self.kernels)
        source = attn.compressor is not None
        with branch(self._streams.get("compress") if source else None) as join_compress:  # a KV source's new row
            if source:
                self._compress(i, attn, x, pos, slots, ropes)
        if source:  # a KV source starts a new group: its rows (unpacked when asked)
            group.clear()
            group["source"] = i
            group["rows"] = lambda sp=self.sources[i]: sp.rows(slots, x.dtype)
        sp = self.sources[group["source"]] if attn.ratio else None
        index = attn.indexer is not None and sp is not None and sp.keys_q is not None
        with branch(self._streams.get("index") if index else None) as join_index:  # the indexer: query, then picks
            if index:
                query = self._index_query(attn.indexer, x, q_res, pos, ropes)
                if source and "compress" in self._streams:  # the picks read the keys the compressor writes now
                    torch.cuda.current_stream(self.device).wait_stream(self._streams["compress"])
                group["top"] = self._select(attn.indexer, sp, *query, pos, slots, group)
        q = self._rope(self._linear(attn.wq_b, q_res).view(b, nh, d), kind, pos, ropes)  # (b, nh, D)
        join_kv()
        join_compress()
        join_index()
        picks = None
        if attn.ratio and group.get("top") is not None:  # a pick that is not a complete row: -1
            top, valid = group["top"]
            picks = torch.where(valid, top, -1)  # (b, k)
        if self.kernels:
            sp = self.sources.get(self.cfg.kv_source_of(i)) if picks is not None else None
            out = v41_decode_attention(
                q, win_q.view(E4M3), win_e, self._window_len(w, pos), slots,
                None if sp is None else sp.rows_q[:, :-1], None if sp is None else sp.rows_s[:, :-1].view(E4M3),
                picks, attn.attn_sink, attn.scaling, q.dtype, self.tuning.attention,
            )  # fmt: skip
        else:
            out = self._attend(attn, q, pos, slots, win_q, win_e, group, picks)
        out = self._rope(out, kind, pos, ropes, inverse=True)  # (b, nh, D)
        if self._gemv(out):  # the grouped o_a as gemv's groups: (1, o_groups · o_lora_rank) flat
            return self._linear(attn.wo_b, gemv(out.view(b, -1), attn.wo_a.weight, attn.o_groups, pdl=self.tuning.gemv_pdl))
        return attn.wo_b(attn.wo_a(out.view(b, attn.o_groups, -1)).flatten(1))

    def _attend(
        self, attn, q: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, win_q: torch.Tensor, win_e: torch.Tensor,
        group: dict, picks: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """The general path's masked softmax with the sinks, on the unpacked values: ``q (b, nh,
        D)`` over [the window in position order, the group's rows (the picks; -inf elsewhere)]."""
        b, w = q.shape[0], attn.window
        win_pos = pos[:, None] - (w - 1) + torch.arange(w, device=q.device)  # (b, W) oldest first
        idx = win_pos % w
        keys = unpack_fp8_window(win_q[slots[:, None], idx].view(E4M3), win_e[slots[:, None], idx]).to(q.dtype)  # (b, W, D)
        mask = torch.zeros(b, w, dtype=torch.float32, device=q.device).masked_fill(win_pos < 0, float("-inf"))  # (b, W)
        if attn.ratio:
            rows = group["rows"]()  # (b, Tc, D)
            bias = torch.full((b, rows.shape[1] + 1), float("-inf"), dtype=torch.float32, device=q.device)  # (b, Tc+1)
            if picks is not None:  # a pick that is not a complete row goes to the dropped last column
                bias.scatter_(-1, torch.where(picks >= 0, picks, rows.shape[1]), 0.0)
            keys, mask = torch.cat([keys, rows], dim=1), torch.cat([mask, bias[:, :-1]], dim=-1)  # (b, W+Tc, ...)
        logits = torch.matmul(q, keys.transpose(1, 2)) * attn.scaling + mask[:, None, :]  # (b, nh, L)
        logits = torch.cat([logits, attn.attn_sink.float()[None, :, None].expand(b, -1, 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)  # sink only in the denominator
        return torch.matmul(probs, keys)  # (b, nh, D)

    def _compress(self, i: int, attn, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, ropes: dict | None) -> None:
        """``Compressor.update`` for one token per row: the group closing at ``pos`` (every row
        at ratio 1) rotated, packed and written to its row (the scratch row for open groups)."""
        comp, sp, r = attn.compressor, self.sources[i], self.sources[i].ratio
        if r == 1:
            latents = self._norm(comp.norm, self._linear(comp.wkv, x))  # (b, D)
        else:
            kv, gate = self._linear32(comp.wkv.weight, x), self._linear32(comp.wgate.weight, x)  # (b, D) fp32
            latents = self._norm(comp.norm, pool_group(kv, gate, sp.buf_kv, sp.buf_gate, slots, pos, x.dtype, self.kernels))  # (b, D)
        flat = self._row_at(r, sp.rows_q.shape[1] - 1, pos, slots)  # (b,)
        if sp.keys_q is not None:  # Indexer.keys before its rounding: projected, normed, rotated at the group's first position
            idx = attn.indexer
            keys = self._rope(self._norm(idx.k_norm, self._linear(idx.wk, latents)), "compress", pos, ropes, r)  # (b, Di)
            write_fp4_keys(keys, sp.keys_q, sp.keys_e, flat, self.kernels)
        write_fp4_rows(self._rope(latents, "compress", pos, ropes, r), sp.rows_q, sp.rows_s, flat, self.kernels)

    def _index_query(
        self, idx, x: torch.Tensor, q_res: torch.Tensor, pos: torch.Tensor, ropes: dict | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``Indexer.select``'s query: its FP4-rounded heads ``(b, Hi, Di)`` and head weights ``(b, Hi)`` fp32."""
        b = x.shape[0]
        q = self._rope(self._linear(idx.wq_b, q_res).view(b, idx.n_heads, idx.head_dim), "compress", pos, ropes)
        q = fp4_indexer_quant(q) if self.kernels else fp4_indexer(q)  # (b, Hi, Di)
        return q, self._linear(idx.weights_proj, x).float() * idx.heads_scaling

    def _select(
        self, idx, sp: SourcePool, q: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, group: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``Indexer.select`` of the query ``q, weights`` (``_index_query``) over all ``Tc``
        columns: chosen rows ``(b, k)`` and ``(b, k)`` True where the choice is a complete row;
        the candidate source publishes ``group["candidates"]``."""
        b, tc = q.shape[0], sp.keys_q.shape[1] - 1
        complete = self._complete(idx.ratio, pos)  # (b,) rows < this are complete
        if self.kernels:
            scores = v41_indexer_scores(q, weights, sp.keys_q[:, :-1], sp.keys_e[:, :-1], slots, complete, idx.softmax_scale)  # (b, Tc)
        else:
            keys = sp.keys(slots, self.dtype)  # (b, Tc, Di)
            scores = torch.einsum("shd,std->sht", q.float(), keys.float()).relu_() * idx.softmax_scale  # (b, Hi, Tc)
            scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # (b, Tc)
            scores = scores.masked_fill(torch.arange(tc, device=q.device)[None, :] >= complete[:, None], float("-inf"))
        if idx.is_candidate_source:
            group["candidates"] = candidate_blocks(scores, complete, idx.block_topk, idx.block_size)  # (b, Tc)
        elif idx.uses_candidates and group.get("candidates") is not None:
            scores = scores.masked_fill(~group["candidates"], float("-inf"))
        top = scores.topk(min(idx.topk, tc), dim=-1, sorted=False)
        return top.indices, top.values > float("-inf")

    def _route(self, gate, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``Router.forward`` of ``x (b, H)``: the fp32 logits (through gemv at one token), then
        with the kernels ``kernels.moe.route`` (one launch for the ~12 of ``Router.route``: the
        same math, picks in the same descending order)."""
        logits = self._linear32(gate.weight, x) if self._gemv(x) else F.linear(x.float(), gate.weight.float())  # (b, E)
        if not self.kernels or gate.scoring_func not in SCORING_FUNCS:
            return gate.route(logits)
        return route(logits, gate.top_k, gate.scaling, gate.bias, scoring_func=gate.scoring_func, temp=gate.temp, normalize=gate.normalize)

    def _moe(self, i: int, moe, x: torch.Tensor) -> torch.Tensor:
        """``MoE.forward`` of ``x (b, H)`` without host syncs (module docstring)."""
        gate_up, down = self._experts[i]
        se, k = moe.shared_experts, moe.gate.top_k
        if self.kernels and se.limit > 0 and use_gemv(x, x.shape[0] * k, self.tuning.moe_gemv):
            shared_w = (se.w1.weight, se.w3.weight, se.w2.weight)  # gate (I, H), up (I, H), down (H, I)
            with branch(self._streams.get("kv")) as join:  # the shared expert's SwiGLU rows next to the router
                act = shared_act(x, shared_w, k, se.limit, self.tuning.moe_gemv)
            weights, indices = self._route(moe.gate, x)  # (b, k) each
            join()
            return moe_gemv(x, weights, indices, gate_up, down, se.limit, shared_w, act=act, tuning=self.tuning.moe_gemv)
        weights, indices = self._route(moe.gate, x)  # (b, k) each
        shared = se(x).float()  # (b, H)
        if self.grouped_moe:
            return moe_experts(x, weights, indices, gate_up, down, moe.shared_experts.limit, add=shared.to(x.dtype))
        order = indices.argsort(dim=-1)  # summed in expert order, as MoE.forward
        indices, weights = indices.gather(1, order), weights.gather(1, order)
        b, k = indices.shape
        h = torch.matmul(gate_up[indices], x[:, None, :, None]).squeeze(-1).float()  # (b, k, 2I)
        gate, up = h.chunk(2, dim=-1)
        limit = moe.shared_experts.limit
        if limit > 0:
            up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
        act = (weights.unsqueeze(-1) * (F.silu(gate) * up)).to(x.dtype)  # (b, k, I)
        y_k = torch.matmul(down[indices], act.unsqueeze(-1)).squeeze(-1).float()  # (b, k, H)
        y = torch.zeros_like(x, dtype=torch.float32)
        for j in range(k):
            y = y + y_k[:, j]
        return (y + shared).to(x.dtype)

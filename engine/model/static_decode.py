"""Static decode: fixed-shape, host-sync-free decode steps over a preallocated slot pool,
captured as one CUDA graph per batch-size bucket and replayed.

The general path (``model.py``, ``attention.py``) keeps per-sequence state tensors that grow each
step and walks Python lists, so a decode step is hundreds of host-side decisions and launches.
Here every sequence lives in a *slot* of per-layer pools whose shapes never change
(``slots.pool.SlotPool``, composed: the window ring ``swa``, each compressor's open-window
buffers, CSA overlap and compressed ``rows`` with a scratch row ``Tc``).

Slot ``S`` is scratch: padded batch rows of a bucket point there. The window closing at token
``p`` (``p % r == r-1``) is pooled for every row of the batch with the ops of
``Compressor.update``; ``index_copy_`` writes the row to ``rows[slot, p // r]`` for the closing
rows and to the scratch row for the others, so no step depends on data on the host. Attention
is ``kernels.decode_attention`` over (ring, row pool); CSA's rows come from
``kernels.indexer.indexer_scores`` over the fixed ``Tc`` columns (``-inf`` past each sequence's
complete rows) and ``torch.topk`` with a fixed ``k`` (``-1`` for missing rows). The MoE runs the
Triton grouped kernel (``Experts`` on CUDA bf16), whose expert counts stay on the device; a step
of at most ``MoEGemvTuning.max_slots`` routed slots (batch 1-32 at six picks) runs the routed and the shared
expert as two weight-streaming GEMV kernels instead (``kernels.moe_gemv``); at batch 1 the dense
projections (x projections, q_b, o_a, o_b, router, lm_head) are weight-streaming GEMV kernels too
(``kernels.gemv``, programmatic dependent launches in the graph). The fused step runs
independent branches on a side stream (the CSA indexer, or else the kv path, next to the q
projection; the shared expert next to the router), captured as parallel branches of the graph.
Index rows the layers share (window ring row and length, compressed row count and start) are
computed on the host with the step's inputs.

Native weights (``load_model(fp8=..., fp4_experts=True)``: the checkpoint's FP8 linears and FP4
experts kept as stored): an ``Fp8Linear`` runs through ``kernels.fp8_gemm`` (activations quantised
per 1×128 group) and at batch 1 through ``kernels.fp8_gemv`` (the same function, dequantised in
registers); the merged x projection becomes one GEMM per run of same-kind weights
(``fp8.merge_weights``: the FP8 q_a + kv, the bf16 compressor and indexer projections); FP4 routed
experts run through ``kernels.moe_fp4``'s grouped kernel, or for at most ``MoEGemvTuning.fp4_max_slots``
routed slots through two GEMV kernels decoding FP4 in registers (``kernels.moe_fp4_gemv``), the FP8
shared expert through the FP8 linears (on the side stream). Dense (bf16) weights stay the parity path.

Prefill stays on the general path: ``load(slot, state)`` imports a ``SequenceState`` (normal
mode, not a replay) into a slot, ``export(slot)`` gives it back. ``step(slots, token_ids)``
runs one decode token for each listed slot and returns the float32 logits ``(n, V)``; with
CUDA graphs the returned tensor is the graph's output buffer, valid until the next step.
``verify(slots, token_rows)`` (speculative decoding) feeds ``1 + k`` tokens per slot in one step
of offset-major columns: each compressor takes the offsets in order in one launch
(``fused.compress_step``), then one multi-query attention launch serves every offset (each
reads the ring as it was before the step plus its slot's new keys up to its own offset), and
the new keys go into the ring after it.

Where Triton does not run (CPU without the interpreter) the same step body runs each kernel
function's PyTorch reference and the general path's mHC modules (tests and the expert-parallel
CPU group; the CPU engine's step is ``host_decode.HostDecoder``).

Same math as the general path (fp32: within 1e-4; bf16: within the kernels' tolerance — the
attention kernel keeps logits in fp32 where the general path rounds them to bf16). One known
difference: when exact indexer score ties straddle the top-k cut, ``torch.topk`` over ``Tc``
columns may break them differently from the general path's ``topk`` over the row count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.model.fp8 import Fp8Linear, Fp8Weight, Weight, merge_weights, weight_of
from engine.model import slot_rewind
from engine.model.attention import Attention, Compressor
from engine.model.layers import HyperConnection, collapse, replicate_streams, swiglu, unweighted_rms_norm
from engine.model.moe import MoE
from engine.model.slots.graphs import branch, capture
from engine.model.slots.pool import CompPool, LayerPool, PendingVerify, PooledDecoder, SlotPool
from kernels import fused as fk
from kernels._common import use_triton
from kernels.decode_attention import decode_attention
from kernels.fp8_gemm import DEFAULT as FP8_GEMM
from kernels.fp8_gemm import Fp8GemmConfig, fp8_linear
from kernels.fp8_gemv import fp8_gemv
from kernels.gemv import gemv
from kernels.gemv import use_gemv as use_dense_gemv
from kernels.indexer import indexer_scores, mask_topk
from kernels.mhc import hc_mix, hc_mix_parts
from kernels.moe import moe_experts, route
from kernels.moe_fp4 import moe_experts_fp4
from kernels.moe_fp4_gemv import moe_fp4_gemv
from kernels.moe_fp8 import moe_experts_fp8
from kernels.moe_gemv import MoEGemvTuning, moe_gemv, shared_act, use_gemv

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class RoutedExperts(Protocol):
    """Routed experts run elsewhere than on this device's full set (``engine.parallel.ep``'s
    sharded experts): ``(experts, x (N, H), weights (N, k), indices (N, k), valid (N,)) → (N, H)``,
    ``valid`` false on the bucket's padding rows."""

    def __call__(self, ex, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class DecodeTuning:
    """The fused step's choices (defaults measured on an H200; the slice bench sweeps them).

    ``side_stream``: fork independent branches onto a side stream (captured into the graph as
    parallel nodes): the CSA indexer (else the kv path) next to the q projection, the shared expert
    next to the router; at batch 1 most kernels fill a few SMs, so the chains overlap (NOTES run 12).
    ``hc_splits``: split-K ways of the mHC input dot (``fused.hc_pre_parts``) at most: at batch 1
    its 1.5 MB fp32 ``fn`` read by 8 programs took 9.5 µs; ``hc_mix_parts`` adds many splits in tiles.
    ``attn_rope_out``: decode attention un-rotates its output in its last kernel (the split
    combine, else the main kernel's epilogue) instead of a norm_rope pass after it; b=1 step the
    same within noise, one launch less per layer (run 13; one split without the combine at b=1 was
    8 µs slower). ``dense_gemv``: the dense projections at batch 1 (merged x projection, q_b, the
    indexer's q_b, o_a, o_b, router, lm_head) through the weight-streaming GEMV kernel
    (``kernels.gemv``, a programmatic dependent launch with ``gemv_pdl``) instead of cuBLAS
    (small-tile GEMMs and split-K reduces at ~2.2-3.5 TB/s; NOTES run 14). ``moe_gemv``: when the
    routed + shared experts of a few slots run as two GEMV kernels, and their launches.
    ``fp8``: the FP8 GEMM's tiling for native FP8 linears (above batch 1, or without ``dense_gemv``).
    """

    side_stream: bool = True
    hc_splits: int = 64
    attn_rope_out: bool = True
    dense_gemv: bool = True
    gemv_pdl: bool = True
    moe_gemv: MoEGemvTuning = field(default_factory=MoEGemvTuning)
    fp8: Fp8GemmConfig = FP8_GEMM


DECODE = DecodeTuning()  # the default


def bucket_for(n: int, buckets: Sequence[int] = BUCKETS) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"batch {n} above the largest bucket {buckets[-1]}")


class StaticDecoder(PooledDecoder):
    """Slot pool + fixed-shape decode step of a ``DeepseekV4ForCausalLM`` (module docstring).

    ``max_slots`` sequences of up to ``max_tokens`` tokens each (prompt and decoded tokens).
    ``use_graphs`` (default: on CUDA) captures one CUDA graph per bucket on its first use.
    The step's glue runs through ``kernels.fused`` (norms + RoPE, mHC pre/merge, compressor
    token, shared-expert SwiGLU) and the routing kernel where Triton runs (CUDA, or its
    interpreter); elsewhere each kernel function runs its PyTorch reference (the general path's
    ops) and the mHC mixing the general path's modules — one step body either way.
    ``step`` returns float32 logits (``output``); ``host_decode.HostDecoder`` returns hidden states.
    """

    output = "logits"

    def __init__(
        self,
        model,
        max_slots: int,
        max_tokens: int,
        use_graphs: bool | None = None,
        buckets: Sequence[int] = BUCKETS,
        merge_proj: bool = True,
        tuning: DecodeTuning = DECODE,
        verify_width: int = 1,
        experts: RoutedExperts | None = None,
    ) -> None:
        self.model = model
        # ``experts``: the routed experts elsewhere (expert parallelism), else this device's own;
        # with its own, a few slots' routed + shared experts run as two GEMV kernels (``kernels.moe_gemv``)
        self.experts = experts
        self.gemv_experts = experts is None
        self.tuning = tuning
        self.cfg = model.config
        self.device = model.device
        self.dtype = model.dtype
        self.max_slots, self.max_tokens = max_slots, max_tokens
        self.scratch = max_slots
        self.verify_width = verify_width  # tokens per slot a ``verify`` step may feed (1: none)
        self.use_graphs = (
            self.device.type == "cuda" if use_graphs is None else use_graphs
        )
        self.buckets = tuple(
            sorted({b for b in buckets if b < max_slots} | {max_slots})
        )
        dev = self.device
        self.slots = SlotPool(model, max_slots, max_tokens, verify_width)  # the state (mechanism); the step is below
        self.pools = self.slots.layers
        with torch.inference_mode():
            bmax = self.buckets[-1]
            # index rows the layers share, computed on the host with the inputs (no launches):
            # ("ring", W): slot · W + pos % W, min(pos + 1, W); ("rows", r, Tc): (pos + 1) // r, slot · (Tc + 1)
            self._derived: list[tuple[int, ...]] = []
            for layer, lp in zip(model.model.layers, self.pools):
                attn = layer.self_attn
                keys = [("ring", attn.window)]
                if lp.comp is not None:
                    keys.append(("rows", attn.compressor.rate, lp.comp.rows.shape[1] - 1))
                self._derived += [k for k in keys if k not in self._derived]
            rows = 3 + 2 * len(self._derived)
            cols = bmax * verify_width  # a verify step's columns: offset-major, ``bucket`` per offset
            self._inputs = torch.zeros(
                rows, cols, dtype=torch.long, device=dev
            )  # ids, positions, slots, then the derived rows
            # two pinned host copies of the inputs: a step writes one while the other's copy to the
            # device may still be queued behind the previous step
            pinned = dev.type == "cuda"
            self._host = [
                torch.zeros(rows, cols, dtype=torch.long, pin_memory=pinned)
                for _ in range(2)
            ]
            self._copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
            self._turn = 0
        self.num_tokens, self.token_ids = self.slots.num_tokens, self.slots.token_ids
        self.triton = use_triton(self._inputs)  # the Triton kernels run (else their references)
        self._rope_tab: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.inference_mode():  # cos/sin of every position, as Rotary.cos_sin gives them per step
            every = torch.arange(max_tokens + 1, device=dev)
            for kind, rot in model.rotary.items():
                cos, sin = rot.cos_sin(every, self.dtype)
                self._rope_tab[kind] = (cos.contiguous(), sin.contiguous())
        self.merge_proj = merge_proj
        self.dense_gemv = tuning.dense_gemv and self.triton
        if self.merge_proj:  # our own concatenated copy; the model's parameters stay as they are
            with torch.inference_mode():
                for layer, lp in zip(model.model.layers, self.pools):
                    attn = layer.self_attn
                    mods = [attn.q_a_proj, attn.kv_proj]
                    if attn.compressor is not None:
                        mods += [attn.compressor.kv_proj, attn.compressor.gate_proj]
                        if attn.indexer is not None:
                            idx = attn.indexer
                            mods += [idx.kv_proj, idx.gate_proj, idx.scorer.weights_proj]
                    lp.xproj = merge_weights([weight_of(m) for m in mods])
        self._graphs: dict[int | tuple[int, int], tuple[torch.cuda.CUDAGraph, object]] = {}  # bucket, or (bucket, width) of a verify
        self._side = torch.cuda.Stream(dev) if tuning.side_stream and dev.type == "cuda" else None
        # fp32 contiguous copies of the mHC parameters (a bf16 checkpoint's fn/scale/base would be
        # cast on every call: 3 launches per block)
        self._hc32: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if self.triton:
            with torch.inference_mode():
                for layer in model.model.layers:
                    for hc in (layer.attn_hc, layer.ffn_hc):
                        self._hc32[id(hc)] = tuple(t.float().contiguous() for t in (hc.fn, hc.scale, hc.base))
                head = model.model.hc_head
                self._hc32[id(head)] = tuple(t.float().contiguous() for t in (head.hc_fn, head.hc_scale, head.hc_base))

    # ---- the step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, slots: Sequence[int], token_ids: Sequence[int], bucket: int | None = None) -> torch.Tensor:
        """One decode token per listed slot → float32 logits ``(n, V)`` (module docstring).

        ``bucket`` (one of ``self.buckets``, at least ``n``) forces the padded batch size; with it
        ``n`` may be 0 (every row scratch: expert-parallel ranks must all run each step)."""
        n = len(slots)
        self.slots.check(slots, token_ids, empty_ok=bucket is not None)
        if bucket is not None and (bucket not in self.buckets or bucket < n):
            raise ValueError(f"bucket {bucket} is not a bucket of at least {n} rows")
        b = bucket_for(n, self.buckets) if bucket is None else bucket
        if self.use_graphs and b not in self._graphs:
            self._capture(b)
        pad = b - n
        self._stage(list(token_ids) + [0] * pad, [self.num_tokens[s] for s in slots] + [0] * pad, list(slots) + [self.scratch] * pad)
        if self.use_graphs:
            graph, out = self._graphs[b]
            graph.replay()
        else:
            out = self._forward(b)
        self.slots.advance(slots, token_ids)
        return out[:n]

    @torch.inference_mode()
    def verify(self, slots: Sequence[int], token_rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each listed slot its ``verify_width`` tokens (its next token, then the drafts) in
        one fixed-shape step (one CUDA graph per bucket and width) → the final hidden states
        ``(n, width, H)`` and the final streams ``(n, width, hc, H)`` (before the hyper-head) of
        every offset, views of buffers the next step reuses. Offset ``j`` of a slot sees the keys
        and compressed rows of the offsets before it, exactly as ``width`` plain steps would.
        ``accept`` must follow before the slots are stepped, verified or exported again."""
        width, n = self.verify_width, len(slots)
        positions = self.slots.check_verify(slots, token_rows, width, self.cfg.vocab_size)
        b = bucket_for(n, self.buckets)
        if self.use_graphs and (b, width) not in self._graphs:
            self._capture(b, width)
        pad = b - n
        ids, pos, cols = [], [], []
        for j in range(width):  # offset-major columns: offset j of slot i at j·b + i
            ids += [int(r[j]) for r in token_rows] + [0] * pad
            pos += [p + j for p in positions] + [0] * pad
            cols += list(slots) + [self.scratch] * pad
        self._stage(ids, pos, cols)
        if self.use_graphs:
            graph, out = self._graphs[b, width]
            graph.replay()
        else:
            out = self._forward(b, width)
        hidden, streams, snap = out
        self.slots.pending = PendingVerify(list(slots), positions, [list(r) for r in token_rows], b, snap)
        return hidden.view(width, b, -1)[:, :n].transpose(0, 1), streams.view(width, b, *streams.shape[1:])[:, :n].transpose(0, 1)

    def accept(self, kept: Sequence[int]) -> None:
        """End the pending ``verify``: slot ``i`` keeps its first ``kept[i]`` tokens (``1 ..
        width``); what the others wrote is undone (``SlotPool.accept``)."""
        self.slots.accept(kept, self.verify_width)

    def _stage(self, ids: list[int], pos: list[int], slots: list[int]) -> None:
        """Write a step's columns (padding included) and their derived rows to the device inputs."""
        cols = len(ids)
        turn = self._turn = 1 - self._turn
        host, copied = self._host[turn], self._copied[turn]
        if copied is not None:
            copied.synchronize()  # the copy two steps ago has left this buffer
        host[0, :cols] = torch.as_tensor(ids, dtype=torch.long)
        host[1, :cols] = torch.as_tensor(pos, dtype=torch.long)
        host[2, :cols] = torch.as_tensor(slots, dtype=torch.long)
        self._derive(host, cols)
        self._inputs[:, :cols].copy_(host[:, :cols], non_blocking=True)
        if copied is not None:
            copied.record()

    def _derive(self, host: torch.Tensor, b: int) -> None:
        """Fill the derived rows of ``host[:, :b]`` (see ``__init__``) from its positions and slots."""
        pos, slots = host[1, :b], host[2, :b]
        for i, (kind, a, *rest) in enumerate(self._derived):
            r = 3 + 2 * i
            if kind == "ring":  # the flat ring row slot · W + pos % W, and the window length
                torch.add(torch.remainder(pos, a), slots * a, out=host[r, :b])
                torch.clamp(pos + 1, max=a, out=host[r + 1, :b])
            else:
                torch.div(pos + 1, a, rounding_mode="floor", out=host[r, :b])
                torch.mul(slots, rest[0] + 1, out=host[r + 1, :b])

    @torch.inference_mode()  # the slot buffers are inference tensors (made under inference_mode)
    def capture_graphs(self) -> None:
        """Capture every bucket's step graph now (else each on its first step): the engine measures
        its free GPU memory after this (``engine.runtime.memory``)."""
        for b in self.buckets:
            if b not in self._graphs:
                self._capture(b)

    def _capture(self, b: int, width: int = 1) -> None:
        """Warm up (Triton compiles, rope tables) and capture bucket ``b`` (of a verify of
        ``width`` tokens per slot) on scratch inputs."""
        cols = b * width
        init = torch.zeros(self._inputs.shape[0], cols, dtype=torch.long)
        init[2] = self.scratch
        self._derive(init, cols)
        self._inputs[:, :cols] = init.to(self.device)
        self._graphs[b if width == 1 else (b, width)] = capture(lambda: self._forward(b, width), self.device)

    @torch.inference_mode()
    def _forward(self, b: int, width: int = 1):
        """The fixed-shape step body on ``self._inputs`` (no host reads where Triton runs): a step
        over ``b`` slots → logits ``(b, V)`` fp32; a verify (``width > 1``, offset-major columns) →
        final hidden ``(b·width, H)``, final streams and the rewind snapshot."""
        model, cfg = self.model, self.cfg
        n = b * width
        ids, pos, slots = self._inputs[0, :n], self._inputs[1, :n], self._inputs[2, :n]
        snap = slot_rewind.snapshot(self.pools, self.slots.windows, pos, slots, b) if width > 1 else None
        embeds = model.model.embed_tokens(ids)  # (n, H)
        streams = replicate_streams(embeds, cfg.hc_mult)  # (n, hc, H)
        derived = {key: (self._inputs[3 + 2 * i, :n], self._inputs[4 + 2 * i, :n]) for i, key in enumerate(self._derived)}
        if width > 1:  # each column's window before the step: (ring end, length) per window size
            j = torch.arange(n, device=pos.device) // b
            first = pos - j  # its slot's position before the step (negative on padding columns)
            for w in {k[1] for k in self._derived if k[0] == "ring"}:
                derived["before", w] = (torch.remainder(first, w), torch.clamp(torch.minimum(first, w - 1 - j), min=0))
        for layer, lp in zip(model.model.layers, self.pools):
            attn = layer.self_attn
            post, comb, x = self._hyper_connection_fused(layer.attn_hc, streams, layer.input_layernorm)
            out = self._attention(attn, lp, x, pos, slots, derived, b)
            streams = fk.hc_merge(post, comb, out, streams)
            post, comb, x = self._hyper_connection_fused(layer.ffn_hc, streams, layer.post_attention_layernorm)
            streams = fk.hc_merge(post, comb, self._moe_fused(layer.mlp, x, ids), streams)
        head, norm = model.model.hc_head, model.model.norm
        if self.triton:
            fn, scale, base = self._hc32[id(head)]
            parts = fk.hc_pre_parts(streams, fn, max_splits=self.tuning.hc_splits)
            hc = streams.shape[1]
            pre, _, _ = hc_mix_parts(parts, hc * streams.shape[2], head.norm_eps, scale, base, hc, 0, head.eps, head=True)
            hidden = fk.collapse_norm(pre, streams, norm.weight, norm.eps)  # norm(hc_head(streams)): (n, H)
        else:
            hidden = norm(head(streams))
        if width > 1:
            return hidden, streams, snap
        return self._linear(hidden, model.lm_head.weight, torch.float32)

    def _linear(self, x: torch.Tensor, w: Weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``F.linear(x, w)`` (then cast to ``out_dtype``): the GEMV kernel for one token; an
        ``Fp8Weight`` through the FP8 GEMV (one token) or the block-scaled FP8 GEMM."""
        if isinstance(w, Fp8Weight):
            if self.dense_gemv and use_dense_gemv(x):
                return fp8_gemv(x, w.q, w.s, out_dtype=out_dtype, pdl=self.tuning.gemv_pdl)
            return fp8_linear(x, w.q, w.s, self.tuning.fp8, out_dtype=out_dtype)
        if self.dense_gemv and use_dense_gemv(x):
            return gemv(x, w, out_dtype=out_dtype, pdl=self.tuning.gemv_pdl)
        y = F.linear(x, w)
        return y if out_dtype is None else y.to(out_dtype)

    def _output(self, attn: Attention, out: torch.Tensor) -> torch.Tensor:
        """The attention's output projections (``Attention._output_fast``): grouped ``o_a``, ``o_b``."""
        if self.dense_gemv and use_dense_gemv(out):
            grouped = gemv(out.reshape(out.shape[0], -1), attn.o_a_proj.weight, attn.o_groups, pdl=self.tuning.gemv_pdl)
            return self._linear(grouped, weight_of(attn.o_b_proj))
        return attn._output_fast(out)

    def _hyper_connection_fused(self, hc: HyperConnection, streams: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_hyper_connection`` + the block's input ``RMSNorm`` in three kernels: split-K norm and
        mixes, gates + Sinkhorn, collapse + norm (without Triton: the general path's ops)."""
        if not self.triton:
            post, comb, x = _hyper_connection(hc, streams)
            return post, comb, norm(x)
        fn, scale, base = self._hc32[id(hc)]
        parts = fk.hc_pre_parts(streams, fn, max_splits=self.tuning.hc_splits)
        pre, post, comb = hc_mix_parts(parts, streams.shape[1] * streams.shape[2], hc.norm_eps, scale, base, hc.hc, hc.iters, hc.hc_eps)
        return post, comb, fk.collapse_norm(pre, streams, norm.weight, norm.eps)

    def _attention(
        self, attn: Attention, lp: LayerPool, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
        derived: dict[tuple, tuple[torch.Tensor, torch.Tensor]], b: int,
    ) -> torch.Tensor:  # fmt: skip
        """One layer's attention over the step's columns (``b`` per offset, offset-major): the
        projections of all of them, the kv path (norm, RoPE, compressors), the CSA indexer (its
        compressor, scores, top-k of every column), then ONE ``decode_attention`` launch.

        A step (one offset): the new key goes into the window ring first (``norm_rope`` writes it
        there) and the attention reads the ring; the indexer, or else the kv path, runs on the side
        stream next to the q projection. A verify (``1 + k`` offsets): the new keys stay apart
        (``fresh``) and each column reads the ring as it was before the step plus its slot's new
        keys up to its own offset, and rows up to its own count (``decode_attention``'s multi-query
        form); each compressor takes the offsets in order in one launch (a window one closes pools
        the buffer entries of the ones before, not yet those of the ones after); the new keys go
        into the ring after the attention; no side stream."""
        n = x.shape[0]
        verify = n > b
        cos, sin = self._rope_tab[attn.rope_kind]
        ccos, csin = self._rope_tab.get("compress", (cos, sin))
        comp, idx = attn.compressor, attn.indexer
        if lp.xproj:  # one GEMM per run of merged projections of x, then column views
            parts = [p for w, widths in lp.xproj for p in self._linear(x, w).split(widths, dim=-1)]
        else:
            mods = [attn.q_a_proj, attn.kv_proj]
            if comp is not None:
                mods += [comp.kv_proj, comp.gate_proj] + ([idx.kv_proj, idx.gate_proj, idx.scorer.weights_proj] if idx is not None else [])
            parts = [m(x) for m in mods]
        q_res = fk.norm_rope(parts[0][:, None], attn.q_a_norm.weight, 1, attn.q_a_norm.eps)[:, 0]
        ring_row, swa_len = derived["ring", attn.window]
        tc = row_len = row_start = None
        if comp is not None:
            tc = lp.comp.rows.shape[1] - 1
            row_len, row_start = derived["rows", comp.rate, tc]
        new_kv: list[torch.Tensor] = []  # a verify's new keys (n, D)

        def compress(c: Compressor, cp: CompPool, kv: torch.Tensor, gate: torch.Tensor) -> None:
            self._compress(c, cp, kv, gate, pos, slots, ccos, csin, b)  # every offset, in order, one pass

        def kv_path() -> None:  # the new keys (into the ring, or apart for a verify); the compressor
            kv = parts[1][:, None]
            if verify:
                new_kv.append(fk.norm_rope(kv, attn.kv_norm.weight, 1, attn.kv_norm.eps, cos, sin, pos)[:, 0])
            else:
                fk.norm_rope(kv, attn.kv_norm.weight, 1, attn.kv_norm.eps, cos, sin, pos, out=lp.swa.view(-1, attn.head_dim), out_rows=ring_row)
            if comp is not None:
                compress(comp, lp.comp, parts[2], parts[3])

        def indexer() -> torch.Tensor:  # its compressor, then each column's top-k rows (any order: no sort)
            compress(idx, lp.index, parts[4], parts[5])
            idx_q = fk.norm_rope(self._linear(q_res, weight_of(idx.q_b_proj)).view(n, idx.n_heads, idx.width), None, 0, 0.0, cos, sin, pos)
            scores = indexer_scores(
                idx_q, parts[6], lp.index.rows.view(-1, idx.width), row_start, row_len, idx.softmax_scale * idx.weights_scaling, t_max=tc,
            )  # fmt: skip
            return mask_topk(scores, idx.topk, ordered=False)

        row_idx = None
        with self._branch(side=not verify) as join:  # next to the q projection
            if idx is not None:
                row_idx = indexer()
            else:
                kv_path()
        q = fk.norm_rope(self._linear(q_res, weight_of(attn.q_b_proj)).view(n, attn.n_heads, attn.head_dim), None, 2, attn.eps, cos, sin, pos)
        if idx is not None:
            kv_path()
        join()
        kw = {"swa_slot": slots, "scale": attn.scaling}
        if self.tuning.attn_rope_out:  # the attention kernel un-rotates its output
            kw.update(rope=(cos, sin), rope_pos=pos, fold_q=0)
        if verify:
            swa_end, swa_len = derived["before", attn.window]
            kw.update(swa_end=swa_end, fresh=new_kv[0], fresh_cols=b)
        if comp is None:
            out = decode_attention(q, lp.swa, swa_len, attn.sinks, **kw)
        else:
            rows = lp.comp.rows.view(-1, attn.head_dim)
            out = decode_attention(q, lp.swa, swa_len, attn.sinks, rows, row_start, row_len, row_idx, max_rows=tc, **kw)
        if verify:
            lp.swa.view(-1, attn.head_dim).index_copy_(0, ring_row, new_kv[0])
        if not self.tuning.attn_rope_out:
            out = fk.norm_rope(out, None, 0, 0.0, cos, sin, pos, sign=-1.0)  # undo the values' rotation
        return self._output(attn, out)

    def _branch(self, side: bool = True):
        """``slots.graphs.branch`` on this decoder's side stream (in place without one, or with
        ``side`` False)."""
        return branch(self._side if side else None)

    def _compress(
        self, comp: Compressor, cp: CompPool, kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, b: int,
    ) -> None:  # fmt: skip
        """The step's tokens (``b`` columns per offset) into the buffers, offset after offset; each
        window one closes pooled into its row (``kernels.fused.compress_step``: one launch)."""
        fk.compress_step(
            kv, gate, pos, slots, cp.buf_kv, cp.buf_gate, cp.overlap_kv, cp.overlap_gate,
            comp.position_bias, comp.kv_norm.weight, comp.kv_norm.eps, cos, sin, cp.rows, cols=b,
        )  # fmt: skip

    def _moe_fused(self, moe: MoE, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gate, ex, sh = moe.gate, moe.experts, moe.shared_experts
        half = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
        native_shared = isinstance(sh.gate_proj, Fp8Linear)
        few = (
            self.gemv_experts and getattr(ex, "fp8", None) is None and ex.fp4 is None and not native_shared
            and sh.limit == ex.limit and use_gemv(x, x.shape[0] * gate.top_k, self.tuning.moe_gemv)
        )  # fmt: skip
        if not (half or few):
            return self._moe(moe, x, ids)
        if few:  # the shared expert's gate/up next to the router (side stream), then two GEMV kernels
            shared = (sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight)
            with self._branch() as join:
                act = shared_act(x, shared, gate.top_k, ex.limit, self.tuning.moe_gemv)
        if not half:  # fp32 (tests): the general path's router
            weights, indices = gate(x, ids)
        else:
            logits = self._linear(x, gate.weight)
            if gate.hash_routed:
                weights, indices = route(logits, gate.top_k, gate.scaling, tid2eid=gate.tid2eid, token_ids=ids, scoring_func=gate.scoring_func)
            else:
                weights, indices = route(logits, gate.top_k, gate.scaling, bias=gate.e_score_correction_bias, scoring_func=gate.scoring_func)
        if few:
            join()
            return moe_gemv(x, weights, indices, ex.gate_up_proj, ex.down_proj, ex.limit, shared, act=act, tuning=self.tuning.moe_gemv)
        with self._branch() as join:
            if native_shared:  # FP8 GEMV / GEMM through _linear
                act = fk.swiglu(self._linear(x, weight_of(sh.gate_proj)), self._linear(x, weight_of(sh.up_proj)), sh.limit)
                shared = self._linear(act, weight_of(sh.down_proj))
            else:
                shared = sh.down_proj(fk.swiglu(sh.gate_proj(x), sh.up_proj(x), sh.limit))
        routed = self._routed(ex, x, weights, indices)
        join()
        return routed + shared

    def _routed(self, ex, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The routed experts on CUDA bf16/fp16 (or ``self.experts``: expert parallelism)."""
        if self.experts is not None:
            return self.experts(ex, x, weights, indices, self._inputs[2, : x.shape[0]] != self.scratch)
        if ex.fp4 is not None:  # the checkpoint's FP4 experts (load_model(fp4_experts=True)): GEMVs for a few slots
            n = indices.numel()
            if self.gemv_experts and n <= self.tuning.moe_gemv.fp4_max_slots and use_gemv(x, n, self.tuning.moe_gemv):
                return moe_fp4_gemv(x, weights, indices, *ex.fp4, ex.limit, tuning=self.tuning.moe_gemv)
            return moe_experts_fp4(x, weights, indices, *ex.fp4, ex.limit)
        fp8 = getattr(ex, "fp8", None)  # engine.model.fp8.attach_fp8_experts
        if fp8 is not None:
            return moe_experts_fp8(x, weights, indices, *fp8, ex.limit)
        return moe_experts(x, weights, indices, ex.gate_up_proj, ex.down_proj, ex.limit, grouped=ex.tuning.grouped)

    def _moe(self, moe: MoE, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.experts is not None:
            weights, indices = moe.gate(x, ids)
            return self._routed(moe.experts, x, weights, indices) + moe.shared_experts(x)
        if not (x.is_cuda and x.dtype == torch.float32) or moe.experts.fp4 is not None:
            return moe(
                x, ids
            )  # CPU: the general path; CUDA bf16/fp16 or FP4 experts: the Triton grouped kernels
        # CUDA fp32 (tests): the per-expert loop reads counts on the host; gather each slot's
        # expert weights instead (fixed shapes, fine at test sizes)
        weights, indices = moe.gate(x, ids)
        ex = moe.experts
        k = indices.shape[1]
        flat = indices.reshape(-1)
        xs = x.repeat_interleave(k, dim=0)  # (N*k, H)
        gate, up = (
            torch.bmm(ex.gate_up_proj.index_select(0, flat), xs.unsqueeze(-1))
            .squeeze(-1)
            .chunk(2, dim=-1)
        )
        ys = torch.bmm(
            ex.down_proj.index_select(0, flat), swiglu(gate, up, ex.limit).unsqueeze(-1)
        ).squeeze(-1)
        routed = (
            (ys * weights.reshape(-1, 1)).to(x.dtype).view(x.shape[0], k, -1).sum(dim=1)
        )
        return routed + moe.shared_experts(x)


def _hyper_connection(
    hc: HyperConnection, streams: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``HyperConnection.forward`` with its Sinkhorn and gates in one kernel (``kernels.mhc``)."""
    flat = unweighted_rms_norm(streams.flatten(1).float(), hc.norm_eps)  # (N, hc*H)
    mixes = F.linear(flat, hc.fn.float())  # (N, (2+hc)*hc)
    pre, post, comb = hc_mix(mixes, hc.scale, hc.base, hc.hc, hc.iters, hc.hc_eps)
    return post, comb, collapse(pre, streams)

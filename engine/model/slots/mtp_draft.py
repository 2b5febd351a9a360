"""``SlotDrafter``: the MTP draft step over a batch of slots — feed each slot the rows a verify
kept, then chain ``k`` drafts — in fixed shapes, so one CUDA graph per batch bucket replays it.

A speculative step of slotted sequences (``engine.runtime.speculative``) is a slot decoder's
``verify`` of ``width = 1 + k`` tokens per slot, the host's acceptance, ``accept``, then this step,
whose inputs are the verify's final streams ``(n, width, hc, H)`` and the kept counts:

1. *feed*: every verify column ``j`` of slot ``i`` is an MTP entry at ``p_i + j`` (``p_i`` the
   slot's ``next_pos``) with the token after it; columns ``j >= kept_i`` are pointed at the
   scratch slot (their keys land there), so the shapes never depend on the counts. Columns are
   offset-major (``j·b + i``); offset ``j`` attends to the ring as it was before the step and to
   its slot's new keys of offsets ``0 .. j``, and the new keys go into the ring after;
2. *chain*: draft 1 is the greedy token of the last kept column's output streams; draft ``j + 1``
   the greedy token of the entry at ``p_i + kept_i + j - 1`` fed the previous output streams and
   draft ``j``. Those ``k - 1`` chained entries are not real, so the ring rows they overwrite are
   copied before (``snap``) and written back after, inside the step.

The window layout is ``mtp_pool.MTPPool``'s. The MTP block runs the model's own modules
(``DecoderLayer.blocks`` with ``Attention.project_attend``; on the CPU with numba, the block's
compiled decode layer, ``cpu_layer.decode_layer``), its attention over the ring through
``kernels.decode_attention`` where Triton runs (CUDA, or its interpreter) and
``kernels.reference.attend_with_sinks`` over the gathered window elsewhere. The head is the fp32
logits' argmax in the graph on CUDA (``kernels.gemv`` for one slot) and ``LMHead.argmax`` (exact)
on the CPU. The drafts equal ``mtp.Drafter``'s (the general path) up to float rounding of
near-ties.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.model import cpu_layer
from engine.model.attention import Projected
from engine.model.mtp import MTPLayer
from engine.model.slots.graphs import capture
from engine.model.slots.mtp_pool import MTPPool
from kernels._common import use_triton
from kernels.decode_attention import decode_attention
from kernels.gemv import gemv
from kernels.reference import attend_with_sinks, hide

# rows of the staged index tensor: token ids, absolute positions (RoPE), slots, positions relative
# to each window's start, flat ring rows (slot · W + rel % W); for column j of a group of
# offsets whose offset 0 is at r0: the ring entries it reads (those before the step's own keys,
# min(r0, W - 1 - j)) and the slot's ring row just after them (r0 % W) — kernels.decode_attention's
# multi-query form
_IDS, _POS, _SLOT, _REL, _RING, _OLD, _END = range(7)


class SlotDrafter:
    """An ``MTPPool`` and its draft step (module docstring) for ``k`` drafts per slot.

    ``buckets``: the padded batch sizes of the CUDA graphs (the slot decoder's); ``use_graphs``
    (default: on CUDA) captures one graph per bucket on its first use — in bf16/fp16 only: in fp32
    the MTP block's experts (the general ``MoE``) read their counts on the host —; without graphs
    nothing is padded. ``compiled``: the numba decode layer where it runs (fp32 CPU)."""

    def __init__(
        self, model, layer: MTPLayer, max_slots: int, k: int, buckets: Sequence[int] = (), use_graphs: bool | None = None,
        compiled: bool = True,
    ) -> None:  # fmt: skip
        if k < 1 or k + 1 >= layer.block.self_attn.window:
            raise ValueError("the draft step needs 1 <= k < window - 1")
        self.model, self.layer, self.k, self.width = model, layer, k, k + 1
        self.pool = MTPPool(layer, max_slots)
        self.device = layer.e_proj.weight.device
        self.use_graphs = (self.device.type == "cuda" if use_graphs is None else use_graphs) and layer.dtype in (torch.bfloat16, torch.float16)
        self.buckets = tuple(sorted({b for b in buckets if b < max_slots} | {max_slots}))
        bmax = self.buckets[-1]
        self._feed, self._chain = self.width * bmax, (k - 1) * bmax  # columns of each part
        cols = self._feed + self._chain + bmax  # then the last kept column of each slot
        hc, h = model.config.hc_mult, model.config.hidden_size
        with torch.inference_mode():
            self._inputs = torch.zeros(7, cols, dtype=torch.long, device=self.device)
            self._streams = torch.zeros(self._feed, hc, h, dtype=layer.dtype, device=self.device)  # verify streams, offset-major
        self._host = torch.zeros(7, cols, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._packed = cpu_layer.pack(layer.block) if compiled and self.device.type == "cpu" else None
        self.steps = 0  # draft steps run (tests and benchmarks read it)

    def nbytes(self) -> int:
        """Bytes of the window ring and the step's input buffers."""
        return self.pool.nbytes() + self._streams.numel() * self._streams.element_size()

    # ---- the step --------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, slots: Sequence[int], streams: torch.Tensor, next_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Feed slot ``slots[i]`` its first ``len(next_ids[i])`` verify columns (``streams (n, width,
        hc, H)``, column ``j`` followed by token ``next_ids[i][j]``) at its ``next_pos``, then chain
        ``k`` greedy drafts → ``k`` tokens per slot; the windows keep the fed entries only."""
        n = len(slots)
        kept = [len(r) for r in next_ids]
        if n == 0 or len(set(slots)) != n or streams.shape[:2] != (n, self.width) or any(not 1 <= c <= self.width for c in kept):
            raise ValueError(f"one to {self.width} fed columns per slot, each slot once, streams (n, {self.width}, hc, H)")
        b = self._bucket(n)
        if self.use_graphs and b not in self._graphs:
            self._capture(b)
        self._stage(list(slots), next_ids, b)
        self._streams[: self.width * b].view(self.width, b, *streams.shape[2:])[:, :n].copy_(streams.transpose(0, 1))
        if self.use_graphs:
            graph, out = self._graphs[b]
            graph.replay()
        else:
            out = self._forward(b)
        for s, c in zip(slots, kept):
            self.pool.next_pos[s] += c
        self.steps += 1
        return out[:n].tolist()

    def _bucket(self, n: int) -> int:
        if not self.use_graphs:
            return n
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch {n} above the largest bucket {self.buckets[-1]}")

    def _stage(self, slots: list[int], next_ids: Sequence[Sequence[int]], b: int) -> None:
        """Write the step's index rows (module constants) for ``b`` columns per part."""
        pool, w, width, k = self.pool, self.pool.window, self.width, self.k
        pad = b - len(slots)
        feed: list[tuple[int, int, int, int]] = []  # (id, position, slot, rel) of each feed column
        for j in range(width):
            for s, ids in zip(slots, next_ids):
                p = pool.next_pos[s] + j
                feed.append((int(ids[j]), p, s, p - pool.start[s]) if j < len(ids) else (0, 0, pool.scratch, 0))
            feed += [(0, 0, pool.scratch, 0)] * pad
        chain = []  # (position, slot, rel) of each chained entry: offset j of slot i at j·b + i
        for j in range(k - 1):
            for s, ids in zip(slots, next_ids):
                p = pool.next_pos[s] + len(ids) + j
                chain.append((p, s, p - pool.start[s]))
            chain += [(0, pool.scratch, 0)] * pad
        host = self._host
        nf, nc = width * b, (k - 1) * b
        cf, cc = self._feed, self._chain
        if feed:
            host[[_IDS, _POS, _SLOT, _REL], :nf] = torch.tensor(feed, dtype=torch.long).t()
        if chain:
            host[[_POS, _SLOT, _REL], cf : cf + nc] = torch.tensor(chain, dtype=torch.long).t()
        last = [(c - 1) * b + i for i, c in enumerate(len(r) for r in next_ids)] + list(range(len(slots), b))
        host[_IDS, cf + cc : cf + cc + b] = torch.tensor(last, dtype=torch.long)
        for a, m, one in ((0, nf, False), (cf, nc, True)):  # the feed's offsets are one group, each chained entry its own
            rel, sl = host[_REL, a : a + m], host[_SLOT, a : a + m]
            host[_RING, a : a + m] = sl * w + rel % w
            j = torch.zeros(m, dtype=torch.long) if one else torch.arange(m) // b  # each column's offset in its group
            first = rel - j  # offset 0's relative position
            host[_OLD, a : a + m] = torch.minimum(first, w - 1 - j).clamp(min=0)
            host[_END, a : a + m] = first % w
        self._inputs.copy_(host, non_blocking=True)

    @torch.inference_mode()
    def _capture(self, b: int) -> None:
        """Warm up and capture bucket ``b`` on scratch inputs (every column in the scratch slot)."""
        scratch = self.pool.scratch
        self._host.zero_()
        self._host[_SLOT] = scratch
        self._host[_RING] = scratch * self.pool.window
        self._host[_IDS, self._feed + self._chain :] = torch.arange(self._host.shape[1] - self._feed - self._chain)
        self._inputs.copy_(self._host)
        self._graphs[b] = capture(lambda: self._forward(b), self.device)

    def _forward(self, b: int) -> torch.Tensor:
        """The fixed-shape step on the staged inputs (no host reads on CUDA) → drafts ``(b, k)``."""
        layer, k, width = self.layer, self.k, self.width
        nf, cf, cc = width * b, self._feed, self._chain
        feed = self._inputs[:, :nf]
        chain = self._inputs[:, cf : cf + (k - 1) * b]
        out = self._block(layer.inputs(self.model, feed[_IDS], self._streams[:nf]), feed, b)  # (nf, hc, H)
        cur = out.index_select(0, self._inputs[_IDS, cf + cc : cf + cc + b])  # (b, hc, H): each slot's last kept column
        ring = self.pool.ring.view(-1, self.pool.ring.shape[-1])  # (S+1·W, D)
        snap = ring.index_select(0, chain[_RING])  # ((k-1)·b, D): rows the chained entries overwrite
        drafts = []
        for j in range(k):
            token = self._argmax(layer.hidden(cur))  # (b,)
            drafts.append(token)
            if j + 1 < k:
                cols = chain[:, j * b : (j + 1) * b].clone()
                cols[_IDS] = token
                cur = self._block(layer.inputs(self.model, token, cur), cols, b)
        ring.index_copy_(0, chain[_RING], snap)
        return torch.stack(drafts, dim=1)  # (b, k)

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of ``hidden (b, H)``: the exact host argmax on the CPU, the fp32 logits'
        argmax on the device (capturable; one slot: ``kernels.gemv``'s weight stream, the
        static step's lm_head at batch 1)."""
        if self.device.type == "cpu":
            return self.model.head.argmax(hidden)
        return gemv(hidden.contiguous(), self.model.lm_head.weight, out_dtype=torch.float32, pdl=False).argmax(-1)

    def _block(self, x: torch.Tensor, cols: torch.Tensor, b: int) -> torch.Tensor:
        """The MTP block on ``x (N, hc, H)`` at the columns ``cols (7, N)`` (groups of ``b``
        attending in order) → its output streams; writes each real column's key to the ring."""
        attn = self.layer.block.self_attn
        rot = self.model.rotary[attn.rope_kind]
        attend = lambda p: self._attend(p, cols, b)  # noqa: E731
        if self._packed is not None:
            pos = cols[_POS]
            cos, sin = (t.index_select(0, pos).numpy() for t in rot.table(int(pos.max()) + 1, x.dtype, x.device))
            return torch.from_numpy(cpu_layer.decode_layer(self._packed, np.ascontiguousarray(x.numpy()), cols[_IDS].numpy(), cos, sin, attend))
        rope = rot.cos_sin(cols[_POS], x.dtype)
        return self.layer.block.blocks(x, cols[_IDS], lambda h: attn.project_attend(h, rope, attend))

    def _attend(self, p: Projected, cols: torch.Tensor, b: int) -> torch.Tensor:
        """The attention of every column over its window, groups of ``b`` columns in order (each
        sees the keys of the groups before it: the ring as it was, then the step's own keys) →
        ``(N, nh, D)``; the keys go into the ring after. Where Triton runs, one multi-query
        ``decode_attention`` launch; elsewhere ``_attend_host``."""
        attn = self.layer.block.self_attn
        ring3 = self.pool.ring
        ring = ring3.view(-1, ring3.shape[-1])
        if use_triton(ring):  # CUDA (or the Triton interpreter)
            out = decode_attention(
                p.q.contiguous(), ring3, cols[_OLD], attn.sinks, swa_slot=cols[_SLOT], scale=attn.scaling, swa_end=cols[_END],
                fresh=p.kv.contiguous(), fresh_cols=b,
            )  # fmt: skip
        else:
            out = self._attend_host(p, cols, b)
        ring.index_copy_(0, cols[_RING], p.kv)
        return out

    def _attend_host(self, p: Projected, cols: torch.Tensor, b: int) -> torch.Tensor:
        """Column ``t`` (group ``j = t // b``, relative position ``r``) over its window, gathered in
        order — relative positions ``r - W + 1 .. r``: the ring's entries before the step's own
        columns, this step's keys ``p.kv`` (not in the ring yet) from the column ``j - back`` groups
        back, the ones before the window's start hidden → ``(N, nh, D)``."""
        attn, w = self.layer.block.self_attn, self.pool.window
        n = p.q.shape[0]
        t = torch.arange(n)
        j, i = t // b, t % b  # (N,) group and row of each column
        back = torch.arange(w - 1, -1, -1)  # key m of the window is relative position r - (W-1) + m
        rel = cols[_REL][:, None] - back[None, :]  # (N, W)
        fresh = back[None, :] <= j[:, None]  # (N, W): a key of this step
        ring = self.pool.ring.view(-1, self.pool.ring.shape[-1])
        old = ring.index_select(0, (cols[_SLOT][:, None] * w + torch.remainder(rel, w)).view(-1)).view(n, w, -1)  # (N, W, D)
        new = p.kv.index_select(0, ((j[:, None] - back[None, :]).clamp(min=0) * b + i[:, None]).view(-1)).view(n, w, -1)
        win = torch.where(fresh[..., None], new, old)  # (N, W, D)
        hidden = rel < 0
        bias = hide(hidden, p.q.dtype) if bool(hidden.any()) else None
        return attend_with_sinks(p.q, win, bias, None, None, attn.sinks, attn.scaling)

"""Expert parallelism (EP) over ``R`` processes with data-parallel attention.

Every rank holds the attention, dense and shared-expert weights and decodes its own batch of
sequences (its own ``StaticDecoder`` slots); the routed experts are split in ``R`` contiguous
ranges, rank ``r`` owning experts ``[r·E/R, (r+1)·E/R)``. Per MoE layer (``ep_routed``):

1. route locally (the same kernels as one GPU) → ``weights, indices (n, k)``;
2. **dispatch**: each of the ``n·k`` (token, expert) slots goes to the rank owning its expert.
   Fixed capacity, so a step has no host sync and captures in a CUDA graph: the send buffer is
   ``(R, C, H)`` with ``C = n·k`` (a rank can receive every slot of every token of a peer: no
   drops); slots bound for rank ``d`` are packed at the front of block ``d`` in slot order, with
   their local expert id (``-1`` for empty rows). Two ``all_to_all_single`` (rows, ids);
3. the receiver runs its local experts on the ``R·C`` rows, grouped by expert (the grouped GEMM
   kernels of one GPU; empty rows sort last, past the last group, and are not computed);
4. **return**: one ``all_to_all_single`` sends the unweighted expert outputs back to the rows they
   came from;
5. **combine** on the token's own rank, exactly as one GPU does: on CUDA bf16/fp16 the Triton
   combine kernel (fp32 sum over ``j``, weights applied there); elsewhere ``Experts.forward``'s
   weighted ``index_add_`` in ascending expert order.

So the expert outputs are the same rows the one-GPU grouped GEMM computes, combined in the
same order; the logits agree with one GPU within the GEMMs' own run-to-run tolerance (fp32 1e-4).
Padding rows of a bucket (slot = scratch) send nothing. All ranks must run every step with the
same bucket, also a rank with no sequence (``EPDecoder.step`` agrees on the bucket through a
small CPU all-reduce, then runs; 0 rows is allowed).

Traffic per layer and step: ``2 · R · C · H`` bytes of bf16 rows out and back per rank
(C = 384 rows at b=64, k=6: 3 MB to each peer at H=4096), plus ``R·C`` int64 ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.model.layers import swiglu
from engine.model.static_decode import StaticDecoder, bucket_for
from kernels._common import use_triton


def shard_experts(model, rank: int, world: int) -> None:
    """Keep only rank ``rank``'s contiguous range of routed experts in every MoE layer (frees the
    rest; FP8 copies from ``engine.model.fp8`` are cut the same way). Sets ``experts.ep_first``."""
    for layer in model.model.layers:
        ex = layer.mlp.experts
        if getattr(ex, "ep_first", None) is not None:
            continue
        e = ex.gate_up_proj.shape[0] if ex.gate_up_proj.numel() else ex.fp8[0].shape[0]
        if e % world:
            raise ValueError(f"{e} experts do not split over {world} ranks")
        n = e // world
        lo = rank * n
        with torch.no_grad():
            if ex.gate_up_proj.numel():
                ex.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj.data[lo : lo + n].clone(), requires_grad=False)
                ex.down_proj = torch.nn.Parameter(ex.down_proj.data[lo : lo + n].clone(), requires_grad=False)
            if getattr(ex, "fp8", None) is not None:
                ex.fp8 = tuple(t[lo : lo + n].clone() for t in ex.fp8)
        ex.ep_first, ex.ep_count, ex.ep_total = lo, n, e
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def _local_experts(rows: torch.Tensor, eid: torch.Tensor, ex) -> torch.Tensor:
    """Rows ``(M, H)`` with local expert ids ``eid (M,)`` (``-1``: empty) → unweighted expert
    outputs ``(M, H)`` (empty rows: zeros off the grouped path, undefined on it)."""
    n_loc = ex.ep_count
    fp8 = getattr(ex, "fp8", None)
    grouped = use_triton(rows) and rows.dtype in (torch.bfloat16, torch.float16)
    if grouped and (fp8 is not None or rows.dtype == torch.bfloat16):
        from kernels.moe import grouped_linear, swiglu_rows
        from kernels.moe_fp8 import fp8_grouped_linear

        key = torch.where(eid < 0, n_loc, eid)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(n_loc + 1, dtype=torch.long, device=rows.device).scatter_add_(0, key, torch.ones_like(key))
        offs = torch.cumsum(counts[:n_loc], 0, dtype=torch.int32)  # empty rows lie past offs[-1]
        xs = rows.index_select(0, order)
        if fp8 is not None:
            h = fp8_grouped_linear(xs, fp8[0], fp8[1], offs)
        else:
            h = grouped_linear(xs, ex.gate_up_proj, offs, counts[:n_loc])
        act = swiglu_rows(h, ex.limit)
        if fp8 is not None:
            y = fp8_grouped_linear(act, fp8[2], fp8[3], offs)
        else:
            y = grouped_linear(act, ex.down_proj, offs, counts[:n_loc])
        return torch.empty_like(rows).index_copy_(0, order, y)
    # CPU / fp32: one F.linear pair per non-empty local expert (reads the ids on the host)
    if fp8 is not None:
        from kernels.moe_fp8 import dequantize_blocks

        gate_up = dequantize_blocks(fp8[0], fp8[1], rows.dtype)
        down = dequantize_blocks(fp8[2], fp8[3], rows.dtype)
    else:
        gate_up, down = ex.gate_up_proj, ex.down_proj
    out = torch.zeros_like(rows)
    ids = eid.tolist()
    for e in sorted({i for i in ids if i >= 0}):
        sel = (eid == e).nonzero().squeeze(1)
        gate, up = F.linear(rows.index_select(0, sel), gate_up[e]).chunk(2, dim=-1)
        out.index_copy_(0, sel, F.linear(swiglu(gate, up, ex.limit), down[e]))
    return out


def ep_routed(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    valid: torch.Tensor,
    ex,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The routed-expert sum of ``x (n, H)`` with experts spread over ``group`` (module docstring).

    ``weights, indices (n, k)``: the router's output (global expert ids); ``valid (n,)`` bool:
    rows that are real tokens (padding rows send nothing). ``ex``: this rank's ``Experts``, cut
    by ``shard_experts``. Every rank of ``group`` must call this with the same ``n``.
    """
    world = dist.get_world_size(group)
    n, k = indices.shape
    hidden = x.shape[1]
    dev = x.device
    n_loc = ex.ep_count
    cap = n * k  # rows each rank may send to one peer
    flat = indices.reshape(-1)  # (n·k,) slot (token, j)
    ok = valid[:, None].expand(n, k).reshape(-1)
    dest = torch.where(ok, torch.div(flat, n_loc, rounding_mode="floor"), world)  # world: dropped
    onehot = (dest[:, None] == torch.arange(world + 1, device=dev)).long()  # (n·k, R+1)
    within = (torch.cumsum(onehot, 0) - onehot).gather(1, dest[:, None]).squeeze(1)  # rank among same dest
    pos = torch.where(ok, dest * cap + within, world * cap)  # row in the send buffer; R·C: a dump row
    send = x.new_zeros(world * cap + 1, hidden)
    send.index_copy_(0, pos, x.repeat_interleave(k, dim=0))
    send_e = torch.full((world * cap + 1,), -1, dtype=torch.long, device=dev)
    send_e.index_copy_(0, pos, torch.where(ok, flat - dest * n_loc, -1))
    recv = torch.empty(world * cap, hidden, dtype=x.dtype, device=dev)
    recv_e = torch.empty(world * cap, dtype=torch.long, device=dev)
    dist.all_to_all_single(recv, send[: world * cap], group=group)
    dist.all_to_all_single(recv_e, send_e[: world * cap], group=group)
    y = _local_experts(recv, recv_e, ex)  # (R·C, H) unweighted, in the received rows' order
    back = torch.empty(world * cap + 1, hidden, dtype=x.dtype, device=dev)
    back[world * cap].zero_()
    dist.all_to_all_single(back[: world * cap], y, group=group)
    return combine(back, pos, weights, indices, x)


def ep_routed_varlen(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, ex, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``ep_routed`` for the general path (prefill chunks, decode off the slots): each rank sends
    only its own slots, ``n`` may differ between ranks (0 on a rank that only joins the step).

    The per-peer slot counts go first (one ``all_to_all_single`` of ``R`` ints, read on the
    host: this path is never captured in a CUDA graph), then the rows with uneven splits, so
    nothing is padded to a capacity (a 2K-token prefill chunk would be ``R · 2K · k`` rows at
    fixed capacity). Slots bound for one rank keep their slot order; the combine is
    ``combine``'s, so the sum is the one ``Experts.forward`` makes on one device.
    """
    world = dist.get_world_size(group)
    n, k = indices.shape
    n_loc = ex.ep_count
    flat = indices.reshape(-1)  # (n·k,) global expert per slot (token, j)
    dest = torch.div(flat, n_loc, rounding_mode="floor")  # (n·k,) owning rank
    order = torch.argsort(dest, stable=True)  # slots grouped by destination, slot order within
    sent = torch.bincount(dest, minlength=world)  # (R,) slots to each rank
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent, group=group)
    out_splits, in_splits = got.tolist(), sent.tolist()  # the one host sync
    rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))  # (n·k, H) in send order
    eid = (flat - dest * n_loc).index_select(0, order)  # (n·k,) local expert id at the receiver
    recv = x.new_empty(sum(out_splits), x.shape[1])
    recv_e = eid.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, rows, out_splits, in_splits, group=group)
    dist.all_to_all_single(recv_e, eid, out_splits, in_splits, group=group)
    y = _local_experts(recv, recv_e, ex) if recv.shape[0] else recv  # (Σ got, H) unweighted
    back = x.new_empty(n * k, x.shape[1])
    dist.all_to_all_single(back, y, in_splits, out_splits, group=group)
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(n * k, device=x.device))  # slot -> row of back
    return combine(back, pos, weights, indices, x)


def combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out[n] = Σ_j weights[n, j] · y[pos[n·k + j]]`` as one GPU combines: the Triton kernel
    (fp32 sum in ``j`` order) on CUDA bf16/fp16, else ``Experts.forward``'s weighted
    ``index_add_`` in ascending expert order."""
    k = indices.shape[1]
    if use_triton(x) and x.dtype in (torch.bfloat16, torch.float16):
        from kernels.moe import combine_rows

        return combine_rows(y, pos, weights, x)
    order = torch.argsort(indices.reshape(-1), stable=True)  # ascending expert, slot order within
    ys = (y.index_select(0, pos.index_select(0, order)) * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, order // k, ys)


def cpu_group_for(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """A gloo group over the same ranks for host-side agreement (the group itself if it is gloo).
    Collective: every rank calls it."""
    if dist.get_backend(group) == "gloo":
        return group
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")


class ShardedExperts:
    """This rank's share of the routed experts for a slot step (``StaticDecoder(experts=...)``):
    every token's rows through ``ep_routed`` over ``group``."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def __call__(self, ex, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return ep_routed(x, weights, indices, valid, ex, self.group)


class EPDecoder(StaticDecoder):
    """``StaticDecoder`` of one expert-parallel rank (module docstring): its own slots, attention
    and shared expert; routed experts through ``ep_routed`` (``ShardedExperts``, composed). Each
    rank builds one with the same ``max_slots``/``buckets`` and calls ``step`` the same number of
    times (possibly with no slots).
    """

    def __init__(self, model, max_slots: int, max_tokens: int, group=None, cpu_group=None, **kw) -> None:
        super().__init__(model, max_slots, max_tokens, experts=ShardedExperts(group), **kw)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.cpu_group = cpu_group if cpu_group is not None else cpu_group_for(group)
        shard_experts(model, self.rank, self.world)

    def step(self, slots: Sequence[int], token_ids: Sequence[int], bucket: int | None = None) -> torch.Tensor:
        """Agree on the bucket (largest batch of any rank), then run it (also with 0 slots)."""
        if bucket is None:
            n = torch.tensor([len(slots)], dtype=torch.long)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.cpu_group)
            bucket = bucket_for(max(int(n.item()), 1), self.buckets)
        return super().step(slots, token_ids, bucket=bucket)

"""Random inputs in the kernels' layouts, error measures and CUDA-graph timing, shared by tests/kernels, the
kernels' microbenchmarks and the GPU benches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import _common

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}  # kernel vs reference, relative error


def kernel_test_device() -> str:
    """The device a kernel test module runs on: ``"cuda"`` when a GPU is here, ``"cpu"`` under
    ``TRITON_INTERPRET=1``; otherwise the calling test module is skipped (call it at import)."""
    import pytest

    if not _common.HAS_TRITON:
        pytest.skip("needs Triton", allow_module_level=True)
    if torch.cuda.is_available():
        return "cuda"
    if not _common.INTERPRET:
        pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
    return "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or inf anywhere in ``out`` counts as failure (inf)."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def poison(device: torch.device | str, nbytes: int = 1 << 26) -> None:
    """Fill a block of the caching allocator with NaN and free it, so that the next ``empty``
    outputs likely reuse NaN memory: an element a kernel fails to write then shows up."""
    if torch.device(device).type == "cuda":
        torch.full((nbytes // 4,), float("nan"), device=device)


@dataclass
class AttnInputs:
    q: torch.Tensor  # (B, H, D)
    swa: torch.Tensor  # (S, W, D)
    swa_len: torch.Tensor  # (B,) int32
    swa_slot: torch.Tensor  # (B,) int32
    sinks: torch.Tensor  # (H,) fp32
    rows: torch.Tensor | None  # (R, D)
    row_start: torch.Tensor | None  # (B,) int32
    row_len: torch.Tensor | None  # (B,) int32
    row_idx: torch.Tensor | None  # (B, K) int32

    def args(self) -> dict:
        return {
            "q": self.q, "swa": self.swa, "swa_len": self.swa_len, "sinks": self.sinks, "rows": self.rows,
            "row_start": self.row_start, "row_len": self.row_len, "row_idx": self.row_idx, "swa_slot": self.swa_slot,
        }  # fmt: skip


def attn_inputs(
    b: int,
    h: int,
    d: int,
    w: int,
    mode: str,
    n_rows: list[int] | int,
    topk: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
    full_window: bool = False,
) -> AttnInputs:
    """``mode``: ``"swa"`` (window only), ``"hca"`` (all rows) or ``"csa"`` (top-``topk`` rows).

    Windows sit in shuffled slots of a larger ring pool, segments at shuffled pool offsets, and CSA
    indices are random distinct rows with ``-1`` padding at random places.
    """
    g = torch.Generator().manual_seed(seed)
    n_rows = [n_rows] * b if isinstance(n_rows, int) else list(n_rows)
    gd = torch.Generator(device=device).manual_seed(seed)  # big float tensors drawn where they live
    q = torch.randn(b, h, d, generator=gd, device=device)
    slots = b + 2
    swa = torch.randn(slots, w, d, generator=gd, device=device)
    swa_slot = torch.randperm(slots, generator=g)[:b].int()
    swa_len = torch.full((b,), w) if full_window else torch.randint(1, w + 1, (b,), generator=g)
    swa_len = swa_len.int()
    sinks = torch.randn(h, generator=g)
    rows = row_start = row_len = row_idx = None
    if mode != "swa":
        order = torch.randperm(b, generator=g).tolist()
        starts = [0] * b
        at = 3  # segments do not start at row 0
        for i in order:
            starts[i] = at
            at += n_rows[i] + 1
        rows = torch.randn(at + 2, d, generator=gd, device=device)
        row_start = torch.tensor(starts, dtype=torch.int32)
        row_len = torch.tensor(n_rows, dtype=torch.int32)
        if mode == "csa":
            row_idx = torch.full((b, topk), -1, dtype=torch.int32)
            for i, n in enumerate(n_rows):
                pick = torch.randperm(n, generator=g)[: min(n, topk)]
                place = torch.randperm(topk, generator=g)[: pick.numel()]
                row_idx[i, place] = pick.int()
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    return AttnInputs(
        cast(q), cast(swa), swa_len.to(device), swa_slot.to(device), sinks.to(device),
        cast(rows), None if row_start is None else row_start.to(device),
        None if row_len is None else row_len.to(device), None if row_idx is None else row_idx.to(device),
    )  # fmt: skip


def verify_attn_inputs(
    b: int, width: int, h: int, d: int, w: int, mode: str, n_rows: list[int], topk: int = 0,
    dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0,
) -> tuple[dict, list[int]]:  # fmt: skip
    """A multi-query (verify) call of ``decode_attention``: ``b`` slots at random positions
    (before, at and past the ring's wrap) feeding ``width`` offsets each, offset-major columns; the
    ring holds the keys before the step, ``fresh`` the step's own. Rows (``mode`` as
    ``attn_inputs``): slot ``i``'s offset ``j`` sees ``n_rows[i] + j // 2`` of them (offsets close
    windows). → the call's keywords and each slot's first position."""
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed)
    n = b * width
    slots = b + 2
    first = [int(x) for x in torch.randint(0, 3 * w, (b,), generator=g)]
    first[0] = 0  # a fresh sequence: no ring keys at all
    j = torch.arange(n) // b
    p0 = torch.tensor(first).repeat(width)
    cast = lambda t: t.to(device=device, dtype=dtype)
    args = {
        "q": cast(torch.randn(n, h, d, generator=gd, device=device)),
        "swa": cast(torch.randn(slots, w, d, generator=gd, device=device)),
        "swa_len": torch.clamp(torch.minimum(p0, w - 1 - j), min=0).int().to(device),
        "sinks": torch.randn(h, generator=g).to(device),
        "swa_slot": torch.randperm(slots, generator=g)[:b].int().repeat(width).to(device),
        "swa_end": (p0 % w).int().to(device),
        "fresh": cast(torch.randn(n, d, generator=gd, device=device)),
        "fresh_cols": b,
    }
    if mode != "swa":
        seen = [n_rows[i % b] + (i // b) // 2 for i in range(n)]
        starts, at = [], 3
        for i in range(b):
            starts.append(at)
            at += n_rows[i] + width + 1
        args["rows"] = cast(torch.randn(at + 2, d, generator=gd, device=device))
        args["row_start"] = torch.tensor(starts, dtype=torch.int32).repeat(width).to(device)
        args["row_len"] = torch.tensor(seen, dtype=torch.int32).to(device)
        if mode == "csa":
            idx = torch.full((n, topk), -1, dtype=torch.int32)
            for c, m in enumerate(seen):
                pick = torch.randperm(m, generator=g)[: min(m, topk)]
                idx[c, torch.randperm(topk, generator=g)[: pick.numel()]] = pick.int()
            args["row_idx"] = idx.to(device)
    return args, first


def pool_inputs(
    seq_windows: list[int],
    r: int,
    d: int,
    overlap: bool,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
    first_has_prev: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows of several sequences back to back; each sequence contributes ``seq_windows[i]``
    windows (plus, for CSA with ``first_has_prev``, one earlier window as overlap source)."""
    g = torch.Generator().manual_seed(seed)
    p = 2 * d if overlap else d
    win, prev = [], []
    at = 0
    for i, n in enumerate(seq_windows):
        lead = overlap and first_has_prev and i % 2 == 0  # every other sequence has a prior window
        base = at + (r if lead else 0)
        for j in range(n):
            win.append(base + j * r)
            prev.append(base + (j - 1) * r if (j or lead) else -1)
        at = base + n * r + 3  # a few unrelated rows between sequences
    kv = torch.randn(at, p, generator=g).to(device=device, dtype=dtype)
    gate = (2 * torch.randn(at, p, generator=g)).to(device=device, dtype=dtype)
    bias = torch.randn(r, p, generator=g).to(device)
    return kv, gate, bias, torch.tensor(win, dtype=torch.int32, device=device), torch.tensor(prev, dtype=torch.int32, device=device)


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int, before=None) -> float:
    """Milliseconds per replay of a captured CUDA graph: one warm replay, ``before()`` if given
    (e.g. a barrier between ranks), then ``replays`` replays between two events."""
    graph.replay()
    torch.cuda.synchronize()
    if before is not None:
        before()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def graph_time_ms(fn, reps: int = 8, replays: int = 10) -> float:
    """Milliseconds per call of ``fn(i)`` on CUDA: ``reps`` calls (``i = 0..reps-1``, e.g. to
    rotate weight copies so no call finds the last one's in L2) captured in one CUDA graph, the
    graph replayed ``replays`` times (device microbenchmarks)."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    return replay_ms(graph, replays) / reps

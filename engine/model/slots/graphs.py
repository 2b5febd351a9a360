"""CUDA-graph capture of a slot decoder's fixed-shape step (one recipe for every slot decoder)."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture(forward: Callable[[], T], device: torch.device, warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``forward`` ``warmups`` times on a side stream (Triton compiles, lazy tables, the
    allocator's pools), then record one call as a CUDA graph → ``(graph, forward's outputs)``,
    the outputs being the tensors each replay rewrites."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    torch.cuda.synchronize(device)
    return graph, out

"""CUDA-graph capture of a slot decoder's fixed-shape step (one recipe for every slot decoder),
and the side-stream branches such a step forks (captured into its graph as parallel branches)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def branch(side: torch.cuda.Stream | None) -> Iterator[Callable[[], None]]:
    """Run the ``with`` body on the ``side`` stream, after the current stream's work so far;
    yields ``join``, which makes the current stream wait for the body's work. With ``side``
    None the body runs in place and ``join`` does nothing."""
    if side is None:
        yield lambda: None
        return
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield lambda: main.wait_stream(side)

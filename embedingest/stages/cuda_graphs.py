"""Replay a function as captured CUDA graphs, one per input shape.

A small encoder (all-MiniLM-L6-v2: 6 layers) runs each batch in well under the time
Python needs to launch its few hundred kernels one by one, so without graphs the GPU
waits on the launching thread. A CUDA graph launches them all at once. Batches come in
a few shapes only (full batches, widths padded to a multiple of 16 tokens), so a graph
is captured the first time a shape is seen and replayed after that; shapes past
``max_graphs`` and any function that cannot be captured run eagerly, so nothing is lost
but speed. The warm-up run that precedes a capture is that batch's result: a new shape
costs one forward and the capture's host time, not a forward more (a run meets a few
dozen shapes, most of them once: the last batch of each loader worker).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("embedingest")


def _key(inputs: tuple[torch.Tensor, ...]) -> tuple:
    """What a graph is captured for: the inputs' shapes and dtypes."""
    return tuple((tuple(t.shape), t.dtype) for t in inputs)


class GraphedFunction:
    """``fn(*tensors) -> tensor`` on CUDA tensors, replayed from a graph per input shape.

    The result is a fresh tensor (a copy of the graph's static output made on the
    current stream), so callers may keep it while the next batch replays the graph.
    All graphs share one memory pool: they replay one at a time on one stream, so their
    intermediates can share memory.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], device: torch.device | str,
                 max_graphs: int = 32, warmup: int = 1):
        self.fn = fn
        self.device = torch.device(device)
        self.max_graphs = max_graphs
        self.warmup = max(1, warmup)  # the last warm-up run is the first batch's result
        self._graphs: dict[tuple, tuple[list[torch.Tensor], torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        # One side stream for every warm-up and capture: the caching allocator keeps the
        # blocks freed on a stream for that stream, so a new stream per shape left each
        # shape's warm-up memory stranded (a base-size model held >100 GiB after 20 shapes).
        self._side: torch.cuda.Stream | None = None
        self.disabled_reason: str | None = None

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def prime(self, *inputs: torch.Tensor) -> None:
        """Capture the graph of the largest inputs to come before any other. The
        allocator cannot serve a larger request from the blocks a smaller shape left
        behind, so shapes met in growing order reserve the sum of their sizes; after the
        largest, every smaller shape reuses its blocks."""
        if _key(inputs) not in self._graphs:
            self._capture_new(inputs)

    def release(self) -> None:
        """Drop the graphs and their memory pool; later calls capture again."""
        self._graphs.clear()
        self._pool = None

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        entry = self._graphs.get(_key(inputs))
        if entry is None:
            result = self._capture_new(inputs)
            return result if result is not None else self.fn(*inputs)
        static_in, graph, static_out = entry
        for dst, src in zip(static_in, inputs):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_out.clone()

    def _capture_new(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """Capture the graph of these input shapes (not captured yet) and return the
        warm-up's result; None to run eagerly (graphs off, or ``max_graphs`` taken)."""
        if self.disabled_reason is not None or len(self._graphs) >= self.max_graphs:
            return None
        return self._capture(_key(inputs), inputs)

    def _capture(self, key: tuple, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """Warm up on ``inputs`` and capture their shapes' graph; return the warm-up's
        result (None when the capture failed: graphs are off from then on)."""
        static_in = [t.clone() for t in inputs]
        compute = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(compute)
        try:
            with torch.cuda.stream(side):  # warm-up off the capture: cuBLAS handles, workspaces
                for _ in range(self.warmup):
                    result = self.fn(*static_in)
            compute.wait_stream(side)
            # made on the side stream, used on the compute stream: its memory must not go
            # to the side stream's next allocation before the compute stream is done with it
            result.record_stream(compute)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # capture_begin/end rather than torch.cuda.graph(), which also synchronizes the
            # device, collects garbage and empties the allocator's cache at every capture
            # (tens of ms each, with a graph per shape). thread_local: the engine's threads
            # keep using CUDA while this thread captures.
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    static_out = self.fn(*static_in)
                finally:
                    graph.capture_end()
            compute.wait_stream(side)
        except (RuntimeError, torch.cuda.CudaError) as exc:  # e.g. a host sync inside fn
            self.disabled_reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("CUDA graphs off for this run (%s); running eagerly", self.disabled_reason)
            torch.cuda.synchronize(self.device)
            return None
        self._graphs[key] = (static_in, graph, static_out)
        return result

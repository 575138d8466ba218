"""Host-to-device prefetch: batch i+1 crosses to the GPU on a side stream while batch i
computes (the input direction of the seed article's method)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")
U = TypeVar("U")


def _tensors(x) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)


def prefetch(items: Iterable[T], send: Callable[[T], U], device: torch.device,
             span: Callable[..., contextlib.AbstractContextManager] | None = None
             ) -> Iterator[tuple[T, U]]:
    """Yield ``(item, send(item))`` where ``send`` does the item's host-to-device copies
    (``non_blocking`` from pinned memory). On CUDA the copies of the next item are
    enqueued on a side stream before the current one is yielded; the compute stream waits
    for them, and the device tensors are marked as used there so the allocator keeps
    them. ``span(lane, stream)`` (e.g. ``engine.span``) times the copies for the timeline.
    """
    device = torch.device(device)
    if device.type != "cuda":
        for item in items:
            yield item, send(item)
        return
    stream = torch.cuda.Stream(device)

    def ahead_of(item):
        with torch.cuda.stream(stream), (span("h2d", stream) if span else contextlib.nullcontext()):
            return item, send(item)

    it = iter(items)
    nxt = next((ahead_of(i) for i in it), None)
    while nxt is not None:
        item, moved = nxt
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(stream)
        for t in _tensors(moved):
            if t.is_cuda:
                t.record_stream(compute)
        nxt = next((ahead_of(i) for i in it), None)
        yield item, moved


def thread_ahead(items: Iterator, depth: int = 2) -> Iterator:
    """Iterate ``items`` in a thread, ``depth`` items ahead, so tokenizing the next batch
    overlaps encoding this one (the tokenizer and CUDA both release the GIL)."""
    out: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(value) -> bool:
        while not stop.is_set():
            try:
                out.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(end)
        except BaseException as exc:
            put(exc)

    thread = threading.Thread(target=run, name="embedingest-tokenize", daemon=True)
    thread.start()
    try:
        while (value := out.get()) is not end:
            if isinstance(value, BaseException):
                raise value
            yield value
    finally:
        stop.set()
        thread.join()

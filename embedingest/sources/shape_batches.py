"""Which images go into one batch: those of one model input shape, across the whole run.

A model input is one tensor, so a batch holds one shape; with the weights' own resize
(``short``) every aspect ratio is a shape of its own. Grouping decoded images as they
come (within a DataLoader batch, or a bounded pool of them) leaves most batches short
when a folder mixes ratios, and every batch size at a shape is one more shape for the
GPU's convolution set-up. :class:`ShapeBatchSampler` plans the batches before decoding
instead: it reads each file's size from its header (see ``image_decode.header_size``,
tens of microseconds where decoding takes milliseconds), keeps the waiting images of
each shape as indices only (so any number may wait, at no memory cost), and hands a
batch to the workers the moment its shape has ``batch_size`` images; each shape's last,
short batch comes at the end. Each shape then gets as few batches as it can.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ..engine.worker_loader import frozen_gc
from .image_decode import Preprocessing, header_size

__all__ = ["ShapeBatchSampler", "HeaderReaders"]

SizeReader = Callable[[Sequence[str]], Iterable["tuple[int, int] | None"]]


def read_here(paths: Sequence[str]) -> Iterator[tuple[int, int] | None]:
    """Each file's size from its header, in this process."""
    return map(header_size, paths)


class HeaderReaders:
    """Processes that read the files' headers for a :class:`ShapeBatchSampler`, so the
    process that drives the GPU does no work per image (a header costs a few hundred
    microseconds of Python).

    Call :meth:`start` before any thread is started (the readers are forked); leaving
    the context stops them. Calling it maps paths to sizes in order, in the background;
    with no processes, or not started, it reads them here. A reader that dies (a hostile
    file taking the parser down) costs nothing but speed: the rest are read here.
    """

    def __init__(self, processes: int, mp_context=None, initializer=None, chunksize: int = 64):
        self.processes = processes
        self.mp_context = mp_context
        self.initializer = initializer
        self.chunksize = chunksize
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> HeaderReaders:
        """Fork the readers now (a pool forks them on its first task otherwise)."""
        if self.processes and self._pool is None:
            self._pool = ProcessPoolExecutor(self.processes, mp_context=self.mp_context,
                                             initializer=self.initializer)
            # a reader forked from a process that used CUDA must not free its objects
            with frozen_gc(), contextlib.suppress(BrokenProcessPool):
                self._pool.submit(int).result()
        return self

    def __enter__(self) -> HeaderReaders:
        return self.start()

    def __exit__(self, *exc) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def __call__(self, paths: Sequence[str]) -> Iterator[tuple[int, int] | None]:
        if self._pool is None:
            yield from read_here(paths)
            return
        done = 0
        with contextlib.suppress(BrokenProcessPool):
            for size in self._pool.map(header_size, paths, chunksize=self.chunksize):
                yield size
                done += 1
        yield from read_here(paths[done:])


class ShapeBatchSampler:
    """The ``batch_sampler`` of a DataLoader over ``ImageFileDataset(files, prep)``.

    Yields lists of indices into ``files``; the lists of one batch come one after the
    other, each of at most ``chunk_size`` images (one worker decodes one list), and
    ``sources.images.regroup`` joins them again. ``chunk_size`` defaults to a whole batch
    with ``fit`` (small squares) and a quarter batch with ``short`` (whole pictures of up
    to 16 model inputs each travel, so a worker holds fewer at a time). A file whose
    header cannot be read goes alone and at once: its decoder reports why. With ``fit``
    every image has one shape and no header is read.

    Runs in the process iterating the DataLoader, as it asks for more batches, so the
    headers are read a batch or so ahead of the decoding, never all before the first.
    """

    def __init__(self, files: Sequence[tuple[str, str]], prep: Preprocessing, batch_size: int,
                 chunk_size: int | None = None, read_sizes: SizeReader = read_here):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be at least 1")
        self.files = files
        self.prep = prep
        self.batch_size = batch_size
        self.chunk_size = chunk_size or (batch_size if prep.resize == "fit" else max(1, batch_size // 4))
        self.read_sizes = read_sizes

    def shapes(self) -> Iterator[tuple[int, int] | None]:
        """The model input (height, width) of each file in turn, None where unknown."""
        if self.prep.resize == "fit":
            fixed = (self.prep.size, self.prep.size)
            return (fixed for _ in self.files)
        return (None if size is None else self.prep.model_size(*size)[::-1]
                for size in self.read_sizes([str(path) for _, path in self.files]))

    def __iter__(self) -> Iterator[list[int]]:
        waiting: dict[tuple[int, int], list[int]] = {}
        for index, shape in enumerate(self.shapes()):
            if shape is None:
                yield [index]
                continue
            batch = waiting.setdefault(shape, [])
            batch.append(index)
            if len(batch) == self.batch_size:
                yield from self._chunks(waiting.pop(shape))
        # the short batches, the fullest first
        for batch in sorted(waiting.values(), key=len, reverse=True):
            yield from self._chunks(batch)

    def _chunks(self, batch: list[int]) -> Iterator[list[int]]:
        for start in range(0, len(batch), self.chunk_size):
            yield batch[start:start + self.chunk_size]

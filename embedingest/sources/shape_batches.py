"""Which images go into one batch: those of one model input shape, across the whole run.

A model input is one tensor, so a batch holds one shape; with the weights' own resize
(``short``) every aspect ratio is a shape of its own. Grouping decoded images as they
come (within a DataLoader batch, or a bounded pool of them) leaves most batches short
when a folder mixes ratios, and every batch size at a shape is one more shape for the
GPU's convolution set-up. :class:`ShapeBatchSampler` plans the batches before decoding
instead: it reads each file's size from its header (see ``image_decode.header_size``,
tens of microseconds where decoding takes milliseconds), keeps the waiting images of
each shape as indices only (so any number may wait, at no memory cost), and hands a
batch to the workers the moment its shape has ``batch_size`` images. Each shape then
gets as few batches as it can.

A shape's last, short batch is known only once every header is read. The headers are
read ahead of the decoding, by processes of their own (:class:`HeaderReaders`), so that
comes early; from then on the short batches go out spread evenly between the full ones
still to come, not all at the end. A short batch (often one image of a ratio of its
own) costs the GPU little but the host a whole forward's launches: between full
batches, which keep the GPU busy, those launches are hidden; at the end of a run,
with nothing else to run, the GPU would wait for them.
"""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ..engine.worker_loader import frozen_gc
from .image_decode import Preprocessing, header_size
from .images import ChunkPlace

__all__ = ["ShapeBatchSampler", "HeaderReaders", "SizeStream"]


class SizeStream:
    """Files' sizes from their headers, in order, a chunk at a time: ``ready()`` gives
    those already read (without waiting), ``next()`` waits for the next chunk (None at
    the end). This one reads each chunk here, when asked; :class:`HeaderReaders` gives
    one whose chunks are read ahead, in other processes."""

    def __init__(self, paths: Sequence[str], chunksize: int = 1):
        self.paths = paths
        self.chunksize = chunksize
        self.done = 0  # files whose sizes were handed out

    @property
    def finished(self) -> bool:
        """Every size handed out."""
        return self.done >= len(self.paths)

    def ready(self) -> list:
        return []

    def next(self) -> list | None:
        if self.done >= len(self.paths):
            return None
        chunk = self.paths[self.done:self.done + self.chunksize]
        self.done += len(chunk)
        return _read_chunk(chunk)


def read_here(paths: Sequence[str]) -> SizeStream:
    """Each file's size from its header, in this process, one file at a time."""
    return SizeStream(paths)


SizeReader = Callable[[Sequence[str]], SizeStream]


class _PoolSizes(SizeStream):
    """Chunks read by a pool's processes, all submitted at once (the pool works through
    them in order); a chunk whose reader died is read here."""

    def __init__(self, paths: Sequence[str], pool: ProcessPoolExecutor, chunksize: int):
        super().__init__(paths, chunksize)
        self._futures: deque[Future] = deque()
        for start in range(0, len(paths), chunksize):
            try:
                future = pool.submit(_read_chunk, paths[start:start + chunksize])
            except BrokenProcessPool:
                break  # a reader died already: next() reads the chunks not submitted here
            self._futures.append(future)

    def ready(self) -> list:
        out = []
        while self._futures and self._futures[0].done():
            out += self._take()
        return out

    def next(self) -> list | None:
        if self._futures:
            return self._take()
        return super().next()

    def _take(self) -> list:
        future = self._futures.popleft()
        chunk = self.paths[self.done:self.done + self.chunksize]
        try:
            sizes = future.result()
        except BrokenProcessPool:
            sizes = _read_chunk(chunk)
        self.done += len(chunk)
        return sizes


def _read_chunk(paths: Sequence[str]) -> list:
    """Each file's (width, height) from its header, None where it cannot be read."""
    return [header_size(p) for p in paths]


class HeaderReaders:
    """Processes that read the files' headers for a :class:`ShapeBatchSampler`, so the
    process that drives the GPU does no work per image (a header costs a few hundred
    microseconds of Python).

    Call :meth:`start` before any thread is started (the readers are forked); leaving
    the context stops them. Calling it gives a :class:`SizeStream` of the paths' sizes,
    read in the background; with no processes, or not started, they are read here. A
    reader that dies (a hostile file taking the parser down) costs nothing but speed:
    its chunk and the rest are read here.
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
        self.close()

    def close(self) -> None:
        """Stop the readers (a chunk being read is left to finish)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def __call__(self, paths: Sequence[str]) -> SizeStream:
        if self._pool is None:
            return SizeStream(paths, self.chunksize)
        return _PoolSizes(paths, self._pool, self.chunksize)


class ShapeBatchSampler:
    """The ``batch_sampler`` of a DataLoader over ``ImageFileDataset(files, prep)``.

    Yields lists of indices into ``files``; the lists of one batch come one after the
    other, each of at most ``chunk_size`` images (one worker decodes one list), and
    :meth:`chunk_batch` says which batch a list belongs to, from its first index, so
    that ``sources.images.regroup`` can join the decoded lists in whatever order the
    workers finish them. ``chunk_size``
    defaults to a whole batch with ``fit`` (small squares) and a quarter batch with
    ``short`` (whole pictures of up to 16 model inputs each travel, so a worker holds
    fewer at a time). A file whose header cannot be read goes alone and at once: its
    decoder reports why. With ``fit`` every image has one shape and no header is read.

    Runs in the process iterating the DataLoader, as it asks for more batches, taking
    every header already read each time (so the end of the headers, and with it every
    short batch, is known early) and waiting for more only when no batch is ready.
    A shape's short batch goes after its full ones.
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
        # each list yielded and not yet asked about, by its first index
        self._places: dict[int, ChunkPlace] = {}
        self._ahead: SizeStream | None = None  # headers asked for before the first iteration

    def read_ahead(self) -> ShapeBatchSampler:
        """Ask for the headers now (the first iteration uses them): a DataLoader's workers,
        forked next, take a while to start, and the readers read meanwhile, so the
        loader's first batches are planned without waiting for headers."""
        if self._ahead is None:
            self._ahead = self.shapes()
        return self

    def shapes(self) -> SizeStream:
        """The model input (height, width) of each file in turn, None where unknown."""
        if self.prep.resize == "fit":
            return _Fixed(len(self.files), (self.prep.size, self.prep.size))
        return _ModelShapes(self.read_sizes([str(path) for _, path in self.files]), self.prep)

    def chunk_batch(self, first: int) -> ChunkPlace:
        """Where the list yielded whose first index is ``first`` goes (asked once a list:
        the answer is forgotten, so the plan's memory stays that of the lists in flight)."""
        return self._places.pop(first)

    def __iter__(self) -> Iterator[list[int]]:
        self._places.clear()
        for number, batch in enumerate(self._batches()):
            parts = -(-len(batch) // self.chunk_size)
            for part in range(parts):
                chunk = batch[part * self.chunk_size:(part + 1) * self.chunk_size]
                self._places[chunk[0]] = ChunkPlace(number, part, parts)
                yield chunk

    def _batches(self) -> Iterator[list[int]]:
        stream = self._ahead if self._ahead is not None else self.shapes()
        self._ahead = None
        waiting: dict[tuple[int, int], list[int]] = {}
        full: deque[tuple[list[int], tuple[int, int] | None]] = deque()  # ready, in order
        ahead: Counter = Counter()  # full batches of each shape still in ``full``
        seen = 0

        def add(shapes: list) -> None:
            nonlocal seen
            for shape in shapes:
                if shape is None:
                    full.append(([seen], None))
                else:
                    batch = waiting.setdefault(shape, [])
                    batch.append(seen)
                    if len(batch) == self.batch_size:
                        full.append((waiting.pop(shape), shape))
                        ahead[shape] += 1
                seen += 1

        while True:  # until the last header: the full batches as they fill
            add(stream.ready())
            if stream.finished:
                break
            if full:
                batch, shape = full.popleft()
                ahead[shape] -= 1
                yield batch
                continue
            shapes = stream.next()
            if shapes is None:
                break
            add(shapes)
        # the short batches (the fullest first), spread over the full ones still to go
        shorts = sorted(waiting.items(), key=lambda item: len(item[1]), reverse=True)
        free = deque(batch for shape, batch in shorts if not ahead[shape])
        held = {shape: batch for shape, batch in shorts if ahead[shape]}
        total_full, total_short, sent_full, sent_short = len(full), len(shorts), 0, 0
        while full or free or held:
            due = total_short if not full else total_short * sent_full // total_full
            if free and (sent_short < due or not full):
                sent_short += 1
                yield free.popleft()
                continue
            if not full:  # only held ones left: their shapes' full batches are all out
                free.extend(held.values())
                held.clear()
                continue
            batch, shape = full.popleft()
            sent_full += 1
            ahead[shape] -= 1
            yield batch
            if shape in held and not ahead[shape]:
                free.append(held.pop(shape))


class _Fixed:
    """A :class:`SizeStream` of ``count`` inputs of one known shape: all ready."""

    def __init__(self, count: int, shape: tuple[int, int]):
        self._left, self._shape = count, shape

    @property
    def finished(self) -> bool:
        return not self._left

    def ready(self) -> list:
        left, self._left = self._left, 0
        return [self._shape] * left

    def next(self) -> list | None:
        return self.ready() or None


class _ModelShapes:
    """A :class:`SizeStream` of files' sizes as model input (height, width) shapes."""

    def __init__(self, sizes: SizeStream, prep: Preprocessing):
        self._sizes, self._prep = sizes, prep

    def _shapes(self, sizes: list | None) -> list | None:
        if sizes is None:
            return None
        return [None if size is None else self._prep.model_size(*size)[::-1] for size in sizes]

    @property
    def finished(self) -> bool:
        return self._sizes.finished

    def ready(self) -> list:
        return self._shapes(self._sizes.ready())

    def next(self) -> list | None:
        return self._shapes(self._sizes.next())

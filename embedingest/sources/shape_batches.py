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

The headers come long before the decoders need them, so many full batches wait at once; of
those the next to go is chosen by the decoding work its images take (their pixels, a PNG's
several times a JPEG's): a heavy one while the work sent so far is under its mean, a light
one while it is over, so that the decoders' load stays near its mean where a folder holds
its large photographs together (a camera's folder of PNGs) and a run of heavy batches would
keep the GPU waiting.

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
import heapq
import os
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


# Decoding work per pixel, by file suffix, against a JPEG's (Pillow on one core: a PNG
# photograph about 35 ms a megapixel, a JPEG 7); only for the order batches go in.
DECODE_WORK = {".png": 5.0}


class _Balanced:
    """Full batches ready to go, each with the decoding work of its images. The next is
    the heaviest while the work handed out so far is under its share of the mean over
    every batch seen, else the lightest; among equals, the first to be ready (batches
    of equal work go in the order they filled)."""

    def __init__(self) -> None:
        self._light: list = []  # (work, seq, batch, shape), lightest first
        self._heavy: list = []  # (-work, seq, batch, shape), heaviest first
        self._gone: set[int] = set()  # seqs taken from the other heap
        self._seq = self._seen_work = self._sent = self._sent_work = 0

    def __len__(self) -> int:
        return self._seq - self._sent

    def add(self, batch: list[int], shape, work: float) -> None:
        heapq.heappush(self._light, (work, self._seq, batch, shape))
        heapq.heappush(self._heavy, (-work, self._seq, batch, shape))
        self._seq += 1
        self._seen_work += work

    def pop(self) -> tuple[list[int], tuple[int, int] | None]:
        heavy = self._sent_work * self._seq < self._sent * self._seen_work
        heap = self._heavy if heavy else self._light
        while heap[0][1] in self._gone:
            self._gone.discard(heapq.heappop(heap)[1])
        work, seq, batch, shape = heapq.heappop(heap)
        self._gone.add(seq)
        self._sent += 1
        self._sent_work += abs(work)
        return batch, shape


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
        self._pixels: list[int] = []  # each file's pixels, as its header is read

    def read_ahead(self) -> ShapeBatchSampler:
        """Ask for the headers now (the first iteration uses them): a DataLoader's workers,
        forked next, take a while to start, and the readers read meanwhile, so the
        loader's first batches are planned without waiting for headers."""
        if self._ahead is None:
            self._ahead = self.shapes()
        return self

    def shapes(self) -> SizeStream:
        """The model input (height, width) of each file in turn, None where unknown."""
        self._pixels = []
        if self.prep.resize == "fit":
            return _Fixed(len(self.files), (self.prep.size, self.prep.size))
        return _ModelShapes(self.read_sizes([str(path) for _, path in self.files]), self.prep, self._pixels)

    def _work(self, batch: list[int]) -> float:
        """The decoding work of ``batch``'s images (0 where no pixels are known)."""
        known = len(self._pixels)
        return sum(self._pixels[i] * DECODE_WORK.get(os.path.splitext(self.files[i][1])[1].lower(), 1.0)
                   for i in batch if i < known)

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
        unknown: deque[list[int]] = deque()  # files whose header could not be read: at once
        full = _Balanced()  # ready
        ahead: Counter = Counter()  # full batches of each shape still in ``full``
        seen = 0

        def add(shapes: list) -> None:
            nonlocal seen
            for shape in shapes:
                if shape is None:
                    unknown.append([seen])
                else:
                    batch = waiting.setdefault(shape, [])
                    batch.append(seen)
                    if len(batch) == self.batch_size:
                        full.add(waiting.pop(shape), shape, self._work(batch))
                        ahead[shape] += 1
                seen += 1

        while True:  # until the last header: the full batches as they fill
            add(stream.ready())
            while unknown:
                yield unknown.popleft()
            if stream.finished:
                break
            if full:
                batch, shape = full.pop()
                ahead[shape] -= 1
                yield batch
                continue
            shapes = stream.next()
            if shapes is None:
                break
            add(shapes)
        while unknown:
            yield unknown.popleft()
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
            batch, shape = full.pop()
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
    """A :class:`SizeStream` of files' sizes as model input (height, width) shapes; each
    file's pixels (0 where unknown) are appended to ``pixels`` as they come."""

    def __init__(self, sizes: SizeStream, prep: Preprocessing, pixels: list[int]):
        self._sizes, self._prep, self._pixels = sizes, prep, pixels

    def _shapes(self, sizes: list | None) -> list | None:
        if sizes is None:
            return None
        self._pixels.extend(0 if size is None else size[0] * size[1] for size in sizes)
        return [None if size is None else self._prep.model_size(*size)[::-1] for size in sizes]

    @property
    def finished(self) -> bool:
        return self._sizes.finished

    def ready(self) -> list:
        return self._shapes(self._sizes.ready())

    def next(self) -> list | None:
        return self._shapes(self._sizes.next())

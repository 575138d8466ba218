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

from collections.abc import Iterator, Sequence

from .image_decode import Preprocessing, header_size

__all__ = ["ShapeBatchSampler"]


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
                 chunk_size: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be at least 1")
        self.files = files
        self.prep = prep
        self.batch_size = batch_size
        self.chunk_size = chunk_size or (batch_size if prep.resize == "fit" else max(1, batch_size // 4))

    def shape(self, path: str) -> tuple[int, int] | None:
        """The model input (height, width) of the image at ``path``, None if unknown."""
        if self.prep.resize == "fit":
            return self.prep.size, self.prep.size
        size = header_size(path)
        if size is None:
            return None
        width, height = self.prep.model_size(*size)
        return height, width

    def __iter__(self) -> Iterator[list[int]]:
        waiting: dict[tuple[int, int], list[int]] = {}
        for index, (_, path) in enumerate(self.files):
            shape = self.shape(str(path))
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

"""A torch Dataset over image files that decodes in DataLoader workers and never raises.

Each item is the letterboxed picture as uint8 H x W x 3 (see ``image_decode`` for the
geometry). Normalisation happens on the device (``stages.segmentation``): uint8 is a
quarter of the bytes of float32 through pinned memory and the host-to-device copy, and
H x W x C is already channels-last once permuted on the GPU.

A file that cannot be used becomes a :class:`BadImage` with the reason;
:func:`collate_images` drops those from the tensor batch and carries them to the main
process, which writes them to the skip report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.utils.data import Dataset

from .image_decode import (DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, ImageMeta, ImageRejected,
                           prepare_file)

__all__ = ["IMAGE_EXTENSIONS", "BadImage", "ImageBatch", "ImageFileDataset", "LoadedImage",
           "collate_images"]


class LoadedImage(NamedTuple):
    pixels: torch.Tensor   # uint8 [size, size, 3]
    meta: ImageMeta


class BadImage(NamedTuple):
    rel_path: str
    path: str
    reason: str


class ImageBatch:
    """The good images of one batch, stacked, and the bad ones with their reasons."""

    def __init__(self, pixels: torch.Tensor | None, items: tuple[ImageMeta, ...],
                 bad: tuple[BadImage, ...]):
        self.pixels = pixels   # uint8 [n, size, size, 3], None when every image was bad
        self.items = items
        self.bad = bad

    def __len__(self) -> int:
        return len(self.items)

    def pin_memory(self, *args) -> ImageBatch:
        """Called by the DataLoader's pin thread (``pin_memory=True``)."""
        if self.pixels is not None:
            self.pixels = self.pixels.pin_memory()
        return self


class ImageFileDataset(Dataset):
    """Images from ``files``, a sequence of (rel_path, path) pairs."""

    def __init__(self, files: Sequence[tuple[str, str]], size: int,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS):
        self.files = files
        self.size = size
        self.max_pixels = max_pixels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> LoadedImage | BadImage:
        rel_path, path = self.files[index]
        try:
            pixels, meta = prepare_file(rel_path, str(path), self.size, self.max_pixels)
        except ImageRejected as exc:
            return BadImage(rel_path, str(path), exc.reason)
        return LoadedImage(torch.from_numpy(pixels), meta)


def collate_images(samples: Sequence[LoadedImage | BadImage]) -> ImageBatch:
    good = [s for s in samples if isinstance(s, LoadedImage)]
    bad = tuple(s for s in samples if isinstance(s, BadImage))
    pixels = torch.stack([s.pixels for s in good]) if good else None
    return ImageBatch(pixels, tuple(s.meta for s in good), bad)

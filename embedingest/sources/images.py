"""A torch Dataset over image files that decodes and resizes in DataLoader workers and
never raises, and the regrouping of decoded images into batches of one shape.

Each item is the model input as uint8 [3, h, w] (see ``image_decode`` for the two
geometries). In the default ``short`` mode the resize is torchvision's own
``transforms.functional.resize`` with the preset's arguments, on the tensor
``pil_to_tensor`` makes, so the pixels are exactly those ``weights.transforms()`` would
compute. Normalisation happens on the device (``stages.segmentation``): uint8 is a quarter
of the bytes of float32 through pinned memory and the host-to-device copy.

A file that cannot be used becomes a :class:`BadImage` with the reason;
:func:`collate_images` drops those from the tensors and carries them to the main
process, which writes them to the skip report.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from .image_decode import (DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, ImageMeta, ImageRejected,
                           Preprocessing, letterbox, open_rgb, picture_rgb)

__all__ = ["IMAGE_EXTENSIONS", "BadImage", "ImageBatch", "ImageFileDataset", "LoadedImage",
           "collate_images", "model_input", "prepare_file", "prepare_picture", "regroup"]


class LoadedImage(NamedTuple):
    pixels: torch.Tensor   # uint8 [3, h, w]
    meta: ImageMeta


class BadImage(NamedTuple):
    rel_path: str
    path: str
    reason: str


def model_input(im: Image.Image, original: tuple[int, int], prep: Preprocessing
                ) -> tuple[torch.Tensor, tuple[int, int]]:
    """The uint8 [3, h, w] model input of an upright RGB picture of ``original`` size (in
    ``fit`` mode possibly a smaller JPEG draft of it), and the (width, height) of its image part."""
    if prep.resize == "fit":
        canvas, content = letterbox(im, original, prep.size)
        return torch.from_numpy(canvas).permute(2, 0, 1), content
    w, h = prep.model_size(*original)
    pixels = TF.resize(TF.pil_to_tensor(im), [h, w], interpolation=InterpolationMode(prep.interpolation),
                       antialias=prep.antialias)
    return pixels, (w, h)


def prepare_file(rel_path: str, path: str, prep: Preprocessing,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS) -> tuple[torch.Tensor, ImageMeta]:
    """Decode and resize one file; raises :class:`ImageRejected` with the reason.

    Only ``fit`` mode decodes JPEGs at a reduced scale (``draft``): it changes the pixels,
    so the preset's mode decodes every image whole."""
    im, (width, height) = open_rgb(path, max_pixels, fit=prep.size if prep.resize == "fit" else None)
    pixels, (cw, ch) = model_input(im, (width, height), prep)
    return pixels, ImageMeta(rel_path, str(path), width, height, cw, ch)


def prepare_picture(picture, prep: Preprocessing, name: str = "") -> tuple[torch.Tensor, ImageMeta]:
    """Resize an in-memory picture (see ``image_decode.picture_rgb`` for what it may be)."""
    im = picture_rgb(picture)
    pixels, (cw, ch) = model_input(im, im.size, prep)
    return pixels, ImageMeta(name, "", im.width, im.height, cw, ch)


class ImageBatch:
    """Good images grouped by model input shape, and the bad ones with their reasons."""

    def __init__(self, groups: Sequence[tuple[torch.Tensor, tuple[ImageMeta, ...]]],
                 bad: tuple[BadImage, ...] = ()):
        self.groups = list(groups)   # (uint8 [n, 3, h, w], the n images' metas), one per shape
        self.bad = bad

    @property
    def items(self) -> tuple[ImageMeta, ...]:
        return tuple(m for _, metas in self.groups for m in metas)

    def __len__(self) -> int:
        return sum(len(metas) for _, metas in self.groups)

    def pin_memory(self, *args) -> ImageBatch:
        """Called by the DataLoader's pin thread (``pin_memory=True``)."""
        self.groups = [(pixels.pin_memory(), metas) for pixels, metas in self.groups]
        return self


class ImageFileDataset(Dataset):
    """Images from ``files``, a sequence of (rel_path, path) pairs."""

    def __init__(self, files: Sequence[tuple[str, str]], prep: Preprocessing,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS):
        self.files = files
        self.prep = prep
        self.max_pixels = max_pixels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> LoadedImage | BadImage:
        rel_path, path = self.files[index]
        try:
            pixels, meta = prepare_file(rel_path, str(path), self.prep, self.max_pixels)
        except ImageRejected as exc:
            return BadImage(rel_path, str(path), exc.reason)
        return LoadedImage(pixels, meta)


def collate_images(samples: Sequence[LoadedImage | BadImage]) -> ImageBatch:
    """Stack the good images of each shape (in the worker: one tensor per shape crosses
    to the main process) and carry the bad ones."""
    shapes: dict[tuple[int, ...], list[LoadedImage]] = {}
    for s in samples:
        if isinstance(s, LoadedImage):
            shapes.setdefault(tuple(s.pixels.shape), []).append(s)
    groups = [(torch.stack([s.pixels for s in group]), tuple(s.meta for s in group))
              for group in shapes.values()]
    return ImageBatch(groups, tuple(s for s in samples if isinstance(s, BadImage)))


def regroup(chunks: Iterable[ImageBatch], batch_size: int, max_waiting: int) -> Iterator[ImageBatch]:
    """Batches of at most ``batch_size`` images of one shape each, from decoded chunks.

    A model input is one tensor, so a batch holds one shape. Images of a shape wait until
    they fill a batch; when more than ``max_waiting`` images wait, the shape with the most
    goes as a short batch (a folder of many aspect ratios costs short batches, never
    unbounded memory); the rest go at the end. Bad images travel with the next batch
    yielded (or alone), so they are reported as they come.
    """
    waiting: dict[tuple[int, ...], list[tuple[torch.Tensor, tuple[ImageMeta, ...]]]] = {}
    count: dict[tuple[int, ...], int] = {}

    def take(shape, n: int) -> ImageBatch:
        parts, taken = [], 0
        queue = waiting[shape]
        while taken < n:
            pixels, metas = queue.pop(0)
            k = min(n - taken, len(metas))
            parts.append((pixels[:k], metas[:k]))
            if k < len(metas):
                queue.insert(0, (pixels[k:], metas[k:]))
            taken += k
        count[shape] -= n
        if not count[shape]:
            del waiting[shape], count[shape]
        return ImageBatch(parts)

    bad: tuple[BadImage, ...] = ()
    for chunk in chunks:
        bad += chunk.bad
        for pixels, metas in chunk.groups:
            shape = tuple(pixels.shape[1:])
            waiting.setdefault(shape, []).append((pixels, metas))
            count[shape] = count.get(shape, 0) + len(metas)
        ready = []
        for shape in list(waiting):
            while count.get(shape, 0) >= batch_size:
                ready.append(take(shape, batch_size))
        while sum(count.values()) > max_waiting:
            shape = max(count, key=count.get)
            ready.append(take(shape, min(count[shape], batch_size)))
        if bad and not ready:
            ready.append(ImageBatch([]))
        for batch in ready:
            batch.bad, bad = bad, ()
            yield batch
    for shape in list(waiting):
        while shape in count:
            yield take(shape, min(count[shape], batch_size))
    if bad:
        yield ImageBatch([], bad)

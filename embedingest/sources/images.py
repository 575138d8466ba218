"""A torch Dataset over image files that decodes in DataLoader workers and never raises,
and the regrouping of decoded images into batches of one model input shape.

Each item is a uint8 [H, W, 3] picture and its meta (see ``image_decode`` for the two
geometries): in ``fit`` mode the letterboxed square itself; in the default ``short``
mode the decoded image at its own size, which the device resizes to the model input
(``stages.segmentation``) with torchvision's own ``resize`` and the preset's arguments:
exactly what ``weights.transforms()`` computes, and on a GPU a fraction of a millisecond
where a CPU worker spends tens (the antialiased float resize of a photo). Pictures over
16 times the model input's square are resized in the worker instead (the same call), so
the pictures in flight stay small. Normalisation
happens on the device too: uint8 is a quarter of the bytes of float32 through pinned
memory and the host-to-device copy.

A file that cannot be used becomes a :class:`BadImage` with the reason;
:func:`collate_images` drops those from the tensors and carries them to the main
process, which writes them to the skip report.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import torch
import numpy as np
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from .files import reads_within
from .image_decode import (DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, ImageMeta, ImageRejected,
                           Preprocessing, letterbox, open_rgb, picture_rgb)

__all__ = ["IMAGE_EXTENSIONS", "BadImage", "BatchJoiner", "ChunkPlace", "ImageBatch", "ImageFileDataset",
           "LoadedImage", "collate_images", "model_input", "prepare_file", "prepare_picture", "regroup"]


class LoadedImage(NamedTuple):
    pixels: torch.Tensor   # uint8 [H, W, 3]: the decoded image (short) or the square (fit)
    meta: ImageMeta        # content_width x content_height: the model input (short)
    index: int = -1        # the dataset's index: names the chunk it came in (see BatchJoiner)


class BadImage(NamedTuple):
    rel_path: str
    path: str
    reason: str
    index: int = -1


def model_input(im: Image.Image, original: tuple[int, int], prep: Preprocessing
                ) -> tuple[torch.Tensor, tuple[int, int]]:
    """The uint8 [H, W, 3] picture handed to the device for an upright RGB picture of
    ``original`` size (in ``fit`` mode possibly a smaller JPEG draft of it), and the
    (width, height) of its image part of the model input. In ``short`` mode a picture
    over ``prep.device_resize_max_pixels`` is resized here, by the same torchvision call
    the device makes (``Segmenter.model_input``)."""
    if prep.resize == "fit":
        canvas, content = letterbox(im, original, prep.size)
        return torch.from_numpy(canvas), content
    w, h = prep.model_size(*original)
    if im.width * im.height <= prep.device_resize_max_pixels:
        return torch.from_numpy(np.array(im)), (w, h)
    pixels = TF.resize(TF.pil_to_tensor(im), [h, w], interpolation=InterpolationMode(prep.interpolation),
                       antialias=prep.antialias)
    return pixels.permute(1, 2, 0).contiguous(), (w, h)


def prepare_file(rel_path: str, path: str, prep: Preprocessing,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS) -> tuple[torch.Tensor, ImageMeta]:
    """Decode one file (and letterbox it in ``fit`` mode); raises :class:`ImageRejected`
    with the reason.

    Only ``fit`` mode decodes JPEGs at a reduced scale (``draft``): it changes the pixels,
    so the preset's mode decodes every image whole."""
    im, (width, height) = open_rgb(path, max_pixels, fit=prep.size if prep.resize == "fit" else None)
    pixels, (cw, ch) = model_input(im, (width, height), prep)
    return pixels, ImageMeta(rel_path, str(path), width, height, cw, ch)


def prepare_picture(picture, prep: Preprocessing, name: str = "") -> tuple[torch.Tensor, ImageMeta]:
    """An in-memory picture as :func:`prepare_file` makes a file (see
    ``image_decode.picture_rgb`` for what it may be)."""
    im = picture_rgb(picture)
    pixels, (cw, ch) = model_input(im, im.size, prep)
    return pixels, ImageMeta(name, "", im.width, im.height, cw, ch)


Group = tuple[torch.Tensor, tuple[ImageMeta, ...], tuple[int, int]]


def input_shape(meta: ImageMeta, pixels: torch.Tensor, prep_resize: str) -> tuple[int, int]:
    """(height, width) of the model input of an image."""
    if prep_resize == "fit":
        return tuple(pixels.shape[-3:-1])
    return meta.content_height, meta.content_width


class ImageBatch:
    """Good images grouped by model input shape, and the bad ones with their reasons."""

    def __init__(self, groups: Sequence[Group], bad: tuple[BadImage, ...] = (), first: int | None = None):
        # (uint8 [n, H, W, 3] pictures of one size, their metas, the model input (h, w))
        self.groups = list(groups)
        self.bad = bad
        # a decoded chunk's first dataset index, by which the batch plan knows it
        self.first = first

    @property
    def items(self) -> tuple[ImageMeta, ...]:
        return tuple(m for _, metas, _ in self.groups for m in metas)

    @property
    def nbytes(self) -> int:
        return sum(pixels.nbytes for pixels, _, _ in self.groups)

    def __len__(self) -> int:
        return sum(len(metas) for _, metas, _ in self.groups)

    def pin_memory(self, *args) -> ImageBatch:
        """Called by the DataLoader's pin thread (``pin_memory=True``): the groups packed
        in one buffer (:func:`collate_images`) are pinned as one, still one buffer."""
        pinned: dict[int, torch.Tensor] = {}
        groups = []
        for pixels, metas, hw in self.groups:
            storage = pixels.untyped_storage()
            if storage.data_ptr() not in pinned:
                pinned[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(storage).pin_memory()
            base = pinned[storage.data_ptr()]
            groups.append((base.as_strided(pixels.shape, pixels.stride(), pixels.storage_offset()), metas, hw))
        self.groups = groups
        return self


class ImageFileDataset(Dataset):
    """Images from ``files``, a sequence of (rel_path, path) pairs."""

    def __init__(self, files: Sequence[tuple[str, str]], prep: Preprocessing,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS, within: str | None = None):
        self.files = files
        self.prep = prep
        self.max_pixels = max_pixels
        self.within = within  # the folder each file must still lie in when read (reads_within)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> LoadedImage | BadImage:
        rel_path, path = self.files[index]
        try:
            with reads_within(self.within):
                pixels, meta = prepare_file(rel_path, str(path), self.prep, self.max_pixels)
        except ImageRejected as exc:
            return BadImage(rel_path, str(path), exc.reason, index)
        return LoadedImage(pixels, meta, index)


def collate_images(samples: Sequence[LoadedImage | BadImage], resize: str = "short") -> ImageBatch:
    """Stack the good images of each picture size and model input shape and carry the bad
    ones. In the worker: every group is a view of one buffer, so a chunk crosses to the
    main process as one shared-memory segment (and is pinned there as one), not one per
    group, which for photographs of varied sizes is one per picture."""
    groups: dict[tuple, list[LoadedImage]] = {}
    for s in samples:
        if isinstance(s, LoadedImage):
            key = (tuple(s.pixels.shape), input_shape(s.meta, s.pixels, resize))
            groups.setdefault(key, []).append(s)
    flat = torch.empty(sum(s.pixels.numel() for group in groups.values() for s in group), dtype=torch.uint8)
    packed, at = [], 0
    for (shape, model_hw), group in groups.items():
        pixels = flat[at:at + len(group) * math.prod(shape)].view(len(group), *shape)
        torch.stack([s.pixels for s in group], out=pixels)
        at += pixels.numel()
        packed.append((pixels, tuple(s.meta for s in group), model_hw))
    return ImageBatch(packed, tuple(s for s in samples if isinstance(s, BadImage)),
                      samples[0].index if samples else None)


class ChunkPlace(NamedTuple):
    """Where a decoded chunk goes in the batch plan."""
    batch: int   # the batch's number
    part: int    # the chunk's place in its batch
    parts: int   # how many chunks the batch was cut into


class BatchJoiner:
    """The planned batches from decoded chunks that come in any order: a DataLoader with
    ``in_order=False`` hands each chunk over as its worker finishes it, so one slow chunk
    (a large PNG) holds back its own batch only, not the batches behind it. ``place``
    says where the chunk whose first dataset index is ``first`` goes
    (``ShapeBatchSampler.chunk_batch``). A batch goes, its chunks in planned order and
    its bad images with it, the moment its last chunk comes.

    A chunk waits in :attr:`waiting` until its batch is whole, so what waits is the
    chunks of incomplete batches only. That is bounded: the loader has at most ``k``
    chunks in flight (workers x prefetch_factor) and the plan hands a batch's chunks out
    one after the other, so at most ``k + 1`` batches are incomplete (each with a chunk
    in flight, or the one being handed out), each with at most ``P - 1`` of its ``P``
    chunks here: ``(k + 1)(P - 1)`` chunks, and with those in flight no more than
    ``k + 1`` batches of decoded images (in order, the loader held at most ``k`` chunks).

    A model input is one tensor, so a batch holds one shape; were a header wrong about
    an image's size (it is taken from the header to plan), that batch goes as one batch
    per shape.
    """

    def __init__(self, place: Callable[[int], ChunkPlace]):
        self.place = place
        self.waiting: dict[int, list[ImageBatch | None]] = {}  # batch number -> its chunks

    @property
    def held(self) -> int:
        """The decoded chunks waiting for the rest of their batch."""
        return sum(chunk is not None for parts in self.waiting.values() for chunk in parts)

    def add(self, chunk: ImageBatch) -> list[ImageBatch]:
        """The batches ``chunk`` completes (none, or one per shape of its batch)."""
        place = self.place(chunk.first)
        parts = self.waiting.setdefault(place.batch, [None] * place.parts)
        parts[place.part] = chunk
        if any(part is None for part in parts):
            return []
        del self.waiting[place.batch]
        by_shape: dict[tuple[int, int], list[Group]] = {}
        for part in parts:
            for group in part.groups:
                by_shape.setdefault(group[2], []).append(group)
        batches = [ImageBatch(groups) for groups in by_shape.values()] or [ImageBatch([])]
        batches[0].bad = tuple(bad for part in parts for bad in part.bad)
        return batches


def regroup(chunks: Iterable[ImageBatch], place: Callable[[int], ChunkPlace]) -> Iterator[ImageBatch]:
    """The planned batches from ``chunks`` in whatever order they come (see
    :class:`BatchJoiner`), each as soon as its last chunk comes."""
    joiner = BatchJoiner(place)
    for chunk in chunks:
        yield from joiner.add(chunk)
    if joiner.waiting:
        raise RuntimeError("the chunks ended inside a planned batch: the sampler and the loader disagree")

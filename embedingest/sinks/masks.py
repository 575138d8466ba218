"""The mask sink: segmentation outputs to PNG masks (and optional logits and overlays) on disk.

It runs inside the engine's consumer processes, so it imports numpy and Pillow only.
Per image it writes, under ``out`` and mirroring the input tree (the source file name
is kept whole, so ``a.jpg`` and ``a.png`` in one folder never share an output):

* ``<rel>.png``: class index per pixel, mode "P" with the PASCAL VOC palette, at the
  image's own width and height (nearest-neighbour, so every value is a real class);
* ``<rel>.logits.npy`` (``save_logits``): float16 [C, h, w] per-class scores at model
  resolution, cropped to the image part of the letterboxed input (upscaling C planes
  to the original size would multiply the bytes for no information);
* ``<rel>.overlay.jpg`` (``overlay``): the original, re-read from disk, with non-background
  classes blended in their palette colour.

Every file goes through a temporary name, is checked to be whole and is ``os.replace``d
(``embedingest.outfiles``), and the mask is written last, so an existing mask means the
image is finished: that is what resume checks. No folder under ``out`` is a link the
sink writes through: a mask never lands outside ``out``.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ..outfiles import atomic_write_bytes, ensure_folder
from ..sources.image_decode import ImageMeta, ImageRejected, open_rgb

MASK_SUFFIX = ".png"
LOGITS_SUFFIX = ".logits.npy"
OVERLAY_SUFFIX = ".overlay.jpg"


def voc_palette(n: int = 256) -> list[int]:
    """The PASCAL VOC colour map (class 0 black, 15 'person' pink ...), flat RGB."""
    palette = []
    for label in range(n):
        r = g = b = 0
        c = label
        for shift in range(7, -1, -1):
            r |= ((c >> 0) & 1) << shift
            g |= ((c >> 1) & 1) << shift
            b |= ((c >> 2) & 1) << shift
            c >>= 3
        palette += [r, g, b]
    return palette


VOC_PALETTE = voc_palette()


def output_paths(out: str | os.PathLike, rel_path: str) -> dict[str, Path]:
    """Where the outputs of the image at ``rel_path`` go."""
    base = Path(out) / rel_path
    return {name: base.with_name(base.name + suffix) for name, suffix in
            (("mask", MASK_SUFFIX), ("logits", LOGITS_SUFFIX), ("overlay", OVERLAY_SUFFIX))}


def restore_mask(mask: np.ndarray, meta: ImageMeta) -> np.ndarray:
    """Crop the pad off a model-size mask and scale it to the image's own size (nearest)."""
    mask = mask[:meta.content_height, :meta.content_width]
    if mask.shape != (meta.height, meta.width):
        mask = np.asarray(Image.fromarray(np.ascontiguousarray(mask)).resize(
            (meta.width, meta.height), Image.Resampling.NEAREST))
    return mask


def mask_image(mask: np.ndarray) -> Image.Image:
    """A uint8 class mask as a palette ("P") image: values stay class indices."""
    im = Image.fromarray(np.ascontiguousarray(mask, dtype=np.uint8))
    im.putpalette(VOC_PALETTE)
    return im


def overlay_image(original: Image.Image, mask: np.ndarray, alpha: float) -> Image.Image:
    """Blend the palette colour of every non-background pixel into ``original``."""
    colour = mask_image(mask).convert("RGB")
    blended = Image.blend(original, colour, alpha)
    return Image.composite(blended, original, Image.fromarray(((mask != 0) * 255).astype(np.uint8)))


def _encode(im: Image.Image, fmt: str, **params) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


@dataclass
class MaskSinkFactory:
    """Picklable: the engine sends it to each consumer and calls it there once."""

    out: str
    save_logits: bool = False
    overlay: bool = False
    overlay_alpha: float = 0.5
    # Re-reading originals for overlays obeys the same limit as the reader.
    max_pixels: int | None = None
    # zlib level of the mask PNGs: masks are flat regions, level 1 is within a few
    # percent of level 9 in size and several times faster to encode.
    png_compress_level: int = 1

    def __call__(self, worker_index: int) -> MaskSink:
        return MaskSink(self)


class MaskSink:
    """Writes the outputs of each batch; ``close()`` returns what it wrote and what failed.

    A source that cannot be re-read for its overlay is reported, not fatal (the mask is
    still written); a failure to write (disk full, permissions) raises and stops the run.
    """

    def __init__(self, factory: MaskSinkFactory):
        self.cfg = factory
        self.written = 0
        self.failed: list[tuple[str, str]] = []
        self._folders: set[Path] = set()

    def __call__(self, batch_id: tuple[ImageMeta, ...], arrays: dict[str, np.ndarray]) -> None:
        masks = arrays.get("mask")
        logits = arrays.get("logits")
        if masks is None:
            masks = logits.argmax(axis=1).astype(np.uint8)
        for i, meta in enumerate(batch_id):
            self._write_one(meta, masks[i], None if logits is None else logits[i])

    def _write_one(self, meta: ImageMeta, mask: np.ndarray, logits: np.ndarray | None) -> None:
        paths = output_paths(self.cfg.out, meta.rel_path)
        folder = paths["mask"].parent
        if folder not in self._folders:
            ensure_folder(Path(self.cfg.out), folder)  # never through a link: masks stay in out
            self._folders.add(folder)
        full = restore_mask(mask, meta)
        if self.cfg.save_logits and logits is not None:
            crop = np.ascontiguousarray(logits[:, :meta.content_height, :meta.content_width],
                                        dtype=np.float16)
            buf = io.BytesIO()
            np.save(buf, crop)
            atomic_write_bytes(paths["logits"], buf.getvalue())
        if self.cfg.overlay:
            self._write_overlay(meta, full, paths["overlay"])
        atomic_write_bytes(paths["mask"], _encode(
            mask_image(full), "PNG", compress_level=self.cfg.png_compress_level))
        self.written += 1

    def _write_overlay(self, meta: ImageMeta, mask: np.ndarray, path: Path) -> None:
        try:
            original, size = open_rgb(meta.path, self.cfg.max_pixels)
        except ImageRejected as exc:
            self.failed.append((meta.path, f"overlay source unreadable: {exc.reason}"))
            return
        if size != (meta.width, meta.height):
            self.failed.append((meta.path, f"overlay source changed: now {size[0]}x{size[1]}, "
                                            f"was {meta.width}x{meta.height}"))
            return
        atomic_write_bytes(path, _encode(overlay_image(original, mask, self.cfg.overlay_alpha),
                                         "JPEG", quality=90))

    def close(self) -> dict:
        return {"written": self.written, "failed": self.failed}

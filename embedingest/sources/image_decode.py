"""Decode one image file into the RGB picture a segmentation model sees (Pillow + numpy only).

This module never imports torch: the mask sink re-reads originals with it inside the
engine's consumer processes, so the overlay shows exactly the picture the model saw
(same EXIF rotation, same mode conversion).

Geometry: the whole image is scaled to fit a ``size`` x ``size`` square, aspect ratio
kept, and padded right and bottom with the normalisation mean (zero after
normalising). A centre crop would leave parts of the image without a mask, and a
stretch would show the model shapes it was never trained on; the pad costs some
compute on very wide or tall images and is cropped off again before the mask is scaled
back to the image's own size.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import NamedTuple

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

# An animated GIF (or a multi-page TIFF) is read as its first frame. AVIF needs a Pillow
# built with libavif (the wheels of 11.2 and later); without it each is skipped, named.
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif",
                              ".avif"})

# Larger than any camera photo (a 100 MP medium-format frame fits), small enough that
# one DataLoader worker never holds more than ~450 MB of decoded RGB.
DEFAULT_MAX_PIXELS = 150_000_000

# ImageNet mean in 0..255: the padding becomes exactly zero after normalisation.
PAD_RGB = (124, 116, 104)

# What transparent pixels are composited over: product shots and logos with a
# transparent background are meant to be seen on white.
ALPHA_BACKGROUND = (255, 255, 255)

_SIXTEEN_BIT = {"I;16", "I;16L", "I;16B", "I;16N", "I"}
_ROTATED = {5, 6, 7, 8}


class ImageMeta(NamedTuple):
    """What a sink needs to put one image's mask back on the image's own pixels."""

    rel_path: str        # path under the input folder, '/'-separated; names the outputs
    path: str            # the source file, re-read for overlays
    width: int           # the image's size after EXIF rotation: the mask's size
    height: int
    content_width: int   # the part of the size x size model input that is image, not pad
    content_height: int


class ImageRejected(Exception):
    """The file cannot be used; ``reason`` reads '<kind>: <detail>' for the skip report."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def content_size(width: int, height: int, size: int) -> tuple[int, int]:
    """Size of the image inside the ``size`` square: longer side ``size``, aspect kept."""
    scale = size / max(width, height)
    return max(1, min(size, round(width * scale))), max(1, min(size, round(height * scale)))


@contextlib.contextmanager
def _pixel_limit(max_pixels: int | None):
    """Make Pillow's own decompression-bomb guard agree with ``max_pixels``.

    Pillow refuses images over twice its global limit before we can see their size;
    setting the limit to ours for the call lets us decide and give the reason.
    """
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels or None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def to_rgb(im: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB without clipping or losing transparency sense.

    16-bit and 32-bit integer greyscale ("I;16*", "I") are scaled from 0..65535 (Pillow's
    own convert would clip everything above 255 to white); float images are stretched
    from their min..max; images with alpha are composited over ``ALPHA_BACKGROUND``.
    """
    if im.mode == "RGB":
        return im
    if im.mode in _SIXTEEN_BIT:
        a = np.asarray(im).astype(np.float32)
        return Image.fromarray(np.clip(np.rint(a / 257.0), 0, 255).astype(np.uint8)).convert("RGB")
    if im.mode == "F":
        a = np.nan_to_num(np.asarray(im, dtype=np.float32))
        lo, hi = float(a.min()), float(a.max())
        a = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
        return Image.fromarray(np.rint(a).astype(np.uint8)).convert("RGB")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*ALPHA_BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    try:
        return im.convert("RGB")
    except ValueError as exc:
        raise ImageRejected(f"unsupported mode: {im.mode} ({exc})") from exc


def open_rgb(path: str | os.PathLike, max_pixels: int | None = DEFAULT_MAX_PIXELS,
             fit: int | None = None) -> tuple[Image.Image, tuple[int, int]]:
    """Read ``path`` as an upright RGB image; return it and its full (width, height).

    With ``fit``, JPEGs are decoded at a reduced scale (DCT scaling, several times
    faster) no smaller than needed for a ``fit`` x ``fit`` model input, so the returned
    image may be smaller than the size returned with it. Every failure is an
    :class:`ImageRejected` with the reason; nothing else escapes.
    """
    try:
        if os.path.getsize(path) == 0:
            raise ImageRejected("empty file: 0 bytes")
        with _pixel_limit(max_pixels):
            try:
                im = Image.open(path)
            except Image.DecompressionBombError as exc:
                raise ImageRejected(f"too large: {exc}") from exc
        with im:
            width, height = im.size
            if max_pixels and width * height > max_pixels:
                raise ImageRejected(
                    f"too large: {width}x{height} = {width * height} pixels is over "
                    f"max_pixels={max_pixels}; raise --max-pixels to read it")
            if im.getexif().get(ExifTags.Base.Orientation) in _ROTATED:
                width, height = height, width
            if fit:
                cw, ch = content_size(im.width, im.height, fit)
                im.draft(None, (cw, ch))
            im.load()
            return to_rgb(ImageOps.exif_transpose(im)), (width, height)
    except ImageRejected:
        raise
    except UnidentifiedImageError as exc:
        raise ImageRejected(f"not an image: {exc}") from exc
    except OSError as exc:
        # errno set: the file system refused (gone, permissions); unset: Pillow's decoders
        kind = "unreadable" if exc.errno is not None else "corrupt or truncated"
        raise ImageRejected(f"{kind}: {exc}") from exc
    except (SyntaxError, ValueError, EOFError) as exc:
        raise ImageRejected(f"corrupt or truncated: {exc}") from exc
    except Exception as exc:
        raise ImageRejected(f"cannot decode: {type(exc).__name__}: {exc}") from exc


def letterbox(im: Image.Image, original: tuple[int, int], size: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Place ``im`` (an RGB image of ``original`` size, or a draft of it) in a padded square.

    Returns the ``size`` x ``size`` x 3 uint8 array and the content (width, height).
    """
    cw, ch = content_size(*original, size)
    if im.size != (cw, ch):
        im = im.resize((cw, ch), Image.Resampling.BILINEAR, reducing_gap=3.0)
    canvas = np.empty((size, size, 3), dtype=np.uint8)
    canvas[...] = PAD_RGB
    canvas[:ch, :cw] = np.asarray(im)
    return canvas, (cw, ch)


def prepare_file(rel_path: str, path: str, size: int,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS) -> tuple[np.ndarray, ImageMeta]:
    """Decode and letterbox one file; raises :class:`ImageRejected` with the reason."""
    im, (width, height) = open_rgb(path, max_pixels, fit=size)
    pixels, (cw, ch) = letterbox(im, (width, height), size)
    return pixels, ImageMeta(rel_path, str(path), width, height, cw, ch)


def prepare_picture(picture, size: int, name: str = "") -> tuple[np.ndarray, ImageMeta]:
    """Letterbox an in-memory picture: a PIL image (any mode, already upright: no EXIF
    rotation is applied), or a uint8 or uint16 array shaped H x W, H x W x 3 or H x W x 4."""
    if not isinstance(picture, Image.Image):
        a = np.asarray(picture)
        if a.dtype == np.uint16:
            a = np.rint(a / 257.0).astype(np.uint8)
        if a.dtype != np.uint8 or a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (3, 4)):
            raise ImageRejected(
                f"unsupported array: dtype {a.dtype}, shape {a.shape}; "
                "pass uint8 or uint16 shaped HxW, HxWx3 or HxWx4")
        picture = Image.fromarray(a)
    im = to_rgb(picture)
    pixels, (cw, ch) = letterbox(im, im.size, size)
    return pixels, ImageMeta(name, "", im.width, im.height, cw, ch)

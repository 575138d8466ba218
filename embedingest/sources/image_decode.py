"""Decode one image file into the RGB picture a segmentation model sees (Pillow + numpy only).

This module never imports torch: the mask sink re-reads originals with it inside the
engine's consumer processes, so the overlay shows exactly the picture the model saw
(same EXIF rotation, same mode conversion). The resize that follows decoding is in
``sources.images`` (it is torchvision's own, in the DataLoader workers).

Two geometries (:class:`Preprocessing`):

* ``short`` (the default): the weights' own preset, torchvision's ``Resize(size)``: the
  short side becomes ``size``, aspect kept, no pad, so images of different aspect
  ratios have different model input shapes (the job batches images of one shape);
* ``fit``: the whole image is scaled to fit a ``size`` x ``size`` square, aspect kept,
  and padded right and bottom with the normalisation mean. One shape for every image;
  the pad is cropped off again before the mask is scaled back to the image's size.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from ..config import DEFAULT_MAX_PIXELS
from .files import NotRegularFile, OutsideInput, open_regular
from .remote import is_remote, open_remote, remote_size

# An animated GIF (or a multi-page TIFF) is read as its first frame. AVIF needs a Pillow
# built with libavif (the wheels of 11.2 and later); without it each is skipped, named.
# .jfif and .jpe are JPEG's other names (browsers save downloads as .jfif).
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".jfif", ".jpe", ".png", ".webp", ".bmp", ".tif", ".tiff",
                              ".gif", ".avif"})

# ImageNet mean in 0..255: the padding becomes exactly zero after normalisation.
PAD_RGB = (124, 116, 104)

# What transparent pixels are composited over: product shots and logos with a
# transparent background are meant to be seen on white.
ALPHA_BACKGROUND = (255, 255, 255)

_SIXTEEN_BIT = {"I;16", "I;16L", "I;16B", "I;16N", "I"}
_ROTATED = {5, 6, 7, 8}


# In ``short`` mode the long side of the model input is capped at this many times
# ``size`` (torchvision's ``Resize(max_size=...)``): only panoramas wider than 4:1 are
# affected, and the host slots can be sized for the largest input.
LONG_SIDE_LIMIT = 4

# In ``short`` mode a picture of up to this many times ``size``² pixels (4.3 MP at 520)
# goes to the device whole and is resized there; a larger one is resized in the worker
# (the same torchvision function, slower there), so what the DataLoader holds in flight
# stays bounded whatever the photographs' size.
DEVICE_RESIZE_FACTOR = 16


@dataclass(frozen=True)
class Preprocessing:
    """How a decoded picture becomes the model input; written to labels.json.

    ``short`` is torchvision's ``SemanticSegmentation`` preset of the weights (resize of the
    short side with antialiasing, ``ToTensor``, normalisation with ``mean``/``std``);
    ``fit`` the letterbox into a ``size`` square.
    """

    resize: str = "short"
    size: int = 520
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    interpolation: str = "bilinear"
    antialias: bool = True

    @property
    def max_size(self) -> int | None:
        """The cap on the long side in ``short`` mode (``Resize(max_size=...)``)."""
        return LONG_SIDE_LIMIT * self.size if self.resize == "short" else None

    @property
    def device_resize_max_pixels(self) -> int:
        return DEVICE_RESIZE_FACTOR * self.size * self.size

    def model_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the image part of the model input for an image of this size."""
        if self.resize == "fit":
            return content_size(width, height, self.size)
        return short_side_size(width, height, self.size, self.max_size)

    def describe(self) -> dict:
        return {"resize": self.resize, "size": self.size, "max_size": self.max_size,
                "interpolation": self.interpolation, "antialias": self.antialias,
                "mean": list(self.mean), "std": list(self.std)}


class ImageMeta(NamedTuple):
    """What a sink needs to put one image's mask back on the image's own pixels."""

    rel_path: str        # path under the input folder, '/'-separated; names the outputs
    path: str            # the source file, re-read for overlays
    width: int           # the image's size after EXIF rotation: the mask's size
    height: int
    content_width: int   # the part of the model input that is image, not pad
    content_height: int
    # Set by the job: the mask handed to the sink is already width x height (else it is
    # content_width x content_height, and the sink scales it up nearest-neighbour).
    full_mask: bool = False


class ImageRejected(Exception):
    """The file cannot be used; ``reason`` reads '<kind>: <detail>' for the skip report."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def content_size(width: int, height: int, size: int) -> tuple[int, int]:
    """Size of the image inside the ``size`` square: longer side ``size``, aspect kept."""
    scale = size / max(width, height)
    return max(1, min(size, round(width * scale))), max(1, min(size, round(height * scale)))


def short_side_size(width: int, height: int, size: int, max_size: int | None = None) -> tuple[int, int]:
    """torchvision's ``Resize([size], max_size=max_size)`` output (width, height): the short
    side ``size``, the long side truncated (``int``), both at least 1."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    new_short = max(1, new_short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


# Held while Pillow's global limit is ours (``_pixel_limit``): threads calling
# ``segment_images`` at once each restored the limit another had set, and the process
# kept it (with max_pixels=0, no decompression-bomb guard at all).
_PIXEL_LIMIT_LOCK = threading.Lock()


def _new_pixel_limit_lock() -> None:
    """A forked child (a DataLoader worker) starts with the lock free: another thread of
    the parent may have held it at the fork, and no thread of the child would free it."""
    global _PIXEL_LIMIT_LOCK
    _PIXEL_LIMIT_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_pixel_limit_lock)


@contextlib.contextmanager
def _pixel_limit(max_pixels: int | None):
    """Make Pillow's own decompression-bomb guard agree with ``max_pixels``.

    Pillow refuses images over twice its global limit before we can see their size;
    setting the limit to ours for the call lets us decide and give the reason. One
    thread at a time, so the limit restored is always Pillow's own.
    """
    with _PIXEL_LIMIT_LOCK:
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
    own convert would clip everything above 255 to white), or stretched from their
    min..max where values lie outside it (a 32-bit or signed TIFF); float images are
    stretched from their finite min..max; images with alpha are composited over
    ``ALPHA_BACKGROUND``.
    """
    if im.mode == "RGB":
        return im
    if im.mode in _SIXTEEN_BIT:
        a = np.asarray(im)
        if a.size and (a.min() < 0 or a.max() > 65535):
            return _stretched(a.astype(np.float64))  # 32-bit or signed: 0..65535 would clip it to one colour
        scaled = np.clip(np.rint(a.astype(np.float32) / 257.0), 0, 255)
        return Image.fromarray(scaled.astype(np.uint8)).convert("RGB")
    if im.mode == "F":
        return _stretched(np.asarray(im, dtype=np.float64))
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*ALPHA_BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    try:
        return im.convert("RGB")
    except ValueError as exc:
        raise ImageRejected(f"unsupported mode: {im.mode} ({exc})") from exc


def _stretched(a: np.ndarray) -> Image.Image:
    """Grey values of any range stretched over 0..255 from their finite min..max (a NaN
    or an infinity is the nearest end; before, an infinity made every finite value 0)."""
    finite = a[np.isfinite(a)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    a = np.clip(np.nan_to_num(a, nan=lo, posinf=hi, neginf=lo), lo, hi)
    a = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
    return Image.fromarray(np.rint(a).astype(np.uint8)).convert("RGB")


def _bomb_reason(exc: Exception, max_pixels: int | None) -> str:
    """The skip reason of an image Pillow refused before we saw its size (over twice its
    limit, which :func:`_pixel_limit` set to ``max_pixels``): in terms of the option, not
    of Pillow's doubled limit."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    pixels = f"{found.group(1)} pixels" if found else "its size"
    return f"too large: {pixels} is over max_pixels={max_pixels}; raise --max-pixels to read it"


def open_rgb(path: str | os.PathLike, max_pixels: int | None = DEFAULT_MAX_PIXELS,
             fit: int | None = None) -> tuple[Image.Image, tuple[int, int]]:
    """Read ``path`` as an upright RGB image; return it and its full (width, height).

    With ``fit``, JPEGs are decoded at a reduced scale (DCT scaling, several times
    faster) no smaller than needed for a ``fit`` x ``fit`` model input, so the returned
    image may be smaller than the size returned with it. Every failure is an
    :class:`ImageRejected` with the reason; nothing else escapes.
    """
    try:
        with _opened(path) as (source, size), warnings.catch_warnings():
            # Pillow's warnings (its own pixel limit, which max_pixels replaces; EXIF it
            # reads past) would go to stderr outside the job's log, for images decoded well
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
            if size == 0:
                raise ImageRejected("empty file: 0 bytes")
            with _pixel_limit(max_pixels):
                try:
                    im = Image.open(source)
                except Image.DecompressionBombError as exc:
                    raise ImageRejected(_bomb_reason(exc, max_pixels)) from exc
            with im:
                width, height = im.size
                if max_pixels and width * height > max_pixels:
                    raise ImageRejected(
                        f"too large: {width}x{height} = {width * height} pixels is over "
                        f"max_pixels={max_pixels}; raise --max-pixels to read it")
                width, height = _upright_size(im)
                drafted = False
                if fit:
                    cw, ch = content_size(im.width, im.height, fit)
                    drafted = im.draft(None, (cw, ch)) is not None
                im.load()
                ImageOps.exif_transpose(im, in_place=True)  # an upright picture is not copied
                if not drafted:  # the pixels say it: a PNG's EXIF may come after them
                    width, height = im.size
                return to_rgb(im), (width, height)
    except ImageRejected:
        raise
    except (NotRegularFile, OutsideInput) as exc:
        raise ImageRejected(str(exc)) from exc
    except UnidentifiedImageError as exc:  # its message names a file object, not the file
        raise ImageRejected("not an image: Pillow recognises no image format in it") from exc
    except OSError as exc:
        # errno set: the file system refused (gone, permissions); unset: Pillow's decoders
        kind = "unreadable" if exc.errno is not None else "corrupt or truncated"
        raise ImageRejected(f"{kind}: {exc}") from exc
    except (SyntaxError, ValueError, EOFError) as exc:
        raise ImageRejected(f"corrupt or truncated: {exc}") from exc
    except Exception as exc:
        raise ImageRejected(f"cannot decode: {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _opened(path: str | os.PathLike):
    """``(what Image.open takes, size in bytes)``: a local file opened with
    :func:`~.files.open_regular` (a pipe cannot hang the decoder; inside
    ``reads_within`` a file swapped for a link out of the input folder is refused); an
    object in storage (an fsspec URL) opened for reading, which Pillow reads from in
    ranges, so a header costs one request. Failing to open it is ``unreadable``."""
    if not is_remote(path):  # opened here, not by Pillow: never blocks, checked (open_regular)
        with open_regular(path) as fh:
            yield fh, os.fstat(fh.fileno()).st_size
        return
    try:
        fh = open_remote(path)
    except OSError as exc:
        raise ImageRejected(f"unreadable: {exc}") from exc
    with fh:
        yield fh, remote_size(fh)


def _upright_size(im: Image.Image) -> tuple[int, int]:
    """The (width, height) ``im`` has once its EXIF orientation is applied, from its header.

    A TIFF's size is taken from its own tags, as stored: Pillow 11.2 and later report a
    rotated TIFF's size already turned upright (and turn its pixels on load), earlier
    versions as stored, so ``im.size`` alone would be turned twice on one of them."""
    tags = getattr(im, "tag_v2", None)
    stored = (tags.get(256), tags.get(257)) if tags is not None else (None, None)
    width, height = stored if all(isinstance(n, int) for n in stored) else im.size
    if im.getexif().get(ExifTags.Base.Orientation) in _ROTATED:
        width, height = height, width
    return width, height


def header_size(path: str | os.PathLike) -> tuple[int, int] | None:
    """The (width, height) :func:`open_rgb` will return for ``path``, read from the file's
    header without decoding the pixels (tens of microseconds), or None when the header
    cannot be read (the decoder then says why).

    A PNG whose EXIF comes after its pixel data would need a full decode to find its
    orientation (Pillow loads the image for it); it is taken as upright here, so the rare
    such file may get another size when decoded: callers use this only to plan."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with _opened(path) as (source, _), Image.open(source) as im:
                lazy_exif = im.format == "PNG" and not {"exif", "XML:com.adobe.xmp"} & set(im.info)
                return im.size if lazy_exif else _upright_size(im)
    except Exception:
        return None


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


def picture_rgb(picture) -> Image.Image:
    """An in-memory picture as an RGB image: a PIL image (any mode, already upright: no
    EXIF rotation is applied), or a uint8 or uint16 array shaped H x W, H x W x 3 or H x W x 4."""
    if not isinstance(picture, Image.Image):
        a = np.asarray(picture)
        if a.dtype == object and a.ndim == 0:
            opened = " (an open file: pass PIL.Image.open(it))" if hasattr(picture, "read") else ""
            raise ImageRejected(f"a {type(picture).__name__} is not a picture{opened}; pass a PIL image, a uint8 "
                                "or uint16 array, or an image file's path")
        if a.dtype == np.uint16:
            a = np.rint(a / 257.0).astype(np.uint8)
        if a.dtype != np.uint8 or a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (3, 4)):
            raise ImageRejected(
                f"unsupported array: dtype {a.dtype}, shape {a.shape}; "
                "pass uint8 or uint16 shaped HxW, HxWx3 or HxWx4")
        picture = Image.fromarray(a)
    if not picture.width or not picture.height:
        raise ImageRejected(f"empty picture: {picture.width}x{picture.height} pixels; pass one of at least 1x1")
    return to_rgb(picture)

"""The mask sink: segmentation outputs to PNG masks (and optional logits, overlays and
per-image statistics) on disk, and the folder's ``labels.json``.

It runs inside the engine's consumer processes, so it imports numpy and Pillow only
(pyarrow too, with statistics). A batch arrives flat: ``mask`` is the images' masks one
after the other (each ``width x height`` bytes when the job made it at the image's size,
``meta.full_mask``, else ``content_width x content_height`` at model size), ``logits``
likewise ``C x content_height x content_width`` float16 values each. Per image it
writes, under ``out`` and mirroring the input tree (the source file name is kept whole,
so ``a.jpg`` and ``a.png`` in one folder never share an output):

* ``<rel>.png``: class index per pixel, mode "P" with the PASCAL VOC palette, at the
  image's own width and height (a model-size mask is scaled nearest-neighbour, so
  every value is a real class);
* ``<rel>.logits.npy`` (``save_logits``): float16 [C, h, w] per-class scores at model
  resolution, the image part of the input (upscaling C planes to the original size
  would multiply the bytes for no information);
* ``<rel>.overlay.jpg`` (``overlay``): the original, re-read from disk, with non-background
  classes blended in their palette colour (scaled down, aspect kept, where a side passes
  the 65,500 pixels a JPEG can hold);
* a row in ``stats/`` (``stats``, see ``mask_stats``), after the mask.

Every file goes through a temporary name, is checked to be whole and is ``os.replace``d
(``embedingest.outfiles``), and the mask is written last, so an existing mask means the
image is finished: that is what resume checks. No folder under ``out`` is a link the
sink writes through: a mask never lands outside ``out``.

``out`` may be a URL (``s3://bucket/prefix``, any fsspec URL): each consumer then writes
its files as above in a staging folder of its own (:func:`tempfile.mkdtemp`), uploads
them, the mask last (one PUT each: an object is whole or absent), and deletes them.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import ConfigError
from ..outfiles import atomic_write_bytes, ensure_folder
from ..sources.files import NotRegularFile, open_regular, reads_within
from ..sources.image_decode import ImageMeta, ImageRejected, open_rgb
from ..sources.remote import is_remote, url_fs

log = logging.getLogger("embedingest")

LABELS_FILE = "labels.json"
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
    """Crop the pad off a model-size mask and scale it to the image's own size (nearest);
    a mask already at the image's size (``meta.full_mask``) is returned as it is."""
    if meta.full_mask:
        return mask
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


# The longest side a JPEG can hold (libjpeg's JPEG_MAX_DIMENSION).
JPEG_MAX_SIDE = 65_500


def jpeg_sized(im: Image.Image) -> Image.Image:
    """``im``, scaled down (aspect kept) where a side passes :data:`JPEG_MAX_SIDE`: the
    overlay of a panorama 70,000 pixels wide failed to encode, and the error stopped the
    run (and every run after it, the image never getting its mask)."""
    long = max(im.size)
    if long <= JPEG_MAX_SIDE:
        return im
    size = tuple(max(1, min(JPEG_MAX_SIDE, round(side * JPEG_MAX_SIDE / long))) for side in im.size)
    return im.resize(size, Image.Resampling.BILINEAR, reducing_gap=3.0)


def _encode(im: Image.Image, fmt: str, **params) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def split_flat(flat: np.ndarray, metas: Sequence[ImageMeta], per_pixel: int = 1,
               full: bool = True) -> list[np.ndarray]:
    """The per-image arrays of a flat batch (see the module docstring): masks
    (``per_pixel`` 1) at the image's size where ``full`` and the meta say so, or
    ``per_pixel`` planes at model size."""
    out, offset = [], 0
    for m in metas:
        if full and m.full_mask:
            shape = (m.height, m.width)
        else:
            shape = (per_pixel, m.content_height, m.content_width) if per_pixel > 1 else \
                (m.content_height, m.content_width)
        n = int(np.prod(shape))
        if offset + n > len(flat):
            raise ValueError(f"a batch of {len(flat)} values is short of its {len(metas)} images' "
                             f"{offset + n} or more")
        out.append(flat[offset:offset + n].reshape(shape))
        offset += n
    return out


def labels_info(arch: str, weights: str, categories: Sequence[str], preprocessing: dict,
                full_max_pixels: int | None, preset: str = "", weights_sha256: str | None = None,
                precision: str | None = None) -> dict:
    """What the values of the masks mean and how they were made: ``labels.json``.
    ``weights_sha256``: of the weights file (None: random weights, seeded); ``precision``:
    the model's dtype in this run (``float16``), added to the folder's ``precisions`` (a
    resume in another one is told, see :func:`write_labels`; None: a run that makes no
    mask)."""
    n = len(categories)
    masks = {"format": "PNG, mode P: the class index of each pixel, at the image's own size, "
                       "with the palette below",
             "resize": ("the logits scaled bilinearly to the image's size, then the argmax "
                        f"(images over {full_max_pixels} pixels: the argmax at model size "
                        "scaled nearest-neighbour)") if full_max_pixels else
                       "the argmax at model size, the pad cropped, scaled nearest-neighbour"}
    return {"arch": arch, "weights": weights, "weights_sha256": weights_sha256, "weights_preset": preset,
            "num_classes": n,
            "categories": list(categories), "preprocessing": preprocessing,
            "precisions": [precision] if precision else [],
            "masks": masks,  # its format says "the palette below": the next key
            "palette": [VOC_PALETTE[3 * i:3 * i + 3] for i in range(n)]}


# What must agree for masks of one folder to mean the same: resuming into a folder made
# with another model (architecture or weights) or preprocessing would mix two kinds of
# mask. The weights are their file's sha256 (the same file at another path is the same
# weights; other bytes at the same path are not); labels written before it was recorded
# are compared by where the weights came from.
_LABELS_MUST_MATCH = ("arch", "weights_sha256", "num_classes", "categories", "preprocessing", "masks")


def _differences(old: dict, info: dict) -> list[str]:
    """The keys of ``_LABELS_MUST_MATCH`` on which labels ``old`` and ``info`` differ; a
    change of weights lists where each came from too."""
    keys = [k if k != "weights_sha256" or k in old else "weights" for k in _LABELS_MUST_MATCH]
    differ = [k for k in keys if old.get(k) != info.get(k)]
    if "weights_sha256" in differ and old.get("weights") != info.get("weights"):
        differ.insert(differ.index("weights_sha256"), "weights")
    return differ


def write_labels(out: str | os.PathLike, info: dict, replace: bool = False) -> Path | str:
    """Write ``labels.json`` (atomically; one PUT where ``out`` is a URL); refuse a folder
    whose labels differ, unless ``replace``. The precisions the folder's masks were made in
    are kept, this run's added: a resume in another one (a GPU run's folder finished on a
    CPU, fp16 then fp32) is allowed, since masks differ only where two classes score nearly
    alike, but it is logged and recorded, never silent."""
    if is_remote(out):
        fs, root = url_fs(out)
        path = f"{root}/{LABELS_FILE}"
        try:
            old = fs.cat_file(path)
        except FileNotFoundError:
            old = None
        url = f"{str(out).rstrip('/')}/{LABELS_FILE}"
        if old is not None and not replace and _same_labels(old, info, out, url):
            return url
        fs.pipe_file(path, _labels_bytes(info))
        return url
    path = Path(out) / LABELS_FILE
    old = None if replace else _read_labels(path)
    if old is not None and _same_labels(old, info, out, path):
        return path
    atomic_write_bytes(path, _labels_bytes(info))
    return path


def _labels_bytes(info: dict) -> bytes:
    return (json.dumps(info, indent=2) + "\n").encode()


def _read_labels(path: Path) -> bytes | None:
    """The bytes of ``labels.json``, None where there is none. Anything but a regular file
    there (a link, a named pipe, a device) is refused unopened: a pipe would block the
    read for ever, and a link would vouch for masks with a file outside the folder."""
    try:
        with open_regular(path, follow_links=False) as fh:
            return fh.read()
    except FileNotFoundError:
        return None
    except NotRegularFile as exc:
        raise ConfigError(f"{path} is {exc.strerror}, not a regular file; remove it, or pass "
                          "--overwrite to redo every image") from exc
    except OSError as exc:
        raise ConfigError(f"{path} is unreadable ({exc}); remove it or pass --overwrite") from exc


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def _same_labels(old: bytes, info: dict, out, path) -> bool:
    """Whether the labels ``old`` (the file's bytes) are ``info``, once ``info`` lists the
    folder's precisions too (:func:`_keep_precisions`); ConfigError when they describe
    masks made otherwise."""
    try:
        old = json.loads(old)
    except (ValueError, RecursionError) as exc:  # JSON nested past Python's stack: damaged too
        raise ConfigError(f"{path} is unreadable ({exc}); remove it or pass --overwrite") from exc
    if not isinstance(old, dict):
        raise ConfigError(f"{path} holds a JSON {_JSON_KINDS.get(type(old), type(old).__name__)}, not the object "
                          "of labels segment writes; remove it or pass --overwrite")
    if not {"arch", "categories"} & set(old):
        raise ConfigError(f"{path} holds a JSON object without segment's labels (no 'arch', no 'categories'): "
                          "another program's file; move it out of the folder, or pass --overwrite")
    differ = _differences(old, info)
    if differ:
        raise ConfigError(
            f"{out} holds masks made with other settings ({', '.join(differ)} differ: "
            f"{', '.join(_described(differ, old, info))}); use another --out, "
            "or --overwrite to redo every image")
    _keep_precisions(old, info, out)
    return old == info


def _keep_precisions(old: dict, info: dict, out) -> None:
    """``info["precisions"]``: those of the folder's labels ``old``, then this run's new ones,
    a new one logged as a warning (labels written before precisions were recorded: this
    run's alone)."""
    was = old.get("precisions")
    was = [p for p in was if isinstance(p, str)] if isinstance(was, list) else []
    new = [p for p in info.get("precisions") or [] if p not in was]
    if new and was:
        log.warning("%s holds masks made in %s; this run makes them in %s: where two classes score nearly "
                    "alike a pixel's class can differ between the two (--dtype %s gives the folder's precision, "
                    "--overwrite redoes every image)", out, ", ".join(was), ", ".join(new),
                    _DTYPE_OPTION.get(was[0], was[0]))
    info["precisions"] = was + new


_DTYPE_OPTION = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _described(differ: list[str], old: dict, info: dict, most: int = 3) -> list[str]:
    """The first ``most`` differences, each the folder's value and this run's: of a
    setting that is an object (preprocessing), only the entries that differ, and of a
    list (the categories), the first entry that differs or the lengths, so a refusal says
    which setting to turn back rather than printing the folder's whole settings."""
    found = []
    for key in differ:
        was, now = old.get(key), info.get(key)
        if isinstance(was, dict) and isinstance(now, dict):
            found += [f"{key}.{k}={was.get(k)!r} (this run: {now.get(k)!r})"
                      for k in {**was, **now} if was.get(k) != now.get(k)]
        elif isinstance(was, list) and isinstance(now, list) and len(was) != len(now):
            found.append(f"{key}: {len(was)} names (this run: {len(now)})")
        elif isinstance(was, list) and isinstance(now, list):
            i = next(i for i, (a, b) in enumerate(zip(was, now)) if a != b)
            found.append(f"{key}[{i}]={was[i]!r} (this run: {now[i]!r})")
        else:
            found.append(f"{key}={was!r} (this run: {now!r})")
    return found[:most]


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
    # Classes of the logits (to split a flat batch of them).
    num_classes: int = 0
    # Write a row per image to stats/ (category names of the columns).
    stats: bool = False
    categories: tuple[str, ...] = field(default_factory=tuple)
    stats_commit_seconds: float = 10.0
    # The folder an original re-read for its overlay must lie in (a real path; None: no
    # check): the reader's own rule (sources.files.reads_within).
    within: str | None = None
    # Each image's overlay and logits from before are deleted before its outputs are
    # written (--overwrite: they may be another model's, and a later run asking for them
    # would take them as done).
    drop_earlier: bool = False

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
        self._remote = None  # (filesystem, root path) where ``out`` is a URL
        self._stage = Path(factory.out)
        if is_remote(factory.out):
            self._remote = url_fs(factory.out)
            self._stage = Path(tempfile.mkdtemp(prefix="embedingest-masks-"))
        self.stats = None
        if factory.stats:
            from .mask_stats import StatsWriter

            self.stats = StatsWriter(factory.out, factory.categories,
                                     seconds=factory.stats_commit_seconds)

    def __call__(self, batch_id: tuple[ImageMeta, ...], arrays: dict[str, np.ndarray]) -> None:
        logits = arrays.get("logits")
        if logits is not None:
            logits = split_flat(logits, batch_id, self.cfg.num_classes, full=False)
        masks = arrays.get("mask")
        if masks is None:
            masks = [lg.argmax(axis=0).astype(np.uint8) for lg in logits]
        else:
            masks = split_flat(masks, batch_id)
        for i, meta in enumerate(batch_id):
            self._write_one(meta, masks[i], None if logits is None else logits[i])

    def _write_one(self, meta: ImageMeta, mask: np.ndarray, logits: np.ndarray | None) -> None:
        paths = output_paths(self._stage, meta.rel_path)
        folder = paths["mask"].parent
        if folder not in self._folders:
            ensure_folder(self._stage, folder)  # never through a link: masks stay in out
            self._folders.add(folder)
        full = restore_mask(mask, meta)
        if self.cfg.drop_earlier and self._remote is None:
            for kind in ("logits", "overlay"):
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    paths[kind].unlink()  # a link there goes, its target stays; a folder is no output
        if self.cfg.save_logits and logits is not None:
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(logits, dtype=np.float16))
            atomic_write_bytes(paths["logits"], buf.getvalue())
        if self.cfg.overlay:
            self._write_overlay(meta, full, paths["overlay"])
        atomic_write_bytes(paths["mask"], _encode(
            mask_image(full), "PNG", compress_level=self.cfg.png_compress_level))
        if self._remote is not None:
            self._upload(paths)
        self.written += 1
        if self.stats is not None:
            self.stats.add(meta.rel_path, full)

    def _upload(self, paths: dict[str, Path]) -> None:
        """Upload an image's files from the staging folder, the mask last (its object
        says the image is done), and delete them there."""
        fs, root = self._remote
        for kind in ("logits", "overlay", "mask"):
            path = paths[kind]
            if path.is_file():
                fs.put_file(os.fspath(path), f"{root}/{path.relative_to(self._stage).as_posix()}")
                path.unlink()

    def _write_overlay(self, meta: ImageMeta, mask: np.ndarray, path: Path) -> None:
        try:
            with reads_within(self.cfg.within):
                original, size = open_rgb(meta.path, self.cfg.max_pixels)
        except ImageRejected as exc:
            self.failed.append((meta.path, f"overlay source unreadable: {exc.reason}"))
            return
        if size != (meta.width, meta.height):
            self.failed.append((meta.path, f"overlay source changed: now {size[0]}x{size[1]}, "
                                            f"was {meta.width}x{meta.height}"))
            return
        if original.size != mask.shape[::-1]:  # a decoder that turns a picture its own way: named, not a crash
            self.failed.append((meta.path, f"overlay: the picture decodes at {original.size[0]}x{original.size[1]}, "
                                            f"its mask is {mask.shape[1]}x{mask.shape[0]}"))
            return
        atomic_write_bytes(path, _encode(jpeg_sized(overlay_image(original, mask, self.cfg.overlay_alpha)),
                                         "JPEG", quality=90))

    def close(self) -> dict:
        if self.stats is not None:
            self.stats.close()
        if self._remote is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
        return {"written": self.written, "failed": self.failed,
                "stats_rows": self.stats.committed if self.stats is not None else 0}

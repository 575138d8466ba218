"""The segment job: a torchvision segmentation model over a folder of images, one mask
per image on disk.

Pipeline: list the images (resuming: those with a mask already are left out), decode
and resize them in DataLoader workers (by default exactly as the weights' own
``transforms()``: the short side to 520, so aspect ratios give different shapes), regroup
them, in the order the workers finish them, into pinned uint8 batches of one shape each
as planned (``sources.images.regroup``), copy each
batch to the GPU on a side stream one batch ahead (``stages.prefetch``), normalise and
run the model there, scale the logits to each image's size and take the argmax there,
and hand only the uint8 masks (a 42nd of the fp16 logits' bytes with 21 classes) to the
egress engine, whose consumer processes write the files (``sinks.masks``). A batch
crosses flat (the masks one after the other), so images of any size share the slots.
With ``save_logits`` the logits at model size go through as well, as float16: the scores
are far inside float16's range and half the bytes of float32.

The package: :mod:`.listing` (what is still to do), :mod:`.run` (the job on one
device), :mod:`.devices` (on several devices of one host); this module runs the steps
and writes the summary, and :func:`segment_images` serves in-memory pictures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import stat
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ...config import SegmentConfig, load_config
from ...errors import ConfigError, SettingError
from ...exit_codes import exit_code
from ...index.lock import RUN_LOCK, RunLock
from ...report import REPORT_NAME, SkipReport
from ...scaleout.devices import devices_of
from ...sinks.mask_stats import (STATS_DIR, drop_stats_rows, foreign_entries, part_files, remove_parts,
                                  stats_folder)
from ...sinks.masks import LABELS_FILE, restore_mask
from ...sources.files import refuse_output_as_input, refuse_report_in_out
from ...sources.image_decode import ImageRejected
from ...sources.images import input_shape, prepare_file, prepare_picture
from ...sources.remote import check_remote, is_remote, local_path, url_fs
from ...stages import fused_argmax
from ...stages.device import resolve_device
from ...stages.segmentation import Segmenter, SegmentationModel, load_segmentation_model
from ...terminal import counted
from .devices import segment_on_devices
from .listing import first_output_file, list_inputs, remove_stale_tmp_files
from .overwrite_mark import OVERWRITING, clear_mark, refuse_unfinished, set_mark
from .run import check_settings, load_model, refuse_slow_precision, segment_on_device

__all__ = ["SegmentConfig", "list_inputs", "segment", "segment_images"]


def segment(config: SegmentConfig, progress: bool = True, timeline: str | None = None,
            trace: str | None = None) -> dict:
    """Run the job; returns a summary dict. Bad images are skipped and reported.

    ``timeline`` names a PNG to draw the last batches' engine timeline into, ``trace`` a
    JSON file for every batch's engine records in the Chrome trace format."""
    config.validate()
    if not config.images:
        raise SettingError("segment needs images (an input folder or file) and out (a folder)")
    if not config.out:
        raise SettingError("segment needs an output folder: give --out DIR (out= in SegmentConfig)")
    devices = devices_of(config)
    several = len(devices) > 1
    if trace and several:
        raise ConfigError(f"--trace records one device's engine; drop it or run on one device "
                          f"(--devices {config.devices!r} names {len(devices)})")
    # Several devices are not touched here (their processes can then be forked).
    device = None if several else resolve_device(devices[0] if devices else config.device)
    for name in devices if several else [device]:
        refuse_slow_precision(config.dtype, name)
    config = dataclasses.replace(config, images=local_path(config.images), out=local_path(config.out))
    remote_out = is_remote(config.out)
    if remote_out:
        if config.stats:
            raise ConfigError(f"--stats writes a table that grows in place, which {config.out!r} (object "
                              "storage) cannot hold: write the masks to a local --out, or drop --stats")
        check_remote("/".join(config.out.split("/")[:3]))  # its bucket, before any write
    if is_remote(config.images):
        check_remote(config.images)  # a missing bucket or credential stops before any write
    elif not remote_out:
        refuse_output_as_input(config.out, config.images, "input folder", "the PNG masks")
    if not remote_out:
        refuse_report_in_out(config.out, {"--timeline": timeline, "--trace": trace})
    out = Path(config.out)
    made = [] if remote_out else _make_out(out)
    try:
        return _run(config, out, remote_out, devices, device, several, progress, timeline, trace)
    except BaseException:
        if made:
            _remove_untouched(out, made[1:])
        raise


def _run(config: SegmentConfig, out: Path, remote_out: bool, devices: list, device, several: bool,
         progress: bool, timeline: str | None, trace: str | None) -> dict:
    """:func:`segment` once its output folder exists: the run under the folder's lock."""
    report = SkipReport()
    t0 = time.perf_counter()
    phases = {}  # seconds of each step, for the summary: where a run's time goes
    # One run at a time per local output folder: two at once did every image twice and
    # gave each two rows of statistics.
    with (contextlib.nullcontext() if remote_out else
          RunLock(out, job="segment run", resumes="every mask written so far is kept", writers=False)):
        try:
            refuse_unfinished(config.out, config.overwrite)
            # The weights are read and the model built while the images are listed, in a
            # thread that ends before any process is forked; with several devices only
            # checked (on the meta device), each device process loads its own.
            with ThreadPoolExecutor(1, thread_name_prefix="embedingest-model") as pool:
                loading = pool.submit(load_model, config, meta=several)
                if config.stats and not remote_out:
                    _refuse_stats_file(out)
                todo, already = list_inputs(config, report)
                if not remote_out and not config.overwrite:
                    _refuse_unlabelled(out, already, config.images)
                if not remote_out:  # an object is whole or absent: nothing half-written to delete
                    remove_stale_tmp_files(out, todo)
            loaded = loading.result()
            if config.overwrite:  # the weights read: from here the folder changes
                set_mark(config.out)
            phases["list_s"] = time.perf_counter() - t0
            # images found: those to do, those done, and those the listing skipped (named
            # outputs taken, links out of the folder): so written + done + skipped add up
            summary = {"images": len(todo) + already + len(report), "already_done": already, "written": 0,
                       "batch_shapes": [], "decoders": 0,
                       "engine": None, "timing": None}  # a run's, when it ran the model
            redo = functools.partial(_before_redoing, config, todo)
            if not todo or several:  # the settings are checked before anything is deleted
                check_settings(config, loaded)
            if todo and several:
                redo()
                summary.update(segment_on_devices(devices, config, todo, report, progress))
            elif todo:
                summary.update(segment_on_device(config, device, todo, report, progress, timeline, trace=trace,
                                                 before_writes=redo, loaded=loaded))
            if config.overwrite:
                clear_mark(config.out)
            phases["segment_s"] = time.perf_counter() - t0 - phases["list_s"]
        finally:
            report_path = _write_report(report, config.out) if remote_out else report.write(out)
    seconds = time.perf_counter() - t0
    phases["finish_s"] = seconds - sum(phases.values())
    summary.update({
        "skipped": len(report), "skipped_by_reason": report.by_reason(), "exit_code": exit_code(len(report)),
        "passed_over": dict(report.passed_over.most_common()), "seconds": round(seconds, 3),
        "images_per_s": round(summary["written"] / seconds, 2) if seconds > 0 else 0.0,
        "phases": {k: round(v, 3) for k, v in phases.items()},
        "out": config.out if remote_out else str(out), "report": str(report_path), "report_run": report.run,
    })
    return summary


def _refuse_unlabelled(out: Path, done: int, images: str) -> None:
    """ConfigError where ``out`` holds ``done`` images' masks, other files named as masks
    are (of images this run does not have), or statistics rows, but no labels.json: no
    run can say which model made them, and this one would have written its own labels
    beside them (masks of two models in one folder, rows of another model's classes read
    under this one's)."""
    if os.path.lexists(out / LABELS_FILE):
        return
    parts = [] if (out / STATS_DIR).is_symlink() else part_files(out)  # a link: --stats refuses it
    other = None if done else first_output_file(out, images)
    if done or parts or other:
        held = " and ".join(filter(None, [f"the masks of {counted(done, 'image')}" if done else "",
                                          f"outputs of a run ({other!r} and maybe more)" if other else "",
                                          counted(len(parts), "--stats part") if parts else ""]))
        raise ConfigError(f"{str(out)!r} holds {held} but no {LABELS_FILE}, which says the model that made "
                          "them: pass --overwrite to redo every image, or give another --out")


def _refuse_stats_file(out: Path) -> None:
    """ConfigError where ``--stats``'s folder name is taken by something else (a file): the
    rows could not be written, and the run found out after every image; or where the
    folder holds files of the user's, which a reader of the folder as one table (as the
    README reads it) would take for rows too."""
    path = stats_folder(out)  # a link there is refused by it
    if os.path.lexists(path) and not path.is_dir():
        raise ConfigError(f"{str(path)!r} is not a folder, and --stats keeps its table in a folder of that "
                          "name: move that file away, or drop --stats")
    foreign = foreign_entries(out)
    if foreign:
        one = len(foreign) == 1
        it, are_not = ("it", "is not a --stats part") if one else ("them", "are not --stats parts")
        raise ConfigError(f"{str(path)!r} holds {counted(len(foreign), 'entry', 'entries')} that {are_not} "
                          f"({foreign[0]!r}{'' if one else ' and more'}): pandas.read_parquet of the folder "
                          f"would read {it} as rows of the table; move {it} out of the folder, or give another --out")


def _remove_untouched(out: Path, parents: list[Path]) -> None:
    """Remove ``out``, made by a run that failed before writing anything (weights it
    cannot read, another model's labels, Ctrl-C at the start): the folder then holds only
    the run's lock and an empty report. Anything else there, or a folder that cannot be
    listed or emptied, and it stays. Then the ``parents`` the run made for it (innermost
    first), each while it is empty."""
    with contextlib.suppress(OSError):
        with os.scandir(out) as entries:
            found = {e.name: e.stat(follow_symlinks=False) for e in entries}
        if set(found) <= {RUN_LOCK, REPORT_NAME, OVERWRITING} and all(
                stat.S_ISREG(st.st_mode) and (name != REPORT_NAME or st.st_size == 0) for name, st in found.items()):
            for name in found:
                (out / name).unlink()
            out.rmdir()
            for parent in parents:
                parent.rmdir()  # fails (and stops) where something else is in it


def _make_out(out: Path) -> list[Path]:
    """Make the output folder; return the folders made (``out`` and the missing parents,
    innermost first), for a run that fails before writing to remove again. A link there
    that leads nowhere is named (mkdir said only ``[Errno 17] File exists``)."""
    made, folder = [], out
    while not os.path.lexists(folder) and folder != folder.parent:
        made.append(folder)
        folder = folder.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        return made
    except FileExistsError:
        if os.path.islink(out) and not out.exists():
            raise ConfigError(f"out={str(out)!r} is a symbolic link to {os.readlink(out)!r}, which does not "
                              "exist; create that folder, or give another --out") from None
        taken = next((f for f in (out, *out.parents) if os.path.lexists(f) and not os.path.isdir(f)), out)
        raise ConfigError(f"out={str(out)!r}: {str(taken)!r} is a file, not a folder; give an --out folder "
                          "(it is made where missing)") from None
    except OSError as exc:  # a parent that cannot hold folders (/proc), one not writable, a full disk
        raise ConfigError(f"cannot make the output folder {str(out)!r}: {exc.strerror or exc}; give an --out "
                          "where folders can be made") from None


def _before_redoing(config: SegmentConfig, todo: list[tuple[str, str]]) -> None:
    """What goes before a run writes, once its model and the folder's labels agree: the
    statistics rows of the images it redoes are dropped (an image redone gets its one row
    anew, ``--stats`` or not); with ``--overwrite`` every part goes, so the table is this
    run's alone."""
    if is_remote(config.out):
        return
    if config.overwrite:
        remove_parts(config.out)
    else:
        drop_stats_rows(config.out, {rel for rel, _ in todo})


def _write_report(report: SkipReport, url: str) -> str:
    """Add this run's entries to the skip report at ``url`` (read, merged in a local
    temporary folder, uploaded in one PUT); its URL."""
    import tempfile

    fs, root = url_fs(url)
    path = f"{root}/{REPORT_NAME}"
    with tempfile.TemporaryDirectory(prefix="embedingest-report-") as folder:
        try:
            fs.get_file(path, os.path.join(folder, REPORT_NAME))
        except FileNotFoundError:
            pass
        fs.put_file(os.fspath(report.write(folder)), path)
    return f"{url.rstrip('/')}/{REPORT_NAME}"


def segment_images(images: Iterable, config: SegmentConfig | None = None, *,
                   model: SegmentationModel | None = None, **overrides) -> list[np.ndarray]:
    """Masks of pictures (PIL images, uint8/uint16 arrays, or image files' paths as str,
    bytes or Path, read and turned upright as :func:`segment` reads them), each a uint8
    [height, width] array at its picture's own size.

    For a handful of images in a notebook or a service: it runs in this process, with
    no engine and no files. Settings come from ``config`` and ``overrides`` (field names
    of :class:`SegmentConfig`; ``max_pixels`` bounds what a file may decode to, a picture
    given in memory is decoded already); pass ``model`` (from ``load_segmentation_model``)
    to reuse a loaded model across calls.
    """
    if isinstance(images, (str, bytes, os.PathLike)):
        raise ConfigError(f"images={images!r} is one path, not a list of pictures: pass [path] for one "
                          "image file, or call segment(SegmentConfig(images=..., out=...)) for a folder (it writes the "
                          "masks)")
    values = {**dataclasses.asdict(config or SegmentConfig()), **overrides}
    config = load_config(SegmentConfig, None, **values)
    config.validate()
    device = resolve_device(config.device)
    refuse_slow_precision(config.dtype, device)
    if model is None:
        model = load_segmentation_model(config.arch, config.weights, config.num_classes,
                                        config.random_weights, config.trust_weights_file)
    prep = model.preprocessing(config.resize, config.size)
    segmenter = Segmenter(model, device, config.dtype)
    if config.resize == "short":  # masks at the pictures' sizes: their kernel compiles meanwhile
        fused_argmax.compile_ahead(segmenter.device, segmenter.dtype, model.num_classes)
    masks: list[np.ndarray] = []
    pictures = iter(images)
    while chunk := list(itertools.islice(pictures, config.batch_size)):
        prepared = [_prepare(picture, prep, len(masks) + i, config.max_pixels) for i, picture in enumerate(chunk)]
        done: dict[int, np.ndarray] = {}
        shapes: dict[tuple[int, ...], list[int]] = {}
        for i, (pixels, meta) in enumerate(prepared):
            shapes.setdefault(input_shape(meta, pixels, config.resize), []).append(i)
        for size, index in shapes.items():
            pixels = segmenter.model_input([prepared[i][0][None] for i in index], size)
            logits = segmenter.logits(pixels)
            got, metas = segmenter.image_masks(logits, [prepared[i][1] for i in index],
                                               None if config.resize == "short" else 0)
            for i, mask, meta in zip(index, got, metas, strict=True):
                done[i] = restore_mask(mask.cpu().numpy(), meta)
        masks += [done[i] for i in range(len(prepared))]
    return masks


def _prepare(picture, prep, index: int, max_pixels: int):
    if isinstance(picture, bytes) and (b"\0" in picture or len(picture) > 4096):
        raise ConfigError(f"image {index}: {len(picture)} bytes that are no file's path (bytes are taken as a path); "
                          "for an encoded image held in memory pass PIL.Image.open(io.BytesIO(data))")
    path = os.fsdecode(picture) if isinstance(picture, (str, bytes, os.PathLike)) else None
    try:
        if path is not None:
            return prepare_file(path, path, prep, max_pixels)
        return prepare_picture(picture, prep)
    except ImageRejected as exc:
        raise ConfigError(f"image {index}{f' ({path})' if path is not None else ''}: {exc.reason}") from exc

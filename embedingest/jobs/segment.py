"""The segment job: a torchvision segmentation model over a folder of images, one mask
per image on disk.

Pipeline: list the images (resuming: those with a mask already are left out), decode
and resize them in DataLoader workers (by default exactly as the weights' own
``transforms()``: the short side to 520, so aspect ratios give different shapes), regroup
them into pinned uint8 batches of one shape each (``sources.images.regroup``), copy each
batch to the GPU on a side stream one batch ahead (``stages.prefetch``), normalise and
run the model there, scale the logits to each image's size and take the argmax there,
and hand only the uint8 masks (a 42nd of the fp16 logits' bytes with 21 classes) to the
egress engine, whose consumer processes write the files (``sinks.masks``). A batch
crosses flat (the masks one after the other), so images of any size share the slots.
With ``save_logits`` the logits at model size go through as well, as float16: the scores
are far inside float16's range and half the bytes of float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import posixpath
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from ..config import load_config
from ..engine.consumers import exit_with_parent, loader_context
from ..engine.egress import EgressEngine
from ..engine.markers import annotate
from ..errors import ConfigError
from ..outfiles import through_link
from ..report import SkipReport
from ..scaleout.devices import devices_of, share_of_cpus
from ..sinks.mask_stats import STATS_DIR, drop_stats_rows, stats_sources
from ..sinks.masks import (LOGITS_SUFFIX, MASK_SUFFIX, OVERLAY_SUFFIX, MaskSinkFactory,
                           labels_info, restore_mask, write_labels)
from ..sources.files import refuse_output_as_input, walk_files
from ..sources.image_decode import (DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, LONG_SIDE_LIMIT,
                                    RESIZE_MODES, ImageMeta, ImageRejected)
from ..sources.images import (ImageBatch, ImageFileDataset, collate_images, input_shape,
                              prepare_picture, regroup)
from ..sources.shape_batches import HeaderReaders, ShapeBatchSampler
from ..stages.device import resolve_device
from ..stages.prefetch import prefetch
from ..stages.segmentation import (ARCHITECTURES, DTYPES, Segmenter, SegmentationModel,
                                   load_segmentation_model)


@dataclass
class SegmentConfig:
    """Settings of a segment run; each field is the CLI option of the same name."""

    # Input folder (read recursively) or a single image file.
    images: str | None = None
    # Output folder: masks mirror the input tree; labels.json and skipped.jsonl go here too.
    out: str | None = None
    # Weights file: a state dict, a checkpoint with "model"/"state_dict", or a pickled
    # module. Default: torchvision's COCO_WITH_VOC_LABELS_V1 file if in the hub cache.
    weights: str | None = None
    # Model architecture: any torchvision segmentation model (fcn_resnet50, fcn_resnet101,
    # deeplabv3_resnet50, deeplabv3_resnet101, deeplabv3_mobilenet_v3_large,
    # lraspp_mobilenet_v3_large).
    arch: str = "deeplabv3_resnet50"
    # Classes of the weights; read from the weights file, so only a check when given.
    num_classes: int | None = None
    # Run with random weights when no weights are found (pipeline tests, benchmarks).
    random_weights: bool = False
    # "short": the weights' own preprocessing (short side to size, aspect kept, no pad;
    # images batched by shape); "fit": each image fitted into size x size and padded (one
    # shape for all).
    resize: str = "short"
    # The short side of the model input ("short"; 520 is the weights' preset), or the
    # side of the square ("fit").
    size: int = 520
    # Masks of images up to this many pixels are made at the image's size on the device
    # (the logits scaled bilinearly, then argmax: torchvision's pipeline); larger images
    # get the argmax at model size scaled up nearest-neighbour. Each host slot holds at
    # least this many bytes. With resize "fit" every mask is made at model size.
    upsample_max_pixels: int = 40_000_000
    # Images per forward pass.
    batch_size: int = 16
    # Model precision: auto (fp16 on CUDA, fp32 on CPU), fp32, fp16 or bf16.
    dtype: str = "auto"
    # "auto" (CUDA when available), "cuda", "cuda:N" or "cpu".
    device: str = "auto"
    # Several devices, one process each, the images split between them: "all" (every
    # GPU), "0,1" (GPU numbers), "cuda:0,cuda:1", or "cpu,cpu" (for testing); "" is the one device.
    devices: str = ""
    # DataLoader worker processes decoding images (0: decode in the main process; -1: the
    # usable cores but two, shared between device processes, and no more than the batches).
    num_workers: int = -1
    # Engine consumer processes writing masks (PNG encoding is their main cost).
    num_consumers: int = 4
    # Engine host slots; 0 means twice the consumers.
    num_slots: int = 0
    # Also write <image>.logits.npy: float16 [classes, h, w] scores at model resolution.
    # Each host slot then grows by batch_size x classes x size x size x 2 bytes.
    save_logits: bool = False
    # Also write <image>.overlay.jpg: the image with the classes blended in colour.
    overlay: bool = False
    # Weight of the class colour in overlays (0..1).
    overlay_alpha: float = 0.5
    # Also write stats/*.parquet: a row per image (source, width, height, the share of
    # its pixels of each class), resumable like the masks.
    stats: bool = False
    # Seconds between commits of each writer's rows (a killed run loses at most the rows
    # of this long; their images are redone on resume). Fewer seconds, more part files.
    stats_commit_seconds: float = 10.0
    # Redo images whose mask exists (otherwise they are skipped: resume).
    overwrite: bool = False
    # Images with more pixels are skipped with a reason (0: no limit).
    max_pixels: int = DEFAULT_MAX_PIXELS

    def validate(self) -> None:
        checks = [
            (self.size >= 32, f"size={self.size}: must be at least 32 (the models downsample 8x or more)"),
            (self.resize in RESIZE_MODES, f"resize={self.resize!r}: choose {' or '.join(RESIZE_MODES)}"),
            (self.upsample_max_pixels >= 0,
             f"upsample_max_pixels={self.upsample_max_pixels}: must be 0 (never) or more"),
            (self.batch_size >= 1, f"batch_size={self.batch_size}: must be at least 1"),
            (self.num_workers >= -1, f"num_workers={self.num_workers}: must be -1 (auto), 0 or more"),
            (self.num_consumers >= 1, f"num_consumers={self.num_consumers}: must be at least 1"),
            (self.num_slots >= 0, f"num_slots={self.num_slots}: must be 0 (auto) or more"),
            (self.max_pixels >= 0, f"max_pixels={self.max_pixels}: must be 0 (no limit) or more"),
            (self.stats_commit_seconds >= 0,
             f"stats_commit_seconds={self.stats_commit_seconds}: must be 0 or more"),
            (0.0 <= self.overlay_alpha <= 1.0, f"overlay_alpha={self.overlay_alpha}: must be in 0..1"),
            (self.dtype == "auto" or self.dtype in DTYPES,
             f"dtype={self.dtype!r}: choose auto, {', '.join(DTYPES)}"),
            (self.arch in ARCHITECTURES,
             f"arch={self.arch!r}: choose one of {', '.join(ARCHITECTURES)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def list_inputs(config: SegmentConfig, report: SkipReport) -> tuple[list[tuple[str, str]], int]:
    """The (rel_path, path) pairs still to do, and how many were already done.

    Whether an image is done comes from one listing of each output folder rather than a
    stat of each output: at ~100k images the per-image paths and stats took seconds of
    every run's start-up (and a scaled-out run's parent does this alone)."""
    root, out = Path(config.images), Path(config.out)
    suffixes = ([MASK_SUFFIX] + [LOGITS_SUFFIX] * config.save_logits
                + [OVERLAY_SUFFIX] * config.overlay)
    present = _FolderNames(str(out))
    with_row = stats_sources(out) if config.stats and not config.overwrite else set()
    single = root.is_file()
    prefix = "" if str(root) == "." else os.path.join(str(root), "")  # walk_files' paths start so
    todo, done = [], 0
    # An output folder inside the input is not listed: masks are PNGs and would be
    # segmented on the next run.
    for path in walk_files(root, set(IMAGE_EXTENSIONS), on_skip=report.add,
                           on_other=report.pass_over, exclude=out):
        full = str(path)
        if single:
            rel = path.name
        elif full.startswith(prefix):
            rel = full[len(prefix):].replace(os.sep, "/")
        else:
            rel = path.relative_to(root).as_posix()
        folder, name = posixpath.split(rel)
        if (not config.overwrite and all(present.has(folder, name + s) for s in suffixes)
                and (not config.stats or rel in with_row)):
            done += 1
        else:
            todo.append((rel, full))
    return todo, done


class _FolderNames:
    """The names in the folders under ``out``, each folder listed once, when first asked."""

    def __init__(self, out: str):
        self.out = out
        self.names: dict[str, frozenset[str]] = {}

    def has(self, folder: str, name: str) -> bool:
        names = self.names.get(folder)
        if names is None:
            try:
                # a link is no mask: its image is redone (the link replaced, not followed)
                with os.scandir(os.path.join(self.out, folder)) as entries:
                    names = frozenset(e.name for e in entries if not e.is_symlink())
            except OSError:  # not made yet, or not a folder: nothing in it is done
                names = frozenset()
            self.names[folder] = names
        return name in names


def remove_stale_tmp_files(out: Path, todo: list[tuple[str, str]]) -> None:
    """Delete the temporary files (``.<name>.tmp-<pid>``, see ``atomic_write_bytes``) that a
    killed run left half-written in ``out`` and in the folders of the images still to do
    (an image whose write was cut is one of those: its mask, written last, is missing), and
    in the statistics folder."""
    subs = {"", STATS_DIR} | {posixpath.dirname(rel) for rel, _ in todo}
    for folder in {os.path.join(out, sub) for sub in subs}:
        if through_link(out, folder):  # never delete through a link: it may lead out of ``out``
            continue
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(".") and ".tmp-" in entry.name and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def segment(config: SegmentConfig, progress: bool = True, timeline: str | None = None,
            trace: str | None = None) -> dict:
    """Run the job; returns a summary dict. Bad images are skipped and reported.

    ``timeline`` names a PNG to draw the last batches' engine timeline into, ``trace`` a
    JSON file for every batch's engine records in the Chrome trace format."""
    config.validate()
    if not config.images or not config.out:
        raise ConfigError("segment needs images (an input folder or file) and out (a folder)")
    devices = devices_of(config)
    if trace and len(devices) > 1:
        raise ConfigError(f"--trace records one device's engine; drop it or run on one device "
                          f"(--devices {config.devices!r} names {len(devices)})")
    device = resolve_device(config.device) if len(devices) < 2 else None
    if len(devices) == 1:
        device = resolve_device(devices[0])
    refuse_output_as_input(config.out, config.images, "input folder", "the PNG masks")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    report = SkipReport()
    t0 = time.perf_counter()
    phases = {}  # seconds of each step, for the summary: where a run's time goes
    try:
        todo, already = list_inputs(config, report)
        remove_stale_tmp_files(out, todo)
        if config.stats and config.overwrite and todo:
            drop_stats_rows(out, {rel for rel, _ in todo})
        phases["list_s"] = time.perf_counter() - t0
        summary = {"images": len(todo) + already, "already_done": already, "written": 0}
        if todo and device is None:
            from ..scaleout.multi_segment import segment_on_devices

            summary.update(segment_on_devices(devices, config, todo, report, progress))
        elif todo:
            summary.update(run_on_device(config, device, todo, report, progress, timeline, trace=trace))
        phases["segment_s"] = time.perf_counter() - t0 - phases["list_s"]
    finally:
        report_path = report.write(out)
    seconds = time.perf_counter() - t0
    phases["finish_s"] = seconds - sum(phases.values())
    summary.update({
        "skipped": len(report), "skip_reasons": report.by_reason(),
        "passed_over": dict(report.passed_over.most_common()), "seconds": round(seconds, 3),
        "images_per_s": round(summary["written"] / seconds, 2) if seconds > 0 else 0.0,
        "phases": {k: round(v, 3) for k, v in phases.items()},
        "out": str(out), "report": str(report_path), "report_run": report.run,
    })
    return summary


def slot_spec(config: SegmentConfig, num_classes: int) -> dict:
    """The flat arrays of one host slot: room for a full batch at the largest model input,
    and for at least one mask of ``upsample_max_pixels`` (a batch that does not fit is
    handed over in several parts, see ``_parts``)."""
    square = config.size * config.size
    if config.resize == "fit":
        masks, logits = config.batch_size * square, config.batch_size * num_classes * square
    else:
        masks = max(config.batch_size * LONG_SIDE_LIMIT * square, config.upsample_max_pixels)
        logits = max(config.batch_size, LONG_SIDE_LIMIT) * num_classes * square
    spec = {"mask": ((masks,), "uint8")}
    if config.save_logits:
        spec["logits"] = ((logits,), "float16")
    return spec


def _parts(metas: list[ImageMeta], masks: list[torch.Tensor], logits: list[torch.Tensor] | None,
           spec: dict) -> Iterator[tuple[tuple[ImageMeta, ...], dict[str, torch.Tensor]]]:
    """The flat arrays of a batch in as few parts as fit a slot, images in order."""
    room = {name: shape[0] for name, (shape, _) in spec.items()}
    start, used = 0, dict.fromkeys(room, 0)
    for i in range(len(metas) + 1):
        sizes = {} if i == len(metas) else {"mask": masks[i].numel(),
                                             **({"logits": logits[i].numel()} if logits else {})}
        if i == len(metas) or any(used[k] + n > room[k] for k, n in sizes.items()):
            if i > start:
                arrays = {"mask": torch.cat([m.reshape(-1) for m in masks[start:i]])}
                if logits:
                    arrays["logits"] = torch.cat([lg.reshape(-1) for lg in logits[start:i]])
                yield tuple(metas[start:i]), arrays
            start, used = i, dict.fromkeys(room, 0)
        for k, n in sizes.items():
            used[k] += n


def run_on_device(config: SegmentConfig, device: torch.device, todo: list[tuple[str, str]],
                  report: SkipReport, progress: bool = False, timeline: str | None = None,
                  on_images=None, processes: int = 1, trace: str | None = None) -> dict:
    """Segment ``todo`` ((rel_path, path) pairs) on one device; bad images go to
    ``report``; ``on_images(n)`` is told of every n images handled; ``processes`` device
    processes share the host's cores. Returns the summary fields of the run, ``timing``
    among them: where this process's time went (model load; starting the decoding workers
    and the engine; waiting for the first batch and for later ones, where the decoders are
    the bound; the first forward, which includes CUDA's lazy set-up; the others with
    their hand-over to the engine; closing, the consumers' last masks), and
    ``batch_shapes``: how many batches of each size and model input shape ran."""
    t0 = time.perf_counter()
    timing = dict.fromkeys(("load_model_s", "start_s", "first_batch_s", "first_forward_s",
                            "input_wait_s", "forward_submit_s", "close_s"), 0.0)
    loaded = load_segmentation_model(config.arch, config.weights, config.num_classes,
                                     config.random_weights)
    prep = loaded.preprocessing(config.resize, config.size)
    full_max = config.upsample_max_pixels if config.resize == "short" else 0
    write_labels(config.out, labels_info(loaded.arch, loaded.source, loaded.categories,
                                         prep.describe(), full_max, loaded.preset),
                 replace=config.overwrite)
    segmenter = Segmenter(loaded, device, config.dtype)
    # cuDNN's algorithm search (torch.backends.cudnn.benchmark) stays off: on an H200 it
    # found no faster kernels for DeepLabV3-ResNet50 at batch 16 (fp16 741 against 739
    # images/s, fp32 392 against 392) and cost 1.6-3.6 s (fp16) and 12 s (fp32) at the
    # start of every process, and it would search again for every new input shape.
    t_loaded = time.perf_counter()
    timing["load_model_s"] = t_loaded - t0
    workers = min(share_of_cpus(config.num_workers, processes), -(-len(todo) // config.batch_size))
    # Headers are read by processes of their own (a few per cent of the decoding's work), so
    # this process, which drives the GPU, does nothing per image.
    headers = HeaderReaders(max(1, workers // 8) if workers and config.resize != "fit" else 0,
                            loader_context(), functools.partial(exit_with_parent, os.getpid()))
    loader = DataLoader(
        ImageFileDataset(todo, prep, config.max_pixels or None),
        # batches of one shape planned from the headers; regroup joins their chunks
        batch_sampler=ShapeBatchSampler(todo, prep, config.batch_size, read_sizes=headers),
        num_workers=workers,
        collate_fn=functools.partial(collate_images, resize=config.resize),
        pin_memory=device.type == "cuda",
        persistent_workers=False, worker_init_fn=functools.partial(exit_with_parent, os.getpid()),
        multiprocessing_context=loader_context() if workers else None)
    spec = slot_spec(config, loaded.num_classes)
    factory = MaskSinkFactory(str(config.out), config.save_logits, config.overlay,
                              config.overlay_alpha, config.max_pixels or None,
                              num_classes=loaded.num_classes, stats=config.stats,
                              categories=tuple(loaded.categories),
                              stats_commit_seconds=config.stats_commit_seconds)
    # Start the header readers and the decoding workers (fork) before any thread.
    headers.start()
    batches = regroup(iter(loader), config.batch_size, max_waiting=4 * config.batch_size)

    def send(batch: ImageBatch) -> torch.Tensor | None:
        if not batch.groups:
            return None
        return segmenter.model_input([pixels for pixels, _, _ in batch.groups], batch.groups[0][2])

    shapes: Counter = Counter()
    seen: set[tuple[int, int]] = set()
    engine = EgressEngine(factory, num_consumers=config.num_consumers,
                          num_slots=config.num_slots or None, device=str(device), slot_spec=spec)
    # disable=None: a bar on a terminal only, never in logs or pipes.
    with headers, tqdm(total=len(todo), unit="img", desc="segment", dynamic_ncols=True,
                       disable=None if progress else True) as bar, engine:
        moved = prefetch(batches, send, device, engine.span)
        t_wait = time.perf_counter()
        timing["start_s"] = t_wait - t_loaded
        first_wait, first_forward = True, True
        for batch, pixels in moved:
            t_got = time.perf_counter()
            timing["first_batch_s" if first_wait else "input_wait_s"] += t_got - t_wait
            first_wait = False
            for bad in batch.bad:
                report.add(bad.path, bad.reason, stage="read")
            if pixels is not None:
                shapes[tuple(pixels.shape[:1]) + tuple(pixels.shape[2:])] += 1
                # a shape's short batch comes after its full ones, so a short batch of a
                # shape not run before is the only batch of that shape
                once = len(batch) < config.batch_size and tuple(pixels.shape[2:]) not in seen
                seen.add(tuple(pixels.shape[2:]))
                engine.mark_compute_start()
                with annotate("segment forward", "compute"):
                    logits = segmenter.logits(pixels, once=once)
                    masks, metas = segmenter.image_masks(logits, batch.items, full_max)
                    crops = None
                    if config.save_logits:
                        crops = [logits[i, :, :m.content_height, :m.content_width].to(torch.float16)
                                 for i, m in enumerate(metas)]
                for part_metas, arrays in _parts(metas, masks, crops, spec):
                    engine.submit(part_metas, arrays)
                timing["first_forward_s" if first_forward else "forward_submit_s"] += (
                    time.perf_counter() - t_got)
                first_forward = False
            bar.update(len(batch) + len(batch.bad))
            if on_images is not None:
                on_images(len(batch) + len(batch.bad))
            t_wait = time.perf_counter()
    timing["close_s"] = time.perf_counter() - t_wait
    if timeline and engine.stats.records:
        from ..engine.timeline import render_timeline

        render_timeline(engine.stats.records, timeline, spans=engine.stats.spans,
                        title=f"segment {config.images} ({device}, {segmenter.dtype})")
    if trace:
        from ..engine.trace import write_trace

        write_trace(trace, [(str(device), engine.stats)], phases=[("segment", t0, time.perf_counter())],
                    title=f"segment {config.images} ({device}, {segmenter.dtype})")
    written = stats_rows = 0
    for result in engine.closed_results:
        if result:
            written += result["written"]
            stats_rows += result.get("stats_rows", 0)
            for path, reason in result["failed"]:
                report.add(path, reason, stage="overlay")
    summary = {"written": written, "model": loaded.source, "arch": loaded.arch,
               "num_classes": loaded.num_classes, "device": str(device),
               "dtype": str(segmenter.dtype).replace("torch.", ""), "resize": config.resize,
               "batch_shapes": [[n, h, w, k] for (n, h, w), k in sorted(shapes.items())],
               "engine": engine.stats.summary(), "timing": {k: round(v, 3) for k, v in timing.items()}}
    if config.stats:
        summary["stats_rows"] = stats_rows
    return summary


def segment_images(images: Iterable, config: SegmentConfig | None = None, *,
                   model: SegmentationModel | None = None, **overrides) -> list[np.ndarray]:
    """Masks of in-memory pictures (PIL images, or uint8/uint16 arrays), each a uint8
    [height, width] array at its picture's own size.

    For a handful of images in a notebook or a service: it runs in this process, with
    no engine and no files. Settings come from ``config`` and ``overrides`` (field names
    of :class:`SegmentConfig`); pass ``model`` (from ``load_segmentation_model``) to
    reuse a loaded model across calls.
    """
    values = {**dataclasses.asdict(config or SegmentConfig()), **overrides}
    config = load_config(SegmentConfig, None, **values)
    config.validate()
    device = resolve_device(config.device)
    if model is None:
        model = load_segmentation_model(config.arch, config.weights, config.num_classes,
                                        config.random_weights)
    prep = model.preprocessing(config.resize, config.size)
    segmenter = Segmenter(model, device, config.dtype)
    masks: list[np.ndarray] = []
    pictures = iter(images)
    while chunk := list(itertools.islice(pictures, config.batch_size)):
        prepared = [_prepare(picture, prep, len(masks) + i) for i, picture in enumerate(chunk)]
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


def _prepare(picture, prep, index: int):
    try:
        return prepare_picture(picture, prep)
    except ImageRejected as exc:
        raise ConfigError(f"image {index}: {exc.reason}") from exc

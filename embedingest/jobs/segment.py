"""The segment job: DeepLabV3 over a folder of images, one mask per image on disk.

Pipeline: list the images (resuming: those with a mask already are left out), decode
and letterbox them in DataLoader workers into pinned uint8 batches, copy each batch to
the GPU on a side stream one batch ahead (``stages.prefetch``), normalise and run the
model there, take the argmax there, and hand only the uint8 masks (a 42nd of the fp16
logits' bytes with 21 classes) to the egress engine, whose consumer processes write
the files (``sinks.masks``). With ``save_logits`` the logits go through as well, as float16:
DeepLabV3's scores are far inside float16's range and half the bytes of float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import posixpath
import time
from collections.abc import Iterable
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
from ..report import SkipReport
from ..scaleout.devices import devices_of, share_of_cpus
from ..sinks.masks import (LOGITS_SUFFIX, MASK_SUFFIX, OVERLAY_SUFFIX, MaskSinkFactory,
                           restore_mask)
from ..sources.files import refuse_output_as_input, walk_files
from ..sources.image_decode import (DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, ImageRejected,
                                    prepare_picture)
from ..sources.images import ImageBatch, ImageFileDataset, collate_images
from ..stages.device import resolve_device
from ..stages.prefetch import prefetch
from ..stages.segmentation import (ARCHITECTURES, DTYPES, Segmenter, SegmentationModel,
                                   load_segmentation_model)


@dataclass
class SegmentConfig:
    """Settings of a segment run; each field is the CLI option of the same name."""

    # Input folder (read recursively) or a single image file.
    images: str | None = None
    # Output folder: masks mirror the input tree; skipped.jsonl goes here too.
    out: str | None = None
    # Weights file: a state dict, a checkpoint with "model"/"state_dict", or a pickled
    # module. Default: torchvision's COCO_WITH_VOC_LABELS_V1 file if in the hub cache.
    weights: str | None = None
    # Model architecture (a torchvision DeepLabV3 builder).
    arch: str = "deeplabv3_resnet50"
    # Classes of the weights; read from the weights file, so only a check when given.
    num_classes: int | None = None
    # Run with random weights when no weights are found (pipeline tests, benchmarks).
    random_weights: bool = False
    # Model input side: each image is scaled to fit size x size, aspect kept, padded.
    size: int = 520
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
    # Redo images whose mask exists (otherwise they are skipped: resume).
    overwrite: bool = False
    # Images with more pixels are skipped with a reason (0: no limit).
    max_pixels: int = DEFAULT_MAX_PIXELS

    def validate(self) -> None:
        checks = [
            (self.size >= 32, f"size={self.size}: must be at least 32 (DeepLabV3 downsamples 8x)"),
            (self.batch_size >= 1, f"batch_size={self.batch_size}: must be at least 1"),
            (self.num_workers >= -1, f"num_workers={self.num_workers}: must be -1 (auto), 0 or more"),
            (self.num_consumers >= 1, f"num_consumers={self.num_consumers}: must be at least 1"),
            (self.num_slots >= 0, f"num_slots={self.num_slots}: must be 0 (auto) or more"),
            (self.max_pixels >= 0, f"max_pixels={self.max_pixels}: must be 0 (no limit) or more"),
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
        if not config.overwrite and all(present.has(folder, name + s) for s in suffixes):
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
                names = frozenset(os.listdir(os.path.join(self.out, folder)))
            except OSError:  # not made yet, or not a folder: nothing in it is done
                names = frozenset()
            self.names[folder] = names
        return name in names


def remove_stale_tmp_files(out: Path, todo: list[tuple[str, str]]) -> None:
    """Delete the temporary files (``.<name>.tmp-<pid>``, see ``atomic_write_bytes``) that a
    killed run left half-written in ``out`` and in the folders of the images still to do
    (an image whose write was cut is one of those: its mask, written last, is missing)."""
    for folder in {os.path.join(out, sub) for sub in {""} | {posixpath.dirname(rel) for rel, _ in todo}}:
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
        "out": str(out), "report": str(report_path),
    })
    return summary


def run_on_device(config: SegmentConfig, device: torch.device, todo: list[tuple[str, str]],
                  report: SkipReport, progress: bool = False, timeline: str | None = None,
                  on_images=None, processes: int = 1, trace: str | None = None) -> dict:
    """Segment ``todo`` ((rel_path, path) pairs) on one device; bad images go to
    ``report``; ``on_images(n)`` is told of every n images handled; ``processes`` device
    processes share the host's cores. Returns the summary fields of the run, ``timing``
    among them: where this process's time went (model load; starting the decoding workers
    and the engine; waiting for the first batch and for later ones, where the decoders are
    the bound; the first forward, which includes CUDA's lazy set-up; the others with
    their hand-over to the engine; closing, the consumers' last masks)."""
    t0 = time.perf_counter()
    timing = dict.fromkeys(("load_model_s", "start_s", "first_batch_s", "first_forward_s",
                            "input_wait_s", "forward_submit_s", "close_s"), 0.0)
    loaded = load_segmentation_model(config.arch, config.weights, config.num_classes,
                                     config.random_weights)
    segmenter = Segmenter(loaded, device, config.dtype)
    # cuDNN's algorithm search (torch.backends.cudnn.benchmark) stays off: on an H200 it
    # found no faster kernels for DeepLabV3-ResNet50 at batch 16 (fp16 741 against 739
    # images/s, fp32 392 against 392) and cost 1.6-3.6 s (fp16) and 12 s (fp32) at the
    # start of every process.
    t_loaded = time.perf_counter()
    timing["load_model_s"] = t_loaded - t0
    workers = min(share_of_cpus(config.num_workers, processes), -(-len(todo) // config.batch_size))
    loader = DataLoader(
        ImageFileDataset(todo, config.size, config.max_pixels or None),
        batch_size=config.batch_size, num_workers=workers,
        collate_fn=collate_images, pin_memory=device.type == "cuda",
        persistent_workers=False, worker_init_fn=functools.partial(exit_with_parent, os.getpid()),
        multiprocessing_context=loader_context() if workers else None)
    spec = {"mask": ((config.batch_size, config.size, config.size), "uint8")}
    if config.save_logits:
        spec["logits"] = ((config.batch_size, loaded.num_classes, config.size, config.size), "float16")
    factory = MaskSinkFactory(str(config.out), config.save_logits, config.overlay,
                              config.overlay_alpha, config.max_pixels or None)
    # Start the decoding workers (fork) before the engine starts its threads.
    batches = iter(loader)

    def send(batch: ImageBatch) -> torch.Tensor | None:
        return None if batch.pixels is None else batch.pixels.to(device, non_blocking=True)

    engine = EgressEngine(factory, num_consumers=config.num_consumers,
                          num_slots=config.num_slots or None, device=str(device), slot_spec=spec)
    # disable=None: a bar on a terminal only, never in logs or pipes.
    with tqdm(total=len(todo), unit="img", desc="segment", dynamic_ncols=True,
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
                engine.mark_compute_start()
                with annotate("segment forward", "compute"):
                    logits = segmenter.logits(pixels)
                    outputs = {"mask": segmenter.masks(logits)}
                    if config.save_logits:
                        outputs["logits"] = logits.to(torch.float16).contiguous()
                engine.submit(batch.items, outputs)
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
    written = 0
    for result in engine.closed_results:
        if result:
            written += result["written"]
            for path, reason in result["failed"]:
                report.add(path, reason, stage="overlay")
    return {"written": written, "model": loaded.source, "num_classes": loaded.num_classes,
            "device": str(device), "dtype": str(segmenter.dtype).replace("torch.", ""),
            "engine": engine.stats.summary(), "timing": {k: round(v, 3) for k, v in timing.items()}}


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
    segmenter = Segmenter(model, device, config.dtype)
    masks: list[np.ndarray] = []
    pictures = iter(images)
    while chunk := list(itertools.islice(pictures, config.batch_size)):
        prepared = [_prepare(picture, config.size, len(masks) + i) for i, picture in enumerate(chunk)]
        pixels = torch.from_numpy(np.stack([p for p, _ in prepared]))
        batch = segmenter.masks(segmenter.logits(pixels)).cpu().numpy()
        masks += [restore_mask(m, meta) for m, (_, meta) in zip(batch, prepared, strict=True)]
    return masks


def _prepare(picture, size: int, index: int):
    try:
        return prepare_picture(picture, size)
    except ImageRejected as exc:
        raise ConfigError(f"image {index}: {exc.reason}") from exc

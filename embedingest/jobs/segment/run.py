"""segment on one device: decode and batch the images in DataLoader workers, run the
model, hand the uint8 masks (and logits, if asked) to the egress engine, whose consumers
write the files."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections import Counter
from collections.abc import Iterator

import torch
from tqdm import tqdm

from ...config import SegmentConfig
from ...engine import EgressEngine
from ...engine.consumers import exit_with_parent, loader_context
from ...engine.worker_loader import WorkerLoader
from ...engine.markers import annotate
from ...errors import ConfigError
from ...report import SkipReport
from ...runner import BatchSteps, run_batches
from ...scaleout.devices import share_of_cpus
from ...sinks.masks import MaskSinkFactory, labels_info, write_labels
from ...sources.files import input_folder
from ...sources.image_decode import LONG_SIDE_LIMIT, ImageMeta
from ...sources.images import ImageBatch, ImageFileDataset, collate_images, regroup
from ...sources.shape_batches import HeaderReaders, ShapeBatchSampler
from ...stages import fused_argmax
from ...stages.device import resolve_dtype
from ...stages.segmentation import (Segmenter, SegmentationModel, load_segmentation_model,
                                    preset_preprocessing)


def slot_spec(config: SegmentConfig, num_classes: int, images: int) -> dict:
    """The flat arrays of one host slot: room for a full batch (of at most ``images``, the
    images to do: a large --batch-size over a few images reserves no memory for the rest)
    at the largest model input, and for at least one mask of ``upsample_max_pixels`` (a
    batch that does not fit is handed over in several parts, see ``_parts``)."""
    square = config.size * config.size
    batch = max(1, min(config.batch_size, images))
    if config.resize == "fit":
        masks, logits = batch * square, batch * num_classes * square
    else:
        masks = max(batch * LONG_SIDE_LIMIT * square, config.upsample_max_pixels)
        logits = max(batch, LONG_SIDE_LIMIT) * num_classes * square
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


def _decoders(config: SegmentConfig, device: torch.device, todo: list[tuple[str, str]], prep,
              workers: int) -> tuple[HeaderReaders, ShapeBatchSampler, WorkerLoader]:
    """The header readers, the batch plan and the DataLoader that decodes the images."""
    # Headers are read by processes of their own (a few per cent of the decoding's work), so
    # this process, which drives the GPU, does nothing per image.
    headers = HeaderReaders(max(1, workers // 8) if workers and config.resize != "fit" else 0,
                            loader_context(), functools.partial(exit_with_parent, os.getpid()))
    # batches of one shape planned from the headers; regroup joins their chunks, taken as
    # the workers finish them (in order, one slow chunk would hold back every batch behind
    # it while the other workers sat finished)
    sampler = ShapeBatchSampler(todo, prep, config.batch_size, read_sizes=headers)
    loader = WorkerLoader(
        ImageFileDataset(todo, prep, config.max_pixels or None,
                         input_folder(config.images, config.follow_outside_links)),
        batch_sampler=sampler,
        num_workers=workers, prefetch_factor=config.decode_ahead if workers else None,
        in_order=not workers,
        collate_fn=functools.partial(collate_images, resize=config.resize),
        pin_memory=device.type == "cuda",
        persistent_workers=False, worker_init_fn=functools.partial(exit_with_parent, os.getpid()),
        multiprocessing_context=loader_context() if workers else None)
    return headers, sampler, loader


def refuse_slow_precision(dtype: str, device: str | torch.device) -> None:
    """ConfigError for fp16 on the CPU: PyTorch has no fast fp16 convolutions there (its
    dilated ones fall back to a plain loop), so one photograph took minutes, and a Ctrl-C
    waited for the convolution under way."""
    if dtype == "fp16" and torch.device(device).type == "cpu":
        raise ConfigError("dtype='fp16' on the CPU: PyTorch has no fast fp16 convolutions there (a photograph "
                          "takes minutes, against seconds in fp32); use --dtype fp32 (auto's choice on the CPU) or "
                          "bf16, and fp16 on a GPU")


def _full_max(config: SegmentConfig) -> int:
    """Pixels up to which masks are made at the image's size (0: all at model size)."""
    return config.upsample_max_pixels if config.resize == "short" else 0


def load_model(config: SegmentConfig, meta: bool = False) -> SegmentationModel:
    """``config``'s model, its weights read (ConfigError where they cannot be), on the CPU:
    no CUDA here, so a caller may load it in a thread while it lists the images, before
    forking. ``meta``: built on the meta device (the weights read and checked, no tensor
    made, no kernel run: device processes forked after it start clean)."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        return load_segmentation_model(config.arch, config.weights, config.num_classes,
                                       config.random_weights, config.trust_weights_file)


def _write_labels(config: SegmentConfig, loaded: SegmentationModel, precision: torch.dtype | None) -> None:
    """``labels.json`` of ``loaded`` under ``config``'s preprocessing, ``precision`` added
    to the folder's (None: a run that makes no mask): a folder whose masks were made with
    another model or preprocessing is refused (ConfigError)."""
    write_labels(config.out, labels_info(loaded.arch, loaded.source, loaded.categories,
                                         loaded.preprocessing(config.resize, config.size).describe(),
                                         _full_max(config), loaded.preset, loaded.sha256,
                                         str(precision).removeprefix("torch.") if precision else None),
                 replace=config.overwrite)


def check_settings(config: SegmentConfig, loaded: SegmentationModel) -> None:
    """Check (and write) ``labels.json`` for ``loaded`` without running it: a run with
    nothing to do refuses another model or preprocessing, as a run with work does."""
    _write_labels(config, loaded, None)


def _model_and_engine(config: SegmentConfig, device: torch.device, full_max: int, images: int,
                      before_writes=None, loaded: SegmentationModel | None = None
                      ) -> tuple[SegmentationModel, Segmenter, EgressEngine, dict, float]:
    """The model (``loaded``, or loaded now) on ``device``, labels.json written,
    ``before_writes()`` called (what a run deletes is deleted only once the model and the
    folder's labels agree), and the engine started (its consumers start while the weights
    go to the device, and the masks' kernel compiles in a thread where masks are scaled to
    the images' sizes: ``full_max``); the engine's slot spec and the seconds the model took."""
    t0 = time.perf_counter()
    loaded = loaded if loaded is not None else load_model(config)
    dtype = resolve_dtype(config.dtype, device)
    if full_max:  # masks scaled to the images' sizes: their kernel compiles meanwhile
        fused_argmax.compile_ahead(device, dtype, loaded.num_classes)
    _write_labels(config, loaded, dtype)
    if before_writes is not None:
        before_writes()
    factory = MaskSinkFactory(str(config.out), config.save_logits, config.overlay,
                              config.overlay_alpha, config.max_pixels or None,
                              num_classes=loaded.num_classes, stats=config.stats,
                              categories=tuple(loaded.categories),
                              stats_commit_seconds=config.stats_commit_seconds,
                              within=input_folder(config.images, config.follow_outside_links),
                              drop_earlier=config.overwrite)
    spec = slot_spec(config, loaded.num_classes, images)
    built = time.perf_counter() - t0
    engine = EgressEngine(factory, num_consumers=config.num_consumers, num_slots=config.num_slots or None,
                          device=str(device), slot_spec=spec).start()
    t_moving = time.perf_counter()
    try:
        # cuDNN's algorithm search (torch.backends.cudnn.benchmark) stays off: on an H200 it
        # found no faster kernels for DeepLabV3-ResNet50 at batch 16 (fp16 741 against 739
        # images/s, fp32 392 against 392) and cost 1.6-3.6 s (fp16) and 12 s (fp32) at the
        # start of every process, and it would search again for every new input shape.
        segmenter = Segmenter(loaded, device, config.dtype)
    except BaseException:
        engine.stop()
        raise
    return loaded, segmenter, engine, spec, built + time.perf_counter() - t_moving


def segment_on_device(config: SegmentConfig, device: torch.device, todo: list[tuple[str, str]],
                  report: SkipReport, progress: bool = False, timeline: str | None = None,
                  on_images=None, processes: int = 1, trace: str | None = None,
                  before_writes=None, loaded: SegmentationModel | None = None) -> dict:
    """Segment ``todo`` ((rel_path, path) pairs) on one device; bad images go to
    ``report``; ``on_images(n)`` is told of every n images handled; ``processes`` device
    processes share the host's cores; ``before_writes()`` is called once the model loaded
    and the folder's labels agree with it, before any mask is written; ``loaded``: the model
    (:func:`load_model`), read already, else it is read here. Returns the summary fields of the run, ``timing``
    among them: where this process's time went (model load; starting the decoding workers
    and the engine; waiting for the first batch and for later ones, where the decoders are
    the bound; the first forward, which includes CUDA's lazy set-up; the others with
    their hand-over to the engine; closing, the consumers' last masks), and
    ``batch_shapes``: how many batches of each size and model input shape ran."""
    t0 = time.perf_counter()
    # The decoders need only the weights' preprocessing: they start first (forked before
    # any thread) and decode the first batches while the model loads (or goes to the
    # device, read while the images were listed) and the engine's consumers start.
    prep = preset_preprocessing(config.arch, config.resize, config.size)
    workers = min(share_of_cpus(config.num_workers, processes), -(-len(todo) // config.batch_size))
    headers, sampler, loader = _decoders(config, device, todo, prep, workers)
    headers.start()
    sampler.read_ahead()  # the readers read while the decoders fork
    batches = regroup(iter(loader), sampler.chunk_batch)
    full_max = _full_max(config)
    try:
        loaded, segmenter, engine, spec, loading = _model_and_engine(config, device, full_max, len(todo),
                                                                     before_writes, loaded)
    except BaseException:
        batches.close()  # the decoders' iterator goes with it: they are shut down
        headers.close()
        raise
    timing = {"load_model_s": loading}
    shapes: Counter = Counter()

    def send(batch: ImageBatch) -> torch.Tensor | None:
        if not batch.groups:
            return None
        return segmenter.model_input([pixels for pixels, _, _ in batch.groups], batch.groups[0][2])

    def forward(batch_no: int, batch: ImageBatch, pixels: torch.Tensor):
        """The masks (and logits) of a batch, in as few parts as fit a host slot."""
        shapes[tuple(pixels.shape[:1]) + tuple(pixels.shape[2:])] += 1
        # a shape has one short batch, after its full ones: its size at that shape is
        # run once, so a convolution set-up for it would not pay
        once = len(batch) < config.batch_size
        with annotate("segment forward", "compute"):
            logits = segmenter.logits(pixels, once=once)
            masks, metas = segmenter.image_masks(logits, batch.items, full_max)
            crops = None
            if config.save_logits:
                crops = [logits[i, :, :m.content_height, :m.content_width].to(torch.float16)
                         for i, m in enumerate(metas)]
        return _parts(metas, masks, crops, spec)

    # disable=None: a bar on a terminal only, never in logs or pipes.
    with headers, tqdm(total=len(todo), unit="img", desc="segment", dynamic_ncols=True,
                       disable=None if progress else True) as bar:

        def done(batch: ImageBatch) -> None:
            bar.update(len(batch) + len(batch.bad))
            if on_images is not None:
                on_images(len(batch) + len(batch.bad))

        steps = BatchSteps(send, forward, skipped=lambda batch: [(b.path, b.reason) for b in batch.bad],
                           done=done)
        engine = run_batches(engine.sink_factory, batches, steps, device=device, slot_spec=spec,
                             num_consumers=config.num_consumers, num_slots=config.num_slots or None,
                             on_skip=functools.partial(report.add, stage="read"), timing=timing,
                             started=t0 + loading, engine=engine)
    if timeline and engine.stats.records:
        from ...engine.timeline import render_timeline

        render_timeline(engine.stats.records, timeline, spans=engine.stats.spans,
                        title=f"segment {config.images} ({device}, {segmenter.dtype})")
    if trace:
        from ...engine.trace import write_trace

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
               "batch_shapes": [[n, h, w, k] for (n, h, w), k in sorted(shapes.items())], "decoders": workers,
               "engine": engine.stats.summary(), "timing": {k: round(v, 3) for k, v in timing.items()}}
    if config.stats:
        summary["stats_rows"] = stats_rows
    return summary


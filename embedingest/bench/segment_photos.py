"""The segment job on varied real photographs, against the model's forward alone at the
shapes the job actually ran, side by side in one run.

Photographs: the real photos in ``benchmarks/photos`` (from scikit-image's bundled data:
public domain and CC0, see the README there) cropped to common camera and screen aspect
ratios (4:3, 3:2, 16:9, 1:1 and their portrait forms) at common long sides from 240 to
1600 px, and a share of odd crops (any ratio from 1:2.2 to 2.2:1, any size in the range);
saved as JPEG (quality 90) and PNG. Real photographs decode and compress as an archive
does; the weights are random (speed does not depend on them), saved to a file that the
job loads as it loads a user's.

Rows, in order:

* ``job``: ``segment()`` over the folder with the default preprocessing (the weights'
  own resize, images batched by shape, PNG masks written by the consumers): images per
  second over the call (end to end: model load, workers, every batch, closing) and over
  the engine's span (steady);
* ``forward alone``: ``Segmenter.logits`` (normalisation and the model) on uint8 inputs
  already on the device, the job's batches (every batch size and shape it ran, in the
  order it ran them), in a process of its own: first as the job met them (each shape
  new, after the same warm-up), then again with every shape seen before; and, in another
  fresh process, the same batches by shape (all of one shape together, as the job ran
  them before its short batches were spread between the full ones).

A warm-up on images of one shape no photograph has runs first in both, so CUDA's start-up
is in no row, while every shape the job meets costs it and the forward alone the same
first call (cuDNN's set-up for a new input shape). The warm-up leaves its masks at the
model's size, so the masks kernel's compile (on an empty Triton cache, seconds) starts in
the timed job, in a thread, as in a fresh process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PHOTOS = Path(__file__).resolve().parents[2] / "benchmarks" / "photos"

# (width, height) ratios of cameras and screens; portrait forms added below
RATIOS = [(4, 3), (3, 2), (16, 9), (1, 1)]
LONG_SIDES = [240, 320, 480, 640, 800, 1024, 1280, 1600]


@dataclass
class PhotoBenchConfig:
    photos: int = 2048  # images generated
    min_side: int = 240  # long side range of the generated images
    max_side: int = 1600
    odd_share: float = 0.1  # images cropped to any aspect ratio and size
    png_share: float = 0.3  # the rest are JPEG
    arch: str = "deeplabv3_resnet50"
    size: int = 520  # the preset's short side
    resize: str = "short"  # the job's preprocessing: "short" (the weights' own) or "fit"
    batch_size: int = 16
    dtype: str = "auto"
    device: str = "auto"
    num_workers: int = -1
    num_consumers: int = 4
    seed: int = 0
    folder: str | None = None  # keep the photographs here (reused when it holds them)
    trace: str | None = None  # the timed job's Chrome trace (segment's --trace) goes here


def photo_specs(cfg: PhotoBenchConfig) -> list[tuple[str, int, int, str, int]]:
    """(source photo, width, height, format, seed) of each image to make."""
    from ..errors import ConfigError

    if not PHOTOS.is_dir():
        raise ConfigError(f"no photographs at {PHOTOS}: run the benchmark from a checkout of the "
                          "repository (benchmarks/photos is not installed with the package)")
    rng = random.Random(cfg.seed)
    sources = sorted(p.name for p in PHOTOS.iterdir() if p.suffix in (".png", ".jpg"))
    sides = [s for s in LONG_SIDES if cfg.min_side <= s <= cfg.max_side] or [cfg.max_side]
    ratios = RATIOS + [(b, a) for a, b in RATIOS if a != b]
    specs = []
    for i in range(cfg.photos):
        if rng.random() < cfg.odd_share:
            long = rng.randint(cfg.min_side, cfg.max_side)
            ratio = rng.uniform(1.0, 2.2)
            short = max(1, round(long / ratio))
            w, h = (long, short) if rng.random() < 0.5 else (short, long)
        else:
            a, b = rng.choice(ratios)
            long = rng.choice(sides)
            w, h = (long, round(long * b / a)) if a >= b else (round(long * a / b), long)
        fmt = "png" if rng.random() < cfg.png_share else "jpg"
        specs.append((sources[i % len(sources)], w, h, fmt, rng.randrange(1 << 30)))
    return specs


def _make_one(args) -> None:
    from PIL import Image

    folder, i, (source, w, h, fmt, seed) = args
    rng = random.Random(seed)
    with Image.open(PHOTOS / source) as im:
        im = im.convert("RGB")
        sw, sh = im.size
        scale = min(sw / w, sh / h)  # the largest crop of the target ratio
        cw, ch = max(1, int(w * scale)), max(1, int(h * scale))
        x, y = rng.randint(0, sw - cw), rng.randint(0, sh - ch)
        out = im.crop((x, y, x + cw, y + ch)).resize((w, h), Image.Resampling.LANCZOS)
    path = Path(folder) / f"{i // 256:03d}" / f"{i:06d}_{w}x{h}.{fmt}"
    path.parent.mkdir(exist_ok=True)
    out.save(path, quality=90) if fmt == "jpg" else out.save(path, compress_level=6)


def make_photos(cfg: PhotoBenchConfig, folder: str | os.PathLike) -> dict:
    """Write the photographs into ``folder`` (skipped when it already holds as many)."""
    folder = Path(folder)
    specs = photo_specs(cfg)
    have = [p for p in folder.rglob("*") if p.suffix in (".jpg", ".png")] if folder.exists() else []
    if len(have) != len(specs):
        folder.mkdir(parents=True, exist_ok=True)
        with ProcessPoolExecutor(max(1, min(16, (os.cpu_count() or 2)))) as pool:
            list(pool.map(_make_one, [(str(folder), i, s) for i, s in enumerate(specs)], chunksize=16))
    files = [p for p in folder.rglob("*") if p.suffix in (".jpg", ".png")]
    return {"images": len(files), "bytes": sum(p.stat().st_size for p in files),
            "jpeg": sum(p.suffix == ".jpg" for p in files), "png": sum(p.suffix == ".png" for p in files),
            "sources": sorted({s for s, *_ in specs})}


def _sync(device):
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


WARM_SIZE = (331, 197)  # (width, height) of the warm-up images: a ratio no photograph here has


def forward_alone(cfg: PhotoBenchConfig, device, calls: list[list], masks: bool = False) -> dict:
    """The job's forward (``Segmenter.logits``) on ``calls`` ([n, h, w, once] each, in
    order), inputs on the device, in a process of its own started as the job's was
    warmed: a fresh CUDA context that has run only the warm-up shape, so each of the
    job's shapes is new to it as it was to the job (``cold``: every call once, first
    calls included, which is what the job paid); then the same calls again (``warm``:
    every shape seen before). ``once`` is the job's: a short batch runs on PyTorch's
    own convolutions (``Segmenter.logits(once=True)``). ``masks``: each call's masks too
    (``Segmenter.image_masks`` on the sizes :class:`_Calls` recorded), the job's GPU work
    but for the copies."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_forward_alone, cfg, str(device), calls, masks).result()


def sorted_calls(cfg: PhotoBenchConfig, batch_shapes: list[list[int]]) -> list[list]:
    """The job's batches ([n, h, w, count] each) as calls sorted by shape, every batch of
    a shape together, with the job's ``once`` (a short batch)."""
    return [[n, h, w, n < cfg.batch_size] for n, h, w, k in batch_shapes for _ in range(k)]


def _forward_alone(cfg: PhotoBenchConfig, device: str, calls: list[list], masks: bool = False) -> dict:
    import torch

    from ..sources.image_decode import ImageMeta
    from ..stages.segmentation import Segmenter, load_segmentation_model

    def metas(call):
        sizes, full_max = call[4]
        return [ImageMeta("", "", *size) for size in sizes], full_max

    torch.manual_seed(cfg.seed)
    loaded = load_segmentation_model(cfg.arch, None, None, random_weights=True)
    segmenter = Segmenter(loaded, device, cfg.dtype)

    def pixels(n, h, w):
        return torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, device=segmenter.device)

    def timed(calls, masks_of=None) -> float:
        """``masks_of``: each call's (metas, full_max_pixels), its masks computed too."""
        _sync(segmenter.device)
        t0 = time.perf_counter()
        for i, (n, h, w, once, *_) in enumerate(calls):
            logits = segmenter.logits(inputs[(n, h, w)], once=once)
            if masks_of:
                segmenter.image_masks(logits, *masks_of[i])
        _sync(segmenter.device)
        return time.perf_counter() - t0

    warm_w, warm_h = loaded.preprocessing(cfg.resize, cfg.size).model_size(*WARM_SIZE)
    inputs = {(n, h, w): pixels(n, h, w) for n, h, w, *_ in calls}
    inputs[(cfg.batch_size, warm_h, warm_w)] = pixels(cfg.batch_size, warm_h, warm_w)
    timed([(cfg.batch_size, warm_h, warm_w, False)] * 2)
    masks_of = [metas(call) for call in calls] if masks else None
    cold = timed(calls, masks_of)
    warm = timed(calls, masks_of)
    images = sum(n for n, *_ in calls)
    return {"images": images, "seconds": cold, "images_per_s": images / cold,
            "warm_seconds": warm, "warm_images_per_s": images / warm,
            "first_call_cost_s": round(cold - warm, 3),
            "dtype": str(segmenter.dtype).replace("torch.", ""), "masks": masks}


class _Calls:
    """Records ``Segmenter.logits``'s calls ([n, h, w, once] each) while the block runs,
    and with each the sizes its ``image_masks`` call was given ([width, height,
    content_width, content_height] per image) and its ``full_max_pixels``."""

    def __enter__(self) -> list:
        from ..stages.segmentation import Segmenter

        self.real, self.real_masks, self.calls = Segmenter.logits, Segmenter.image_masks, []

        def logits(segmenter, pixels, once=False):
            self.calls.append([pixels.shape[0], pixels.shape[2], pixels.shape[3], bool(once)])
            return self.real(segmenter, pixels, once)

        def image_masks(segmenter, logits, metas, full_max_pixels):
            self.calls[-1].append(([[m.width, m.height, m.content_width, m.content_height] for m in metas],
                                   full_max_pixels))
            return self.real_masks(segmenter, logits, metas, full_max_pixels)

        Segmenter.logits, Segmenter.image_masks = logits, image_masks
        return self.calls

    def __exit__(self, *exc) -> None:
        from ..stages.segmentation import Segmenter

        Segmenter.logits, Segmenter.image_masks = self.real, self.real_masks


def random_weights_file(cfg: PhotoBenchConfig, path: Path) -> Path:
    """Random weights of ``cfg.arch`` saved as a state dict: the job loads them from a
    file, as it loads a user's weights (random ones would be drawn at every start)."""
    import torch

    from ..stages.segmentation import load_segmentation_model

    torch.save(load_segmentation_model(cfg.arch, random_weights=True, seed=cfg.seed).model.state_dict(), path)
    return path


def warm_up_config(job, images: Path, out: Path):
    """The warm-up job: the timed job's settings on ``images``, its masks left at the model's
    size. Masks at the images' sizes would start the masks kernel's compile in a thread
    (``fused_argmax.compile_ahead``); on an empty Triton cache that outlives the short
    warm-up, and the timed job's decoders, forked next, would wait for it (a fork waits for
    a compile under way). The timed job starts the compile itself, as a fresh process does."""
    return dataclasses.replace(job, images=str(images), out=str(out), upsample_max_pixels=0)


def warmed_job(cfg: PhotoBenchConfig, folder: Path, tmp: Path, device: str = "auto"):
    """Make (or reuse) the photographs in ``folder`` and a random weights file in ``tmp``,
    run the warm-up job there, and return the timed job's settings (its ``out`` in
    ``tmp``) and what :func:`make_photos` said."""
    from PIL import Image

    from ..jobs.segment import SegmentConfig, segment

    made = make_photos(cfg, folder)
    weights = random_weights_file(cfg, tmp / "weights.pth")
    job = SegmentConfig(images=str(folder), out=str(tmp / "masks"), weights=str(weights), arch=cfg.arch,
                        size=cfg.size, resize=cfg.resize, batch_size=cfg.batch_size, dtype=cfg.dtype,
                        device=str(device), num_workers=cfg.num_workers, num_consumers=cfg.num_consumers)
    warm = tmp / "warm-up"
    warm.mkdir()
    for i in range(2 * cfg.batch_size):
        Image.effect_noise(WARM_SIZE, 64).convert("RGB").save(warm / f"{i}.png")
    segment(warm_up_config(job, warm, tmp / "warm-out"), progress=False)
    return job, made


def run(cfg: PhotoBenchConfig, log=print) -> dict:
    """Make (or reuse) the photographs, run the warm-up job, the timed job, the forward alone."""
    from ..jobs.segment import segment
    from .report import HostCpu
    from ..stages.device import resolve_device

    device = resolve_device(cfg.device)
    with tempfile.TemporaryDirectory(prefix="embedingest-bench-photos-") as tmp:
        folder = Path(cfg.folder) if cfg.folder else Path(tmp) / "photos"
        t0 = time.perf_counter()
        job, made = warmed_job(cfg, folder, Path(tmp), device)
        log(f"  {made['images']} photographs ({made['jpeg']} JPEG, {made['png']} PNG, "
            f"{made['bytes'] / 1e6:.0f} MB) and the warm-up in {time.perf_counter() - t0:.1f} s")
        with HostCpu() as cpu, _Calls() as calls:
            summary = segment(job, progress=False, trace=cfg.trace)
        log(f"  job: {summary['written']} images in {summary['seconds']:.2f} s")
        shapes = summary["batch_shapes"]
        alone = forward_alone(cfg, device, calls)
        log(f"  forward alone, the job's order: {alone['images']} images in {alone['seconds']:.2f} s")
        by_shape = forward_alone(cfg, device, sorted_calls(cfg, shapes))
        log(f"  forward alone, by shape: {by_shape['images']} images in {by_shape['seconds']:.2f} s")
        with_masks = forward_alone(cfg, device, calls, masks=True)
        log(f"  forward and masks alone, the job's order: {with_masks['images']} images in "
            f"{with_masks['seconds']:.2f} s")
    engine = summary["engine"]
    steady_s = engine["wall_seconds"]
    images = summary["written"]
    return {
        "photos": made, "device": str(device), "dtype": summary["dtype"], "arch": cfg.arch,
        "distinct_shapes": len({(h, w) for _, h, w, _ in shapes}),
        "batches": sum(k for *_, k in shapes),
        "short_batches": sum(k for n, _, _, k in shapes if n < cfg.batch_size),
        "job": {"images": images, "seconds": summary["seconds"],
                "images_per_s": images / summary["seconds"],
                "steady_seconds": steady_s, "steady_images_per_s": images / steady_s if steady_s else None,
                "gpu_idle_fraction": engine.get("gpu_idle_fraction"), "timing": summary["timing"],
                "phases": summary["phases"], "skipped": summary["skipped"], "host_cpu": cpu.result(),
                "engine": engine,
                "decoders": summary.get("decoders")},
        "forward_alone": alone, "forward_alone_by_shape": by_shape, "forward_and_masks_alone": with_masks,
        "short_calls_before_last_full": _shorts_between(calls, cfg.batch_size),
        "job_vs_forward": (images / summary["seconds"]) / alone["images_per_s"],
        "job_vs_forward_by_shape": (images / summary["seconds"]) / by_shape["images_per_s"],
        "steady_vs_forward": (images / steady_s) / alone["images_per_s"] if steady_s else None,
        "job_vs_forward_and_masks": (images / summary["seconds"]) / with_masks["images_per_s"],
        "steady_vs_forward_and_masks": (images / steady_s) / with_masks["images_per_s"] if steady_s else None,
        "steady_vs_warm_forward": (images / steady_s) / alone["warm_images_per_s"] if steady_s else None,
        "batch_shapes": shapes,
    }


def _shorts_between(calls: list[list], batch_size: int) -> int:
    """How many short batches the job ran before its last full one: spread between the
    full ones rather than all at the end."""
    last_full = max((i for i, (n, *_) in enumerate(calls) if n == batch_size), default=-1)
    return sum(1 for n, *_ in calls[:last_full] if n < batch_size)


def table(result: dict) -> str:
    """The rows as a Markdown table."""
    job, alone = result["job"], result["forward_alone"]
    by_shape, masked = result["forward_alone_by_shape"], result["forward_and_masks_alone"]
    lines = ["| row | images | seconds | images/s | × forward alone |", "|---|---|---|---|---|",
             f"| forward alone ({result['dtype']}, inputs on the device, the job's batches in the "
             f"job's order, each shape new as it was to the job) | {alone['images']} | {alone['seconds']:.2f} | "
             f"{alone['images_per_s']:.1f} | 1.00 |",
             f"| forward alone, the same batches by shape (all of a shape together, each shape new) | "
             f"{by_shape['images']} | {by_shape['seconds']:.2f} | {by_shape['images_per_s']:.1f} | "
             f"{by_shape['images_per_s'] / alone['images_per_s']:.2f} |",
             f"| forward alone, the same batches again (every shape seen before) | {alone['images']} | "
             f"{alone['warm_seconds']:.2f} | {alone['warm_images_per_s']:.1f} | "
             f"{alone['warm_images_per_s'] / alone['images_per_s']:.2f} |",
             f"| forward and masks alone (the job's batches in its order, each batch's masks as the "
             f"job computes them: its GPU work but the copies) | {masked['images']} | "
             f"{masked['seconds']:.2f} | {masked['images_per_s']:.1f} | "
             f"{masked['images_per_s'] / alone['images_per_s']:.2f} |",
             f"| segment job, end to end (the call) | {job['images']} | {job['seconds']:.2f} | "
             f"{job['images_per_s']:.1f} | {result['job_vs_forward']:.2f} |"]
    if job["steady_images_per_s"]:
        lines.append(f"| segment job, steady (engine span) | {job['images']} | {job['steady_seconds']:.2f} | "
                     f"{job['steady_images_per_s']:.1f} | {result['steady_vs_forward']:.2f} |")
    lines.append(f"\n{result['distinct_shapes']} model input shapes, {result['batches']} batches "
                 f"({result['short_batches']} short, {result['short_calls_before_last_full']} of them "
                 f"before the last full one); first calls at new shapes cost the forward "
                 f"{alone['first_call_cost_s']:.2f} s in all.")
    cpu = job.get("host_cpu") or {}
    lines.append(f"job timing (s): {json.dumps(job['timing'])}; phases: {json.dumps(job['phases'])}; "
                 f"GPU idle {job['gpu_idle_fraction']}; host CPUs busy {cpu.get('busy')}")
    return "\n".join(lines)

"""The segment job's decoders and the hand-over of their decoded chunks to this process,
without the model: images per second, the time the loop waits for batches and this
process's CPU time per batch, for a chunk handed over as one buffer (the job's
``collate_images``) against one tensor per group (the collate before it), alternated in
one run on the bench's photographs, as JSON lines. On a CUDA machine the batches are
pinned too, as the job pins them.

    python benchmarks/loader_handover.py --photos 2048 --photo-dir /tmp/photos --workers 14 --repeat 2
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch

from embedingest.bench.segment_photos import PhotoBenchConfig, make_photos
from embedingest.config import SegmentConfig
from embedingest.jobs.segment import run
from embedingest.sources.images import ImageBatch, LoadedImage, collate_images, input_shape, regroup
from embedingest.stages.segmentation import preset_preprocessing


def collate_per_group(samples, resize: str = "short") -> ImageBatch:
    """The collate before: each group a tensor of its own (one shared-memory segment each)."""
    groups: dict[tuple, list[LoadedImage]] = {}
    for s in samples:
        if isinstance(s, LoadedImage):
            groups.setdefault((tuple(s.pixels.shape), input_shape(s.meta, s.pixels, resize)), []).append(s)
    return ImageBatch([(torch.stack([s.pixels for s in g]), tuple(s.meta for s in g), k[1])
                       for k, g in groups.items()],
                      tuple(s for s in samples if not isinstance(s, LoadedImage)),
                      samples[0].index if samples else None)


def one_run(collate, todo, config: SegmentConfig, workers: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run.collate_images = collate  # what _decoders hands the DataLoader
    prep = preset_preprocessing(config.arch, config.resize, config.size)
    t0, cpu0 = time.perf_counter(), time.process_time()
    headers, sampler, loader = run._decoders(config, device, todo, prep, workers)
    waits, batches, images = [], 0, 0
    with headers:
        headers.start()
        sampler.read_ahead()
        it = regroup(iter(loader), sampler.chunk_batch)
        while True:
            w = time.perf_counter()
            batch = next(it, None)
            waits.append(time.perf_counter() - w)
            if batch is None:
                break
            batches += 1
            images += len(batch)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    waits.sort()
    return {"collate": collate.func.__name__, "images": images, "batches": batches, "seconds": round(seconds, 3),
            "images_per_s": round(images / seconds, 1), "wait_s": round(sum(waits), 3),
            "median_wait_ms": round(1e3 * waits[len(waits) // 2], 3),
            "main_cpu_ms_per_batch": round(1e3 * cpu / max(1, batches), 3), "pinned": device.type == "cuda"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", type=int, default=2048)
    ap.add_argument("--photo-dir", default="/tmp/photos")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    made = make_photos(PhotoBenchConfig(photos=args.photos), args.photo_dir)
    todo = sorted((str(p.relative_to(args.photo_dir)), str(p)) for p in Path(args.photo_dir).rglob("*")
                  if p.suffix in (".jpg", ".png"))
    for p in todo:  # the page cache holds them all, as it does for the job after the listing
        Path(p[1]).read_bytes()
    config = SegmentConfig(images=args.photo_dir)
    print(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cpus": os.cpu_count(),
                      "workers": args.workers, "photos": made["images"]}), flush=True)
    one_run(functools.partial(collate_images, resize=config.resize), todo[:64], config, args.workers)  # warm-up
    for _ in range(args.repeat):
        for collate in (collate_per_group, collate_images):
            print(json.dumps(one_run(functools.partial(collate, resize=config.resize), todo, config, args.workers)),
                  flush=True)


if __name__ == "__main__":
    main()

"""The segment job's decoders and the hand-over of their decoded chunks to this process,
without the model: images per second, the time the loop waits for batches, this process's
CPU time per batch and the decoders' CPU time per image, for a chunk made in private memory
(then moved by the DataLoader into a shared-memory segment of its own: a second copy) against
one made in shared memory in the worker (the job's ``_chunk_buffer``), alternated in one run
on the bench's photographs, as JSON lines. On a CUDA machine the batches are pinned too, as
the job pins them.

    python benchmarks/loader_handover.py --photos 2048 --photo-dir /tmp/photos --workers 14 --repeat 2
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch

from embedingest.bench.segment_photos import PhotoBenchConfig, make_photos
from embedingest.config import SegmentConfig
from embedingest.jobs.segment import run
from embedingest.sources import images as image_source
from embedingest.sources.images import regroup
from embedingest.stages.segmentation import preset_preprocessing

SHARED = image_source._chunk_buffer


def private_buffer(nbytes: int) -> torch.Tensor:
    """The buffer before: ordinary memory, which the DataLoader copies into shared memory to send."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(buffer, todo, config: SegmentConfig, workers: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    image_source._chunk_buffer = buffer  # what the workers, forked below, collate into
    prep = preset_preprocessing(config.arch, config.resize, config.size)
    t0, cpu0, children0 = time.perf_counter(), time.process_time(), _children_cpu()
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
    children = _children_cpu() - children0
    waits.sort()
    return {"buffer": buffer.__name__, "images": images, "batches": batches, "seconds": round(seconds, 3),
            "images_per_s": round(images / seconds, 1), "wait_s": round(sum(waits), 3),
            "median_wait_ms": round(1e3 * waits[len(waits) // 2], 3),
            "main_cpu_ms_per_batch": round(1e3 * cpu / max(1, batches), 3),
            "decoders_cpu_ms_per_image": round(1e3 * children / max(1, images), 3), "pinned": device.type == "cuda"}


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
    one_run(SHARED, todo[:64], config, args.workers)  # warm-up
    for _ in range(args.repeat):
        for buffer in (private_buffer, SHARED):
            print(json.dumps(one_run(buffer, todo, config, args.workers)), flush=True)


if __name__ == "__main__":
    main()

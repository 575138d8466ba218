"""The segment job's first run on a machine whose Triton cache is empty: the masks' kernel
compiled in a thread while the model loads (the job as it is), against compiled by the
first masks (``compile_ahead`` switched off, as before), and against a warm cache.

Each run is a fresh process with its own ``TRITON_CACHE_DIR`` (empty for the cold rows),
on the same photographs (made as ``bench segmentation --photos`` makes them), in the order
cold-ahead, cold-inline, warm, repeated. Prints the seconds of each ``segment()`` call and
where its start went, and writes them as JSON.

    python benchmarks/masks_kernel_cold_start.py --photos 1024 --photo-dir /tmp/photos --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(mode: str, images: str, out: str) -> dict:
    from embedingest.jobs.segment import SegmentConfig, run as segment_run, segment
    from embedingest.stages import fused_argmax

    if mode == "inline":
        segment_run.fused_argmax.compile_ahead = lambda *a: False
    t0 = time.perf_counter()
    summary = segment(SegmentConfig(images=images, out=out, random_weights=True, overwrite=True), progress=False)
    seconds = time.perf_counter() - t0
    compiled = [(str(k), s.done.is_set(), s.ok) for k, s in fused_argmax._compiles.items()]
    return {"mode": mode, "call_s": seconds, "images": summary["written"], "seconds": summary["seconds"],
            "timing": summary["timing"], "compiles": compiled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", type=int, default=1024)
    ap.add_argument("--photo-dir", default=None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", nargs=3, metavar=("MODE", "IMAGES", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    from embedingest.bench.segment_photos import PhotoBenchConfig, make_photos

    with tempfile.TemporaryDirectory(prefix="masks-cold-") as tmp:
        folder = Path(args.photo_dir or Path(tmp) / "photos")
        make_photos(PhotoBenchConfig(photos=args.photos, folder=str(folder)), folder)
        warm_cache = Path(tmp) / "warm-cache"
        rows = []
        for rep in range(args.repeat + 1):
            for mode in ("ahead", "inline", "warm"):
                if rep == 0 and mode != "warm":
                    continue  # the first pass only fills the warm cache
                cache = warm_cache if mode == "warm" else Path(tempfile.mkdtemp(dir=tmp, prefix="cold-"))
                env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
                run = subprocess.run([sys.executable, __file__, "--one", "inline" if mode == "inline" else "ahead",
                                      str(folder), str(Path(tmp) / "out")], env=env, capture_output=True,
                                     text=True, check=True)
                row = json.loads(run.stdout.strip().splitlines()[-1])
                row["mode"] = mode
                if rep:
                    rows.append(row)
                    t = row["timing"]
                    print(f"{mode:7s} {row['images']} images: segment() {row['seconds']:.2f} s, first forward "
                          f"{t.get('first_forward_s', 0):.2f} s, load {t.get('load_model_s', 0):.2f} s; "
                          f"compiles {row['compiles']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"photos": args.photos, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

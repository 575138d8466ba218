"""How many images per second the segment job's own decoding (``prepare_file``: open,
decode, EXIF, RGB, the array the worker hands over) gives on this host's CPUs, alone,
for 1..N processes: the ceiling the decoders put on ``segment``, to set beside the
model's forward alone (embedingest.bench.segment_photos) on the same photographs.

    python benchmarks/decode_rate.py PHOTO_DIR --images 2048 --procs 1,8,14,16
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from embedingest.sources.image_decode import IMAGE_EXTENSIONS
from embedingest.sources.images import prepare_file
from embedingest.stages.segmentation import preset_preprocessing

PREP = preset_preprocessing("deeplabv3_resnet50")  # the job's default: the weights' own


def _decode(path: str) -> tuple[str, float, int]:
    t0 = time.perf_counter()
    pixels, meta = prepare_file("", path, PREP)
    return Path(path).suffix.lower(), time.perf_counter() - t0, meta.width * meta.height


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--procs", default="1,8,14,16")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    paths = sorted(str(p) for p in Path(args.folder).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
    paths = paths[:args.images]
    for p in paths:  # the page cache holds them all, as it does for the job after the listing
        Path(p).read_bytes()
    rows = []
    for procs in [int(p) for p in args.procs.split(",")]:
        with ProcessPoolExecutor(procs) as pool:
            list(pool.map(int, range(procs)))  # started
            t0 = time.perf_counter()
            got = list(pool.map(_decode, paths, chunksize=4))
            seconds = time.perf_counter() - t0
        by_kind = {}
        for kind, s, px in got:
            k = by_kind.setdefault(kind, [0, 0.0, 0])
            k[0] += 1
            k[1] += s
            k[2] += px
        row = {"procs": procs, "images": len(paths), "seconds": round(seconds, 3),
               "images_per_s": round(len(paths) / seconds, 1),
               "per_image_ms": {k: round(1e3 * s / n, 2) for k, (n, s, _) in by_kind.items()},
               "megapixels_per_s_per_proc": {k: round(px / s / 1e6, 1) for k, (n, s, px) in by_kind.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cpus": os.cpu_count(),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

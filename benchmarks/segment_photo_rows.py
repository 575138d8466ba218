"""The segment job on varied real photographs with both preprocessings, each against the
model's forward alone at the shapes it ran (embedingest.bench.segment_photos), one after
the other in one run over the same photographs; the result as JSON.

    python benchmarks/segment_photo_rows.py --photos 2048 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time

from embedingest.bench.segment_photos import PhotoBenchConfig, run, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=2048)
    parser.add_argument("--resize", default="short,fit", help="comma-separated rows")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--trace", help="write each timed job's Chrome trace here (RESIZE is replaced "
                        "by the row's preprocessing), e.g. trace-RESIZE.json")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="embedingest-photo-rows-") as folder:
        for resize in args.resize.split(","):
            cfg = PhotoBenchConfig(photos=args.photos, resize=resize, dtype=args.dtype,
                                   device=args.device, folder=folder,
                                   trace=args.trace.replace("RESIZE", resize) if args.trace else None)
            print(f"== --resize {resize}", flush=True)
            results[resize] = run(cfg)
            print(table(results[resize]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                       "host": platform.node(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""The segment job on the bench's photographs with several values of one setting
(``decode_ahead`` unless ``--field`` names another SegmentConfig field), alternated in one
process after one warm-up job: seconds, the loop's waits for decoded batches and the host
CPUs' busy share of each run, as JSON lines.

    python benchmarks/decode_ahead.py --photos 8192 --photo-dir /tmp/photos --values 2,4,8 --repeat 2
    python benchmarks/decode_ahead.py --field num_consumers --values 2,4 --repeat 2
"""
import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from embedingest.bench.report import HostCpu
from embedingest.bench.segment_photos import PhotoBenchConfig, warmed_job
from embedingest.jobs.segment import segment

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--photos", type=int, default=8192)
    ap.add_argument("--photo-dir", default="/tmp/photos")
    ap.add_argument("--field", default="decode_ahead")
    ap.add_argument("--values", default="2,4,8")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        job, _ = warmed_job(PhotoBenchConfig(photos=args.photos), Path(args.photo_dir), Path(tmp))
        job = dataclasses.replace(job, overwrite=True)
        for rep in range(args.repeat):
            for text in args.values.split(","):
                value = type(getattr(job, args.field))(text)
                with HostCpu() as cpu:
                    s = segment(dataclasses.replace(job, **{args.field: value}), progress=False)
                print(json.dumps({args.field: value, "rep": rep, "seconds": s["seconds"],
                                  "images_per_s": s["written"] / s["seconds"],
                                  "steady_s": s["engine"]["wall_seconds"], "timing": s["timing"],
                                  "phases": s["phases"],
                                  "gpu_idle": s["engine"].get("gpu_idle_fraction"),
                                  "host_busy": cpu.result()["busy"]}), flush=True)

"""The segment job on the bench's photographs with several values of one setting
(``decode_ahead`` unless ``--field`` names another SegmentConfig field), alternated in one
process after one warm-up job: seconds, the loop's waits for decoded batches and the host
CPUs' busy share of each run, as JSON lines.

    python benchmarks/decode_ahead.py --photos 8192 --photo-dir /tmp/photos --values 2,4,8 --repeat 2
    python benchmarks/decode_ahead.py --field num_consumers --values 2,4 --repeat 2
"""
import argparse
import json
import tempfile
from pathlib import Path

from embedingest.bench.report import HostCpu
from embedingest.bench.segment_photos import PhotoBenchConfig, make_photos, random_weights_file, warm_up_config
from embedingest.jobs.segment import SegmentConfig, segment

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--photos", type=int, default=8192)
    ap.add_argument("--photo-dir", default="/tmp/photos")
    ap.add_argument("--field", default="decode_ahead")
    ap.add_argument("--values", default="2,4,8")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    cfg = PhotoBenchConfig(photos=args.photos)
    make_photos(cfg, args.photo_dir)
    with tempfile.TemporaryDirectory() as tmp:
        weights = random_weights_file(cfg, Path(tmp) / "w.pth")
        job = SegmentConfig(images=args.photo_dir, weights=str(weights), overwrite=True, out=str(Path(tmp) / "masks"))
        warm = Path(tmp) / "warm"
        warm.mkdir()
        from PIL import Image
        for i in range(32):
            Image.effect_noise((331, 197), 64).convert("RGB").save(warm / f"{i}.png")
        segment(warm_up_config(job, warm, Path(tmp) / "warm-out"), progress=False)
        for rep in range(args.repeat):
            for text in args.values.split(","):
                value = type(getattr(job, args.field))(text)
                with HostCpu() as cpu:
                    s = segment(SegmentConfig(**{**job.__dict__, args.field: value}), progress=False)
                print(json.dumps({args.field: value, "rep": rep, "seconds": s["seconds"],
                                  "images_per_s": s["written"] / s["seconds"],
                                  "steady_s": s["engine"]["wall_seconds"], "timing": s["timing"],
                                  "gpu_idle": s["engine"].get("gpu_idle_fraction"),
                                  "host_busy": cpu.result()["busy"]}), flush=True)

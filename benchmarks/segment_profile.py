"""The segment job on the bench's photographs under torch.profiler for a window of
batches in its middle (CPU and CUDA activities): where the loop's thread spends each
batch and where the GPU waits, as the profiler's tables (printed) and a Chrome trace.

    python benchmarks/segment_profile.py --photos 8192 --photo-dir /tmp/photos --skip 300 --active 40 --trace out.json
"""
import argparse
import dataclasses
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, schedule

import embedingest.jobs.segment as job_module
from embedingest.bench.segment_photos import PhotoBenchConfig, warmed_job
from embedingest.jobs.segment import segment

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--photos", type=int, default=8192)
    ap.add_argument("--photo-dir", default="/tmp/photos")
    ap.add_argument("--skip", type=int, default=300, help="batches before the window")
    ap.add_argument("--active", type=int, default=40, help="batches profiled")
    ap.add_argument("--trace", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        job, _ = warmed_job(PhotoBenchConfig(photos=args.photos), Path(args.photo_dir), Path(tmp))
        job = dataclasses.replace(job, overwrite=True)
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                       schedule=schedule(wait=args.skip, warmup=3, active=args.active, repeat=1))
        original = job_module.segment_on_device

        def traced(*a, **k):
            k["on_images"] = lambda n: prof.step()
            return original(*a, **k)

        job_module.segment_on_device = traced
        with prof:
            s = segment(job, progress=False)
        print("job", s["seconds"], "s", s["timing"], "gpu idle", s["engine"].get("gpu_idle_fraction"))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
        if args.trace:
            prof.export_chrome_trace(args.trace)

"""The segment bench's first and gating rows only: the job end to end on the bench's
photographs against the model's forward alone on the job's batches in its order
(``embedingest bench segmentation --photos``, without its by-shape and masks rows, for a
device call with little time left), as one JSON line.

    python benchmarks/segment_job_vs_forward.py --photos 8192 --photo-dir /tmp/photos
"""
import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    """Imported here, not at the top: the job's consumers are spawned, and a spawned process
    imports the main script first; the package's imports at the top would have each consumer
    import torch too, which delayed their start by seconds (the loop blocked on full slots),
    where the command line's consumers import neither."""
    from embedingest.bench.report import HostCpu
    from embedingest.bench.segment_photos import PhotoBenchConfig, _Calls, forward_alone, warmed_job
    from embedingest.jobs.segment import segment
    from embedingest.stages.device import resolve_device

    ap = argparse.ArgumentParser()
    ap.add_argument("--photos", type=int, default=8192)
    ap.add_argument("--photo-dir", default="/tmp/photos")
    args = ap.parse_args()
    cfg = PhotoBenchConfig(photos=args.photos)
    device = resolve_device(cfg.device)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        job, made = warmed_job(cfg, Path(args.photo_dir), Path(tmp), device)
        print(f"photographs and warm-up in {time.perf_counter() - t0:.1f} s", flush=True)
        with HostCpu() as cpu, _Calls() as calls:
            summary = segment(job, progress=False)
        print(f"job: {summary['written']} images in {summary['seconds']:.2f} s", flush=True)
        alone = forward_alone(cfg, device, calls)
    images = summary["written"]
    engine = summary["engine"]
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "photos": made, "images": images,
        "job_s": summary["seconds"], "steady_s": engine["wall_seconds"], "forward_alone_s": alone["seconds"],
        "forward_alone_warm_s": alone["warm_seconds"],
        "job_vs_forward": (images / summary["seconds"]) / alone["images_per_s"],
        "steady_vs_forward": (images / engine["wall_seconds"]) / alone["images_per_s"],
        "timing": summary["timing"], "phases": summary["phases"], "gpu_idle": engine.get("gpu_idle_fraction"),
        "producer_blocked_s": engine.get("producer_blocked_seconds"), "host_busy": cpu.result()["busy"],
        "batch_shapes": summary["batch_shapes"]}))


if __name__ == "__main__":
    main()

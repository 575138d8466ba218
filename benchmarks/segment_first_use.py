"""What the segment job's first batches pay for first uses in the process: the masks
kernel's Triton set-up (in its thread) and cuDNN's set-up for each full batch's new input
shape. One process per run: the bench's warm-up job, then, outside the clock, nothing
(``base``), the masks kernel loaded (``triton``), every full-batch shape of the folder run
once at the job's batch size (``cudnn``), or both; then the timed job. One JSON line.

    for v in base both triton cudnn; do python benchmarks/segment_first_use.py --variant $v; done
"""
import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path


def main() -> None:
    import torch
    from PIL import Image

    from embedingest.bench.segment_photos import PhotoBenchConfig, warmed_job
    from embedingest.jobs.segment import segment
    from embedingest.stages import fused_argmax
    from embedingest.stages.device import resolve_device, resolve_dtype
    from embedingest.stages.segmentation import Segmenter, load_segmentation_model, preset_preprocessing

    ap = argparse.ArgumentParser()
    ap.add_argument("--photos", type=int, default=8192)
    ap.add_argument("--photo-dir", default="/tmp/photos")
    ap.add_argument("--variant", choices=("base", "triton", "cudnn", "both"), default="base")
    args = ap.parse_args()
    cfg = PhotoBenchConfig(photos=args.photos)
    device = resolve_device(cfg.device)
    with tempfile.TemporaryDirectory() as tmp:
        job, _ = warmed_job(cfg, Path(args.photo_dir), Path(tmp), device)
        t0 = time.perf_counter()
        dtype = resolve_dtype(cfg.dtype, device)
        if args.variant in ("triton", "both"):
            fused_argmax._first_run(torch.device(device), dtype, 21)
        shapes = []
        if args.variant in ("cudnn", "both"):
            prep = preset_preprocessing(cfg.arch, cfg.resize, cfg.size)
            count = Counter()
            for p in Path(args.photo_dir).rglob("*"):
                if p.suffix in (".jpg", ".png"):
                    with Image.open(p) as im:
                        count[prep.model_size(*im.size)[::-1]] += 1
            shapes = [s for s, n in count.items() if n >= cfg.batch_size]
            seg = Segmenter(load_segmentation_model(cfg.arch, random_weights=True), device, cfg.dtype)
            with torch.inference_mode():
                for h, w in shapes:
                    seg.logits(torch.zeros((cfg.batch_size, 3, h, w), dtype=torch.uint8, device=device))
            torch.cuda.synchronize()
            del seg
        before = time.perf_counter() - t0
        s = segment(job, progress=False)
    print(json.dumps({"variant": args.variant, "seconds": s["seconds"], "steady_s": s["engine"]["wall_seconds"],
                      "timing": s["timing"], "phases": s["phases"], "gpu_idle": s["engine"].get("gpu_idle_fraction"),
                      "warmed_shapes": len(shapes), "outside_clock_s": round(before, 2),
                      "gpu": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()

"""What the first forward at an input shape never seen before costs a segmentation model
on the GPU, and how that depends on the convolution back end (cuDNN's heuristics, cuDNN
with channels-last tensors, PyTorch's own kernels without cuDNN); each variant gets shapes
of its own, so every first call is a real first call.

    python benchmarks/new_shape_cost.py --shapes 8
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from embedingest.stages.segmentation import Segmenter, load_segmentation_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="deeplabv3_resnet50")
    parser.add_argument("--shapes", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    torch.manual_seed(0)
    seg = Segmenter(load_segmentation_model(args.arch, None, None, random_weights=True), "cuda", args.dtype)

    def call(x) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        seg.logits(x)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def pixels(h, w, n=args.batch):
        return torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, device="cuda")

    for _ in range(3):
        call(pixels(520, 520, 16))
    results = {}
    variants = [("cudnn_channels_last", True, torch.channels_last),
                ("no_cudnn_channels_last", False, torch.channels_last),
                ("no_cudnn_contiguous", False, torch.contiguous_format),
                ("cudnn_contiguous", True, torch.contiguous_format)]
    for v, (name, enabled, fmt) in enumerate(variants):
        seg.memory_format = fmt
        seg.model.to(memory_format=fmt)
        first, again = [], []
        with torch.backends.cudnn.flags(enabled=enabled):
            for i in range(args.shapes):
                x = pixels(520, 600 + 8 * (v * args.shapes + i) + 1)
                first.append(call(x))
                again.append(call(x))
        key = name
        results[key] = {"first_ms": [round(t * 1e3, 1) for t in first],
                        "warm_ms": [round(t * 1e3, 1) for t in again],
                        "first_median_ms": round(sorted(first)[len(first) // 2] * 1e3, 1),
                        "warm_median_ms": round(sorted(again)[len(again) // 2] * 1e3, 1)}
        print(key, results[key], flush=True)
    print(json.dumps({"arch": args.arch, "batch": args.batch, "dtype": str(seg.dtype),
                      "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "results": results}))


if __name__ == "__main__":
    main()

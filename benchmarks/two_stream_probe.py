"""Whether a lone picture of a shape of its own (the segment job's short batches, run on
PyTorch's own convolutions) can run beside the full batches on a second CUDA stream
instead of after them: the same forwards, in one stream and in two, side by side.

    python benchmarks/two_stream_probe.py [--full 60] [--short 80] [--repeat 3]

Prints one JSON line per run: seconds for the full batches alone, the short ones alone
(and the host's time to launch them), both in one stream, and both in two streams.
"""
import argparse
import json
import time


def main() -> None:
    import torch

    from embedingest.stages.segmentation import Segmenter, load_segmentation_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--full", type=int, default=60)
    ap.add_argument("--short", type=int, default=80)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    seg = Segmenter(load_segmentation_model("deeplabv3_resnet50", random_weights=True), "cuda", "auto")
    dev = seg.device
    full = torch.randint(0, 256, (16, 3, 520, 693), dtype=torch.uint8, device=dev)
    shorts = [torch.randint(0, 256, (1, 3, 520, 522 + 3 * i), dtype=torch.uint8, device=dev)
              for i in range(args.short)]
    side = torch.cuda.Stream(dev)
    per_full = -(-args.short // args.full)

    def sync():
        torch.cuda.synchronize(dev)

    def run(kind):
        sync()
        t0 = time.perf_counter()
        launch = 0.0
        if kind == "full":
            for _ in range(args.full):
                seg.logits(full)
        elif kind == "short":
            for x in shorts:
                seg.logits(x, once=True)
            launch = time.perf_counter() - t0
        else:
            k = 0
            for _ in range(args.full):
                seg.logits(full)
                mine = shorts[k:k + per_full]
                k += per_full
                if kind == "one stream":
                    for x in mine:
                        seg.logits(x, once=True)
                else:
                    with torch.cuda.stream(side):
                        for x in mine:
                            seg.logits(x, once=True)
        sync()
        return time.perf_counter() - t0, launch

    with torch.inference_mode():
        for kind in ("full", "short", "one stream", "two streams"):
            run(kind)  # warm-up: every shape once
        for rep in range(args.repeat):
            row = {"run": rep, "gpu": torch.cuda.get_device_name(dev), "dtype": str(seg.dtype)}
            for kind in ("full", "short", "one stream", "two streams"):
                seconds, launch = run(kind)
                row[kind] = round(seconds, 4)
                if launch:
                    row["short_launch"] = round(launch, 4)
            row["two_vs_one"] = round(row["one stream"] / row["two streams"], 3)
            row["sum_alone"] = round(row["full"] + row["short"], 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

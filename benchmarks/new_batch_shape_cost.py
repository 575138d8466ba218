"""What a text batch of a row count not seen before costs the encoder on the GPU, the
first time and the second, against a full batch: a build-index run meets one such short
batch per loader worker.

    python benchmarks/new_batch_shape_cost.py [--eager] [--rows 214 334 511]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from embedingest.stages.encoder import TextEncoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--full", type=int, default=1024)
    parser.add_argument("--rows", type=int, nargs="+", default=[214, 334, 511, 739, 833, 961])
    parser.add_argument("--dtype", default="fp16")
    args = parser.parse_args()
    enc = TextEncoder.load(None, device="cuda", dtype=args.dtype, cuda_graphs=not args.eager)

    def call(rows: int) -> float:
        ids = torch.randint(1000, 20000, (rows, args.width), device="cuda")
        mask = torch.ones_like(ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        enc.forward(ids, mask)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    full = [call(args.full) for _ in range(4)]
    out = {"eager": args.eager, "full_batch_s": full, "rows": {}}
    for rows in args.rows:
        out["rows"][rows] = [call(rows) for _ in range(3)]
    print(json.dumps(out))
    for rows, times in out["rows"].items():
        print(f"{rows} x {args.width}: first {times[0] * 1e3:.1f} ms, then {times[1] * 1e3:.1f}, "
              f"{times[2] * 1e3:.1f} ms (a full batch {min(full) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()

"""Where the first batch of a new row count spends its extra time on the GPU: the host's
enqueue against the wait for the GPU, and a profile (torch.profiler, CPU and CUDA) of
that first call, sorted by the host's own time, so runtime calls such as ``cudaMalloc``
or a kernel's first launch stand out.

    python benchmarks/new_shape_probe.py [--graphs] [--rows 214 334] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from embedingest.stages.encoder import TextEncoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", action="store_true", help="with CUDA graphs (default: eager)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--full", type=int, default=1024)
    parser.add_argument("--rows", type=int, nargs="+", default=[214, 334, 511])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    t0 = time.perf_counter()
    enc = TextEncoder.load(None, device="cuda", dtype="fp16", cuda_graphs=args.graphs)
    torch.cuda.synchronize()
    out = {"module_loading": os.environ.get("CUDA_MODULE_LOADING", "(default)"),
           "load_s": time.perf_counter() - t0, "calls": []}

    def call(rows: int, profile: bool = False) -> dict:
        ids = torch.randint(1000, 20000, (rows, args.width), device="cuda")
        mask = torch.ones_like(ids)
        torch.cuda.synchronize()
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA]) if profile else None
        if prof:
            prof.__enter__()
        t = time.perf_counter()
        enc.forward(ids, mask)
        enqueued = time.perf_counter() - t
        torch.cuda.synchronize()
        total = time.perf_counter() - t
        row = {"rows": rows, "enqueue_s": round(enqueued, 4), "total_s": round(total, 4)}
        if prof:
            prof.__exit__(None, None, None)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            row["profile"] = table
            print(table)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        out["calls"].append(row)
        return row

    for _ in range(3):
        call(args.full)
    for rows in args.rows:
        call(rows, profile=rows == args.rows[0])
        call(rows)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

"""Where a fresh process's way to its first encoded batch goes on a GPU: the interpreter,
``import torch``, CUDA's start, the weights, and the first forward of a new shape, each
timed in fresh interpreters (runs alternated). ``ctx-ahead`` starts the CUDA driver and
the device's primary context through ``ctypes`` in a thread before ``import torch``
(a foreign call releases the GIL, so the two can overlap); ``beside`` runs the same
child while a second interpreter imports torch and reads files, as a planning process
beside a device process would.

    python benchmarks/startup_parts.py [--repeat 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import ctypes, json, sys, threading, time
t0 = time.perf_counter()
ahead = {}
def ctx():
    t = time.perf_counter()
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    ahead["ctx_s"] = time.perf_counter() - t
thread = None
if sys.argv[1] == "ctx-ahead":
    thread = threading.Thread(target=ctx)
    thread.start()
import torch
t1 = time.perf_counter()
from embedingest.stages.encoder import TextEncoder
t2 = time.perf_counter()
if thread is not None:
    thread.join()
t3 = time.perf_counter()
torch.cuda.init()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t4 = time.perf_counter()
enc = TextEncoder.load(None, device="cuda", dtype="fp16", cuda_graphs=True)
torch.cuda.synchronize()
t5 = time.perf_counter()
ids = torch.randint(1000, 20000, (96, 256), device="cuda")
enc.forward(ids, torch.ones_like(ids))
torch.cuda.synchronize()
t6 = time.perf_counter()
ids = torch.randint(1000, 20000, (1024, 256), device="cuda")
enc.forward(ids, torch.ones_like(ids))
torch.cuda.synchronize()
t7 = time.perf_counter()
print(json.dumps({"import_torch_s": t1 - t0, "import_encoder_s": t2 - t1, "join_ctx_s": t3 - t2,
                  "cuda_start_s": t4 - t3, "weights_s": t5 - t4, "first_forward_s": t6 - t5,
                  "first_full_forward_s": t7 - t6, "to_first_forward_end_s": t6 - t0, **ahead}))
"""

BESIDE = r"""
import os, time
import torch
from embedingest.jobs.build_index import build_index
n = 0
for root, _, files in os.walk(os.path.dirname(torch.__file__)):
    n += len(files)
"""


def run_child(variant: str) -> dict:
    t = time.perf_counter()
    other = None
    if variant == "beside":
        other = subprocess.Popen([sys.executable, "-c", BESIDE])
    out = subprocess.run([sys.executable, "-c", CHILD, variant], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    if other is not None:
        other.wait()
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["process_wall_s"] = wall
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows: dict[str, list] = {"interpreter": [], "plain": [], "ctx-ahead": [], "beside": []}
    for _ in range(args.repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        rows["interpreter"].append({"process_wall_s": time.perf_counter() - t})
        for variant in ("plain", "ctx-ahead", "beside"):
            rows[variant].append(run_child(variant))
            print(variant, json.dumps({k: round(v, 3) for k, v in rows[variant][-1].items()}), flush=True)
    summary = {v: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for v, rs in rows.items()}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": rows, "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()

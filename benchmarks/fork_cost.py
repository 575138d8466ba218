"""What forking a decoding worker costs the process that drives the GPU: the parent's
time in os.fork() (the child exits at once), before CUDA starts and after (a model's
weights on the device, pinned host memory, kernels run), with the mappings that make
the difference (VM size, page-table size from /proc/self/status).

    python benchmarks/fork_cost.py
"""
import json
import os
import time

import torch


def status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmSize", "VmRSS", "VmPTE", "VmPin", "VmLck"):
                out[key] = value.strip()
    return out


def forks(n: int = 15) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        times.append(time.perf_counter() - t)
        os.waitpid(pid, 0)
    return times


def row(label: str) -> None:
    times = forks()
    print(json.dumps({"state": label, "fork_ms_median": round(sorted(times)[len(times) // 2] * 1e3, 2),
                      "fork_ms_total_15": round(sum(times) * 1e3, 1), **status()}), flush=True)


if __name__ == "__main__":
    import torchvision

    row("torch imported")
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    row("CUDA started")
    model = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None)
    model = model.cuda().half().eval().to(memory_format=torch.channels_last)
    with torch.inference_mode():
        for _ in range(3):
            model(torch.randn(16, 3, 520, 693, device="cuda", dtype=torch.half))
    torch.cuda.synchronize()
    row("model run")
    pinned = [torch.empty(40_000_000, dtype=torch.uint8).pin_memory() for _ in range(8)]
    row("320 MB pinned")
    del pinned
    row("pinned freed (cached)")

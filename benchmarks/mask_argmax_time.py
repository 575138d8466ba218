"""The masks' GPU time per photograph: the one-pass kernel against the two steps, on
channels_last fp16 scores of photo-like batches, and whether they agree pixel for pixel."""
import time
import torch
from embedingest.stages import fused_argmax
from embedingest.stages.segmentation import upsampled_argmax


def batches(n_batches=40, b=16, c=21, h=520, w=693, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for k in range(n_batches):
        lg = (torch.randn((b, c, h, w), generator=g, device="cuda") * 4).to(torch.float16)
        out.append((lg.contiguous(memory_format=torch.channels_last), [(1200 + 8 * k + 2 * i) for i in range(b)]))
    return out


def masks(lg, widths):
    return [upsampled_argmax(lg[i:i + 1], (W * 3 // 4, W))[0] for i, W in enumerate(widths)]


def timed(data):
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter(); s.record()
    res = [masks(lg, widths) for lg, widths in data]
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e), time.perf_counter() - t0, res


if __name__ == "__main__":
    data = batches()
    images = sum(len(wd) for _, wd in data)
    results = {}
    import types
    import embedingest.stages.segmentation as seg
    off = types.SimpleNamespace(usable=lambda *a: False)
    for name in ["fused", "two-step", "fused", "two-step"]:
        seg.fused_argmax = fused_argmax if name == "fused" else off
        gpu_ms, wall, res = timed(data)
        print(f"{name}: GPU {gpu_ms / images:.4f} ms/image, host {wall * 1e3 / images:.4f} ms/image")
        results[name] = res
    diff = sum(int((a != b).sum()) for r1, r2 in zip(results["fused"], results["two-step"]) for a, b in zip(r1, r2))
    total = sum(a.numel() for r in results["fused"] for a in r)
    print(f"pixels that differ: {diff} of {total}")

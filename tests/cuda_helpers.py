"""Helpers of the GPU tests (pytest puts ``tests/`` on ``sys.path``)."""

from __future__ import annotations


def cycles_per_second(device: int = 0) -> float:
    """How many cycles of ``torch.cuda._sleep`` one second of this GPU is, measured now:
    tests size their kernels in seconds, whatever the GPU's clock."""
    import torch

    with torch.cuda.device(device):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(50_000_000)
        b.record()
        b.synchronize()
        return 50_000_000 / (a.elapsed_time(b) / 1e3)


def busy_then_idle(seconds: float = 2.0) -> tuple[float, float, float]:
    """One kernel of ``seconds`` on the current GPU, then as long with nothing on it; the
    host times (``time.perf_counter``) of its start, its end and the end of the idle."""
    import time

    import torch

    cycles = cycles_per_second(torch.cuda.current_device())
    t0 = time.perf_counter()
    torch.cuda._sleep(int(seconds * cycles))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    time.sleep(seconds)
    return t0, t1, time.perf_counter()

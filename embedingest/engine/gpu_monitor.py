"""Sample the GPU's kernel activity through NVML while the engine runs.

CUDA events show gaps *between* batches; a GPU starved inside a batch (kernel launches
slowed by a busy host) looks busy to them. NVML's utilisation counter (share of time a
kernel was running) sees both, so the engine reports it as the GPU idle fraction when
``pynvml`` (package ``nvidia-ml-py``) is importable.
"""

from __future__ import annotations

import threading
import time


class UtilizationSampler:
    """Background thread averaging ``torch.cuda.utilization`` every ``period`` seconds."""

    def __init__(self, device, period: float = 0.1):
        self.device, self.period = device, period
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> UtilizationSampler:
        import torch

        try:
            torch.cuda.utilization(self.device)
        except Exception:  # no pynvml, or NVML refuses: report nothing rather than guess
            return self
        self._thread = threading.Thread(target=self._run, name="embedingest-nvml", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        import torch

        while not self._stop.wait(self.period):
            try:
                self.samples.append((time.perf_counter(), int(torch.cuda.utilization(self.device))))
            except Exception:
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def idle_fraction(self, since: float = 0.0, until: float = float("inf")) -> float | None:
        """Mean idle share of the samples taken between two ``perf_counter`` times."""
        s = [v for t, v in self.samples if since <= t <= until]
        return 1.0 - sum(s) / (100.0 * len(s)) if s else None

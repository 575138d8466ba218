"""Sample the GPU's kernel activity through NVML while the engine runs.

CUDA events show gaps *between* batches; a GPU starved inside a batch (kernel launches
slowed by a busy host) looks busy to them. NVML's utilisation counter (share of time a
kernel was running) sees both, so the engine reports it as the GPU idle fraction; NVML
is reached through ``torch.cuda.utilization``, which needs ``pynvml`` (the package
``nvidia-ml-py``, a dependency of embedingest). Where NVML cannot be read the engine says
so once in the log and falls back to the CUDA-event gaps (``stats.gpu_idle_source``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("embedingest")
_warned = False


class UtilizationSampler:
    """Background thread reading the utilisation (0-100) every ``period`` seconds.

    ``read`` is the reading, ``torch.cuda.utilization(device)`` by default (a stand-in
    for tests without a GPU). ``error`` says why nothing is sampled, when it is not.
    """

    def __init__(self, device, period: float = 0.1, read: Callable[[], int] | None = None):
        self.device, self.period = device, period
        self.read = read
        self.samples: list[tuple[float, int]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> UtilizationSampler:
        global _warned
        if self.read is None:
            import torch

            self.read = functools.partial(torch.cuda.utilization, self.device)
        try:
            self.read()
        except Exception as exc:  # no pynvml, or NVML refuses: report nothing rather than guess
            self.error = f"{type(exc).__name__}: {exc}"
            if not _warned:
                log.warning("GPU utilisation cannot be sampled (%s); gpu_idle_fraction falls back "
                            "to the gaps between batches (pip install nvidia-ml-py)", self.error)
                _warned = True
            return self
        self._thread = threading.Thread(target=self._run, name="embedingest-nvml", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.samples.append((time.perf_counter(), int(self.read())))
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def idle_fraction(self, since: float = 0.0, until: float = float("inf")) -> float | None:
        """Mean idle share of the samples taken between two ``perf_counter`` times."""
        s = [v for t, v in self.samples if since <= t <= until]
        return 1.0 - sum(s) / (100.0 * len(s)) if s else None


def gpu_idle(nvml: float | None, compute_gap: float | None) -> tuple[float | None, str | None]:
    """The GPU idle fraction and where it comes from: NVML's samples (``nvml``, from
    :meth:`UtilizationSampler.idle_fraction`) when there are any, else the compute
    stream's gaps between batches (CUDA events), else nothing."""
    if nvml is not None:
        return nvml, "nvml"
    if compute_gap is not None:
        return compute_gap, "cuda-events"
    return None, None

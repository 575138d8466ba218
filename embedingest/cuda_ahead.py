"""CUDA's start, made while a job command imports its modules.

``import torch`` holds the GIL for a second or more, and CUDA's start (the driver, then
the device's primary context) costs a third of a second more once torch asks for it.
A call through :mod:`ctypes` releases the GIL, so a thread can start the driver and
retain the primary context while the import runs; torch's runtime then finds that
context made and its own start costs milliseconds. Nothing here imports torch.

Only for a process that will itself run on one GPU: once the driver is started here, a
child forked from this process cannot use CUDA (the several-device runs fork children
that do, so they never call this). Failing (no driver, no such device) changes nothing:
torch meets the same and says so in its own words.
"""

from __future__ import annotations

import ctypes
import re
import signal
import threading
import time

__all__ = ["CudaAhead", "ordinal_of"]

_CUDA = re.compile(r"(auto|cuda)(?::(\d+))?")


def ordinal_of(device: str | None) -> int | None:
    """The GPU ``device`` (a job's ``device`` setting) runs on, as the driver numbers the
    visible ones: 0 for auto and cuda, N for cuda:N; None for cpu or any other value."""
    match = _CUDA.fullmatch((device or "").strip())
    if match is None or (match.group(1) == "auto" and match.group(2)):
        return None
    return int(match.group(2) or 0)


class CudaAhead:
    """``with CudaAhead(ordinal):`` around the imports: a thread starts the driver and
    retains device ``ordinal``'s primary context (kept for the process's life, as torch
    keeps it); leaving the block waits for that thread, so no thread runs when the job
    forks its workers. ``None``: nothing is done. ``seconds`` and ``error`` say how it went."""

    def __init__(self, ordinal: int | None, library: str = "libcuda.so.1"):
        self.ordinal = ordinal
        self.library = library
        self.seconds: float | None = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> CudaAhead:
        if self.ordinal is None:
            return self
        self._thread = threading.Thread(target=self._start, name="embedingest-cuda-ahead", daemon=True)
        # The thread inherits SIGINT blocked, as the import beside it has it (a Ctrl-C
        # then waits for the import instead of landing inside it; see import_interruptibly).
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _start(self) -> None:
        t0 = time.perf_counter()
        try:
            cuda = ctypes.CDLL(self.library)
            device, context = ctypes.c_int(), ctypes.c_void_p()
            for name, call in (("cuInit", lambda: cuda.cuInit(0)),
                               ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(device), self.ordinal)),
                               ("cuDevicePrimaryCtxRetain",
                                lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))):
                result = call()
                if result != 0:
                    self.error = f"{name} returned CUDA error {result}"
                    return
        except OSError as exc:
            self.error = str(exc)
        finally:
            self.seconds = time.perf_counter() - t0

"""How a batch's outputs get into a host slot, and when the copy is over: one class per
kind of device, so the engine itself never asks which one it runs on.

:class:`HostCopyPath` (CPU engine) copies in ``submit`` and times everything on the host
clock. :class:`CudaCopyPath` enqueues device tensors' copies on a dedicated egress stream
that waits for the compute stream, records CUDA events, and lets the monitor thread wait
for them; its event times are put on the host clock through one reference event.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from .gpu_monitor import UtilizationSampler
from .layout import RAW_BITS, numpy_dtype
from .pool import HostPool
from .telemetry import BatchRecord


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "is_cuda")


def _host_array(x) -> np.ndarray:
    """A numpy view (or copy, for device tensors on a CPU engine) of a CPU array."""
    if isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        import torch

        x = x.detach()
        raw = numpy_dtype(x.dtype)
        if x.dtype.itemsize == raw.itemsize and str(x.dtype).replace("torch.", "") in RAW_BITS:
            # bfloat16, float8: no numpy twin; their bits travel as unsigned integers of their width
            bits = {1: torch.uint8, 2: torch.int16}[raw.itemsize]
            return x.cpu().view(bits).numpy().view(raw)
        return x.cpu().numpy()
    return np.asarray(x)


@dataclass
class Pending:
    """A submitted batch on its way to the consumers (the monitor thread's queue item)."""

    record: BatchRecord
    batch_id: object
    lengths: dict[str, int]
    done_event: object = None  # CUDA event recorded after the copy
    timing: tuple = ()  # (compute_start, compute_end, copy_start) events
    keep: list = field(default_factory=list)  # device tensors alive until the copy ends


class HostCopyPath:
    """The CPU engine's copies: made in ``submit``, over when it returns."""

    pins = False  # whether the pool should be page-locked for this path

    def __init__(self, device: str):
        self.device = device
        self._compute_start = None
        self._compute_end = None
        self._spans: list[tuple] = []

    def open(self, pool: HostPool) -> None:
        """Called once the pool exists, before the first copy."""

    def mark_compute_start(self) -> None:
        self._compute_start = time.perf_counter()

    def mark_compute_end(self) -> None:
        """Mark where the batch's compute ends, before ``submit`` may wait for the pool or a
        slot (a mark after the wait would count the wait as compute)."""
        self._compute_end = time.perf_counter()

    @contextlib.contextmanager
    def span(self, lane: str, stream=None):
        t0 = time.perf_counter()
        yield
        self._spans.append((lane, t0, time.perf_counter()))

    def copy(self, pool: HostPool, slot: int, arrays: dict, pending: Pending) -> int:
        """Copy ``arrays`` into ``slot``; return the bytes copied."""
        rec = pending.record
        t0 = time.perf_counter()
        nbytes = self._copy_host(pool.views(slot), arrays, pending.lengths, skip_device=False)
        rec.copy_start, rec.copy_end = t0, time.perf_counter()
        rec.compute_start, rec.compute_end = self._compute_start, self._compute_end or rec.submit_t
        self._compute_start = self._compute_end = None
        return nbytes

    def _copy_host(self, views: dict, arrays: dict, lengths: dict, skip_device: bool) -> int:
        nbytes = 0
        for name, a in arrays.items():
            if _is_torch(a) and a.is_cuda:
                if skip_device:
                    continue
                raise ConfigError(f"array {name!r} is on {a.device} but the engine runs on "
                                  f"{self.device}; build the engine with device='cuda'")
            src = _host_array(a)
            np.copyto(views[name][:lengths[name]], src, casting="no")
            nbytes += src.nbytes
        return nbytes

    def wait(self, pending: Pending) -> None:
        """Block until the copy of ``pending`` is in the slot (monitor thread)."""

    def stop(self) -> None:
        """No copy may write into the pool after this returns."""

    def release(self) -> None:
        """Drop every reference into the pool (before it is unmapped)."""

    def idle_fraction(self, since: float = 0.0, until: float = float("inf")) -> float | None:
        """The GPU's measured idle share between two ``perf_counter`` times (None on CPU)."""
        return None

    def spans(self, pool_open: bool) -> list[tuple[str, float, float]]:
        """The :meth:`span` blocks timed so far, on the host clock."""
        return list(self._spans)


class CudaCopyPath(HostCopyPath):
    """Device tensors' copies on a dedicated egress stream, timed by CUDA events; host
    arrays in the same batch are copied as on the CPU."""

    pins = True

    def __init__(self, device: str):
        super().__init__(device)
        self._stream = None
        self._device_index: int | None = None
        self._host_tensors: list[dict] = []
        self._ref_event = None
        self._ref_t = 0.0
        self.sampler: UtilizationSampler | None = None

    def open(self, pool: HostPool) -> None:
        import torch

        dev = torch.device(self.device)
        self._device_index = dev.index if dev.index is not None else torch.cuda.current_device()
        self._stream = torch.cuda.Stream(device=dev)
        for i in range(pool.num_slots):
            views = pool.views(i)
            tensors = {}
            for f in pool.layout.fields:
                v = views[f.name]
                if f.source_dtype == "bfloat16":
                    tensors[f.name] = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16)
                else:
                    tensors[f.name] = torch.from_numpy(v)
            self._host_tensors.append(tensors)
        torch.cuda.synchronize(dev)
        self._ref_event = torch.cuda.Event(enable_timing=True)
        self._ref_event.record(torch.cuda.current_stream(dev))
        self._ref_event.synchronize()
        self._ref_t = time.perf_counter()
        self.sampler = UtilizationSampler(dev).start()

    def mark_compute_start(self) -> None:
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self._compute_start = ev

    def mark_compute_end(self) -> None:
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self._compute_end = ev

    @contextlib.contextmanager
    def span(self, lane: str, stream=None):
        import torch

        stream = stream or torch.cuda.current_stream(self.device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        yield
        b.record(stream)
        self._spans.append((lane, a, b))

    def copy(self, pool: HostPool, slot: int, arrays: dict, pending: Pending) -> int:
        nbytes = self._copy_host(pool.views(slot), arrays, pending.lengths, skip_device=True)
        items = [(name, a) for name, a in arrays.items() if _is_torch(a) and a.is_cuda]
        if not items:
            self._compute_start = self._compute_end = None
            return nbytes
        return nbytes + self._copy_device(slot, items, pending)

    def _copy_device(self, slot: int, items: list, pending: Pending) -> int:
        import torch

        for name, t in items:
            if t.device.index != self._device_index:
                raise ConfigError(f"array {name!r} is on {t.device}, the engine on "
                                  f"cuda:{self._device_index}; one engine serves one GPU")
        end = self._compute_end  # the engine's submit marks it before every copy
        start_copy = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True, blocking=True)
        self._stream.wait_event(end)
        host = self._host_tensors[slot]
        nbytes = 0
        with torch.cuda.stream(self._stream):
            start_copy.record(self._stream)
            for name, t in items:
                host[name][:pending.lengths[name]].copy_(t, non_blocking=True)
                nbytes += t.numel() * t.element_size()
            done.record(self._stream)
        pending.done_event = done
        pending.timing = (self._compute_start, end, start_copy)
        pending.keep = [t for _, t in items]
        self._compute_start = self._compute_end = None
        return nbytes

    def _host_time(self, ev) -> float | None:
        if ev is None:
            return None
        return self._ref_t + self._ref_event.elapsed_time(ev) / 1e3

    def wait(self, pending: Pending) -> None:
        if pending.done_event is None:  # host arrays only: copied in submit
            return
        pending.done_event.synchronize()
        rec = pending.record
        compute_start, compute_end, copy_start = pending.timing
        rec.compute_start = self._host_time(compute_start)
        rec.compute_end = self._host_time(compute_end)
        rec.copy_start = self._host_time(copy_start)
        rec.copy_end = self._host_time(pending.done_event)
        pending.keep.clear()

    def stop(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        if self.sampler is not None:
            self.sampler.stop()

    def release(self) -> None:
        self._host_tensors = []

    def idle_fraction(self, since: float = 0.0, until: float = float("inf")) -> float | None:
        return self.sampler.idle_fraction(since, until) if self.sampler is not None else None

    def spans(self, pool_open: bool) -> list[tuple[str, float, float]]:
        out = []
        for lane, a, b in list(self._spans):
            if pool_open and a.query() and b.query():
                out.append((lane, self._host_time(a), self._host_time(b)))
        return out

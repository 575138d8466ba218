"""The host buffer pool: shared memory that is really page-locked.

``torch.empty(..., pin_memory=True).share_memory_()`` moves the tensor into fresh shared
memory that is *not* pinned, so device-to-host copies fall back to pageable speed. Here
the memory is an anonymous ``memfd`` (no name in /dev/shm, so nothing can leak there
even on SIGKILL, and no /dev/shm size limit applies) mapped in every process, and the
producer registers its mapping with ``cudaHostRegister``. Consumers get the descriptor
through the process start-up (``DupFd``), not through a path.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import tempfile
import threading
from multiprocessing import reduction

import numpy as np

from ..errors import EngineError
from .layout import SlotLayout


def _available_bytes() -> int | None:
    """Memory the kernel says is available now (MemAvailable), else the physical total."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _anonymous_fd(size: int) -> int:
    """A descriptor of ``size`` bytes of anonymous shared memory. A pool larger than the
    memory available is refused here: the mapping itself would succeed (the pages are
    only reserved), and faulting them in would bring the OOM killer instead of an error."""
    available = _available_bytes()
    if available is not None and size > available:
        raise EngineError(f"cannot allocate a host pool of {size / 1e9:.2f} GB: only "
                          f"{available / 1e9:.2f} GB of memory is available; use fewer slots "
                          "or smaller batches")
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("embedingest-pool", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux: an unlinked temporary file behaves the same
        fd, name = tempfile.mkstemp(prefix="embedingest-pool-")
        os.unlink(name)
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        os.close(fd)
        raise EngineError(f"cannot allocate a host pool of {size / 1e9:.2f} GB: {exc}; "
                          "use fewer slots or smaller batches") from exc
    return fd


class HostPool:
    """``num_slots`` slots of one :class:`SlotLayout` in one shared mapping.

    With ``ahead``, the pages are faulted in and registered with CUDA in a thread (both
    let go of the GIL), so a caller that goes on meanwhile (moving a model to the device)
    does not wait for them; :meth:`ready` waits, and raises what failed there."""

    def __init__(self, layout: SlotLayout, num_slots: int, *, pin: bool = False, ahead: bool = False):
        self.layout = layout
        self.num_slots = num_slots
        self.size = layout.slot_bytes * num_slots
        self.fd = _anonymous_fd(self.size)
        self._mm = mmap.mmap(self.fd, self.size)
        self._registered_ptr: int | None = None
        self._views = [layout.views(memoryview(self._mm)[i * layout.slot_bytes:(i + 1) * layout.slot_bytes])
                       for i in range(num_slots)]
        self._preparing: threading.Thread | None = None
        self._prepare_error: BaseException | None = None
        if ahead:
            self._preparing = threading.Thread(target=self._prepare, args=(pin,), daemon=True,
                                               name="embedingest-pool")
            self._preparing.start()
        else:
            self._prepare(pin)
            self.ready()

    def _prepare(self, pin: bool) -> None:
        """Registering with CUDA faults the pages in itself, sooner than touching them
        first and then registering (docs/BENCHMARKS.md, the engine's host slots)."""
        try:
            if pin:
                self._register()
            else:
                self._touch()
        except BaseException as exc:
            self._prepare_error = exc

    def ready(self) -> None:
        """Wait until the pages are in (and registered); raise the error if that failed.
        Copies into the slots must wait for this: a copy into pages being registered
        would run at pageable speed, or race the registration."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        if self._prepare_error is not None:
            raise self._prepare_error

    def _touch(self) -> None:
        """Fault every page in now, so the first copies do not pay for it."""
        flat = np.frombuffer(self._mm, dtype=np.uint8)
        flat[::mmap.PAGESIZE] = 0
        del flat

    def _register(self) -> None:
        import torch

        ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.size, 1)  # 1 = portable
        if int(err) != 0:
            raise EngineError(
                f"cudaHostRegister of {self.size / 1e9:.2f} GB failed with CUDA error "
                f"{int(err)}; lower num_slots or the batch size, or raise the locked-memory "
                "limit (ulimit -l)")
        self._registered_ptr = ptr

    @property
    def pinned(self) -> bool:
        if self._preparing is not None:
            self._preparing.join()
        return self._registered_ptr is not None

    def views(self, slot: int) -> dict[str, np.ndarray]:
        return self._views[slot]

    def handle(self) -> PoolHandle:
        return PoolHandle(self.fd, self.layout, self.num_slots)

    def close(self) -> None:
        """Unregister (before unmapping, or CUDA reports the range as mapped later) and free;
        a preparation still under way is waited for first."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        if self._registered_ptr is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self._registered_ptr = None
        self._views = []
        if not self._mm.closed:
            # BufferError: a caller still holds a view; the mapping goes with the last one.
            with contextlib.suppress(BufferError):
                self._mm.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PoolHandle:
    """What a consumer process needs to map the pool: the descriptor and the layout."""

    def __init__(self, fd: int, layout: SlotLayout, num_slots: int):
        self.fd, self.layout, self.num_slots = fd, layout, num_slots

    def __reduce__(self):
        return _rebuild_handle, (reduction.DupFd(self.fd), self.layout, self.num_slots)

    def attach(self) -> list[dict[str, np.ndarray]]:
        """Map the pool in this process and return per-slot views."""
        size = self.layout.slot_bytes * self.num_slots
        mm = mmap.mmap(self.fd, size)
        os.close(self.fd)
        sb = self.layout.slot_bytes
        return [self.layout.views(memoryview(mm)[i * sb:(i + 1) * sb]) for i in range(self.num_slots)]


def _rebuild_handle(dupfd, layout: SlotLayout, num_slots: int) -> PoolHandle:
    return PoolHandle(dupfd.detach(), layout, num_slots)

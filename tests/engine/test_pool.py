"""The host pool: one anonymous shared mapping, slots that do not overlap, a handle that
maps the same memory in another process."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

from embedingest.engine.layout import SlotLayout
from embedingest.engine.pool import HostPool
from embedingest.errors import EngineError

LAYOUT = SlotLayout.from_spec({"x": ((4, 2), np.float32), "n": ((4,), np.int64)})


def _child_reads_and_writes(handle, conn):
    slots = handle.attach()
    conn.send([s["x"].tolist() for s in slots])
    slots[1]["n"][:] = [7, 8, 9, 10]
    conn.send("written")


def test_slots_do_not_overlap_and_are_zeroed():
    pool = HostPool(LAYOUT, 3)
    try:
        assert (pool.num_slots, pool.size, pool.pinned) == (3, 3 * LAYOUT.slot_bytes, False)
        for i in range(3):
            pool.views(i)["x"][:] = i + 1
        assert [float(pool.views(i)["x"].sum()) for i in range(3)] == [8.0, 16.0, 24.0]
        assert all(not pool.views(i)["n"].any() for i in range(3))
    finally:
        pool.close()


def test_a_spawned_process_maps_the_same_memory():
    pool = HostPool(LAYOUT, 2)
    try:
        pool.views(0)["x"][:] = np.arange(8, dtype=np.float32).reshape(4, 2)
        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_child_reads_and_writes, args=(pool.handle(), theirs))
        p.start()
        seen = mine.recv()
        assert mine.recv() == "written"
        p.join(30)
        assert p.exitcode == 0
        assert seen[0] == [[0, 1], [2, 3], [4, 5], [6, 7]] and seen[1] == [[0, 0]] * 4
        assert pool.views(1)["n"].tolist() == [7, 8, 9, 10]
    finally:
        pool.close()


def test_nothing_is_named_in_dev_shm_and_close_frees_the_descriptor():
    pool = HostPool(LAYOUT, 2)
    fd = pool.fd
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:embedingest-pool")
    assert not [n for n in os.listdir("/dev/shm") if "embedingest" in n]
    pool.close()
    assert pool.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)
    pool.close()  # twice is fine


def test_a_pool_larger_than_the_memory_available_is_refused_before_it_is_touched():
    """The mapping of a memfd succeeds at any size; faulting its pages in would bring the
    OOM killer. 8 TiB is refused up front, naming both sizes."""
    huge = SlotLayout.from_spec({"x": ((1 << 40,), np.uint8)})  # 1 TiB a slot
    with pytest.raises(EngineError, match=r"cannot allocate a host pool of 8796\.09 GB: only "
                                          r"[0-9.]+ GB of memory is available; use fewer slots"):
        HostPool(huge, 8)


def _rss_kib(address: int) -> int:
    """Resident KiB of the mapping of this process that starts at ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                inside = int(head.split("-")[0], 16) == address
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


def test_every_page_is_faulted_in_when_the_pool_is_made():
    """The first copies into a slot must not pay for page faults: the whole mapping is
    resident as soon as the pool exists (every page touched, not every 8th)."""
    import ctypes

    layout = SlotLayout.from_spec({"x": ((8 << 20,), np.uint8)})  # 8 MiB a slot
    pool = HostPool(layout, 4)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(pool._mm))
        assert _rss_kib(address) >= pool.size // 1024
    finally:
        pool.close()


def test_close_unmaps_the_pool_even_while_a_view_is_held():
    """A caller that still holds a slot's view: close neither fails nor leaves the pool
    mapped for others; the memory goes with the last view."""
    pool = HostPool(LAYOUT, 2)
    held = pool.views(0)["x"]
    held[:] = 3.0
    pool.close()
    assert held.sum() == 24.0  # the view still reads its memory
    pool2 = HostPool(LAYOUT, 2)
    pool2.close()
    assert pool2._mm.closed  # with no view left, the mapping itself is closed


def test_the_memory_available_is_the_kernel_s_memavailable():
    """The up-front refusal compares with MemAvailable (what can be used now without
    swapping), not with the physical total, which is only its fallback."""
    from embedingest.engine import pool as pool_module

    fields = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    available = int(fields["MemAvailable"].split()[0]) * 1024
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    got = pool_module._available_bytes()
    assert abs(got - available) < 128 << 20
    assert total - got > 128 << 20  # this machine uses some memory: not the total


def test_without_proc_meminfo_the_physical_total_is_the_bound(monkeypatch):
    import builtins

    from embedingest.engine import pool as pool_module

    real_open = builtins.open

    def no_meminfo(path, *args, **kwargs):
        if str(path) == "/proc/meminfo":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_meminfo)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert pool_module._available_bytes() == total


def test_memavailable_is_read_in_kib(monkeypatch):
    import builtins
    import io

    from embedingest.engine import pool as pool_module

    real_open = builtins.open
    text = "MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:    1234567 kB\n"
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(text) if str(path) == "/proc/meminfo"
                        else real_open(path, *a, **k))
    assert pool_module._available_bytes() == 1234567 * 1024


def test_a_pool_the_kernel_will_not_size_is_refused_with_what_to_do(monkeypatch):
    import errno

    from embedingest.engine import pool as pool_module

    def full(fd, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pool_module.os, "ftruncate", full)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(EngineError) as err:
        HostPool(LAYOUT, 1_000_000)
    size = LAYOUT.slot_bytes * 1_000_000
    assert str(err.value) == (f"cannot allocate a host pool of {size / 1e9:.2f} GB: [Errno 28] No space "
                              "left on device; use fewer slots or smaller batches")
    assert set(os.listdir("/proc/self/fd")) <= before  # its descriptor closed


def test_a_pool_made_ahead_is_the_same_pool_once_ready_and_closes_while_preparing(monkeypatch):
    """``ahead``: the pages are faulted in by a thread; ready() waits for it, and then the
    slots are the same zeroed, separate memory. close() while it still runs waits for it
    (no unmapping under the thread)."""
    import threading

    pool = HostPool(LAYOUT, 3, ahead=True)
    try:
        pool.ready()
        assert (pool.num_slots, pool.pinned) == (3, False)
        for i in range(3):
            pool.views(i)["n"][:] = i
        assert [pool.views(i)["n"].tolist() for i in range(3)] == [[0] * 4, [1] * 4, [2] * 4]
    finally:
        pool.close()
    gate, touched = threading.Event(), []
    real = HostPool._touch

    def held(p):
        assert gate.wait(60)
        real(p)
        touched.append(p)

    monkeypatch.setattr(HostPool, "_touch", held)
    pool = HostPool(LAYOUT, 2, ahead=True)
    closing = threading.Thread(target=pool.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive() and not touched  # close waits for the thread
    gate.set()
    closing.join(60)
    assert touched == [pool] and pool.fd == -1


def test_a_pool_made_in_place_raises_what_failed_at_once(monkeypatch):
    """Without ``ahead`` the pages are prepared in the constructor, and its failure is the
    constructor's (an engine's pool is made ahead; other callers get the error where they
    asked)."""
    def failing(pool):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(HostPool, "_touch", failing)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        HostPool(LAYOUT, 2)


def test_pinned_waits_for_the_registration_under_way(monkeypatch):
    """A pool registered in a thread is reported pinned once that is done, not as unpinned
    while it runs (the engine's summary reads it)."""
    import threading

    gate = threading.Event()

    def held_register(pool):
        assert gate.wait(60)
        pool._registered_ptr = 1  # as a registration would (no GPU here)

    monkeypatch.setattr(HostPool, "_register", held_register)
    pool = HostPool(LAYOUT, 2, pin=True, ahead=True)
    answers = []
    asking = threading.Thread(target=lambda: answers.append(pool.pinned))
    asking.start()
    asking.join(0.2)
    assert asking.is_alive() and not answers
    gate.set()
    asking.join(60)
    assert answers == [True]
    pool._registered_ptr = None  # nothing to unregister without a GPU
    pool.close()

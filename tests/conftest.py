"""Shared test fixtures: CUDA gating and leak checks (processes, /dev/shm)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "needs_cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


def child_pids(parent: int | None = None) -> set[int]:
    """Live descendants of ``parent`` (default: this process), multiprocessing's helper excluded."""
    parent = os.getpid() if parent is None else parent
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z" or b"resource_tracker" in cmd:
            continue
        kids.setdefault(int(fields[1]), []).append(int(d.name))
    out, stack = set(), [parent]
    while stack:
        for k in kids.get(stack.pop(), []):
            out.add(k)
            stack.append(k)
    return out


def shm_files() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


@pytest.fixture
def no_leaks():
    """Fail the test if it leaves a child process or a new /dev/shm file behind."""
    import time

    before_shm = shm_files()
    before_kids = child_pids()
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        extra = child_pids() - before_kids
        if not extra:
            break
        time.sleep(0.1)
    assert not extra, f"processes left behind: {sorted(extra)}"
    assert shm_files() - before_shm == set(), f"new /dev/shm files: {shm_files() - before_shm}"

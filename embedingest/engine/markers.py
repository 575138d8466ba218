"""NVTX ranges around the engine's steps, so Nsight Systems timelines read by name.

The ``nvtx`` package is cheap when no profiler is attached; where it is missing (or
``EMBEDINGEST_NVTX=0``) the ranges are no-ops.
"""

from __future__ import annotations

import contextlib
import os

try:
    if os.environ.get("EMBEDINGEST_NVTX", "1") == "0":
        raise ImportError("disabled")
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - depends on the environment
    _nvtx = None

COLORS = {
    "submit": "blue",
    "copy": "yellow",
    "handoff": "cyan",
    "sink": "green",
    "compute": "purple",
    "load": "red",
}


def annotate(name: str, kind: str = "submit"):
    """Return a context manager that marks ``name`` on the NVTX timeline."""
    if _nvtx is None:
        return contextlib.nullcontext()
    return _nvtx.annotate(name, color=COLORS.get(kind, "white"), domain="embedingest")

"""Which runtime encodes queries: torch, or the encoder exported to ONNX and run by ONNX
Runtime (:mod:`~embedingest.stages.onnx_forward`), which gives the same vectors in about
half the time for one short query on a CPU.

``"auto"`` takes ONNX where it applies (fp32 on the CPU) and falls back to torch, with
one warning per process and reason, when onnxruntime or onnx is missing or the graph
cannot be made, loaded or checked; ``"onnx"`` insists and raises instead; ``"torch"``
never tries.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError

log = logging.getLogger("embedingest")
RUNTIMES = ("auto", "torch", "onnx")
_warned: set[str] = set()


def check_runtime(runtime: str) -> None:
    if runtime not in RUNTIMES:
        raise ConfigError(f"query runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")


def use_query_runtime(encoder: Any, runtime: str, cache_dir: str | os.PathLike, threads: int) -> str:
    """Make ``encoder`` (a :class:`~embedingest.stages.encoder.TextEncoder`) encode through
    ``runtime``; returns the one in use. ``cache_dir``: where the exported graph is kept;
    ``threads``: ONNX Runtime's threads (torch's are the caller's to set)."""
    check_runtime(runtime)
    if runtime == "torch" or (runtime == "auto" and (encoder.device.type != "cpu" or encoder.dtype != "fp32")):
        encoder.use_runtime(None)
        return "torch"
    from .onnx_forward import load

    try:
        encoder.use_runtime(load(encoder, Path(cache_dir), threads))
    except Exception as exc:
        if runtime == "onnx":
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"the ONNX query runtime failed: {type(exc).__name__}: {exc}; "
                              "use --query-runtime torch") from exc
        reason = f"{type(exc).__name__}: {exc}"
        if reason not in _warned:
            _warned.add(reason)
            log.warning("queries are encoded with torch, not ONNX Runtime (%s)", reason)
        encoder.use_runtime(None)
        return "torch"
    return "onnx"

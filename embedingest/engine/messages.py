"""What the engine and its consumer processes say to each other over their pipes.

Named tuples, so both ends read fields by name: a message that gains a field cannot
silently shift another's. They pickle as plain tuples of their fields (this module
imports nothing heavy: consumers stay free of torch).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Task(NamedTuple):
    """Engine -> consumer: run the sink on ``slot`` (rows of each array in ``lengths``)."""

    seq: int
    slot: int
    batch_id: Any
    lengths: dict


class Ready(NamedTuple):
    """Consumer -> engine: the pool is mapped and the sink built."""

    worker: int
    pid: int


class Done(NamedTuple):
    """Consumer -> engine: the sink ran on the slot, which is free again."""

    worker: int
    seq: int
    slot: int
    sink_start: float
    sink_end: float
    result: Any


class Skipped(NamedTuple):
    """Consumer -> engine: the run is aborting, so the slot was handed back unused."""

    worker: int
    seq: int
    slot: int


class Failed(NamedTuple):
    """Consumer -> engine: the sink (or its factory, or ``close``) raised; see
    :func:`~embedingest.errors.error_payload` for the last three fields."""

    worker: int
    seq: int | None
    batch_id: Any
    payload: bytes | None
    summary: str
    traceback: str


class Closed(NamedTuple):
    """Consumer -> engine: the sink was closed; ``result`` is what ``close()`` returned,
    ``close_start``/``close_end`` when it ran (``time.perf_counter()``, the same clock as
    the engine's on Linux and macOS; 0.0 when the sink has no ``close``)."""

    worker: int
    result: Any
    close_start: float = 0.0
    close_end: float = 0.0

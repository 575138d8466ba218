"""Short batches padded with empty rows up to a row count the GPU already runs, when the
padding costs less than a new row count does.

The first batch of a row count never run before costs the GPU more than its work: new
kernel choices and loads stall the queue (tens of milliseconds for a small encoder,
several times a full batch's work: ``benchmarks/new_batch_shape_cost.py``). build-index
meets such a batch once per loader worker, its last, short one. Padded up to a row count
already run at the same width, it costs the padded rows' work instead. Which is cheaper
depends on the model and the GPU, so both are measured as the run goes, with CUDA events
on the compute stream (read once they have passed; nothing waits): each row count's GPU
time, and how much longer a new row count's first batch took than its share of a known
one's. Rows are independent in the encoder, so the real rows' vectors do not change.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import torch

__all__ = ["RowPadding"]


class RowPadding:
    """The row count to run a batch of ``n`` rows at (:meth:`rows`), from the GPU times of
    the batches run so far (:meth:`timed` records them, :meth:`observe` takes them)."""

    def __init__(self, max_pending: int = 256):
        self._seconds: dict[tuple[int, int], float] = {}  # (rows, width): least GPU time of a later run
        self._seen: set[tuple[int, int]] = set()
        self._first_extra: float | None = None  # GPU seconds a new row count's first batch added
        self._pending: deque = deque(maxlen=max_pending)
        self.padded = 0  # batches padded so far

    def rows(self, n: int, width: int) -> int:
        """``n``, or the smallest row count already run at ``width`` whose extra rows cost
        less GPU time than a new row count's first batch has cost in this run."""
        self._collect()
        if (n, width) in self._seen or self._first_extra is None:
            return n
        best = n
        for (rows, w), seconds in self._seconds.items():
            if w == width and rows > n and seconds * (1 - n / rows) < self._first_extra:
                best = rows if best == n else min(best, rows)
        self.padded += best > n
        return best

    def observe(self, rows: int, width: int, seconds: float, first: bool) -> None:
        """One batch's GPU time; ``first``: the first batch of its row count at its width."""
        key = (rows, width)
        self._seen.add(key)
        if not first:
            self._seconds[key] = min(seconds, self._seconds.get(key, seconds))
            return
        known = [(r, s) for (r, w), s in self._seconds.items() if w == width]
        if known:  # its work, estimated from the largest known row count at that width
            r, s = max(known)
            extra = max(0.0, seconds - s * rows / r)
            self._first_extra = extra if self._first_extra is None else max(self._first_extra, extra)

    @contextmanager
    def timed(self, rows: int, width: int):
        """Time the batch's work enqueued in the block, with CUDA events on the current
        stream; the time is taken once they have passed, by a later :meth:`rows`."""
        first = (rows, width) not in self._seen
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._seen.add((rows, width))
        self._pending.append((rows, width, first, start, end))

    def _collect(self) -> None:
        while self._pending and self._pending[0][4].query():
            rows, width, first, start, end = self._pending.popleft()
            self.observe(rows, width, start.elapsed_time(end) / 1e3, first)

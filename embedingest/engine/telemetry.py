"""What the engine measured: one record per batch and the run's summary.

Host times are ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux, so comparable across
the producer and the consumer processes). GPU times come from CUDA events and are put
on the same clock through one reference event recorded on an idle device at start.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class BatchRecord:
    seq: int
    slot: int
    nbytes: int
    submit_t: float  # host: submit() called
    slot_t: float  # host: a free slot was obtained (submit_t..slot_t = back-pressure wait)
    ready_t: float = 0.0  # host: copy finished (event observed by the monitor)
    dispatch_t: float = 0.0  # host: handed to the consumers' queue
    sink_start_t: float = 0.0  # host, in the consumer
    sink_end_t: float = 0.0
    freed_t: float = 0.0  # host: the slot back on the free list (the answer collected)
    worker: int = -1
    # GPU spans on the host clock (CUDA only); compute_start is None when not marked.
    compute_start: float | None = None
    compute_end: float | None = None
    copy_start: float | None = None
    copy_end: float | None = None

    @property
    def copy_seconds(self) -> float:
        if self.copy_start is not None and self.copy_end is not None:
            return max(self.copy_end - self.copy_start, 0.0)
        return max(self.ready_t - self.slot_t, 0.0)


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass
class EngineStats:
    """Summary of one engine run (``engine.stats`` after the ``with`` block)."""

    device: str
    batches: int = 0
    bytes: int = 0
    wall_seconds: float = 0.0
    batches_per_second: float = 0.0
    bytes_per_second: float = 0.0
    copy_gbps: float = 0.0  # bytes over the summed device-to-host (or host) copy time
    producer_blocked_seconds: float = 0.0  # submit() waiting for a free slot
    gpu_idle_fraction: float | None = None  # no kernel running, from NVML samples (CUDA only)
    gpu_idle_source: str | None = None  # "nvml", or "cuda-events" where NVML cannot be read
    compute_gap_fraction: float | None = None  # compute stream idle between batches (CUDA events)
    pinned: bool = False
    num_slots: int = 0
    num_consumers: int = 0
    slot_bytes: int = 0
    sink_seconds: dict[int, float] = field(default_factory=dict)  # busy time per worker
    close_seconds: dict[int, float] = field(default_factory=dict)  # each worker's sink.close()
    batches_per_worker: dict[int, int] = field(default_factory=dict)
    records: list[BatchRecord] = field(default_factory=list, repr=False)
    spans: list[tuple[str, float, float]] = field(default_factory=list, repr=False)  # engine.span()

    @classmethod
    def from_records(cls, records: list[BatchRecord], *, device: str, wall: float,
                     pinned: bool, num_slots: int, num_consumers: int, slot_bytes: int) -> EngineStats:
        st = cls(device=device, pinned=pinned, num_slots=num_slots,
                 num_consumers=num_consumers, slot_bytes=slot_bytes, records=records)
        st.batches = len(records)
        st.bytes = sum(r.nbytes for r in records)
        st.wall_seconds = wall
        if wall > 0:
            st.batches_per_second = st.batches / wall
            st.bytes_per_second = st.bytes / wall
        copy_time = sum(r.copy_seconds for r in records)
        st.copy_gbps = st.bytes / copy_time / 1e9 if copy_time > 0 else 0.0
        st.producer_blocked_seconds = sum(max(r.slot_t - r.submit_t, 0.0) for r in records)
        for r in records:
            if r.worker >= 0:
                st.sink_seconds[r.worker] = st.sink_seconds.get(r.worker, 0.0) + (r.sink_end_t - r.sink_start_t)
                st.batches_per_worker[r.worker] = st.batches_per_worker.get(r.worker, 0) + 1
        st.compute_gap_fraction = _idle_fraction(records)
        return st

    def summary(self) -> dict:
        """A JSON-ready dict without the per-batch records."""
        d = asdict(self)
        d.pop("records")
        d.pop("spans")
        d["sink_seconds"] = {str(k): round(v, 4) for k, v in self.sink_seconds.items()}
        d["close_seconds"] = {str(k): round(v, 4) for k, v in self.close_seconds.items()}
        d["batches_per_worker"] = {str(k): v for k, v in self.batches_per_worker.items()}
        return d


def _idle_fraction(records: list[BatchRecord]) -> float | None:
    """Share of the compute span with no marked compute running.

    Each batch's compute runs from its start marker (or, unmarked, the previous batch's
    end) to the event recorded at submit; on a GPU that is kept busy these spans abut.
    """
    spans, prev_end = [], None
    for r in sorted(records, key=lambda r: r.seq):
        if r.compute_end is None:
            return None
        start = r.compute_start if r.compute_start is not None else prev_end
        if start is not None:
            spans.append((start, r.compute_end))
        prev_end = r.compute_end
    if not spans:
        return None
    first = min(a for a, _ in spans)
    last = max(b for _, b in spans)
    if last <= first:
        return None
    return max(0.0, 1.0 - _union_length(spans) / (last - first))

"""The engine's records as a Chrome trace (the JSON that Perfetto and chrome://tracing open).

One process per engine (one per device of a multi-device run), with a track each for
compute, the stages' own spans (e.g. host-to-device), the device-to-host copy and every
consumer; a hand-off (copy done until a consumer takes the slot) is an async slice, since
those of consecutive batches overlap. Flow arrows tie each batch's compute, copy and
consumer work together. A job's phases (loading the model, planning, encoding, ...) go
on a track of their own, nested under the whole run. Times are the engine's host clock
(``time.perf_counter``), the same in every process of the host, in microseconds from the
first event.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..outfiles import atomic_write_bytes
from .telemetry import BatchRecord

PHASES_TID, COMPUTE_TID, COPY_TID, HANDOFF_TID, SPAN_TID0, CONSUMER_TID0 = 0, 1, 2, 3, 10, 100


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _span(a: float, b: float, t0: float) -> dict:
    """``ts`` and ``dur`` (µs) of the interval a..b, so that events that abut still abut
    after rounding (a phase ends exactly where the next begins)."""
    ts = _us(a, t0)
    return {"ts": ts, "dur": round(_us(b, t0) - ts, 3)}


def _meta(pid: int, tid: int | None, kind: str, name: str, sort: int | None = None) -> list[dict]:
    out = [{"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}]
    if tid is not None:
        out[0]["tid"] = tid
        if sort is not None:
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                        "args": {"sort_index": sort}})
    return out


def engine_events(records: Iterable[BatchRecord], spans: Iterable[tuple[str, float, float]] = (), *,
                  pid: int = 1, name: str = "engine", t0: float = 0.0) -> list[dict]:
    """Trace events of one engine run (records and stage spans on the host clock)."""
    events = _meta(pid, None, "process_name", name)
    events += _meta(pid, COMPUTE_TID, "thread_name", "compute", COMPUTE_TID)
    events += _meta(pid, COPY_TID, "thread_name", "d2h copy", COPY_TID)
    events += _meta(pid, HANDOFF_TID, "thread_name", "hand-off", HANDOFF_TID)
    lanes: dict[str, int] = {}
    for lane, a, b in spans:
        if lane not in lanes:
            lanes[lane] = SPAN_TID0 + len(lanes)
            events += _meta(pid, lanes[lane], "thread_name", lane, lanes[lane])
        events.append({"ph": "X", "pid": pid, "tid": lanes[lane], "name": lane, "cat": "stage",
                       **_span(a, b, t0)})
    workers = set()
    for r in sorted(records, key=lambda r: r.seq):
        args = {"batch": r.seq, "slot": r.slot, "bytes": r.nbytes}
        flow = []
        if r.compute_end is not None:
            start = r.compute_start if r.compute_start is not None else r.compute_end
            events.append({"ph": "X", "pid": pid, "tid": COMPUTE_TID, "name": f"compute {r.seq}",
                           "cat": "compute", **_span(start, r.compute_end, t0), "args": args})
            flow.append((COMPUTE_TID, start))
        copy_start = r.copy_start if r.copy_start is not None else r.slot_t
        copy_end = r.copy_end if r.copy_end is not None else r.ready_t
        events.append({"ph": "X", "pid": pid, "tid": COPY_TID, "name": f"copy {r.seq}", "cat": "copy",
                       **_span(copy_start, copy_end, t0), "args": args})
        flow.append((COPY_TID, copy_start))
        if r.sink_start_t:
            for ph, t in (("b", copy_end), ("e", r.sink_start_t)):
                events.append({"ph": ph, "pid": pid, "tid": HANDOFF_TID, "name": "hand-off",
                               "cat": "hand-off", "id": f"{pid}-{r.seq}", "ts": _us(t, t0),
                               "args": args if ph == "b" else {}})
            tid = CONSUMER_TID0 + r.worker
            workers.add(r.worker)
            back = {"slot_back_ts": _us(r.freed_t, t0)} if r.freed_t else {}
            events.append({"ph": "X", "pid": pid, "tid": tid, "name": f"sink {r.seq}", "cat": "consumer",
                           **_span(r.sink_start_t, r.sink_end_t, t0),
                           "args": args | {"worker": r.worker} | back})
            flow.append((tid, r.sink_start_t))
        for i, (tid, t) in enumerate(flow):
            ph = "s" if i == 0 else ("f" if i == len(flow) - 1 else "t")
            events.append({"ph": ph, "pid": pid, "tid": tid, "name": "batch", "cat": "batch",
                           "id": pid * 10**9 + r.seq, "ts": _us(t, t0), "bp": "e"})
    for w in sorted(workers):
        events += _meta(pid, CONSUMER_TID0 + w, "thread_name", f"consumer {w}", CONSUMER_TID0 + w)
    return events


def write_trace(path: str | Path, engines: Sequence[tuple[str, object]], *,
                phases: Sequence[tuple[str, float, float]] = (), title: str = "embedingest") -> Path:
    """Write a Chrome trace of ``engines`` (``(name, stats)`` pairs; stats have ``records``
    and ``spans``, as :class:`~embedingest.engine.telemetry.EngineStats`) and the job's
    ``phases`` (``(name, start, end)`` on the same clock; the first is the whole run,
    the others nest in it) to ``path``, atomically."""
    starts = [a for _, a, _ in phases]
    for _, stats in engines:
        starts += [r.slot_t for r in stats.records] + [r.compute_start or r.compute_end for r in stats.records
                                                       if r.compute_end is not None]
        starts += [a for _, a, _ in stats.spans]
    t0 = min(starts, default=0.0)
    events = []
    if phases:
        events += _meta(0, None, "process_name", title)
        events += _meta(0, PHASES_TID, "thread_name", "phases", PHASES_TID)
        for phase, a, b in phases:
            events.append({"ph": "X", "pid": 0, "tid": PHASES_TID, "name": phase, "cat": "phase",
                           **_span(a, b, t0)})
    for i, (name, stats) in enumerate(engines, 1):
        events += engine_events(stats.records, stats.spans, pid=i, name=f"engine {name}", t0=t0)
    data = json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"title": title}}, separators=(",", ":"))
    path = Path(path)
    atomic_write_bytes(path, data.encode("utf-8"))
    return path


def phase_spans(run: str, t_start: float, phases: dict[str, float]) -> list[tuple[str, float, float]]:
    """``(name, start, end)`` of a job's consecutive phases given as seconds (``{"plan_s":
    1.2, ...}``, in order) from ``t_start``, after one for the whole ``run``."""
    spans, t = [], t_start
    for key, seconds in phases.items():
        spans.append((key.removesuffix("_s").replace("_", " "), t, t + seconds))
        t += seconds
    return [(run, t_start, t)] + spans

"""The engine's per-batch records and the run's summary, computed from records made by
hand: every figure exact."""

from __future__ import annotations

import json

import pytest

from embedingest.engine.telemetry import BatchRecord, EngineStats, _idle_fraction, _union_length


def rec(seq, **kw):
    base = dict(seq=seq, slot=seq % 2, nbytes=1000, submit_t=10.0 + seq, slot_t=10.0 + seq)
    base.update(kw)
    return BatchRecord(**base)


def stats(records, wall=4.0):
    return EngineStats.from_records(records, device="cpu", wall=wall, pinned=True, num_slots=4,
                                    num_consumers=2, slot_bytes=4096)


def test_copy_seconds_from_the_gpu_span_else_from_the_host_clock():
    assert rec(0, copy_start=1.0, copy_end=1.25, ready_t=9.0).copy_seconds == 0.25
    assert rec(0, copy_start=1.0, copy_end=0.5).copy_seconds == 0.0
    assert rec(0, copy_start=1.0, slot_t=2.0, ready_t=2.5).copy_seconds == 0.5  # half a span: the host's
    assert rec(0, slot_t=2.0, ready_t=2.5).copy_seconds == 0.5
    assert rec(0, slot_t=2.0, ready_t=1.0).copy_seconds == 0.0


@pytest.mark.parametrize("spans, length", [
    ([], 0.0),
    ([(0.0, 1.0)], 1.0),
    ([(0.0, 1.0), (2.0, 3.5)], 2.5),
    ([(2.0, 3.0), (0.0, 1.0)], 2.0),  # any order
    ([(0.0, 2.0), (1.0, 3.0)], 3.0),  # overlapping
    ([(0.0, 4.0), (1.0, 2.0), (3.0, 5.0)], 5.0),  # one inside another
    ([(0.0, 1.0), (1.0, 2.0)], 2.0),  # touching
])
def test_union_length(spans, length):
    assert _union_length(spans) == pytest.approx(length)


def test_summary_of_records():
    records = [
        rec(0, submit_t=1.0, slot_t=1.5, ready_t=2.0, sink_start_t=3.0, sink_end_t=3.25, worker=0),
        rec(1, nbytes=3000, submit_t=2.0, slot_t=1.0, ready_t=3.0, sink_start_t=4.0, sink_end_t=5.0,
            worker=1),
        rec(2, submit_t=3.0, slot_t=4.0, ready_t=4.5, sink_start_t=5.0, sink_end_t=5.5, worker=0),
        rec(3, submit_t=4.0, slot_t=4.0, ready_t=4.0),  # dropped on a stop: no worker ran it
    ]
    st = stats(records, wall=4.0)
    assert (st.batches, st.bytes, st.wall_seconds) == (4, 6000, 4.0)
    assert (st.batches_per_second, st.bytes_per_second) == (1.0, 1500.0)
    assert st.copy_gbps == 6000 / 3.0 / 1e9
    assert st.producer_blocked_seconds == 1.5  # 0.5 + 0 (slot_t before submit_t) + 1.0
    assert st.sink_seconds == {0: 0.75, 1: 1.0}
    assert st.batches_per_worker == {0: 2, 1: 1}
    assert (st.device, st.pinned, st.num_slots, st.num_consumers, st.slot_bytes) == ("cpu", True, 4, 2, 4096)
    assert st.compute_gap_fraction is None  # no CUDA events on the CPU
    assert st.records is records


def test_rates_of_a_run_shorter_than_a_second():
    st = stats([rec(0, slot_t=1.0, ready_t=1.5)], wall=0.5)
    assert (st.batches_per_second, st.bytes_per_second) == (2.0, 2000.0)
    assert st.copy_gbps == 1000 / 0.5 / 1e9


def test_no_wall_time_and_no_copy_time_give_zero_rates():
    st = stats([rec(0, slot_t=1.0, ready_t=1.0)], wall=0.0)
    assert (st.batches_per_second, st.bytes_per_second, st.copy_gbps) == (0.0, 0.0, 0.0)
    empty = stats([], wall=0.0)
    assert (empty.batches, empty.bytes, empty.sink_seconds, empty.compute_gap_fraction) == (0, 0, {}, None)


def test_summary_is_json_without_the_records():
    st = stats([rec(0, sink_start_t=1.0, sink_end_t=1.123456, worker=3)], wall=2.0)
    st.spans.append(("load", 0.0, 1.0))
    d = st.summary()
    assert "records" not in d and "spans" not in d
    assert d["sink_seconds"] == {"3": 0.1235} and d["batches_per_worker"] == {"3": 1}
    assert json.loads(json.dumps(d)) == d
    assert d["batches"] == 1 and d["device"] == "cpu"


def test_compute_gap_from_marked_and_unmarked_batches():
    # marked: 0..1 and 2..3 over 0..3: a third idle
    marked = [rec(0, compute_start=0.0, compute_end=1.0), rec(1, compute_start=2.0, compute_end=3.0)]
    assert _idle_fraction(marked) == pytest.approx(1 / 3)
    # unmarked: each batch runs from the previous one's end, so the first gives no span
    unmarked = [rec(0, compute_end=1.0), rec(1, compute_end=2.0), rec(2, compute_end=4.0)]
    assert _idle_fraction(unmarked) == 0.0
    # records out of order are taken in submission order
    assert _idle_fraction(list(reversed(marked))) == pytest.approx(1 / 3)
    # overlapping spans count once
    overlap = [rec(0, compute_start=0.0, compute_end=2.0), rec(1, compute_start=1.0, compute_end=3.0),
               rec(2, compute_start=5.0, compute_end=6.0)]
    assert _idle_fraction(overlap) == pytest.approx(2 / 6)  # busy 0..3 and 5..6


def test_compute_gap_is_unknown_without_events_or_span():
    assert _idle_fraction([]) is None
    assert _idle_fraction([rec(0, compute_start=0.0, compute_end=1.0), rec(1)]) is None
    assert _idle_fraction([rec(0, compute_end=1.0)]) is None  # one unmarked batch: no span
    assert _idle_fraction([rec(0, compute_start=1.0, compute_end=1.0)]) is None  # zero length
    assert _idle_fraction([rec(0, compute_start=2.0, compute_end=1.0)]) is None
    st = stats([rec(0, compute_start=0.0, compute_end=1.0), rec(1, compute_start=3.0, compute_end=4.0)])
    assert st.compute_gap_fraction == pytest.approx(0.5)


def test_idle_fraction_is_never_negative():
    spans = [rec(0, compute_start=0.0, compute_end=1.0), rec(1, compute_start=0.0, compute_end=1.0)]
    assert _idle_fraction(spans) == 0.0

"""The one batch loop (embedingest/runner.py) that build-index, segment and the Ray actors
run: every batch through the job's steps in one order, the same timing keys for all."""

from __future__ import annotations

import pytest
import torch
from engine_sinks import recording_sink_factory

from embedingest.runner import LOOP_KEYS, WAIT_SPAN_MIN, BatchSteps, run_batches

SPEC = {"y": ((2,), "float32")}


class Loader:
    """Like a DataLoader: each iteration is a new generator, which only the loop holds."""

    def __init__(self, items, closed: list | None = None):
        self.items, self.closed = items, closed

    def __iter__(self):
        try:
            yield from self.items
        finally:
            if self.closed is not None:
                self.closed.append(True)


def items(n: int) -> list[dict]:
    return [{"x": torch.arange(4.0) + 10 * i, "empty": i == 3,
             "skipped": [(f"file{i}", "binary: not text")] if i % 2 else []} for i in range(n)]


def two_parts(batch_no: int, item: dict, x: torch.Tensor):
    return [((batch_no, 0), {"y": x[:2] * 2}), ((batch_no, 1), {"y": x[2:] * 2})]


def test_every_batch_goes_through_the_steps_and_reaches_the_sinks():
    batches, done, skips = items(6), [], []
    timing = {"own_s": 1.5}  # a job's own key is kept
    steps = BatchSteps(send=lambda item: None if item["empty"] else item["x"].clone(), forward=two_parts,
                       skipped=lambda item: item["skipped"], done=done.append)
    engine = run_batches(recording_sink_factory, Loader(batches), steps, device="cpu", slot_spec=SPEC,
                         num_consumers=2, num_slots=3, on_skip=lambda where, why: skips.append((where, why)),
                         timing=timing)
    assert [id(d) for d in done] == [id(b) for b in batches]  # every batch, in order, empty ones too
    assert skips == [(f"file{i}", "binary: not text") for i in (1, 3, 5)]
    received = sorted(seen for result in engine.closed_results for seen in result)
    expected = sorted(((i, part), {"y": [2 * (10 * i + 2 * part + k) for k in (0, 1)]})
                      for i in range(6) if i != 3 for part in (0, 1))
    assert received == expected  # batch 3 sent nothing to the device: no forward, no parts
    assert engine.stats.summary()["batches"] == 10
    assert set(timing) == set(LOOP_KEYS) | {"own_s"} and timing["own_s"] == 1.5
    assert min(timing.values()) >= 0 and timing["first_forward_s"] > 0


def test_start_is_counted_from_started():
    timing = {}
    steps = BatchSteps(send=lambda item: item["x"], forward=two_parts, skipped=lambda item: [])
    run_batches(recording_sink_factory, Loader(items(1)), steps, device="cpu", slot_spec=SPEC,
                num_consumers=1, num_slots=2, on_skip=print, timing=timing,
                started=__import__("time").perf_counter() - 100.0)
    assert timing["start_s"] >= 100.0


def test_an_error_in_forward_is_raised_and_the_loader_closed():
    closed = []

    def forward(batch_no, item, x):
        if batch_no == 2:
            raise ValueError("batch 2 is bad")
        return two_parts(batch_no, item, x)

    steps = BatchSteps(send=lambda item: item["x"], forward=forward, skipped=lambda item: [])
    try:
        run_batches(recording_sink_factory, Loader(items(50), closed), steps, device="cpu",
                    slot_spec=SPEC, num_consumers=1, num_slots=2, on_skip=print)
    except ValueError as exc:
        assert str(exc) == "batch 2 is bad"
        assert closed == [True]  # by the loop, not by the collection of its frame
    else:
        pytest.fail("the error was not raised")


def test_a_wait_for_input_is_a_span_of_the_engine():
    """The trace shows when the loop waited for its loader: a slow batch's wait is a host
    span as long as the wait; only waits over WAIT_SPAN_MIN are kept."""
    import time

    def slow(n):
        for i, item in enumerate(items(n)):
            if i == 2:
                time.sleep(0.2)
            yield item

    steps = BatchSteps(send=lambda item: item["x"], forward=two_parts, skipped=lambda item: [])
    engine = run_batches(recording_sink_factory, slow(4), steps, device="cpu", slot_spec=SPEC,
                         num_consumers=1, num_slots=2, on_skip=print)
    waits = [b - a for lane, a, b in engine.stats.spans if lane == "loop: wait for input"]
    slow_ones = [w for w in waits if w >= 0.2]
    assert len(slow_ones) == 1 and slow_ones[0] < 1.0
    assert all(w > WAIT_SPAN_MIN for w in waits) and len(waits) <= 5  # one a next(); a loaded machine may add some

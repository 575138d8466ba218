"""The warming thread: each new key once, in order, beside the caller; a failure ends it
with one warning, never the run."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from embedingest.stages.warm_ahead import WarmAhead


def test_each_new_key_is_called_once_in_order_in_a_thread_of_its_own():
    calls, threads = [], set()
    done = threading.Event()

    def call(key):
        calls.append(key)
        threads.add(threading.get_ident())
        if key == "last":
            done.set()

    with WarmAhead(call) as warm:
        for key in ["a", "b", "a", ("c", 1), "b", "last"]:
            warm.add(key)  # before the start: they wait for it
        assert calls == []
        warm.start()
        assert done.wait(10)
    assert calls == ["a", "b", ("c", 1), "last"]
    assert warm.warmed == calls
    assert threads and threading.get_ident() not in threads


def test_close_waits_for_the_call_under_way_and_drops_the_rest():
    started, release = threading.Event(), threading.Event()
    calls = []

    def call(key):
        calls.append(key)
        started.set()
        release.wait(10)

    warm = WarmAhead(call).start()
    for key in range(5):
        warm.add(key)
    assert started.wait(10)
    closer = threading.Thread(target=warm.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close waits for the call under way"
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert calls == [0] and warm.warmed == [0]
    warm.add(99)  # after close: ignored
    assert calls == [0]


def test_a_failing_call_is_reported_once_and_ends_the_warming(caplog):
    calls = []

    def call(key):
        calls.append(key)
        if key == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    caplog.set_level(logging.WARNING, logger="embedingest")
    warm = WarmAhead(call)
    for key in range(1, 6):
        warm.add(key)
    warm.start()
    warm._thread.join(10)
    assert not warm._thread.is_alive(), "the thread ends at the failure"
    assert calls == [1, 2] and warm.warmed == [1]
    assert isinstance(warm.failure, torch.cuda.OutOfMemoryError)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "2" in warnings[0] and "OutOfMemoryError" in warnings[0] and "goes on" in warnings[0]
    warm.add(7)
    warm.close()
    assert calls == [1, 2]


def test_a_warm_ahead_never_started_closes_at_once():
    warm = WarmAhead(lambda key: pytest.fail("never called"))
    warm.add(1)
    warm.close(timeout=1)
    warm.start()  # after close: nothing starts
    assert warm._thread is None


def test_a_segmenter_warms_a_shape_on_the_cpu_without_keeping_anything():
    """``Segmenter.warm`` runs the model once at the shape (on the CPU there is nothing to
    cache; the call is what a CUDA run makes ahead)."""
    from embedingest.stages.segmentation import Segmenter, load_segmentation_model

    seg = Segmenter(load_segmentation_model("lraspp_mobilenet_v3_large", random_weights=True), "cpu")
    seen = []
    handle = seg.model.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    try:
        assert seg.warm((2, 40, 56)) is None
    finally:
        handle.remove()
    assert seen == [(2, 3, 40, 56)]

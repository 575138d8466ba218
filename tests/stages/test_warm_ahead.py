"""The warming thread: each new key once, in order, beside the caller; a key the loop
reaches first is the loop's, one under way is waited for; a failure ends the warming
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

    with WarmAhead() as warm:
        for key in ["a", "b", "a", ("c", 1), "b", "last"]:
            warm.add(key)  # before the start: they wait for it
        assert calls == []
        warm.start(call)
        assert done.wait(10)
    assert calls == ["a", "b", ("c", 1), "last"]
    assert warm.warmed == calls
    assert threads and threading.get_ident() not in threads


def test_the_loop_takes_a_key_not_reached_waits_for_one_under_way_and_passes_one_done():
    running, release = threading.Event(), threading.Event()
    calls = []

    def call(key):
        calls.append(key)
        if key == "slow":
            running.set()
            assert release.wait(10)

    warm = WarmAhead()
    for key in ["fast", "slow", "later", "last"]:
        warm.add(key)
    warm.claim("later")  # not reached yet: the loop's own, the thread skips it
    warm.start(call)
    assert running.wait(10)
    warm.claim("fast")  # done already: at once
    waiter = threading.Thread(target=warm.claim, args=("slow",))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "a key under way is waited for"
    release.set()
    waiter.join(10)
    assert not waiter.is_alive()
    warm.close()
    assert calls[:2] == ["fast", "slow"] and "later" not in calls
    assert warm.warmed[:2] == ["fast", "slow"]
    warm.add("later")  # claimed (and closed): never warmed
    assert "later" not in calls


def test_a_claim_waits_no_longer_than_its_timeout():
    release = threading.Event()
    running = threading.Event()

    def call(key):
        running.set()
        release.wait(10)

    warm = WarmAhead()
    warm.add(1)
    warm.start(call)
    assert running.wait(10)
    warm.claim(1, timeout=0.1)  # returns: the loop sets the shape up itself
    assert warm._state[1] == "claimed"
    release.set()
    warm.close()


def test_close_waits_for_the_call_under_way_and_drops_the_rest():
    started, release = threading.Event(), threading.Event()
    calls = []

    def call(key):
        calls.append(key)
        started.set()
        release.wait(10)

    warm = WarmAhead().start(call)
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
    warm = WarmAhead()
    for key in range(1, 6):
        warm.add(key)
    warm.start(call)
    warm._thread.join(10)
    assert not warm._thread.is_alive(), "the thread ends at the failure"
    assert calls == [1, 2] and warm.warmed == [1]
    assert isinstance(warm.failure, torch.cuda.OutOfMemoryError)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "2" in warnings[0] and "OutOfMemoryError" in warnings[0] and "goes on" in warnings[0]
    warm.claim(2, timeout=5)  # the failed key is the loop's, at once
    warm.claim(3, timeout=5)
    warm.add(7)
    warm.close()
    assert calls == [1, 2]


def test_a_warm_ahead_never_started_closes_at_once():
    warm = WarmAhead()
    warm.add(1)
    warm.claim(1)
    warm.close(timeout=1)
    warm.start(lambda key: pytest.fail("never called"))  # after close: nothing starts
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

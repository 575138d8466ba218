"""Which consumer gets the next batch, and what a stop does, on a group made by hand (no
processes): the choice is the least busy consumer, in turn among equals."""

from __future__ import annotations

import threading

import pytest

from embedingest.engine.consumer_group import ConsumerGroup


def group(outstanding, next_=0):
    g = ConsumerGroup.__new__(ConsumerGroup)
    g._conns = [object()] * len(outstanding)
    g._outstanding = [list(o) for o in outstanding]
    g._next = next_
    g._lock = threading.Lock()
    return g


@pytest.mark.parametrize("outstanding, next_, picked, after", [
    ([[], [], []], 0, 0, 1),
    ([[], [], []], 1, 1, 2),
    ([[], [], []], 2, 2, 0),  # wraps around
    ([[1], [], []], 0, 1, 2),  # the least busy
    ([[1], [2], []], 0, 2, 0),
    ([[], [1], []], 1, 2, 0),  # among equals, the first from _next on
    ([[1, 2], [3], [4]], 2, 2, 0),
    ([[1], [2], [3]], 1, 1, 2),
])
def test_pick(outstanding, next_, picked, after):
    g = group(outstanding, next_)
    assert g._pick() == picked
    assert g._next == after


def test_batches_spread_evenly_over_idle_consumers():
    g = group([[], [], [], []])
    order = []
    for seq in range(8):
        w = g._pick()
        g._outstanding[w].append(seq)
        order.append(w)
    assert order == [0, 1, 2, 3, 0, 1, 2, 3]


def test_a_dead_consumer_is_reported_with_its_oldest_batch():
    g = group([[7, 9], []])
    deaths = []
    g._on_death = lambda w, p, seq: deaths.append((w, p, seq))
    g._died(0, "proc0")
    g._died(1, "proc1")
    assert deaths == [(0, "proc0", 7), (1, "proc1", -1)]


def test_abort_flag():
    g = group([[]])
    g.abort = bytearray(1)
    assert not g.aborting
    g.drop_queued()
    assert g.aborting and g.abort[0] == 1


def test_a_batch_sent_to_a_consumer_that_is_gone_reports_its_death_with_that_batch():
    """The send fails (its pipe is closed: it died a moment ago): the group waits up to
    1 s for its exit status, then reports the death with the batch just given to it."""
    from embedingest.engine.messages import Task

    class Gone:
        def send(self, msg):
            raise BrokenPipeError(32, "Broken pipe")

    class Proc:
        def __init__(self):
            self.joined = []

        def join(self, timeout=None):
            self.joined.append(timeout)

    g = group([[], [4]])
    g._conns = [Gone(), Gone()]
    proc = Proc()
    g.procs = [proc, Proc()]
    deaths = []
    g._on_death = lambda w, p, seq: deaths.append((w, p, seq))
    g.dispatch(Task(5, 1, "batch-5", {"x": 4}))
    assert deaths == [(0, proc, 5)]
    assert proc.joined == [1.0]
    assert g._outstanding == [[5], [4]]

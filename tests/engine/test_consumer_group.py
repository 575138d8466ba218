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
    g._reap_lock = threading.Lock()
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
    g._on_death = lambda w, p, seq, code: deaths.append((w, p, seq, code))
    g._died(0, "proc0", -9)
    g._died(1, "proc1", 3)
    assert deaths == [(0, "proc0", 7, -9), (1, "proc1", -1, 3)]


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

    g = group([[], [4]])
    g._conns = [Gone(), Gone()]
    proc = Ending(calls_running=3, code=-9)
    g.procs = [proc, Ending()]
    deaths = []
    g._on_death = lambda w, p, seq, code: deaths.append((w, p, seq, code))
    g.dispatch(Task(5, 1, "batch-5", {"x": 4}))
    assert deaths == [(0, proc, 5, -9)]
    assert g._outstanding == [[5], [4]]


class Ending:
    """A process whose pipes closed (its sentinel reads as ready) and whose exit status
    shows only after ``calls_running`` reads, as when the kernel has not reaped it yet."""

    def __init__(self, calls_running: int = 0, code: int | None = 0, ended: bool = True):
        import os

        r, w = os.pipe()
        if ended:
            os.close(w)
        else:
            self._w = w
        self.sentinel, self.pid = r, 4242
        self._left, self._code, self.reads = calls_running, code, 0

    @property
    def exitcode(self):
        self.reads += 1
        if self._left:
            self._left -= 1
            return None
        return self._code


def test_exitcode_waits_for_the_status_of_a_consumer_whose_pipes_closed():
    """Its pipes close a moment before its status exists: the status is read again
    until it comes (a death was named "exited with code None" under load)."""
    g = group([[]])
    p = Ending(calls_running=4, code=-9)
    assert g.exitcode(p, 2.0) == -9
    assert p.reads == 5


def test_exitcode_of_a_running_consumer_is_none_after_the_timeout():
    import time

    g = group([[]])
    p = Ending(code=None, ended=False)
    t0 = time.monotonic()
    assert g.exitcode(p, 0.2) is None
    assert 0.2 <= time.monotonic() - t0 < 1.0
    assert g.exitcode(p) is None


def test_exitcode_without_a_timeout_does_not_wait():
    import time

    g = group([[]])
    p = Ending(code=None, ended=False)
    t0 = time.monotonic()
    assert g.exitcode(p) is None
    assert time.monotonic() - t0 < 0.1


class Signalled(Ending):
    def __init__(self, code):
        super().__init__(code=code, ended=code is not None)
        self.sent = []

    def terminate(self):
        self.sent.append("SIGTERM")

    def kill(self):
        self.sent.append("SIGKILL")


def test_only_a_consumer_still_running_is_signalled():
    """A reaped consumer's pid may already name another process: no signal goes to it."""
    g = group([[]])
    running, ended = Signalled(None), Signalled(0)
    for p in (running, ended):
        g._signal(p, kill=False)
        g._signal(p, kill=True)
    assert running.sent == ["SIGTERM", "SIGKILL"] and ended.sent == []

"""The consumer group on groups made by hand (no processes): which consumer gets the next
batch (the least busy, in turn among equals), what the collector makes of answers and
ends, and what a stop does when (on a clock of the test's own); then a real group of
spawned consumers."""

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


# -- the collector loop, run here on consumers made by hand ------------------------------
#
# A consumer is an ``Ending`` (its sentinel is the read end of a pipe: ready once the write
# end is closed) and one end of a real pipe whose other end the test writes answers into.


def collecting_group(outstanding, closed_ok=None, aborting=False):
    """A group of hand-made consumers whose answers and deaths are kept in lists."""
    g = group(outstanding)
    g._closed_ok = list(closed_ok) if closed_ok is not None else [False] * len(outstanding)
    g.abort = bytearray([int(aborting)])
    g.messages, g.deaths = [], []
    g._on_message = g.messages.append
    g._on_death = lambda w, p, seq, code: g.deaths.append((w, p, seq, code))
    return g


def run_collector(g, procs, conns):
    """Run the collector loop until every consumer has ended (at most 60 s, far beyond
    what it needs); an error in it fails the test."""
    g.procs, g._conns = list(procs), list(conns)
    errors = []

    def loop():
        try:
            g._collect_loop()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the collector loop did not end when its consumers did"
    assert errors == []


def pipe_with(*answers, keep_open=False):
    """Our end of a pipe; the consumer's end has sent ``answers`` (bytes: sent raw, as
    a message that cannot be unpickled), then closed unless ``keep_open``."""
    import multiprocessing

    mine, theirs = multiprocessing.Pipe(duplex=True)
    for a in answers:
        if isinstance(a, bytes):
            theirs.send_bytes(a)
        else:
            theirs.send(a)
    if keep_open:
        mine._theirs = theirs
    else:
        theirs.close()
    return mine


def waits_recorded(monkeypatch, before=None):
    """Every ``wait`` of the group, recorded (its objects, in order); ``before(objects,
    n)`` runs before the n-th real wait and may raise in its place."""
    from embedingest.engine import consumer_group

    real, calls = consumer_group.wait, []

    def wait(objects, timeout=None):
        calls.append(list(objects))
        if before is not None:
            before(list(objects), len(calls))
        return real(objects, timeout)

    monkeypatch.setattr(consumer_group, "wait", wait)
    return calls


class Clock:
    """``time`` for the group: a clock that moves only when the group sleeps or the test
    moves it."""

    def __init__(self, now=1000.0):
        self.now = now

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_answers_are_passed_on_and_a_clean_end_is_no_death():
    from embedingest.engine.messages import Closed, Done, Skipped

    g = collecting_group([[3, 4]])
    answers = [Done(0, 3, 1, 0.5, 0.75, "w0:a"), Skipped(0, 4, 0), Closed(0, ["a"])]
    proc = Ending(code=0)
    run_collector(g, [proc], [pipe_with(*answers)])
    assert g.messages == answers
    assert g._outstanding == [[]] and g._closed_ok == [True]
    assert g.deaths == []


def test_a_consumer_s_last_answers_are_read_before_its_end_is_judged(monkeypatch):
    """Its exit and its last answers are seen in the same wake-up, its exit listed first
    (``wait`` gives no order): the answers are still read first, so a consumer that
    finished its batch and closed its sink is not taken for dead."""
    from embedingest.engine import consumer_group
    from embedingest.engine.messages import Closed, Done

    real = consumer_group.wait
    monkeypatch.setattr(consumer_group, "wait", lambda objects, timeout=None: sorted(
        real(objects, timeout), key=lambda obj: not isinstance(obj, int)))  # sentinels first
    g = collecting_group([[3]])
    answers = [Done(0, 3, 0, 0.5, 0.75, "w0:a"), Closed(0, ["a"])]
    run_collector(g, [Ending(code=0)], [pipe_with(*answers)])
    assert g.messages == answers and g.deaths == [] and g._outstanding == [[]]


def test_a_consumer_that_dies_is_reported_once_with_its_status_and_oldest_batch():
    """Killed holding batches 5 and 6, its status readable only after a few reads (the
    kernel reaps it a moment after its pipes close): one death, with -9 and batch 5; the
    other consumer ends cleanly."""
    from embedingest.engine.messages import Closed

    g = collecting_group([[5, 6], []])
    killed, fine = Ending(calls_running=3, code=-9), Ending(code=0)
    run_collector(g, [killed, fine], [pipe_with(), pipe_with(Closed(1, None))])
    assert g.deaths == [(0, killed, 5, -9)]
    assert g.messages == [Closed(1, None)]



def test_a_consumer_whose_status_never_shows_is_reported_after_two_seconds(monkeypatch):
    """Its pipes closed but its exit status never comes: the collector waits 2 s for it (on
    the test's clock), then reports the death with no status rather than hang."""
    from embedingest.engine import consumer_group

    clock = Clock(1000.0)
    monkeypatch.setattr(consumer_group, "time", clock)
    g = collecting_group([[5]])
    never = Ending(calls_running=10**9, code=-9)
    run_collector(g, [never], [pipe_with()])
    assert g.deaths == [(0, never, 5, None)]
    assert 1002.0 <= clock.now < 1002.01

@pytest.mark.parametrize("outstanding, aborting, closed, death", [
    ([5], False, True, 5),  # stopped by someone else's SIGTERM: its sink closed, batch 5 not run
    ([5], True, True, None),  # the run is aborting: batches handed back unrun are no loss
    ([], False, True, None),  # a clean end
    ([], True, False, -1),  # idle, but its sink never closed (its shard never committed)
    ([5], True, False, 5),
])
def test_which_ends_are_deaths(outstanding, aborting, closed, death):
    from embedingest.engine.messages import Closed

    g = collecting_group([list(outstanding)], aborting=aborting)
    proc = Ending(code=-15 if outstanding else 0)
    run_collector(g, [proc], [pipe_with(*([Closed(0, None)] if closed else []))])
    assert g.deaths == ([] if death is None else [(0, proc, death, proc._code)])


def test_a_failing_wait_is_not_the_end_of_the_collector(monkeypatch):
    """``wait`` raising OSError (a pipe closed under it) is taken as nothing ready: the
    collector goes on and still reads the answers and sees the end."""
    from embedingest.engine.messages import Closed

    def fail_first(objects, n):
        if n == 1:
            raise OSError(9, "Bad file descriptor")

    calls = waits_recorded(monkeypatch, fail_first)
    g = collecting_group([[]])
    run_collector(g, [Ending(code=0)], [pipe_with(Closed(0, None))])
    assert g.messages == [Closed(0, None)] and g.deaths == []
    assert len(calls) >= 2


def test_a_pipe_at_its_end_is_no_longer_watched(monkeypatch):
    """The consumer's end of the pipe closed while its process still runs (its interpreter
    shutting down): the pipe is dropped, not read again and again until the process ends."""
    from embedingest.engine.messages import Closed, Done

    proc = Ending(code=0, ended=False)
    conn = pipe_with(Done(0, 3, 0, 0.5, 0.75, "r"), Closed(0, None))
    ended = []

    def end_when_unwatched(objects, n):
        if not ended and (conn not in objects or n > 50):
            import os

            os.close(proc._w)  # the process ends once its pipe is dropped
            ended.append(n)

    calls = waits_recorded(monkeypatch, end_when_unwatched)
    g = collecting_group([[3]])
    run_collector(g, [proc], [conn])
    assert calls == [[conn, proc.sentinel], [proc.sentinel], [proc.sentinel]]  # the last: exitcode's
    assert g.messages == [Done(0, 3, 0, 0.5, 0.75, "r"), Closed(0, None)] and g.deaths == []


def test_after_an_answer_that_cannot_be_read_that_consumer_is_heard_no_more(monkeypatch):
    """An answer that does not unpickle is reported as an error naming the consumer; its
    pipe is dropped (what follows on it is not read), and its end is then a death with the
    batch it still held."""
    from embedingest.engine.messages import Done
    from embedingest.errors import EngineError

    proc = Ending(code=0, ended=False)
    conn = pipe_with(b"not a pickle", Done(0, 3, 0, 0.5, 0.75, "r"), keep_open=True)
    ended = []

    def end_when_unwatched(objects, n):
        if not ended and (conn not in objects or n > 50):
            import os

            os.close(proc._w)
            ended.append(n)

    calls = waits_recorded(monkeypatch, end_when_unwatched)
    g = collecting_group([[3]])
    run_collector(g, [proc], [conn])
    (err,) = g.messages
    assert isinstance(err, EngineError)
    assert str(err).startswith("cannot read the answer of consumer 0: UnpicklingError(")
    assert calls == [[conn, proc.sentinel], [proc.sentinel], [proc.sentinel]]
    assert g.deaths == [(0, proc, 3, 0)]


# -- stop: its schedule, on a clock of its own -----------------------------------------


class Stubborn:
    """A consumer that exits at ``ends_at`` on the test's clock; after SIGTERM, within
    ``term`` seconds (None: it ignores SIGTERM); at once after SIGKILL."""

    def __init__(self, name, clock, ends_at=float("inf"), term=None, code=0):
        self.name, self.clock, self.ends_at, self.term, self._code = name, clock, ends_at, term, code
        self.pid, self.sent = 4242, []

    @property
    def exitcode(self):
        return self._code if self.ends_at <= self.clock.now else None

    def terminate(self):
        self.sent.append("SIGTERM")
        if self.term is not None:
            self.ends_at, self._code = min(self.ends_at, self.clock.now + self.term), -15

    def kill(self):
        self.sent.append("SIGKILL")
        self.ends_at, self._code = min(self.ends_at, self.clock.now), -9


def scheduled_group(monkeypatch, procs, clock):
    """A group of ``Stubborn`` consumers whose waits (``exitcode``) are recorded and take
    the test clock's time; the collector thread a stub that records its join."""
    from embedingest.engine import consumer_group

    monkeypatch.setattr(consumer_group, "time", clock)
    g = group([[]] * len(procs))
    g.procs, g.waits, g.sent, g.joins = list(procs), [], [], []

    class Pipe:
        def __init__(self, gone):
            self.gone = gone

        def send(self, msg):
            if self.gone:
                raise BrokenPipeError(32, "Broken pipe")
            g.sent.append(msg)

    g._conns = [Pipe(gone=p.ends_at <= clock.now) for p in procs]

    def exitcode(p, timeout=0.0):
        g.waits.append((p.name, timeout))
        assert len(g.waits) < 50, "waiting for ever"
        clock.now = max(clock.now, min(p.ends_at, clock.now + timeout))
        return p.exitcode

    g.exitcode = exitcode
    g._collector = type("Joined", (), {"join": lambda self, timeout=None: g.joins.append(timeout)})()
    return g


def test_stop_gives_the_timeout_then_sigterm_then_sigkill_two_seconds_later(monkeypatch):
    """``stop(0.5)`` of a run stopped early: every consumer is told to finish; together they
    get 0.5 s (one deadline, not 0.5 s each), then SIGTERM goes to those still running, and
    2 s later SIGKILL, with 1 s more to reap; the collector gets 5 s to see it all.
    A consumer already gone (its pipe broken) is no error and gets no signal."""
    clock = Clock(1000.0)
    gone = Stubborn("gone", clock, ends_at=999.0)
    quick = Stubborn("quick", clock, ends_at=1000.25)  # ends within the timeout
    termed = Stubborn("termed", clock, term=1.5)  # ends 1.5 s after SIGTERM
    deaf = Stubborn("deaf", clock)  # ignores SIGTERM
    g = scheduled_group(monkeypatch, [gone, quick, termed, deaf], clock)
    g.stop(0.5)
    assert g.sent == [None, None, None]
    assert g.waits == [("gone", 0.5), ("quick", 0.5), ("termed", 0.25), ("deaf", 0.0),
                       ("gone", 2.0), ("quick", 2.0), ("termed", 2.0), ("deaf", 0.5), ("deaf", 1.0)]
    assert [p.sent for p in (gone, quick, termed, deaf)] == [[], [], ["SIGTERM"], ["SIGTERM", "SIGKILL"]]
    assert [p.exitcode for p in (gone, quick, termed, deaf)] == [0, 0, -15, -9]
    assert g.joins == [5.0]
    assert clock.now == 1002.5  # SIGKILL ends it at once


def test_a_finished_run_waits_for_every_close_then_stops_on_the_deadline(monkeypatch):
    """``finished=True``: each consumer gets as long as its close takes (here 70 s; the
    wait is made in 30-s steps); the timeout only follows that, all being gone by then."""
    clock = Clock(1000.0)
    slow = Stubborn("slow", clock, ends_at=1070.0)
    quick = Stubborn("quick", clock, ends_at=1001.0)
    g = scheduled_group(monkeypatch, [slow, quick], clock)
    g.stop(0.5, finished=True)
    assert g.waits == [("slow", 30.0), ("slow", 30.0), ("slow", 30.0), ("quick", 30.0),
                       ("slow", 0.5), ("quick", 0.5), ("slow", 2.0), ("quick", 2.0)]
    assert slow.sent == quick.sent == [] and g.joins == [5.0]


def test_a_group_whose_collector_never_started_stops_without_it(monkeypatch):
    """A consumer could not start: those started before it are stopped, and there is no
    collector thread to wait for."""
    clock = Clock(1000.0)
    p = Stubborn("started", clock, term=0.0)
    g = scheduled_group(monkeypatch, [p], clock)
    g._collector = None
    g.stop(5.0)
    assert p.sent == ["SIGTERM"] and p.exitcode == -15


# -- a real group: spawned consumers -------------------------------------------------------


def test_spawned_consumers_take_batches_in_turn_from_consumer_0_and_close_at_the_end():
    """Consumers are fresh interpreters (spawned: a forked one would inherit the producer's
    CUDA context and threads); the first batch goes to consumer 0, the next to consumer 1;
    at a normal stop each closes its sink and exits with 0, and no death is reported."""
    import queue

    import numpy as np
    from engine_sinks import ListSinkFactory

    from embedingest.engine.layout import SlotLayout
    from embedingest.engine.messages import Closed, Done, Ready, Task
    from embedingest.engine.pool import HostPool

    answers, deaths = queue.Queue(), []
    pool = HostPool(SlotLayout.from_spec({"x": ((4,), np.float32)}), 2)
    g = ConsumerGroup(ListSinkFactory(), 2, pool.handle(), answers.put,
                      lambda *death: deaths.append(death))
    try:
        ready = sorted(answers.get(timeout=120) for _ in range(2))
        assert ready == [Ready(0, g.procs[0].pid), Ready(1, g.procs[1].pid)]
        for p in g.procs:
            with open(f"/proc/{p.pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            assert any(a.startswith(b"from multiprocessing.spawn import spawn_main") for a in argv), argv
        g.dispatch(Task(0, 0, "a", {"x": 1}))
        g.dispatch(Task(1, 1, "b", {"x": 2}))
        g.stop(60.0, finished=True)
        said = [answers.get(timeout=10) for _ in range(4)]
        assert sorted((m.seq, m.worker, m.result) for m in said if isinstance(m, Done)) == [
            (0, 0, "w0:a"), (1, 1, "w1:b")]
        assert sorted(m[:2] for m in said if isinstance(m, Closed)) == [(0, ["a"]), (1, ["b"])]
        assert [p.exitcode for p in g.procs] == [0, 0]
        assert deaths == [] and g._outstanding == [[], []] and g._closed_ok == [True, True]
    finally:
        g.stop(1.0)
        g.close()
        pool.close()

"""A loader worker's thread hook: a broken hand-over in multiprocessing's resource sharer
(the run is stopping) prints nothing; any other thread error is reported as usual."""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import threading

import pytest

from embedingest.engine.consumers import quiet_resource_sharer

SERVE = "def serve(exc):\n    raise exc\n"


def run_in_thread(filename: str, exc: BaseException, capsys) -> str:
    scope: dict = {}
    exec(compile(SERVE, filename, "exec"), scope)  # frames that look like the sharer's own
    previous, threading.excepthook = threading.excepthook, quiet_resource_sharer
    try:
        thread = threading.Thread(target=scope["serve"], args=(exc,))
        thread.start()
        thread.join()
    finally:
        threading.excepthook = previous
    return capsys.readouterr().err


@pytest.mark.parametrize("exc", [ConnectionResetError(104, "reset"), BrokenPipeError(), EOFError(),
                                 multiprocessing.AuthenticationError("digest received was wrong")])
def test_a_broken_hand_over_in_the_resource_sharer_prints_nothing(capsys, exc):
    assert run_in_thread("/usr/lib/python3/multiprocessing/resource_sharer.py", exc, capsys) == ""


@pytest.mark.parametrize("filename,exc", [
    ("/usr/lib/python3/multiprocessing/resource_sharer.py", ValueError("a real bug")),
    ("/work/embedingest/sources/text.py", ConnectionResetError(104, "reset")),
])
def test_other_thread_errors_are_reported(capsys, filename, exc):
    err = run_in_thread(filename, exc, capsys)
    assert "Traceback" in err and type(exc).__name__ in err


BROKEN_HANDSHAKE = """
import os, socket, sys, time
from multiprocessing import resource_sharer
from embedingest.engine.consumers import quiet_resource_sharer_sys
if sys.argv[1] == "quiet":
    sys.excepthook = quiet_resource_sharer_sys
r, w = os.pipe()
resource_sharer.DupFd(r)  # starts the sharer's listener and its thread
address = resource_sharer._resource_sharer._address
s = socket.socket(socket.AF_UNIX)
s.connect(address)
s.close()  # the handshake broken off, as when the other process exits on Ctrl-C
time.sleep(1)
print("done")
"""


@pytest.mark.parametrize("hook", ["quiet", "python"])
def test_the_real_sharer_s_broken_handshake_prints_nothing(hook):
    """The resource sharer's thread catches its loop's errors and calls sys.excepthook
    itself, so a threading.excepthook never sees them: a Ctrl-C during a hand-over put its
    EOFError traceback under the run's "interrupted" line (a fault test saw it)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", BROKEN_HANDSHAKE, hook], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout == "done\n", run.stderr
    if hook == "quiet":
        assert run.stderr == ""
    else:  # the test provokes what it says: Python prints it
        assert "Traceback" in run.stderr and "resource_sharer.py" in run.stderr  # EOF or broken pipe


def test_consumers_ignore_ctrl_c_from_the_start_of_their_start_up():
    """A Ctrl-C in the terminal reaches every process of the group. A consumer still
    importing (its arguments are unpickled before its code runs) died of it with a
    KeyboardInterrupt traceback under the run's 'interrupted' line; it must already
    ignore SIGINT then or hold it (blocked, until it ignores it), and the producer's own
    handler must be back afterwards."""
    import signal

    from engine_sinks import StartupSignalSinkFactory

    from embedingest.engine import EgressEngine

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with EgressEngine(StartupSignalSinkFactory(), num_consumers=2, device="cpu",
                      slot_spec={"x": ((4,), "float32")}) as engine:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == set()  # nothing left blocked
    assert engine.closed_results == ["ignored", "ignored"]


def test_a_dead_consumer_is_named_with_its_signal():
    """The group gives the exit status it waited for (``ConsumerGroup.exitcode``; under
    load a death was once named "exited with code None" instead of "was killed by
    SIGKILL")."""
    import threading

    from embedingest.engine.egress import EgressEngine

    class Dead:
        pid = 4242

    failures = []
    stub = type("Stub", (), {})()
    stub._lock, stub._inflight, stub._ready = threading.Condition(), {7: ("a.png",)}, {0}
    stub._fail = failures.append
    EgressEngine._consumer_died(stub, 0, Dead(), 7, -9)
    assert str(failures[0]).startswith("consumer 0 (pid 4242) was killed by SIGKILL while holding "
                                       "batch ('a.png',) (seq 7); the run was stopped")


# -- consumer_main, run in this process (the messages it sends, exactly) ---------------

def run_consumer(factory, tasks, abort=False, end_with_sentinel=True, recv_fails_after=None,
                 deaf=False, timed=False):
    """Run ``consumer_main`` here on a pool of two slots: ``tasks`` as (seq, slot,
    batch_id, values of "x") are written into the slots and queued on its pipe before it
    starts. Returns every message it sent, in order; unless ``timed``, a ``Closed``'s
    times are checked (in order, or no end when the close failed) and given as zeros.
    Its signal dispositions and parent death signal are put back afterwards (it sets
    them for a process of its own)."""
    import ctypes
    import os
    import signal

    import numpy as np

    from embedingest.engine import consumers
    from embedingest.engine.layout import SlotLayout
    from embedingest.engine.messages import Task
    from embedingest.engine.pool import HostPool, PoolHandle

    pool = HostPool(SlotLayout.from_spec({"x": ((4,), np.float32), "n": ((4,), np.int64)}), 2)
    tasks_in, tasks_out = multiprocessing.Pipe(duplex=False)
    said_in, said_out = multiprocessing.Pipe(duplex=False)
    mine, theirs = _Ends(said_in, tasks_out), _Ends(tasks_in, said_out, recv_fails_after)
    flag = multiprocessing.RawArray("b", 1)
    flag[0] = int(abort)
    for seq, slot, batch_id, values in tasks:
        pool.views(slot)["x"][:len(values)] = values
        pool.views(slot)["n"][:len(values)] = np.arange(len(values)) + 10 * seq
        mine.send(Task(seq, slot, batch_id, {"x": len(values), "n": len(values)}))
    if end_with_sentinel:
        mine.send(None)
    else:
        tasks_out.close()  # the producer's end: gone
    if deaf:  # nobody reads what it says: every send fails (BrokenPipeError)
        said_in.close()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        consumers.consumer_main(3, factory, PoolHandle(os.dup(pool.fd), pool.layout, 2), theirs, flag,
                                os.getppid())
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        ctypes.CDLL(None).prctl(1, 0)  # PR_SET_PDEATHSIG: none, as before
        pool.close()
    out = []
    with contextlib.suppress(EOFError, OSError):  # its end is closed once all is said
        while True:
            out.append(mine.recv())
    assert said_out.closed and tasks_in.closed  # it closed its ends
    return out if timed else [_untimed(m) for m in out]


def _untimed(msg):
    from embedingest.engine.messages import Closed

    if not isinstance(msg, Closed):
        return msg
    assert msg.close_end == 0.0 or 0.0 < msg.close_start <= msg.close_end, msg
    return msg._replace(close_start=0.0, close_end=0.0)


class _Ends:
    """One end of two one-way pipes, used as one duplex connection: what a side sent
    stays readable after it closed, unread tasks or not."""

    def __init__(self, recv_from, send_to, recv_fails_after=None):
        self._recv_from, self._send_to = recv_from, send_to
        self._left = recv_fails_after

    def recv(self):
        if self._left is not None:
            if self._left == 0:
                raise ValueError("a message that cannot be unpickled")
            self._left -= 1
        return self._recv_from.recv()

    def send(self, msg):
        self._send_to.send(msg)

    def close(self):
        self._send_to.close()
        self._recv_from.close()



def test_consumer_runs_each_task_on_its_slot_and_says_so():
    from engine_sinks import ListSinkFactory

    from embedingest.engine.messages import Closed, Done, Ready

    msgs = run_consumer(ListSinkFactory(), [(0, 1, "a", [1.0, 2.0, 3.0]), (1, 0, ("b", 2), [4.0])],
                        timed=True)
    import os
    assert msgs[0] == Ready(3, os.getpid())
    assert (msgs[0].worker, msgs[0].pid) == (3, os.getpid())  # the engine reads them by name
    assert [type(m) for m in msgs] == [Ready, Done, Done, Closed]
    d0, d1 = msgs[1], msgs[2]
    assert (d0.worker, d0.seq, d0.slot, d0.result) == (3, 0, 1, "w3:a")
    assert (d1.worker, d1.seq, d1.slot, d1.result) == (3, 1, 0, "w3:('b', 2)")
    assert 0 < d0.sink_start <= d0.sink_end <= d1.sink_start <= d1.sink_end
    c = msgs[3]
    assert c == Closed(3, ["a", ("b", 2)], c.close_start, c.close_end)
    assert d1.sink_end <= c.close_start <= c.close_end  # the close is timed, after the last sink


def test_consumer_hands_slots_back_unused_when_aborting():
    from engine_sinks import ListSinkFactory

    from embedingest.engine.messages import Closed, Ready, Skipped

    msgs = run_consumer(ListSinkFactory(), [(5, 1, "a", [1.0]), (6, 0, "b", [2.0])], abort=True)
    assert msgs[1:] == [Skipped(3, 5, 1), Skipped(3, 6, 0), Closed(3, [])]
    assert isinstance(msgs[0], Ready)


def test_consumer_reports_a_failing_sink_then_still_closes():
    from engine_sinks import ListSinkFactory

    from embedingest.engine.messages import Closed, Done, Failed, Ready

    msgs = run_consumer(ListSinkFactory(bad=("b",)), [(0, 0, "a", [1.0]), (1, 1, "b", [2.0]), (2, 0, "c", [3.0])])
    assert [type(m) for m in msgs] == [Ready, Done, Failed, Closed]  # nothing after the failure
    f = msgs[2]
    assert (f.worker, f.seq, f.batch_id, f.summary) == (3, 1, "b", "ValueError: bad batch b")
    assert "raise ValueError" in f.traceback and f.payload is not None
    assert msgs[3] == Closed(3, ["a"])


def test_consumer_reports_a_failing_factory_and_a_failing_close():
    from engine_sinks import ListSinkFactory

    from embedingest.engine.messages import Closed, Failed, Ready

    msgs = run_consumer(ListSinkFactory(factory_fails=True), [(0, 0, "a", [1.0])])
    assert [type(m) for m in msgs] == [Failed, Closed]  # no Ready: the sink never existed
    assert (msgs[0].seq, msgs[0].batch_id) == (None, None)
    assert msgs[0].summary == "PermissionError: [Errno 13] cannot open the shard folder"
    assert msgs[1] == Closed(3, None)

    msgs = run_consumer(ListSinkFactory(close_fails=True), [(0, 0, "a", [1.0])])
    assert [type(m) for m in msgs] == [Ready, type(msgs[1]), Failed, Closed]
    assert (msgs[2].worker, msgs[2].seq, msgs[2].batch_id) == (3, None, "close")
    assert msgs[2].summary == "OSError: [Errno 28] No space left on device"
    assert msgs[3] == Closed(3, None)


def test_consumer_ends_when_the_producer_is_gone():
    """No sentinel: the producer's end of the pipe closed (it died). The consumer runs
    what was queued, closes its sink, and leaves without an error."""
    from engine_sinks import ListSinkFactory

    from embedingest.engine.messages import Closed, Done, Ready

    msgs = run_consumer(ListSinkFactory(), [(0, 0, "a", [1.0])], end_with_sentinel=False)
    assert [type(m) for m in msgs] == [Ready, Done, Closed] and msgs[2] == Closed(3, ["a"])


def test_consumer_sink_sees_only_the_rows_of_its_batch():
    from engine_sinks import ListSink

    seen = []

    class Probe(ListSink):
        def __call__(self, batch_id, arrays):
            seen.append({k: (v.shape, v.tolist()) for k, v in arrays.items()})
            return None

    run_consumer(ProbeFactory(Probe), [(0, 1, "a", [1.0, 2.0, 3.0]), (1, 0, "b", [9.0])])
    assert seen == [{"x": ((3,), [1.0, 2.0, 3.0]), "n": ((3,), [0, 1, 2])},
                    {"x": ((1,), [9.0]), "n": ((1,), [10])}]


class ProbeFactory:
    def __init__(self, cls):
        self.cls = cls

    def __call__(self, worker):
        return self.cls(worker)


def test_consumer_marks_each_sink_call_for_the_profiler(monkeypatch):
    """Each sink call is an NVTX range named after its batch (cut to 64 characters), of
    the "sink" kind (its colour in Nsight Systems)."""
    from engine_sinks import ListSinkFactory

    from embedingest.engine import consumers

    marks = []
    monkeypatch.setattr(consumers, "annotate", lambda name, kind: marks.append((name, kind))
                        or contextlib.nullcontext())
    long_id = "p" * 100
    run_consumer(ListSinkFactory(), [(0, 0, "a", [1.0]), (1, 1, long_id, [2.0])])
    assert marks == [("sink 'a'", "sink"), (f"sink '{long_id}"[:64], "sink")]
    assert len(marks[1][0]) == 64


def test_a_close_stopped_by_sigterm_is_reported_not_taken_as_done():
    from engine_sinks import ListSink

    from embedingest.engine import consumers
    from embedingest.engine.messages import Closed, Done, Failed, Ready

    class StoppedInClose(ListSink):
        def close(self):
            raise consumers._Stop(143)  # what the SIGTERM handler raises

    msgs = run_consumer(ProbeFactory(StoppedInClose), [(0, 0, "a", [1.0])])
    assert [type(m) for m in msgs] == [Ready, Done, Failed, Closed]
    f = msgs[2]
    assert (f.worker, f.seq, f.batch_id) == (3, None, "close")
    assert f.summary == ("EngineError: consumer 3 was stopped (SIGTERM) while closing its sink, so "
                         "what the sink had not yet written out is lost; re-run to redo it")
    assert msgs[3] == Closed(3, None)


def test_a_message_that_cannot_be_read_is_reported_with_no_batch():
    """After a batch went through, the next message fails to unpickle: the error names no
    batch (not the one before), and the sink still closes."""
    from engine_sinks import ListSinkFactory

    from embedingest.engine.messages import Closed, Done, Failed, Ready

    msgs = run_consumer(ListSinkFactory(), [(0, 0, "a", [1.0]), (1, 1, "b", [2.0])], recv_fails_after=1)
    assert [type(m) for m in msgs] == [Ready, Done, Failed, Closed]
    assert (msgs[2].seq, msgs[2].batch_id, msgs[2].summary) == (None, None, "ValueError: a message that cannot be unpickled")
    assert msgs[3] == Closed(3, ["a"])


def test_a_consumer_nobody_listens_to_still_runs_and_closes():
    """The producer's reading end is gone (it died): every answer fails to send, which is
    no error; the queued batches still go through the sink, and it closes."""
    from engine_sinks import ListSink

    made = []

    class Kept(ListSink):
        def __init__(self, worker):
            super().__init__(worker)
            made.append(self)

        def close(self):
            self.closed = True
            return super().close()

    assert run_consumer(ProbeFactory(Kept), [(0, 0, "a", [1.0]), (1, 1, "b", [2.0])], deaf=True) == []
    (sink,) = made
    assert [b for b, _ in sink.seen] == ["a", "b"] and sink.closed


def _death_signal() -> int:
    import ctypes

    value = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(value))  # PR_GET_PDEATHSIG
    return value.value


def test_consumers_ask_for_sigterm_when_their_parent_dies():
    import ctypes
    import os
    import signal

    from embedingest.engine import consumers

    try:
        consumers._parent_death_signal(signal.SIGUSR1)
        assert _death_signal() == signal.SIGUSR1
        consumers._die_with_parent(os.getppid())
        assert _death_signal() == signal.SIGTERM
        with pytest.raises(consumers._Stop) as stop:  # the parent is already another process
            consumers._die_with_parent(os.getppid() + 1)
        assert stop.value.code == 1
    finally:
        ctypes.CDLL(None).prctl(1, 0)
    assert _death_signal() == 0


def test_sigterm_becomes_a_clean_stop_with_the_shell_s_status():
    from embedingest.engine import consumers

    with pytest.raises(consumers._Stop) as stop:
        consumers._on_sigterm(15, None)
    assert stop.value.code == 143 and isinstance(stop.value, SystemExit)


def test_loader_workers_are_forked_on_linux():
    from embedingest.engine.consumers import loader_context

    assert loader_context().get_start_method() == "fork"


def test_a_loader_worker_leaves_ctrl_c_to_its_parent_and_dies_with_it(monkeypatch):
    """``exit_with_parent``, as a DataLoader worker runs it first: SIGINT ignored, the
    resource sharer's broken hand-overs quiet, SIGKILL when the parent dies; a parent
    already gone (the worker was re-parented) ends the worker at once with status 1."""
    import ctypes
    import os
    import signal

    from embedingest.engine import consumers

    exits = []
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    before = signal.getsignal(signal.SIGINT)
    try:
        consumers.exit_with_parent(os.getppid())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert threading.excepthook is consumers.quiet_resource_sharer
        assert sys.excepthook is consumers.quiet_resource_sharer_sys
        assert _death_signal() == signal.SIGKILL
        assert exits == []
        consumers.exit_with_parent(os.getppid() + 1)
        assert exits == [1]
    finally:
        signal.signal(signal.SIGINT, before)
        ctypes.CDLL(None).prctl(1, 0)


@pytest.mark.parametrize("ending, code, printed", [
    (None, 0, ""), (SystemExit(143), 143, ""), (SystemExit(None), 0, ""), (SystemExit("why"), 1, ""),
    (ValueError("escaped"), 1, "ValueError: escaped")])
def test_a_consumer_process_ends_at_once_with_its_status(monkeypatch, capsys, ending, code, printed):
    """``consumer_process`` runs ``consumer_main`` with its arguments, then ends the
    process with ``os._exit`` (no interpreter finalization to wait for at the run's end),
    with the status that ending means, an escaped error's traceback printed first."""
    from embedingest.engine import consumers

    got, exits = [], []

    def main(*args):
        got.append(args)
        if ending is not None:
            raise ending

    class Exited(Exception):
        pass

    def _exit(status):
        exits.append(status)
        raise Exited

    monkeypatch.setattr(consumers, "consumer_main", main)
    monkeypatch.setattr(consumers.os, "_exit", _exit)
    with pytest.raises(Exited):
        consumers.consumer_process(1, "factory", "handle", "conn", "abort", 42)
    assert got == [(1, "factory", "handle", "conn", "abort", 42)] and exits == [code]
    err = capsys.readouterr().err
    assert (printed in err and "Traceback" in err) if printed else err == ""


def test_a_consumer_whose_sink_has_no_close_says_so_with_no_close_times():
    """A sink without ``close`` (or none at all: its factory failed) ends with a
    ``Closed`` of no result whose times are both 0.0, as ``Closed`` says."""
    from engine_sinks import ListSinkFactory

    from embedingest.engine.messages import Closed, Done, Failed, Ready

    msgs = run_consumer(lambda worker: (lambda batch_id, arrays: f"w{worker}:{batch_id}"),
                        [(0, 0, "a", [1.0])], timed=True)
    assert [type(m) for m in msgs] == [Ready, Done, Closed]
    assert msgs[1].result == "w3:a" and msgs[2] == Closed(3, None, 0.0, 0.0)

    msgs = run_consumer(ListSinkFactory(factory_fails=True), [(0, 0, "a", [1.0])], timed=True)
    assert [type(m) for m in msgs] == [Failed, Closed] and msgs[1] == Closed(3, None, 0.0, 0.0)

    msgs = run_consumer(ListSinkFactory(close_fails=True), [(0, 0, "a", [1.0])], timed=True)
    assert [type(m) for m in msgs] == [Ready, Done, Failed, Closed]  # a close that failed:
    assert msgs[3].close_start > 0.0 and msgs[3].close_end == 0.0  # its start, no end


@pytest.mark.parametrize("broken", ["stdout", "stderr"])
def test_a_consumer_process_whose_output_cannot_be_flushed_still_ends_with_its_status(
        monkeypatch, broken):
    """A stream whose flush fails (a closed pipe, a full disk) neither keeps
    ``consumer_process`` from ``os._exit`` with its status nor the other stream from its
    flush."""
    import sys

    from embedingest.engine import consumers

    flushed, exits = [], []

    class Stream:
        def __init__(self, name):
            self.name = name

        def flush(self):
            if self.name == broken:
                raise OSError(28, "No space left on device")
            flushed.append(self.name)

    class Exited(Exception):
        pass

    def _exit(status):
        exits.append(status)
        raise Exited

    def main(*args):
        raise SystemExit(143)

    monkeypatch.setattr(consumers, "consumer_main", main)
    monkeypatch.setattr(consumers.os, "_exit", _exit)
    monkeypatch.setattr(sys, "stdout", Stream("stdout"))
    monkeypatch.setattr(sys, "stderr", Stream("stderr"))
    with pytest.raises(Exited):
        consumers.consumer_process(1, "factory", "handle", "conn", "abort", 42)
    assert exits == [143] and flushed == [{"stdout": "stderr", "stderr": "stdout"}[broken]]

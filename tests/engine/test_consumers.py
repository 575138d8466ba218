"""A loader worker's thread hook: a broken hand-over in multiprocessing's resource sharer
(the run is stopping) prints nothing; any other thread error is reported as usual."""

from __future__ import annotations

import multiprocessing
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


def test_consumers_ignore_ctrl_c_from_the_start_of_their_start_up():
    """A Ctrl-C in the terminal reaches every process of the group. A consumer still
    importing (its arguments are unpickled before its code runs) died of it with a
    KeyboardInterrupt traceback under the run's 'interrupted' line; it must already
    ignore SIGINT then, and the producer's own handler must be back afterwards."""
    import signal

    from engine_sinks import StartupSignalSinkFactory

    from embedingest.engine import EgressEngine

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with EgressEngine(StartupSignalSinkFactory(), num_consumers=2, device="cpu",
                      slot_spec={"x": ((4,), "float32")}) as engine:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == set()  # nothing left blocked
    assert engine.closed_results == ["ignored", "ignored"]


def test_a_dead_consumer_is_named_with_its_signal_even_before_it_is_reaped():
    """The collector sees a consumer's pipe close a moment before its exit status exists;
    the message said "exited with code None" under load instead of "was killed by
    SIGKILL" (the fault test of a SIGKILLed consumer caught it once)."""
    import threading

    from embedingest.engine.egress import EgressEngine

    class Dying:  # a killed process not reaped yet: the status comes with join
        pid, exitcode = 4242, None

        def join(self, timeout=None):
            self.exitcode = -9

    failures = []
    stub = type("Stub", (), {})()
    stub._lock, stub._inflight, stub._ready = threading.Condition(), {7: ("a.png",)}, {0}
    stub._fail = failures.append
    EgressEngine._consumer_died(stub, 0, Dying(), 7)
    assert str(failures[0]).startswith("consumer 0 (pid 4242) was killed by SIGKILL while holding "
                                       "batch ('a.png',) (seq 7); the run was stopped")

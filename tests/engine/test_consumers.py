"""A loader worker's thread hook: a broken hand-over in multiprocessing's resource sharer
(the run is stopping) prints nothing; any other thread error is reported as usual."""

from __future__ import annotations

import threading

import pytest

from embedingest.engine.consumers import _quiet_resource_sharer

SERVE = "def serve(exc):\n    raise exc\n"


def run_in_thread(filename: str, exc: BaseException, capsys) -> str:
    scope: dict = {}
    exec(compile(SERVE, filename, "exec"), scope)  # frames that look like the sharer's own
    previous, threading.excepthook = threading.excepthook, _quiet_resource_sharer
    try:
        thread = threading.Thread(target=scope["serve"], args=(exc,))
        thread.start()
        thread.join()
    finally:
        threading.excepthook = previous
    return capsys.readouterr().err


@pytest.mark.parametrize("exc", [ConnectionResetError(104, "reset"), BrokenPipeError(), EOFError()])
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

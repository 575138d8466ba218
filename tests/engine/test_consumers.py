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

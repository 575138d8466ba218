"""A Ctrl-C (SIGINT) or a stop (SIGTERM) that lands while a finalizer runs is swallowed by
Python; embedingest.interrupts delivers it again, in the CLI's job run and in a process
that installs the hook."""

from __future__ import annotations

import subprocess
import sys

import pytest

from embedingest.exit_codes import EXIT_INTERRUPTED

FINALIZED = """
class Finalized:
    def __del__(self):
        import os, signal, time
        os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C arrives while the finalizer runs
        time.sleep(0.2)
"""

HOOK = FINALIZED + """
import signal, sys, time
from embedingest.interrupts import redeliver_swallowed_interrupts
if sys.argv[1] == "hook":
    sys.unraisablehook = redeliver_swallowed_interrupts(signal.SIGINT)
try:
    Finalized()
    time.sleep(5)
    sys.exit(4)  # the Ctrl-C was lost
except KeyboardInterrupt:
    sys.exit(3)
"""


@pytest.mark.parametrize("hook", ["hook", "none"])
def test_a_ctrl_c_swallowed_in_a_finalizer_is_delivered_again(hook):
    run = subprocess.run([sys.executable, "-c", HOOK, hook], capture_output=True, text=True, timeout=60)
    if hook == "hook":
        assert run.returncode == 3, run.stderr
        assert "Exception ignored" not in run.stderr and "Traceback" not in run.stderr, run.stderr
    else:
        assert run.returncode == 4 and "Exception ignored" in run.stderr, run.stderr


JOB = FINALIZED + """
import sys, time
from embedingest.cli.common import run_job

def call(module):
    Finalized()
    time.sleep(5)
    return {"exit_code": 0}

run_job("json", call, as_json=True, paragraph=str, interrupted="the test job")
"""


def test_the_cli_exits_interrupted_when_the_ctrl_c_landed_in_a_finalizer():
    """What a build-index start-up hit: a Ctrl-C inside an import lock's callback ran on,
    and the run finished with exit 0 as if nobody had asked it to stop."""
    run = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, timeout=60)
    assert run.returncode == EXIT_INTERRUPTED, run.stderr
    assert run.stderr.strip() == "interrupted: the test job" and run.stdout == "", run.stderr


IN_CHILD_START = """
import os, signal, sys, threading, time
from embedingest.interrupts import children_ignore_sigint

signal.signal(signal.SIGINT, signal.default_int_handler)
stop = threading.Event()
other = threading.Thread(target=stop.wait, daemon=True)  # SIGINT not blocked in it
other.start()
try:
    with children_ignore_sigint():
        os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C, while children start
        deadline = time.monotonic() + 30
        while signal.SIGINT in signal.sigpending():  # until the other thread took it
            assert time.monotonic() < deadline, "no thread took the SIGINT"
            time.sleep(0.01)
    time.sleep(5)
    sys.exit(4)  # the Ctrl-C was lost
except KeyboardInterrupt:
    sys.exit(3)
"""


def test_a_ctrl_c_taken_by_another_thread_while_children_start_is_not_lost():
    """A thread that does not block SIGINT (tokenizers' thread pool, the engine's pool
    thread) is where the kernel delivers a Ctrl-C while the main thread blocks it; with
    SIGINT ignored for the children's start, it was discarded there."""
    run = subprocess.run([sys.executable, "-c", IN_CHILD_START], capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr


FIRST_SPAWN = """
import multiprocessing, os, signal, sys, time
from embedingest.interrupts import children_ignore_sigint

# A Ctrl-C that reaches the child as it starts: it must hold it (exit 0), not die of it.
child = multiprocessing.get_context("spawn").Process(target=signal.raise_signal, args=(signal.SIGINT,))
try:
    with children_ignore_sigint():
        child.start()  # this process's first spawn: multiprocessing starts its resource tracker
        os.kill(os.getpid(), signal.SIGINT)  # the Ctrl-C, while children start
    time.sleep(5)
    code = 4  # the Ctrl-C was lost
except KeyboardInterrupt:
    code = 3
child.join(60)
sys.exit(code if child.exitcode == 0 else 10)
"""


def test_a_ctrl_c_after_the_first_spawn_of_a_process_is_not_lost():
    """multiprocessing starts its resource tracker at a process's first spawn, and then
    unblocks SIGINT (``SIG_UNBLOCK``, whatever the mask was): a Ctrl-C later in the start,
    with SIGINT ignored for it, was discarded. The child still starts holding SIGINT."""
    run = subprocess.run([sys.executable, "-c", FIRST_SPAWN], capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr
    assert "Traceback" not in run.stderr, run.stderr

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

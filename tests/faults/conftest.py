"""Fixtures of the fault-injection tests: start CLI runs, and after each test check that
no process of any run is left and no new file is left in /dev/shm."""

from __future__ import annotations

import os

import pytest
from fault_helpers import Run, half_made_semaphores, new_shm_files, shm_listing


@pytest.fixture
def cli(tmp_path, request):
    """``cli(*args, env={...}, preexec_fn=...)`` starts ``python -m embedingest *args`` in a new session
    (fault hooks on PYTHONPATH, cwd ``tmp_path``) and returns its :class:`Run`. At the
    end of the test every run must have ended with all its processes (those of its
    session, and any whose command line names ``tmp_path``), and /dev/shm must hold no
    file that was not there before (but a semaphore a killed run was making:
    :func:`~fault_helpers.half_made_semaphores`)."""
    runs: list[Run] = []
    shm_before = shm_listing()

    def start(*args, env: dict | None = None, preexec_fn=None) -> Run:
        run = Run([str(a) for a in args], tmp_path / "logs", env=env, cwd=tmp_path,
                  marker=str(tmp_path), preexec_fn=preexec_fn)
        runs.append(run)
        return run

    yield start
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for run in runs:
        if run.running():
            run.kill_all()
            if not failed:
                raise AssertionError(f"{run} was still running at the end of the test")
    for run in runs:
        run.assert_no_leftovers()
    new = new_shm_files(shm_before)
    for name in half_made_semaphores(new):  # a kill inside sem_open: no program can remove it
        os.unlink(os.path.join("/dev/shm", name))
        new.discard(name)
    assert not new, f"new files left in /dev/shm: {sorted(new)}"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep

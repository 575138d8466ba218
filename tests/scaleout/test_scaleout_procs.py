"""One process per device: results in order, progress, errors and Ctrl-C made the parent's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from embedingest.errors import ConfigError, EngineError, RemoteTraceback
from embedingest.scaleout import DeviceJob, run_per_device


def square(x, report):
    report(x, "half")
    return {"x": x * x, "pid": os.getpid(), "env": os.environ.get("EMBEDINGEST_TEST_ENV")}


def sleeper(marker, report):
    """Runs until stopped; the marker says it started, then that its clean-up ran. The
    marker is written inside the ``try``: another job waits for the file to exist, and a
    stop landing while it is written must still end in the clean-up."""
    try:
        Path(marker).write_text("running")
        report("started")
        while True:
            time.sleep(0.05)
    finally:
        Path(marker).write_text("stopped")


def fail_or_sleep(marker, fail, wait_for, report):
    """Fail as asked once the process of ``wait_for`` runs its target, or sleep."""
    while wait_for and not Path(wait_for).exists():
        time.sleep(0.02)
    if fail == "config":
        raise ConfigError("batch_size=0: must be at least 1")
    if fail == "unpicklable":
        raise _Unpicklable(threading.Lock())
    if fail == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    sleeper(marker, report)


class _Unpicklable(RuntimeError):
    def __init__(self, lock):
        super().__init__(f"holds {lock!r}")
        self.lock = lock


def test_results_in_order_with_progress_and_env(no_leaks):
    seen = []
    jobs = [DeviceJob(f"cpu{i}", (i,), {"EMBEDINGEST_TEST_ENV": f"e{i}"}) for i in range(3)]
    out = run_per_device(square, jobs, on_progress=lambda i, *v: seen.append((i, *v)))
    assert [r["x"] for r in out] == [0, 1, 4]
    assert [r["env"] for r in out] == ["e0", "e1", "e2"]
    assert len({r["pid"] for r in out} | {os.getpid()}) == 4
    assert sorted(seen) == [(0, 0, "half"), (1, 1, "half"), (2, 2, "half")]
    assert "EMBEDINGEST_TEST_ENV" not in os.environ


def test_child_error_is_raised_with_its_type_and_text_and_stops_the_others(tmp_path, no_leaks):
    jobs = [DeviceJob("cuda:0", (str(tmp_path / "m0"), None, None)),
            DeviceJob("cuda:1", (str(tmp_path / "m1"), "config", str(tmp_path / "m0")))]
    with pytest.raises(ConfigError, match=r"^batch_size=0: must be at least 1$") as err:
        run_per_device(fail_or_sleep, jobs)
    assert isinstance(err.value.__cause__, RemoteTraceback)
    assert "in the process of device cuda:1" in str(err.value.__cause__)
    assert (tmp_path / "m0").read_text() == "stopped"


def test_unpicklable_error_keeps_its_text(tmp_path, no_leaks):
    jobs = [DeviceJob("cpu", (str(tmp_path / "m"), "unpicklable", None))]
    with pytest.raises(EngineError, match="device cpu: _Unpicklable: holds <unlocked"):
        run_per_device(fail_or_sleep, jobs)


def test_killed_child_is_an_error_naming_device_and_signal(tmp_path, no_leaks):
    jobs = [DeviceJob("cpu", (str(tmp_path / "m0"), None, None)),
            DeviceJob("cuda:3", (str(tmp_path / "m1"), "killed", str(tmp_path / "m0")))]
    with pytest.raises(EngineError, match=r"device cuda:3 ended \(exit code -9\)"):
        run_per_device(fail_or_sleep, jobs)
    assert (tmp_path / "m0").read_text() == "stopped"


def test_ctrl_c_stops_every_child_cleanly(tmp_path, no_leaks):
    markers = [tmp_path / f"m{i}" for i in range(2)]
    jobs = [DeviceJob(f"cpu{i}", (str(m),)) for i, m in enumerate(markers)]
    started = set()

    def on_progress(index, what):
        started.add(index)
        if len(started) == len(jobs):
            os.kill(os.getpid(), signal.SIGINT)  # as a Ctrl-C in the terminal reaches the parent

    with pytest.raises(KeyboardInterrupt):
        run_per_device(sleeper, jobs, on_progress=on_progress)
    assert all(m.read_text() == "stopped" for m in markers)


def prepare_pid(tag):
    """A stand-in for loading a model: what the child keeps for its work, and what it
    tells the parent."""
    return {"tag": tag, "pid": os.getpid()}, {"tag": tag, "pid": os.getpid()}


def prepare_fails(tag):
    raise ConfigError(f"model folder {tag!r} does not exist")


def prepare_forever(marker):
    Path(marker).write_text("preparing")
    while True:
        time.sleep(0.05)


def use_prepared(prepared, x, report):
    report(x)
    prepared["calls"] = prepared.get("calls", 0) + 1
    return {"tag": prepared["tag"], "same_process": prepared["pid"] == os.getpid(), "x": x}


def count_calls(prepared, report):
    return prepared.get("calls", 0)


PARENT_STATE = {"loaded_in_parent": False}


def prepare_sees_parent(tag):
    return None, {"tag": tag, "inherited": PARENT_STATE["loaded_in_parent"]}


def square_prepared(prepared, x, report):
    return square(x, report)


def test_prepared_state_reaches_the_work_and_idle_children_get_none(no_leaks):
    from embedingest.scaleout.procs import DeviceProcesses

    seen = []
    jobs = [DeviceJob(f"cpu{i}", (f"t{i}",)) for i in range(3)]
    with DeviceProcesses(prepare_pid, jobs) as procs:
        out = procs.run(use_prepared, [(10,), None, (12,)], on_progress=lambda i, x: seen.append((i, x)))
    assert out == [{"tag": "t0", "same_process": True, "x": 10}, None,
                   {"tag": "t2", "same_process": True, "x": 12}]
    assert sorted(seen) == [(0, 10), (2, 12)]


def test_a_failed_prepare_is_raised_by_run_with_its_type(no_leaks):
    from embedingest.scaleout.procs import DeviceProcesses

    with DeviceProcesses(prepare_fails, [DeviceJob("cuda:1", ("/nope",))]) as procs:
        procs.procs[0].join(60)  # the child has failed, reported it and ended before its work is sent
        assert procs.procs[0].exitcode == 0
        with pytest.raises(ConfigError, match="model folder '/nope' does not exist"):
            procs.run(use_prepared, [(1,)])


def test_leaving_without_work_stops_children_still_preparing(tmp_path, no_leaks):
    from embedingest.scaleout.procs import DeviceProcesses

    marker = tmp_path / "m"
    t0 = time.monotonic()
    with DeviceProcesses(prepare_forever, [DeviceJob("cpu", (str(marker),))]):
        wait_until = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < wait_until:
            time.sleep(0.02)
        assert marker.exists()
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_ctrl_c_while_a_child_starts_stops_that_child_too(tmp_path, monkeypatch, method, no_leaks):
    """A Ctrl-C during a child's start waits (SIGINT blocked) and arrives as the start
    ends: here raised right there, after the second child started. Both children are
    stopped before the interrupt reaches the caller; before, the one just started was not
    yet known, ran on waiting for work, and the program's exit waited for it for good."""
    import contextlib

    from embedingest.scaleout import procs as procs_module

    starts = []

    @contextlib.contextmanager
    def interrupted_after_the_second_start():
        yield
        starts.append(1)
        if len(starts) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(procs_module, "children_ignore_sigint", interrupted_after_the_second_start)
    markers = [tmp_path / "m0", tmp_path / "m1"]
    jobs = [DeviceJob(f"cpu{i}", (str(m),)) for i, m in enumerate(markers)]
    with pytest.raises(KeyboardInterrupt):
        procs_module.DeviceProcesses(prepare_forever, jobs, start_method=method, stop_timeout=30)
    assert len(starts) == 2
    assert [p.name for p in __import__("multiprocessing").active_children()
            if p.name.startswith("embedingest-")] == []


def test_children_report_ready_and_serve_several_calls(no_leaks):
    from embedingest.scaleout.procs import DeviceProcesses

    jobs = [DeviceJob(f"cpu{i}", (f"t{i}",)) for i in range(2)]
    with DeviceProcesses(prepare_pid, jobs) as procs:
        infos = [procs.info(i) for i in range(2)]
        assert [i["tag"] for i in infos] == ["t0", "t1"]
        assert len({i["pid"] for i in infos} | {os.getpid()}) == 3
        assert procs.call(1, use_prepared, (5,)) == {"tag": "t1", "same_process": True, "x": 5}
        assert procs.run(count_calls, [(), ()]) == [0, 1]  # the state lives on between calls
    assert all(not p.is_alive() for p in procs.procs)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_forked_children_inherit_the_parents_imports_and_state(method, monkeypatch, no_leaks):
    from embedingest.scaleout.procs import DeviceProcesses

    monkeypatch.setitem(PARENT_STATE, "loaded_in_parent", True)
    jobs = [DeviceJob(f"cpu{i}", (f"t{i}",), {"EMBEDINGEST_TEST_ENV": f"e{i}"}) for i in range(2)]
    with DeviceProcesses(prepare_sees_parent, jobs, start_method=method) as procs:
        assert [procs.info(i)["inherited"] for i in range(2)] == [method == "fork"] * 2
        out = procs.run(square_prepared, [(2,), (3,)])
    assert [r["x"] for r in out] == [4, 9] and [r["env"] for r in out] == ["e0", "e1"]
    assert "EMBEDINGEST_TEST_ENV" not in os.environ


def test_a_failed_prepare_is_raised_while_waiting_for_its_info(no_leaks):
    from embedingest.scaleout.procs import DeviceProcesses

    with DeviceProcesses(prepare_fails, [DeviceJob("cuda:1", ("/nope",))],
                         start_method="fork") as procs:
        with pytest.raises(ConfigError, match="model folder '/nope' does not exist"):
            procs.info(0)


def test_fork_is_safe_only_without_threads_and_cuda():
    from embedingest.scaleout.procs import fork_is_safe

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not fork_is_safe()
    finally:
        stop.set()
        thread.join()
    # torch.cuda.is_available() initialises the driver (where there is one): a child
    # forked afterwards cannot use CUDA, so fork is refused from then on.
    code = ("from embedingest.scaleout.procs import fork_is_safe; import torch; a = fork_is_safe(); "
            "torch.cuda.is_available(); print(a, fork_is_safe())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False"], out.stderr


FINALIZER_STOP = """
import os, signal, sys, time
from embedingest.scaleout.procs import _interrupt_once, _stop_from_finalizer
signal.signal(signal.SIGTERM, _interrupt_once)
if sys.argv[1] == "hook":
    sys.unraisablehook = _stop_from_finalizer

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the stop arrives while the finalizer runs
        time.sleep(0.2)

try:
    Finalized()
    time.sleep(5)
    sys.exit(4)  # the stop was lost
except KeyboardInterrupt:
    sys.exit(3)
"""


@pytest.mark.parametrize("hook", ["hook", "none"])
def test_a_stop_that_lands_in_a_finalizer_still_stops_the_child(hook):
    """A device process's SIGTERM raised inside a ``__del__`` is swallowed by Python;
    the child's unraisable hook delivers it again, so the child stops, quietly. Without
    the hook the stop is lost (exit 4) with an "Exception ignored" traceback."""
    run = subprocess.run([sys.executable, "-c", FINALIZER_STOP, hook], capture_output=True,
                         text=True, timeout=60)
    if hook == "hook":
        assert run.returncode == 3, run.stderr
        assert "Exception ignored" not in run.stderr and "Traceback" not in run.stderr, run.stderr
    else:
        assert run.returncode == 4 and "Exception ignored" in run.stderr, run.stderr

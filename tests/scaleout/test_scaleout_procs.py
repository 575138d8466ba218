"""One process per device: results in order, progress, errors and Ctrl-C made the parent's."""

from __future__ import annotations

import os
import signal
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
    """Runs until stopped; the marker says it started, then that its clean-up ran."""
    Path(marker).write_text("running")
    try:
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

"""CUDA's start during a job command's imports (embedingest.cuda_ahead): which device it
starts, that it never stops a run, that its thread cannot take a Ctrl-C meant for the
import, that several-device runs never start it, and on a GPU that torch runs in the
context it made."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import pytest
from click.testing import CliRunner

from embedingest.cuda_ahead import CudaAhead, ordinal_of


@pytest.mark.parametrize("device, ordinal", [
    ("auto", 0), ("cuda", 0), ("cuda:0", 0), ("cuda:3", 3), (" cuda:1 ", 1),
    ("cpu", None), ("", None), (None, None), ("auto:1", None), ("cuda:x", None), ("mps", None),
    ("cuda:1,cuda:2", None),
])
def test_the_ordinal_is_the_gpu_the_device_setting_names(device, ordinal):
    assert ordinal_of(device) == ordinal


def test_no_ordinal_starts_no_thread():
    before = threading.active_count()
    with CudaAhead(None) as ahead:
        assert threading.active_count() == before
    assert ahead.seconds is None and ahead.error is None


def test_a_missing_driver_is_noted_and_changes_nothing(tmp_path):
    with CudaAhead(0, library=str(tmp_path / "libcuda.so.1")) as ahead:
        pass
    assert "libcuda.so.1" in ahead.error
    assert ahead.seconds is not None and ahead.seconds >= 0


def test_the_block_ends_with_the_thread_and_it_holds_sigint_back():
    """The thread starts with SIGINT blocked (the import beside it holds it back; a Ctrl-C
    delivered to this thread would raise inside the import), and the main thread's own
    mask is as before once the thread has started."""
    seen = {}

    class Probe(CudaAhead):
        def _start(self):
            seen["mask"] = signal.pthread_sigmask(signal.SIG_BLOCK, set())
            seen["thread"] = threading.current_thread()

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with Probe(0):
        assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == mask
    assert signal.SIGINT in seen["mask"]
    assert seen["thread"] is not threading.main_thread() and not seen["thread"].is_alive()


@pytest.mark.parametrize("command, extra, expected", [
    (["build-index", "CORPUS"], [], "auto"),
    (["build-index", "CORPUS"], ["--device", "cuda:1"], "cuda:1"),
    (["build-index", "CORPUS"], ["--devices", "cpu,cpu"], None),
    (["segment", "CORPUS"], ["--device", "cpu"], "cpu"),
    (["segment", "CORPUS"], ["--devices", "0,1"], None),
])
def test_a_job_command_names_its_one_device_and_none_for_several(tmp_path, monkeypatch, command, extra, expected):
    """A run on several devices forks children that use CUDA: its parent must never start it."""
    import embedingest.cli.index as index_cli
    import embedingest.cli.segment as segment_cli
    from embedingest.cli import main

    got = {}

    def fake_run_job(module, call, **kwargs):
        got.update(kwargs)

    monkeypatch.setattr(index_cli, "run_job", fake_run_job)
    monkeypatch.setattr(segment_cli, "run_job", fake_run_job)
    (tmp_path / "in").mkdir()
    args = [str(tmp_path / "in") if a == "CORPUS" else a for a in command] + extra
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert got["device"] == expected


TORCH_IN_THE_CONTEXT = """
import ctypes, json
from embedingest.cuda_ahead import CudaAhead
with CudaAhead(0) as ahead:
    import torch
x = torch.arange(10, device="cuda").sum().item()
cuda = ctypes.CDLL("libcuda.so.1")
current, primary, dev = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int()
cuda.cuCtxGetCurrent(ctypes.byref(current))
cuda.cuDeviceGet(ctypes.byref(dev), 0)
cuda.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev)
print(json.dumps({"error": ahead.error, "sum": x, "same": current.value == primary.value}))
"""


@pytest.mark.needs_cuda
def test_torch_runs_in_the_primary_context_started_ahead():
    run = subprocess.run([sys.executable, "-c", TORCH_IN_THE_CONTEXT], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"error": None, "sum": 45, "same": True}

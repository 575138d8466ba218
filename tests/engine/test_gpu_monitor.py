"""The NVML utilisation sampler: on the CPU with a stand-in for NVML, on a GPU for real."""

from __future__ import annotations

import threading
import time

import pytest
from cuda_helpers import busy_then_idle

from embedingest.engine.gpu_monitor import UtilizationSampler, gpu_idle


class FakeNVML:
    """Answers a utilisation per call from a script; ``fail_at`` raises from that call on;
    ``done`` is set once every scripted value was read."""

    def __init__(self, values, fail_at=None):
        self.values, self.fail_at, self.calls = list(values), fail_at, 0
        self.done = threading.Event()

    def __call__(self):
        n = self.calls
        self.calls += 1
        if self.fail_at is not None and n >= self.fail_at:
            raise RuntimeError("NVML Shared Library Not Found")
        if n >= len(self.values):
            self.done.set()
            return self.values[-1]
        return self.values[n]


def test_samples_in_the_background_and_averages_the_idle_share():
    nvml = FakeNVML([0, 100, 100, 50, 0, 0])  # the first read is start()'s probe
    s = UtilizationSampler("cuda:0", period=0.001, read=nvml).start()
    assert s.running and s.error is None
    assert nvml.done.wait(30)
    s.stop()
    assert not s.running
    values = [v for _, v in s.samples]
    assert values[:5] == [100, 100, 50, 0, 0] and set(values[5:]) <= {0}
    times = [t for t, _ in s.samples]
    assert times == sorted(times)
    # a window over the first four samples: 1 - (100 + 100 + 50 + 0) / 400
    assert s.idle_fraction(times[0], times[3]) == pytest.approx(0.375)
    assert s.idle_fraction(times[0], times[1]) == pytest.approx(0.0)
    assert s.idle_fraction(times[1], times[2]) == pytest.approx(0.25)
    assert s.idle_fraction(times[-1] + 1) is None
    assert s.idle_fraction() == pytest.approx(1 - 250 / (100 * len(values)))


def test_nvml_missing_samples_nothing_and_says_why(caplog):
    import embedingest.engine.gpu_monitor as gm

    gm._warned = False
    s = UtilizationSampler("cuda:0", read=FakeNVML([], fail_at=0)).start()
    assert not s.running and s.samples == [] and s.idle_fraction() is None
    assert s.error == "RuntimeError: NVML Shared Library Not Found"
    assert "GPU utilisation cannot be sampled" in caplog.text and "nvidia-ml-py" in caplog.text
    s.stop()  # no thread: nothing to join


def test_nvml_failing_later_keeps_the_samples_so_far():
    s = UtilizationSampler("cuda:0", period=0.001, read=FakeNVML([0, 40, 60], fail_at=3)).start()
    s._thread.join(30)
    assert not s.running and [v for _, v in s.samples] == [40, 60]
    assert s.error.startswith("RuntimeError") and s.idle_fraction() == pytest.approx(0.5)


def test_idle_fraction_prefers_nvml_then_event_gaps():
    sampler = UtilizationSampler("cuda:0")
    assert gpu_idle(None, None) == (None, None)
    assert gpu_idle(sampler.idle_fraction(), 0.25) == (0.25, "cuda-events")  # no samples
    sampler.samples = [(1.0, 70), (2.0, 90)]
    assert gpu_idle(sampler.idle_fraction(), 0.25) == (pytest.approx(0.2), "nvml")
    assert gpu_idle(0.0, 0.5) == (0.0, "nvml") and gpu_idle(None, 0.0) == (0.0, "cuda-events")


@pytest.mark.needs_cuda
def test_nvml_sees_a_busy_gpu_busy_and_an_idle_one_idle():
    """Two seconds of one long kernel, then two seconds of nothing. NVML averages over
    a sample period of up to a second, so the first second of each phase is left out."""
    import pynvml  # noqa: F401  (a dependency: it must be there)
    import torch

    dev = torch.device("cuda")
    s = UtilizationSampler(dev, period=0.05).start()
    assert s.running, s.error
    t0, t1, t2 = busy_then_idle(2.0)
    s.stop()
    busy, idle = s.idle_fraction(t0 + 1.0, t1), s.idle_fraction(t1 + 1.0, t2)
    assert busy is not None and idle is not None, s.samples
    assert busy < 0.2 and idle > 0.8, (busy, idle, s.samples)


def test_default_reading_is_torch_cuda_utilization_of_the_device(monkeypatch):
    import torch

    asked = []
    monkeypatch.setattr(torch.cuda, "utilization", lambda device: asked.append(device) or 30)
    s = UtilizationSampler("cuda:3", period=0.001).start()
    try:
        assert s.running and s._thread.name == "embedingest-nvml" and s._thread.daemon
        deadline = time.monotonic() + 30
        while len(s.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        s.stop()
    assert set(asked) == {"cuda:3"} and s.idle_fraction() == pytest.approx(0.7)


def test_a_missing_nvml_is_said_once_per_process(caplog):
    import embedingest.engine.gpu_monitor as gm

    gm._warned = False
    for _ in range(2):
        UtilizationSampler("cuda:0", read=FakeNVML([], fail_at=0)).start()
    (record,) = [r for r in caplog.records if r.name == "embedingest"]
    assert record.levelname == "WARNING" and record.getMessage() == (
        "GPU utilisation cannot be sampled (RuntimeError: NVML Shared Library Not Found); "
        "gpu_idle_fraction falls back to the gaps between batches (pip install nvidia-ml-py)")

"""The benchmarks' shared reporting helpers (embedingest/bench/report.py)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from embedingest.bench.report import HostCpu


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_host_cpu_sees_a_busy_core_and_an_idle_wait():
    with HostCpu(every=0.1) as busy:
        end = time.perf_counter() + 0.6
        while time.perf_counter() < end:
            pass
    with HostCpu(every=0.1) as idle:
        time.sleep(0.6)
    got, quiet = busy.result(), idle.result()
    assert 0 < got["busy"] <= 1 and len(got["samples"]) >= 4
    assert all(0 <= s <= 1 for s in got["samples"])
    # at least a share of one core of the machine's spun (other processes may run too)
    assert got["busy"] >= 0.25 / os.cpu_count()
    assert quiet["busy"] <= 1 and quiet["samples"] and max(quiet["samples"]) <= 1

"""Benchmark tables: one row per loop, ratios against the bound and the seed's final loop."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def machine_info() -> dict:
    """What the numbers were measured on: GPU, driver, library versions, date."""
    info = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "host_cpus": os.cpu_count(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            info["driver"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def _fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec)


COLUMNS = [("name", "loop", "s"), ("rate", "rate", ".2f"), ("vs_bound", "x bound", ".2f"),
           ("vs_seed_final", "x seed", ".2f"), ("copy_gbps", "copy GB/s", ".1f"),
           ("gpu_idle", "GPU idle", ".0%"), ("pinned", "pinned", ""), ("bound", "bound by", "s")]


TEXT_COLUMNS = [("name", "loop", "s"), ("rate", "docs/s", ",.0f"), ("vs_bound", "x bound", ".2f"),
                ("vs_st", "x sentence-transformers", ".2f"), ("steady_docs_per_s", "steady docs/s", ",.0f"),
                ("seconds", "seconds", ".1f"), ("gpu_idle", "GPU idle", ".0%"), ("pinned", "pinned", "")]


DOCUMENTS_COLUMNS = [("name", "loop", "s"), ("rate", "chunks/s", ",.0f"), ("vs_bound", "x bound", ".2f"),
                     ("vs_st", "x sentence-transformers", ".2f"),
                     ("steady_chunks_per_s", "steady chunks/s", ",.0f"), ("steady_vs_bound", "steady x bound", ".2f"),
                     ("seconds", "seconds", ".1f"), ("peak_pss_mb", "peak PSS MB", ",.0f"),
                     ("vectors_mb", "vectors MB", ",.0f")]


def table(rows: list[dict], unit: str, columns=None) -> str:
    """A Markdown table of ``rows`` (``rate`` in ``unit``)."""
    columns = columns or COLUMNS
    head = [c[1] if c[0] != "rate" else unit for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(k), spec) for k, _, spec in columns) + " |")
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str))


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


class HostCpu:
    """The host's CPUs' busy share while the block runs, overall and every ``every``
    seconds: whether a run was bound by the CPUs that feed the GPU. A context manager;
    ``result()`` gives ``{"busy": share, "samples": [share, ...]}`` (None off Linux)."""

    def __init__(self, every: float = 0.5):
        import threading

        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._first = self._last = None
        self.samples: list[float] = []

    def _sample(self) -> None:
        prev = self._first
        while not self._stop.wait(self.every):
            now = _cpu_ticks()
            if prev and now and now[1] > prev[1]:
                self.samples.append(round((now[0] - prev[0]) / (now[1] - prev[1]), 3))
            prev = now

    def __enter__(self) -> HostCpu:
        self._first = _cpu_ticks()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._last = _cpu_ticks()

    def result(self) -> dict | None:
        if not (self._first and self._last) or self._last[1] <= self._first[1]:
            return None
        busy = (self._last[0] - self._first[0]) / (self._last[1] - self._first[1])
        return {"busy": round(busy, 3), "samples": self.samples}

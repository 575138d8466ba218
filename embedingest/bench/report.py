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

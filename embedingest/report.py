"""The skip report: every input a run could not use, with the reason.

Bad inputs never stop a run and never pass silently: each one is counted, logged and
written to ``skipped.jsonl`` in the output folder (atomically, so a crash mid-write
leaves the previous report, never half of one).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("embedingest")

REPORT_NAME = "skipped.jsonl"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@dataclass
class SkipReport:
    """Collects skipped inputs; thread-safe, cheap, written once at the end of a run."""

    entries: list[dict] = field(default_factory=list)
    # Files of a folder that are not of a format the job reads, counted by suffix: not
    # skipped inputs, but a folder of PDFs must not look like an empty corpus.
    passed_over: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def pass_over(self, path: str | os.PathLike) -> None:
        self.passed_over[Path(path).suffix.lower() or "(no suffix)"] += 1

    def add(self, path: str, reason: str, stage: str = "read", **extra) -> None:
        entry = {"path": str(path), "reason": reason, "stage": stage, **extra}
        with self._lock:
            self.entries.append(entry)
        log.warning("skipped %s: %s", path, reason)

    def __len__(self) -> int:
        return len(self.entries)

    def by_reason(self) -> dict[str, int]:
        return dict(Counter(e["reason"].split(":")[0] for e in self.entries))

    def write(self, folder: str | os.PathLike) -> Path:
        """Write the report as JSON lines into ``folder`` and return its path."""
        path = Path(folder) / REPORT_NAME
        with self._lock:
            data = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in self.entries)
        # A file name that is not UTF-8 reaches here as surrogates: write them as escapes.
        atomic_write_bytes(path, data.encode("utf-8", "backslashreplace"))
        return path


def passed_over_sentence(summary: dict) -> str:
    """The sentence of a run's summary on files of formats the job does not read, or ''."""
    counts = summary.get("passed_over") or {}
    if not counts:
        return ""
    kinds = ", ".join(f"{suffix} {n}" for suffix, n in counts.items())
    return (f" Passed over {sum(counts.values())} files of formats it does not read ({kinds}); "
            "the README lists the ones it does.")

"""The skip report: every input a run could not use, with the reason.

Bad inputs never stop a run and never pass silently: each one is counted, logged and
written to ``skipped.jsonl`` in the output folder (atomically, so a crash mid-write
leaves the previous report, never half of one). Each entry names the run that skipped
the input (``run``); a run adds its entries to those of earlier runs, so a re-run that
skips nothing (an unchanged corpus) never erases what an earlier run reported. An entry
a later run repeats (same path, reason and stage) is kept once, with the later run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .outfiles import atomic_write_bytes, new_run_id
from .sources.files import open_regular
from .terminal import counted

log = logging.getLogger("embedingest")

REPORT_NAME = "skipped.jsonl"


# The passed_over key of hidden files and folders (a name starting with "."), not entered.
HIDDEN = "(hidden)"


@dataclass
class SkipReport:
    """Collects skipped inputs; thread-safe, cheap, written once at the end of a run."""

    entries: list[dict] = field(default_factory=list)
    # Files of a folder that are not of a format the job reads, counted by suffix: not
    # skipped inputs, but a folder of PDFs must not look like an empty corpus.
    passed_over: Counter = field(default_factory=Counter)
    # This run's id, written with each of its entries (those that device processes
    # collected and handed over too).
    run: str = field(default_factory=new_run_id)
    # Entries of earlier runs that the last write kept in the report.
    earlier: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def pass_over(self, path: str | os.PathLike) -> None:
        name = Path(path).name
        self.passed_over[HIDDEN if name.startswith(".") else Path(name).suffix.lower() or "(no suffix)"] += 1

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
        """Add this run's entries to the report in ``folder`` (JSON lines) and return its path."""
        path = Path(folder) / REPORT_NAME
        with self._lock:
            mine = [json.dumps({**e, "run": self.run}, ensure_ascii=False) for e in self.entries]
            again = {_same(e) for e in self.entries}
        earlier = [line for line, entry in _read_lines(path) if _same(entry) not in again]
        self.earlier = len(earlier)
        data = "".join(line + "\n" for line in earlier + mine)
        # A file name that is not UTF-8 reaches here as surrogates: write them as escapes.
        atomic_write_bytes(path, data.encode("utf-8", "backslashreplace"))
        return path


def _same(entry: dict) -> tuple:
    return entry.get("path"), entry.get("reason"), entry.get("stage")


def _read_lines(path: Path) -> list[tuple[str, dict]]:
    """The entries of an existing report, as (line, parsed). What is not a regular file
    there (a link, a named pipe, a device) is never opened blocking nor read through: it
    is replaced by the new report; lines that are not entries are dropped."""
    try:
        with open_regular(path, follow_links=False) as fh:
            lines = fh.read().decode("utf-8", "surrogateescape").splitlines()
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("cannot read the earlier skip report %s (%s): it is replaced", path, exc)
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict):
                out.append((line, entry))
    return out


def passed_over_sentence(summary: dict) -> str:
    """The sentence of a run's summary on files of formats the job does not read, and on
    hidden files and folders, or ''."""
    counts = dict(summary.get("passed_over") or {})
    hidden = counts.pop(HIDDEN, 0)
    said = ""
    if counts:
        kinds = ", ".join(f"{suffix} {n}" for suffix, n in counts.items())
        said = (f" Passed over {counted(sum(counts.values()), 'file')} of formats it does not read ({kinds}); "
                "the README lists the ones it does.")
    if hidden:
        said += (f" Passed over {hidden} hidden {'entry' if hidden == 1 else 'entries'} (a name starting with '.'; "
                 "a folder's files not counted): give one as the input itself to read it.")
    return said

"""Per-image class statistics as Parquet: one row per image, written by the mask writers.

Each consumer process collects rows (source, width, height, then the share of the
image's pixels of each class, one float32 column per class; ``source`` is the image's
input-relative path as ``sources.names.name_as_text`` writes it: the same unless the
name is not UTF-8 or holds a backslash) and commits them as a part
file ``stats/part-<time>-<pid>-<n>.parquet``: serialised in memory, read back, written
under a temporary name, fsynced and renamed. A row is added only after its image's mask
is written, so a committed row always has its mask; a killed run loses the rows not yet
committed, and resume (``row_counts``) treats an image with a mask but not exactly one
committed row as not done; before a run redoes an image (for whatever reason: no row, a
missing mask or overlay, ``--overwrite``) its rows are dropped (``drop_stats_rows``), so
the re-run writes its row once: every image ends with exactly one row.
Read the folder as one table with ``pyarrow.dataset.dataset(out / "stats")`` or
``pandas.read_parquet(out / "stats")``.

The folder is part of the output tree: where ``stats`` is a symbolic link it is refused
(never read, written or deleted through), and a part that is a link is no part (its
target is never read).
"""

from __future__ import annotations

import io
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..outfiles import atomic_write_bytes, ensure_folder, refuse_link
from ..sources.files import open_regular
from ..sources.names import name_as_text

log = logging.getLogger("embedingest")

STATS_DIR = "stats"
FIXED_COLUMNS = ("source", "width", "height")


def stats_columns(categories: Sequence[str]) -> list[str]:
    """The share columns, one per class, named by the category (``class_<i>`` where a
    name is empty, repeated, or one of the fixed columns)."""
    seen, names = set(FIXED_COLUMNS), []
    for i, name in enumerate(categories):
        name = name if name and name not in seen else f"class_{i}"
        seen.add(name)
        names.append(name)
    return names


def stats_folder(out: str | os.PathLike) -> Path:
    """``out``/stats; ConfigError where it is a symbolic link, so rows are never read,
    written or deleted outside ``out``."""
    folder = Path(out) / STATS_DIR
    refuse_link(folder, " (the --stats folder)")
    return folder


# The names the writers give parts (``StatsWriter.commit``, ``drop_stats_rows``): any
# other file in the folder is the user's, never read, counted, rewritten or deleted.
_PART_NAME = re.compile(r"part-\d+-\d+-(?:kept)?\d+\.parquet")


def _is_part_name(name: str) -> bool:
    """Whether ``name`` is one a writer gives a part: an --out that already had a
    ``stats/`` folder of the user's keeps its files (``sales.parquet``), where before
    --overwrite deleted them, with --stats or without."""
    return _PART_NAME.fullmatch(name) is not None


def part_files(out: str | os.PathLike) -> list[Path]:
    """The committed parts: the files of the stats folder named as a writer names parts
    (:func:`_is_part_name`) that are regular files (a link there is not read through)."""
    folder = stats_folder(out)
    try:
        with os.scandir(folder) as entries:
            return sorted(Path(e.path) for e in entries
                          if _is_part_name(e.name) and e.is_file(follow_symlinks=False))
    except OSError:
        return []


def foreign_entries(out: str | os.PathLike) -> list[str]:
    """The names in the stats folder that a reader of the folder as one table
    (``pandas.read_parquet``, ``pyarrow.dataset``) takes for data and that are no part:
    anything not hidden (``.``) or marked (``_``), files and folders alike."""
    try:
        with os.scandir(stats_folder(out)) as entries:
            return sorted(e.name for e in entries if not e.name.startswith((".", "_")) and not _is_part_name(e.name))
    except OSError:
        return []


def _read_part(part: Path, columns: list[str] | None = None):
    """A part's table, opened without following a link and without blocking; None where
    it is damaged (cut short, not Parquet, no ``source``): its rows are lost, so its
    images have no row and are redone, and ``drop_stats_rows`` deletes it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with open_regular(part, follow_links=False) as fh:
            table = pq.read_table(fh, columns=columns)
        if "source" not in table.column_names:
            raise pa.ArrowInvalid("it has no 'source' column")
        return table
    except pa.ArrowException as exc:
        log.warning("stats part %s is damaged (%s): its rows are lost, and its images redone",
                    part, str(exc).splitlines()[0])
        return None
    except OSError as exc:
        raise ConfigError(f"stats part {part} is unreadable ({exc.strerror or exc}); make it readable, "
                          "or delete it (its images are then redone)") from exc


def row_counts(out: str | os.PathLike) -> Counter:
    """How many committed rows each source has (input-relative paths as ``name_as_text``
    writes them): resume takes an image as done only with exactly one."""
    counts: Counter = Counter()
    for part in part_files(out):
        table = _read_part(part, ["source"])
        if table is not None:
            counts.update(table.column("source").to_pylist())
    return counts


def drop_stats_rows(out: str | os.PathLike, sources: set[str]) -> None:
    """Remove the rows of ``sources`` (input-relative paths of images about to be redone),
    part by part.

    The old part is removed before its other rows are committed again under a new name:
    a crash in between loses rows, never duplicates them, and an image without a row is
    redone by the next run. A damaged part (its rows lost already, its images redone) and
    a link at a part's name (the link, not its target) are deleted."""
    import pyarrow.compute as pc

    sources = {name_as_text(source) for source in sources}
    _remove_linked_parts(out)
    for n, part in enumerate(part_files(out)):
        table = _read_part(part)
        if table is None:  # damaged: its rows are lost already, its images redone
            log.warning("deleting the damaged stats part %s", part)
            os.unlink(part)
            continue
        keep = pc.invert(pc.is_in(table.column("source"), value_set=_string_array(sources)))
        kept = table.filter(keep)
        if kept.num_rows == table.num_rows:
            continue
        os.unlink(part)
        if kept.num_rows:
            _commit(part.parent / f"part-{time.time_ns()}-{os.getpid()}-kept{n}.parquet", kept)


def remove_parts(out: str | os.PathLike) -> None:
    """Delete every part (by name, in the stats folder; a link there, not its target):
    ``--overwrite`` makes the table this run's alone. Parts of an earlier model have other
    class columns (a reader of the folder as one table drops the columns that differ,
    silently) and rows of images no longer in the input."""
    _remove_linked_parts(out)
    for part in part_files(out):
        os.unlink(part)


def _remove_linked_parts(out: str | os.PathLike) -> None:
    """Delete the links at part names in the stats folder (the links, never what they lead
    to): a reader of the folder as one table would read their targets' rows."""
    folder = stats_folder(out)
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if _is_part_name(entry.name) and entry.is_symlink():
            log.warning("deleting %s: a link where a stats part goes (its target is kept)", entry.path)
            os.unlink(entry.path)


def _string_array(values: Iterable[str]):
    import pyarrow as pa

    return pa.array(sorted(values), type=pa.string())


def _commit(path: Path, table) -> None:
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    data = buf.getvalue()
    if pq.read_metadata(io.BytesIO(data)).num_rows != table.num_rows:
        raise OSError(f"stats part {path} did not read back with its {table.num_rows} rows")
    atomic_write_bytes(path, data)


class StatsWriter:
    """Rows of one consumer process; committed every ``rows_per_part`` rows or
    ``seconds`` (checked as rows come), and at ``close``."""

    def __init__(self, out: str, categories: Sequence[str], rows_per_part: int = 4096,
                 seconds: float = 10.0):
        self.out = Path(out)
        self.folder = self.out / STATS_DIR
        self.columns = stats_columns(categories)
        self.rows_per_part, self.seconds = rows_per_part, seconds
        self.sources: list[str] = []
        self.sizes: list[tuple[int, int]] = []
        self.shares: list[np.ndarray] = []
        self.parts = 0
        self.committed = 0
        self._since = time.monotonic()

    def add(self, source: str, mask: np.ndarray) -> None:
        """The row of one image whose mask (uint8 [height, width], class per pixel) is written."""
        counts = np.bincount(mask.ravel(), minlength=len(self.columns))[:len(self.columns)]
        self.sources.append(name_as_text(source))
        self.sizes.append((mask.shape[1], mask.shape[0]))
        self.shares.append((counts / max(1, mask.size)).astype(np.float32))
        if len(self.sources) >= self.rows_per_part or time.monotonic() - self._since >= self.seconds:
            self.commit()

    def commit(self) -> None:
        import pyarrow as pa

        self._since = time.monotonic()
        if not self.sources:
            return
        shares = np.stack(self.shares)
        sizes = np.asarray(self.sizes, dtype=np.int32)
        table = pa.table({"source": pa.array(self.sources, type=pa.string()),
                          "width": sizes[:, 0], "height": sizes[:, 1],
                          **{name: shares[:, i] for i, name in enumerate(self.columns)}})
        ensure_folder(self.out, stats_folder(self.out))  # never through a link: rows stay in out
        _commit(self.folder / f"part-{time.time_ns()}-{os.getpid()}-{self.parts}.parquet", table)
        self.parts += 1
        self.committed += len(self.sources)
        self.sources, self.sizes, self.shares = [], [], []

    def close(self) -> None:
        self.commit()

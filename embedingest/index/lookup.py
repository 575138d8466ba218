"""Vector id -> chunk row, through the shards' Parquet files (index format 2).

Opening reads the id column of every shard (a few bytes per chunk, compressed well) and
sorts it once: then any id is found by a binary search, as (shard, row). Fetching rows
reads only the row groups that hold them, of the columns asked for, from Parquet files
kept open (the most recently used :data:`OPEN_FILES`). A shard's rows are in the order
its vectors were added; a row group holds
:data:`~embedingest.sinks.shard_writer.ROW_GROUP_ROWS` of them.
Safe to use from several threads (one lock per open file: a Parquet reader is not).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ConfigError
from ..outfiles import native_path
from .shards import CHUNK_BITS, CHUNK_COLUMNS, COMMIT_SUFFIX, Shard, redo_advice, schema_problem
from .store import Chunk

class IndexChanged(ConfigError):
    """A shard opened for this index is gone or is another file now: a build replaced or
    removed it since (the index is read as it was opened). Open the index again."""


OPEN_FILES = 64
READ_THREADS = 4  # shards read side by side for one lookup (at most the cores)
_DERIVED = ("id", "chunk_no")  # chunk_no is the low half of the id (the writer checks it)
_CHUNK_MASK = (1 << CHUNK_BITS) - 1


class ShardRows:
    """The chunk rows of committed ``shards``, by vector id. ``ids``: each shard's ids in
    row order when the caller has them (open_index takes them from the faiss files it
    loads); else they are read from the Parquet files."""

    def __init__(self, shards: Iterable[Shard], ids: Sequence[np.ndarray] | None = None,
                 threads: int | None = None, opener: Callable[[Shard], object] | None = None,
                 where: Callable[[Shard], str] | None = None):
        self.shards = [s for s in shards if s.rows]
        # Parquet files elsewhere (object storage): ``opener`` gives a file object read by
        # range, ``where`` the name errors give it.
        self._opener = opener
        self._where = where or (lambda shard: str(shard.path("parquet")))
        self._threads = min(READ_THREADS, os.cpu_count() or 1) if threads is None else threads
        self._pool: ThreadPoolExecutor | None = None
        self._files: OrderedDict[int, tuple[pq.ParquetFile, threading.Lock]] = OrderedDict()
        self._files_lock = threading.Lock()
        if ids is not None and len(ids) != len(self.shards):
            raise ValueError(f"{len(ids)} id arrays for {len(self.shards)} shards with rows")
        per_shard, group_starts = [], []
        # which file each shard's rows were opened from: rows that are not the ones the
        # vectors give are then damage, unless a build has replaced the file since
        self._opened = [None if opener is not None else _identity(s.path("parquet")) for s in self.shards]
        for no, shard in enumerate(self.shards):
            pf = self._open(no)
            meta = pf.metadata
            problem = schema_problem(pf.schema_arrow)
            if problem:
                raise ConfigError(f"{self._where(shard)!r} is not a shard's rows file ({problem}): the "
                                  f"shard is damaged; {redo_advice(shard.name)}")
            if meta.num_rows != shard.rows or (ids is not None and len(ids[no]) != shard.rows):
                raise ConfigError(f"{self._where(shard)!r} holds {meta.num_rows} rows, but "
                                  f"its commit record says {shard.rows}: the shard is damaged; "
                                  f"{redo_advice(shard.name)}")
            group_starts.append(_group_starts(meta, shard))
            if ids is not None and not _groups_match(meta, group_starts[-1], ids[no]):
                raise ConfigError(f"the vectors of shard {shard.name} are not in the order of its "
                                  f"rows in {self._where(shard)!r}: the shard is damaged; "
                                  f"{redo_advice(shard.name)}")
            per_shard.append(ids[no] if ids is not None else
                             pf.read(columns=["id"], use_threads=False).column(0).to_numpy())
            if no < OPEN_FILES:  # kept open for the first lookups
                self._files[no] = (pf, threading.Lock())
            else:
                pf.close()
        self._group_starts = group_starts
        self._offsets = np.cumsum([0] + [len(a) for a in per_shard], dtype=np.int64)
        flat = (np.concatenate(per_shard).astype(np.int64, copy=False) if per_shard
                else np.empty(0, np.int64))
        self._flat = flat
        self._order = np.argsort(flat, kind="stable")
        self._sorted = flat[self._order]

    def shard_ids(self, no: int) -> np.ndarray:
        """The ids of shard ``no`` (of :attr:`shards`) in row order."""
        return self._flat[self._offsets[no]:self._offsets[no + 1]]

    def where(self, no: int) -> str:
        """Shard ``no``'s Parquet file (its path, or its URL), as errors name it."""
        return self._where(self.shards[no])

    def shared_id(self) -> tuple[int, int, int] | None:
        """An id that two rows hold, as (id, shard number, the other's shard number, in
        :attr:`shards`' order), or None: the ids are sorted already, so this is one pass."""
        return first_shared(self._sorted, self._order, self._offsets)

    def first_rows(self, no: int) -> tuple[list[int], list[str | None]]:
        """The ids and sources of shard ``no``'s first row group (a few rows: a sample of
        which units the shard holds, read without reading the file)."""
        pf, lock = self._file(no)
        try:
            with lock:
                table = pf.read_row_group(0, columns=["id", "source"], use_threads=False)
        except (pa.ArrowException, OSError) as exc:
            shard = self.shards[no]
            raise ConfigError(f"cannot read {self._where(shard)!r} ({exc}): the shard is damaged; "
                              f"{redo_advice(shard.name)}") from exc
        return table.column("id").to_pylist(), table.column("source").to_pylist()

    def __len__(self) -> int:
        return len(self._sorted)

    def locate(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(shard number, row in shard) of each id; -1, -1 where the id is unknown."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        pos = np.searchsorted(self._sorted, ids)
        pos_c = np.minimum(pos, max(len(self._sorted) - 1, 0))
        found = (pos < len(self._sorted)) & (self._sorted[pos_c] == ids) if len(self._sorted) else \
            np.zeros(len(ids), bool)
        flat = np.where(found, self._order[pos_c] if len(self._sorted) else 0, -1)
        shard = np.where(found, np.searchsorted(self._offsets, flat, side="right") - 1, -1)
        row = np.where(found, flat - self._offsets[np.maximum(shard, 0)], -1)
        return shard, row

    def _open(self, no: int) -> pq.ParquetFile:
        """A shard's Parquet file; one that is not Parquet is a ConfigError naming it, one
        whose commit record is gone too an :class:`IndexChanged` (a build removed it)."""
        shard = self.shards[no]
        try:
            if self._opener is not None:
                return pq.ParquetFile(self._opener(shard))
            with native_path(shard.path("parquet")) as name:
                return pq.ParquetFile(name, memory_map=True)
        except (pa.ArrowException, OSError) as exc:
            if self._opener is None and not (shard.folder / f"{shard.name}{COMMIT_SUFFIX}").exists():
                raise IndexChanged(f"shard {shard.name} was removed since the index was opened: a build "
                                   "is updating it; search again") from exc
            raise ConfigError(f"cannot read {self._where(shard)!r} ({exc}): the shard is "
                              f"damaged; {redo_advice(shard.name)}") from exc

    def _file(self, no: int) -> tuple[pq.ParquetFile, threading.Lock]:
        with self._files_lock:
            entry = self._files.get(no)
            if entry is not None:
                self._files.move_to_end(no)
                return entry
            entry = (self._open(no), threading.Lock())
            self._files[no] = entry
            while len(self._files) > OPEN_FILES:
                # dropped, not closed: a thread may be reading it; it closes when unused
                self._files.popitem(last=False)
            return entry

    def table(self, ids, columns: Iterable[str] = CHUNK_COLUMNS) -> dict[int, dict]:
        """The rows of ``ids`` as {id: {column: value}} (``id`` always among the columns);
        unknown ids are absent. ``id`` and ``chunk_no`` come from the id itself, so only
        the other columns asked for are read; the shards hit are read side by side
        (pyarrow decodes without the GIL)."""
        columns = ["id", *(c for c in columns if c != "id")]
        ids = np.unique(np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64))
        shard_nos, rows = self.locate(ids)
        work = [(no, ids[shard_nos == no].tolist(), rows[shard_nos == no], columns)
                for no in np.unique(shard_nos[shard_nos >= 0]).tolist()]
        out: dict[int, dict] = {}
        if len(work) > 1 and self._threads > 1:
            with self._files_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="embedingest-rows")
            parts = self._pool.map(lambda w: self._shard_rows(*w), work)
        else:
            parts = (self._shard_rows(*w) for w in work)
        for part in parts:
            out.update(part)
        return out

    def _shard_rows(self, no: int, mine_ids: list[int], mine: np.ndarray, columns: list[str]) -> dict:
        """The rows at positions ``mine`` of shard ``no`` (ids ``mine_ids``)."""
        read = [c for c in columns if c not in _DERIVED]
        starts = self._group_starts[no]
        groups = np.searchsorted(starts, mine, side="right") - 1
        wanted = np.unique(groups)
        sizes = starts[wanted + 1] - starts[wanted]
        base = np.cumsum(sizes) - sizes  # where each group read starts in the table
        take = base[np.searchsorted(wanted, groups)] + (mine - starts[groups])
        values = {}
        if read:
            pf, lock = self._file(no)
            with lock:
                table = pf.read_row_groups(wanted.tolist(), columns=["id", *read], use_threads=False)
            found = table.column("id").take(pa.array(take)).to_pylist()
            if found != mine_ids:
                self._refuse_other_rows(no, mine_ids, found)
            # only the rows asked for become Python values (Table.take would import pandas
            # on a first call)
            values = {c: table.column(c) for c in read}
        out = {}
        for k, i in zip(take.tolist(), mine_ids):
            row = {"id": i}
            for c in columns[1:]:
                row[c] = i & _CHUNK_MASK if c == "chunk_no" else values[c][k].as_py()
            out[i] = row
        return out

    def _refuse_other_rows(self, no: int, wanted: list[int], found: list[int]) -> None:
        """Rows read that are not those of the ids asked: :class:`IndexChanged` when a
        build replaced the shard's file since it was opened, else the shard is damaged
        (its rows are not in the order of its vectors: searching again finds the same)."""
        shard = self.shards[no]
        opened = self._opened[no]
        if opened is not None and _identity(shard.path("parquet")) == opened:
            bad = next(i for i, (w, f) in enumerate(zip(wanted, found)) if w != f)
            raise ConfigError(f"the rows of shard {shard.name} in {self._where(shard)!r} are not in the order "
                              f"of its vectors (the row of id {wanted[bad]} holds id {found[bad]}): the shard "
                              f"is damaged; {redo_advice(shard.name)}")
        raise IndexChanged(f"shard {shard.name} holds other rows than when the index was "
                           "opened: a build rewrote it; search again")

    def chunks(self, ids) -> dict[int, Chunk]:
        """The rows of ``ids`` as :class:`~embedingest.index.store.Chunk` (unknown ids absent)."""
        return {i: Chunk(i, i >> CHUNK_BITS, r["source"], r["record_id"], r["chunk_no"], r["span_start"],
                         r["span_end"], r["text"]) for i, r in self.table(ids).items()}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        with self._files_lock:
            for pf, _ in self._files.values():
                pf.close()
            self._files.clear()


def first_shared(ids_sorted: np.ndarray, order: np.ndarray, offsets: np.ndarray) -> tuple[int, int, int] | None:
    """The first id that two rows hold in ``ids_sorted`` (the shards' ids end to end,
    sorted by the stable ``order``; shard ``n``'s from ``offsets[n]``), as (id, shard,
    other shard); None when every id is once."""
    twice = np.flatnonzero(ids_sorted[1:] == ids_sorted[:-1])
    if not len(twice):
        return None
    at = int(twice[0])
    first, second = sorted(int(x) for x in order[at:at + 2])
    shard_of = np.searchsorted(offsets, [first, second], side="right") - 1
    return int(ids_sorted[at]), int(shard_of[0]), int(shard_of[1])


def _identity(path) -> tuple | None:
    """Which file is at ``path`` (device, inode, size, change time); None when none is."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _group_starts(meta: pq.FileMetaData, shard: Shard) -> np.ndarray:
    """The first row of each row group, and the row count last. Groups of the size the
    commit record gives (all but the last) are not asked one by one: a shard has
    thousands of them."""
    size, n = shard.record.get("row_group_rows"), meta.num_row_groups
    if isinstance(size, int) and size > 0 and n == -(-shard.rows // size) and n \
            and meta.row_group(n - 1).num_rows == shard.rows - (n - 1) * size:
        return np.append(np.arange(0, shard.rows, size, dtype=np.int64), np.int64(shard.rows))
    return np.cumsum([0] + [meta.row_group(g).num_rows for g in range(n)], dtype=np.int64)


CHECKED_GROUPS = 16


def _groups_match(meta: pq.FileMetaData, starts: np.ndarray, ids: np.ndarray) -> bool:
    """The smallest and largest ids of :data:`CHECKED_GROUPS` row groups spread over
    the file (its statistics) are those of the same rows of ``ids``: ids given out of
    their rows' order are found without reading the id column."""
    n = meta.num_row_groups
    for g in np.unique(np.linspace(0, n - 1, min(n, CHECKED_GROUPS)).astype(int)).tolist():
        st = meta.row_group(g).column(0).statistics
        if st is None or not st.has_min_max:
            continue  # a file written without statistics: nothing to compare
        part = ids[starts[g]:starts[g + 1]]
        if not len(part) or st.min != part.min() or st.max != part.max():
            return False
    return True

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

import threading
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (Table.take: imported at open, not in the first query)
import pyarrow.parquet as pq

from ..errors import ConfigError
from .shards import CHUNK_BITS, CHUNK_COLUMNS, Shard
from .store import Chunk

OPEN_FILES = 64


class ShardRows:
    """The chunk rows of committed ``shards``, by vector id."""

    def __init__(self, shards: Iterable[Shard]):
        self.shards = [s for s in shards if s.rows]
        self._files: OrderedDict[int, tuple[pq.ParquetFile, threading.Lock]] = OrderedDict()
        self._files_lock = threading.Lock()
        ids, group_starts = [], []
        for no, shard in enumerate(self.shards):
            pf = self._open(no)
            meta = pf.metadata
            if meta.num_rows != shard.rows:
                raise ConfigError(f"{str(shard.path('parquet'))!r} holds {meta.num_rows} rows, but "
                                  f"its commit record says {shard.rows}: the shard is damaged; "
                                  f"delete its files ({shard.name}.*) and run build-index again")
            sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            group_starts.append(np.cumsum([0] + sizes, dtype=np.int64))
            ids.append(pf.read(columns=["id"], use_threads=False).column(0).to_numpy())
            if no < OPEN_FILES:  # kept open for the first lookups
                self._files[no] = (pf, threading.Lock())
            else:
                pf.close()
        self._group_starts = group_starts
        self._offsets = np.cumsum([0] + [len(a) for a in ids], dtype=np.int64)
        flat = np.concatenate(ids).astype(np.int64, copy=False) if ids else np.empty(0, np.int64)
        self._flat = flat
        self._order = np.argsort(flat, kind="stable")
        self._sorted = flat[self._order]

    def shard_ids(self, no: int) -> np.ndarray:
        """The ids of shard ``no`` (of :attr:`shards`) in row order."""
        return self._flat[self._offsets[no]:self._offsets[no + 1]]

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
        return pq.ParquetFile(self.shards[no].path("parquet"), memory_map=True)

    def _file(self, no: int) -> tuple[pq.ParquetFile, threading.Lock]:
        with self._files_lock:
            entry = self._files.get(no)
            if entry is not None:
                self._files.move_to_end(no)
                return entry
            entry = (self._open(no), threading.Lock())
            self._files[no] = entry
            while len(self._files) > OPEN_FILES:
                self._files.popitem(last=False)[1][0].close()
            return entry

    def table(self, ids, columns: Iterable[str] = CHUNK_COLUMNS) -> dict[int, dict]:
        """The rows of ``ids`` as {id: {column: value}}; unknown ids are absent."""
        columns = list(columns)
        if "id" not in columns:
            columns = ["id", *columns]
        ids = np.unique(np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64))
        shard_nos, rows = self.locate(ids)
        out: dict[int, dict] = {}
        for no in np.unique(shard_nos[shard_nos >= 0]).tolist():
            mine = rows[shard_nos == no]
            starts = self._group_starts[no]
            groups = np.searchsorted(starts, mine, side="right") - 1
            wanted = np.unique(groups).tolist()
            pf, lock = self._file(no)
            with lock:
                table = pf.read_row_groups(wanted, columns=columns, use_threads=False)
            # rows of the groups read, in the order the groups were read
            base = np.cumsum([0] + [int(starts[g + 1] - starts[g]) for g in wanted])
            index = {g: b for g, b in zip(wanted, base[:-1].tolist())}
            take = np.array([index[g] for g in groups.tolist()], dtype=np.int64) + (mine - starts[groups])
            for row in table.take(pa.array(take)).to_pylist():
                out[row["id"]] = row
        return out

    def chunks(self, ids) -> dict[int, Chunk]:
        """The rows of ``ids`` as :class:`~embedingest.index.store.Chunk` (unknown ids absent)."""
        return {i: Chunk(i, i >> CHUNK_BITS, r["source"], r["record_id"], r["chunk_no"], r["span_start"],
                         r["span_end"], r["text"]) for i, r in self.table(ids).items()}

    def close(self) -> None:
        with self._files_lock:
            for pf, _ in self._files.values():
                pf.close()
            self._files.clear()

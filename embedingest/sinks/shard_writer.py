"""Shard writer (index format 2): the vectors a writer receives, with their chunks'
metadata, become shards it commits itself (see :mod:`embedingest.index.shards`).

It runs where the vectors land: an engine consumer process (:class:`ShardSink`), a device
process or a Ray actor (:class:`ShardWriter` directly). Imports numpy, pyarrow and faiss
only, never torch. The Parquet rows are streamed to the shard's temporary file a row
group at a time, so a writer holds one row group of text, not a whole shard's; the
vectors are added to the faiss index as they come (and kept as float16 when embeddings
are saved). Both happen in a thread of the writer's own, a few batches behind
:meth:`ShardWriter.add`, which returns once the batch is checked and copied: a faiss index
that doubles its storage (a copy of the whole shard so far) or a slow disk then holds up
that thread, not the engine's slots; its errors are raised by the next call. A commit
writes the Parquet, embeddings and faiss files (each through a temporary name, checked,
fsynced, renamed), then the commit record that makes the shard exist. A writer that dies
before that leaves files no record names: garbage that the next build deletes before it
redoes the units. With ``remote`` (an index in object
storage) the writer then uploads the shard, its commit record last
(:mod:`embedingest.index.remote_store`).
"""

from __future__ import annotations

import collections
import contextlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ConfigError
from ..index.faiss_factory import as_float32, copy_index, empty_index, read_index_file
from ..index.lock import hold_writer_lock
from ..index.shards import (
    CHUNK_SCHEMA,
    EMB_SUFFIX,
    FORMAT,
    HashingFile,
    PARQUET_SUFFIX,
    SHARD_NAME,
    BatchMeta,
    decode_chunks,
    ensure_shards_dir,
    faiss_name,
    hashes_record,
    now,
    shard_name,
    write_commit,
    write_hashed,
)
from ..outfiles import RUN_ID, atomic_file, new_run_id, write_streamed

ROW_GROUP_ROWS = 32
"""Rows per Parquet row group: a lookup reads (and decompresses) one group per hit, so
groups are small (docs/BENCHMARKS.md, index lookup: 32 against 64 rows)."""
_FAISS_CHUNK = 1 << 20
STORE_BEHIND = 16
"""Batches a writer's thread may be behind :meth:`ShardWriter.add` (memory: that many
batches' vectors and rows)."""
PARQUET_OPTIONS = {"compression": "zstd", "use_dictionary": ["source", "record_id"],
                   "write_statistics": ["id"]}


@dataclass
class ShardWriterFactory:
    """Picklable recipe of the shard writers of one run; called with a worker number in
    each engine consumer it gives that consumer's :class:`ShardSink`."""

    folder: str  # the index folder (shards go to its shards/ directory)
    dim: int
    factory: str = "Flat"
    metric: str = "ip"
    run_id: str = field(default_factory=new_run_id)
    commit_every: int = 200_000
    trained: str | None = None
    save_embeddings: bool = False
    generation: int = 0
    row_group_rows: int = ROW_GROUP_ROWS
    remote: str | None = None  # s3:// URL of the index: each shard is uploaded once committed

    def __post_init__(self):
        self.folder = os.fspath(self.folder)
        if self.trained is not None:
            self.trained = os.fspath(self.trained)
        if not RUN_ID.fullmatch(self.run_id):
            raise ConfigError(f"run id {self.run_id!r} may hold only letters, digits and '_'")
        for name in ("dim", "commit_every", "row_group_rows"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.trained is None:
            empty_index(self.dim, self.factory, self.metric)  # fail here, not in a consumer
        elif not Path(self.trained).is_file():
            raise ConfigError(f"trained index {self.trained!r} does not exist; "
                              "train one with IndexStore.train_index")

    def __call__(self, worker: int) -> ShardSink:
        return ShardSink(self, worker)

    def load_trained(self) -> faiss.Index | None:
        if self.trained is None:
            return None
        trained = read_index_file(Path(self.trained), redo="delete it and run build-index again "
                                  "(it is trained again)")
        if trained.d != self.dim:
            raise ConfigError(f"trained index {self.trained!r} has dim {trained.d}, not {self.dim}")
        return trained


class ShardWriter:
    """One shard being written: :meth:`add` batches, then :meth:`commit`. A writer dropped
    before its commit leaves a temporary Parquet file, which the next build deletes."""

    def __init__(self, spec: ShardWriterFactory, name: str, trained: faiss.Index | None = None,
                 folder: Path | None = None, replaces: tuple = ()):
        if not SHARD_NAME.fullmatch(name):
            raise ConfigError(f"{name!r} is not a shard name (shard-<run>-w<worker>-<part>)")
        self.spec, self.name, self.replaces = spec, name, tuple(replaces)
        self.folder = folder or ensure_shards_dir(spec.folder)
        if (self.folder / f"{name}.commit.json").exists():
            raise ConfigError(f"shard {name} already exists in {str(self.folder)!r}: run id "
                              f"{spec.run_id!r} was used before; start each run with a new one")
        self._trained = trained
        self._index: faiss.IndexIDMap | None = None
        self._emb: list[np.ndarray] = []
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._parquet_file = None  # (ExitStack holding the temporary file, hashing file, writer)
        self._storing: collections.deque[Future] = collections.deque()  # oldest first
        self._thread: ThreadPoolExecutor | None = None
        self._broken: BaseException | None = None  # the thread's error: no commit after it
        self.rows = 0
        self.id_min: int | None = None
        self.id_max: int | None = None
        self.units: dict[int, int] = {}
        self.hashes: dict[int, str] = {}

    def add(self, emb: np.ndarray, ids: np.ndarray, chunks: pa.RecordBatch | bytes,
            units_done=(), unit_hashes=()) -> None:
        """Add vectors ``emb`` under ``ids`` with their rows ``chunks`` (same order, ids
        equal), and record ``units_done`` ((unit_no, n_chunks) pairs) as finished here,
        with ``unit_hashes`` ((unit_no, sha256) pairs, of some of them)."""
        if self._broken is not None:
            raise self._broken
        chunks = decode_chunks(chunks)
        n = len(ids)
        if emb.ndim != 2 or emb.shape != (n, self.spec.dim):
            raise ConfigError(f"shard {self.name}: embeddings of shape {emb.shape} for {n} ids, "
                              f"expected ({n}, {self.spec.dim})")
        ids = np.array(ids, dtype=np.int64)  # a copy: the engine's slot is reused
        if chunks.num_rows != n or not np.array_equal(
                chunks.column(0).to_numpy(zero_copy_only=False), ids):
            raise ConfigError(f"shard {self.name}: the {chunks.num_rows} metadata rows of a batch "
                              f"do not match its {n} vector ids")
        if not np.array_equal(chunks.column(3).to_numpy(zero_copy_only=False), ids & 0xFFFFFFFF):
            raise ConfigError(f"shard {self.name}: chunk numbers of a batch are not the low half "
                              "of their vector ids (unit_no << 32 | chunk_no)")
        for unit, n_chunks in units_done:
            self.units[int(unit)] = int(n_chunks)
        for unit, digest in unit_hashes:
            if int(unit) not in self.units:
                raise ConfigError(f"shard {self.name}: a hash for unit {unit}, which no batch "
                                  "finished: a unit's hash goes with its finishing")
            self.hashes[int(unit)] = str(digest)
        if not n:
            return
        vectors = np.array(as_float32(emb), dtype=np.float32, order="C")  # a copy: the slot is reused
        self.rows += n
        lo, hi = int(ids.min()), int(ids.max())
        self.id_min = lo if self.id_min is None else min(self.id_min, lo)
        self.id_max = hi if self.id_max is None else max(self.id_max, hi)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"embedingest-{self.name}")
        while len(self._storing) >= STORE_BEHIND:
            self._result(self._storing[0])
            self._storing.popleft()
        self._storing.append(self._thread.submit(self._store, vectors, ids, chunks))

    def _store(self, vectors: np.ndarray, ids: np.ndarray, chunks: pa.RecordBatch) -> None:
        """Add a batch to the faiss index and the Parquet rows (the writer's thread)."""
        if self._index is None:
            spec = self.spec
            base = (copy_index(self._trained) if self._trained is not None
                    else empty_index(spec.dim, spec.factory, spec.metric))
            self._index = faiss.IndexIDMap(base)
        self._index.add_with_ids(vectors, ids)
        if self.spec.save_embeddings:
            self._emb.append(vectors.astype(np.float16))
        self._pending.append(chunks)
        self._pending_rows += len(ids)
        if self._pending_rows >= self.spec.row_group_rows:
            self._write_row_groups(final=False)

    def _result(self, stored: Future) -> None:
        """Wait for one batch's store; its error is raised here and by every later call
        (an interrupt of the wait itself, Ctrl-C or the engine's SIGTERM, is not its error:
        the batch stays queued and the commit waits for it)."""
        try:
            stored.result()
        except BaseException as exc:
            if stored.done() and not stored.cancelled() and stored.exception() is exc:
                self._broken = exc
            raise

    def _stored(self) -> None:
        """Wait until the writer's thread has stored every batch (its thread then ends);
        raise its error, if any (the batches behind the failed one are dropped)."""
        while self._storing:
            try:
                self._result(self._storing[0])
            except BaseException:
                if self._broken is not None:
                    for stored in self._storing:
                        stored.cancel()
                    self._storing.clear()
                    self._thread.shutdown(wait=True)
                    self._thread = None
                raise
            self._storing.popleft()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._broken is not None:
            raise self._broken

    def _write_row_groups(self, final: bool) -> None:
        """Write the buffered rows as whole row groups (the rest too when ``final``)."""
        size = self.spec.row_group_rows
        table = pa.Table.from_batches(self._pending, schema=CHUNK_SCHEMA)
        cut = table.num_rows if final else table.num_rows - table.num_rows % size
        if cut:
            if self._parquet_file is None:
                stack = contextlib.ExitStack()
                fh = stack.enter_context(atomic_file(self.folder / f"{self.name}{PARQUET_SUFFIX}"))
                hashing = HashingFile(fh)
                writer = pq.ParquetWriter(hashing, CHUNK_SCHEMA, **PARQUET_OPTIONS)
                self._parquet_file = (stack, hashing, writer)
            self._parquet_file[2].write_table(table.slice(0, cut), row_group_size=size)
        rest = table.slice(cut)
        self._pending = rest.to_batches() if rest.num_rows else []
        self._pending_rows = rest.num_rows

    def commit(self) -> dict:
        """Write the shard's files, then its commit record; return the record."""
        self._stored()
        files = {}
        if self.rows:
            self._write_row_groups(final=True)
            stack, hashing, writer = self._parquet_file
            self._parquet_file = None
            writer.close()
            stack.close()  # flushed, checked, fsynced, renamed
            files["parquet"] = hashing.summary(f"{self.name}{PARQUET_SUFFIX}")
            if self.spec.save_embeddings:
                emb = np.concatenate(self._emb)
                files["emb"] = write_hashed(self.folder / f"{self.name}{EMB_SUFFIX}",
                                            lambda fh: np.lib.format.write_array(fh, emb, allow_pickle=False))
            files["faiss"] = write_faiss_hashed(self._index, self.folder / faiss_name(self.name, self.spec.generation))
        units = sorted(self.units.items())
        record = {"format": FORMAT, "name": self.name, "rows": self.rows,
                  "id_min": self.id_min if self.rows else 0, "id_max": self.id_max if self.rows else -1,
                  "dim": self.spec.dim, "factory": self.spec.factory, "generation": self.spec.generation,
                  "row_group_rows": self.spec.row_group_rows, "files": files, "units": [[u for u, _ in units], [n for _, n in units]],
                  "replaces": list(self.replaces), "run": self.spec.run_id, "created": now(),
                  **hashes_record(self.hashes.items())}
        write_commit(self.folder, record)
        self._index, self._emb, self._pending = None, [], []
        if self.spec.remote:
            from ..index.remote_store import upload_shard

            upload_shard(self.spec.remote, self.folder, record)
        return record


def write_faiss_hashed(index: faiss.Index, path: Path) -> dict:
    """Write a faiss index like :func:`~embedingest.outfiles.write_faiss_index`, hashing
    the bytes on their way (:class:`~embedingest.index.shards.HashingFile`: beside the
    write); return {name, size, sha256}."""
    hashing: list[HashingFile] = []

    def produce(write) -> None:
        hashing.append(HashingFile(SimpleNamespace(write=write)))
        faiss.write_index(index, faiss.PyCallbackIOWriter(hashing[0].write, _FAISS_CHUNK))

    write_streamed(path, produce)
    return hashing[0].summary(path.name)


class ShardSink:
    """Engine sink: ``arrays["emb"]`` under ``arrays["ids"]``, the batch id a
    :class:`~embedingest.index.shards.BatchMeta` with the rows; a shard is committed
    every ``commit_every`` rows (shards hold exactly that many, the last fewer)."""

    def __init__(self, spec: ShardWriterFactory, worker: int):
        self.spec, self.worker = spec, worker
        self.folder = ensure_shards_dir(spec.folder)
        # Held until the last commit (close) or this process's death: a new build of the
        # folder waits for it (index/lock.py).
        self._writer_lock: int | None = hold_writer_lock(spec.folder)
        self._trained = spec.load_trained()
        self._part = 0
        self._writer: ShardWriter | None = None
        self.written: list[dict] = []

    def _current(self) -> ShardWriter:
        if self._writer is None:
            self._writer = ShardWriter(self.spec, shard_name(self.spec.run_id, self.worker, self._part),
                                       self._trained, self.folder)
        return self._writer

    def __call__(self, batch_id: BatchMeta, arrays: dict) -> None:
        if not isinstance(batch_id, BatchMeta):
            raise ConfigError(f"batch {batch_id!r} carries no chunk metadata: submit a BatchMeta "
                              "as the batch id to a shard writer")
        emb, ids = arrays["emb"], arrays["ids"]
        chunks = decode_chunks(batch_id.chunks)
        start, n = 0, len(ids)
        while True:
            writer = self._current()
            stop = min(n, start + self.spec.commit_every - writer.rows)
            last = stop == n
            writer.add(emb[start:stop], ids[start:stop], chunks.slice(start, stop - start),
                       batch_id.units_done if last else (), batch_id.unit_hashes if last else ())
            start = stop
            if writer.rows >= self.spec.commit_every:
                self.commit()
            if last:
                return

    def commit(self) -> None:
        """Commit the current shard (when it holds rows or finished units)."""
        writer, self._writer = self._writer, None
        if writer is None or not (writer.rows or writer.units):
            return
        record = writer.commit()
        self.written.append({"name": record["name"], "count": record["rows"]})
        self._part += 1

    def close(self) -> list[dict]:
        """Commit what is left; return every shard this sink wrote as {name, count}."""
        try:
            self.commit()
        finally:
            if self._writer_lock is not None:
                os.close(self._writer_lock)
                self._writer_lock = None
        return list(self.written)


MARKS_WORKER = 9999
"""The worker number of the shard :func:`commit_finished` writes (no engine consumer has it)."""


def commit_finished(spec: ShardWriterFactory, units_done, part: int = 0, unit_hashes=()) -> dict | None:
    """Commit a shard of no rows that declares ``units_done`` ((unit_no, n_chunks) pairs)
    finished, with ``unit_hashes`` ((unit_no, sha256) of some of them): for the units
    whose finishing came after the last batch a writer got (their rows are in the shards
    of the writers that got them). None when there are none."""
    units_done = list(units_done)
    if not units_done:
        return None
    writer = ShardWriter(spec, shard_name(spec.run_id, MARKS_WORKER, part))
    empty = np.zeros((0, spec.dim), np.float32)
    chunks = pa.RecordBatch.from_pylist([], schema=CHUNK_SCHEMA)
    writer.add(empty, np.zeros(0, np.int64), chunks, units_done, unit_hashes)
    return writer.commit()

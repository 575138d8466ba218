"""Chunk metadata written to sqlite by a background thread, off the encoding loop.

The main process feeds the GPU, so it must not spend its time, or its GIL, on the
id -> source rows. The DataLoader workers already made each batch's rows into one JSON
text (:class:`~embedingest.sources.text_dataset.Chunks`); they are buffered here, handed
over a few times a second, and written by a thread with its own connection, one
statement per batch, during which sqlite holds no GIL. (Rows bound one by one through
``executemany`` take the GIL for each row: next to a busy thread the writer then
managed ~1,500 rows a second; ``benchmarks/metadata_gil.py``.) The queue is bounded:
when the thread falls behind, ``add`` waits instead of memory growing.

A unit is marked done only after its chunk rows are written, never before: a run killed
at any point leaves units that are not done, and the next run redoes them.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import TYPE_CHECKING

from ..sources.text_dataset import CHUNK_FIELDS, Chunks

if TYPE_CHECKING:
    from .store import IndexStore

BUSY_TIMEOUT_MS = 600_000  # wait this long for another process's commit (several devices)


def _plain(value):
    """numpy scalars (from Arrow or numpy columns) as the Python values JSON takes."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"chunk field {value!r} ({type(value).__name__}) is not a string or number")


class MetadataWriter:
    """Buffers chunk rows and finished units; a thread writes them in order, one
    transaction per hand-over. Use as a context manager, or call :meth:`close`."""

    def __init__(self, store: IndexStore, every: float = 0.5, max_rows: int = 50_000,
                 depth: int = 4):
        self.store, self.every, self.max_rows = store, every, max_rows
        self.rows: list[str] = []  # JSON payloads
        self.n_rows = 0
        self.done: list[tuple[int, int]] = []
        self.last = time.monotonic()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # Seconds ``add`` waited for the thread (it fell behind) and the thread spent
        # writing, lock waits on other processes' commits included.
        self.blocked_s = 0.0
        self.write_s = 0.0

    def __enter__(self) -> MetadataWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(flush=exc_type is None)

    def add(self, item: dict) -> None:
        """Take the ``chunks`` and ``units_done`` of one batch (a dataset item); chunks
        given as dicts (without ``id``) are made into JSON here."""
        c = item["chunks"]
        if len(c):
            if isinstance(c, Chunks):
                self.rows.append(c.json)
            else:
                self.rows.append(json.dumps([[r["unit_no"] << 32 | r["chunk_no"],
                                              *(r[f] for f in CHUNK_FIELDS[1:])] for r in c],
                                            default=_plain))
            self.n_rows += len(c)
        self.done.extend((int(u), int(n)) for u, n in item["units_done"])
        if time.monotonic() - self.last > self.every or self.n_rows > self.max_rows:
            self._hand_over()

    def flush(self) -> None:
        """Write everything added so far; return when it is committed."""
        self._hand_over()
        self._queue.join()
        self._raise()

    def close(self, flush: bool = True, raise_errors: bool = True) -> None:
        """Stop the thread, after writing what was added when ``flush``; with
        ``raise_errors=False`` (cleaning up after another failure) a write error is
        dropped, so it does not hide the failure being handled."""
        try:
            if flush:
                self.flush()
        except Exception:
            if raise_errors:
                raise
        finally:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None

    def _hand_over(self) -> None:
        self._raise()
        if self.rows or self.done:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="embedingest-metadata",
                                                daemon=True)
                self._thread.start()
            t = time.perf_counter()
            self._queue.put((self.rows, self.done))
            self.blocked_s += time.perf_counter() - t
        self.rows, self.done, self.last, self.n_rows = [], [], time.monotonic(), 0

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        """Write hand-overs in order until None; after a failure, only take them off the
        queue (so flush and close never hang) and leave the error for the caller."""
        db = None
        try:
            while True:
                work = self._queue.get()
                try:
                    if work is None:
                        return
                    if self._error is None:
                        t = time.perf_counter()
                        db = db or self.store.connect(BUSY_TIMEOUT_MS)
                        rows, done = work
                        if rows:
                            self.store.insert_chunk_json(rows, db)
                        if done:
                            self.store.mark_units_done(done, db)
                        self.write_s += time.perf_counter() - t
                except BaseException as exc:  # re-raised in the caller's thread
                    self._error = exc
                finally:
                    self._queue.task_done()
        finally:
            if db is not None:
                db.close()

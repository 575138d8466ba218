"""Chunk metadata written to sqlite by a background thread, off the encoding loop.

Inserting the id -> source rows costs about as much CPU per chunk as everything else the
main process does for it (sqlite does ~100k rows/s), and the main process is what feeds
the GPU. So rows are buffered, handed over a few times a second, and written by a
thread with its own connection; sqlite releases the GIL while it writes. The queue is
bounded: when the thread falls behind, ``add`` waits instead of memory growing.

A unit is marked done only after its chunk rows are written, never before: a run killed
at any point leaves units that are not done, and the next run redoes them.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

from ..sources.text_dataset import Chunks

if TYPE_CHECKING:
    from .store import IndexStore

BUSY_TIMEOUT_MS = 600_000  # wait this long for another process's commit (several devices)


class MetadataWriter:
    """Buffers chunk rows and finished units; a thread writes them in order, one
    transaction per hand-over. Use as a context manager, or call :meth:`close`."""

    def __init__(self, store: IndexStore, every: float = 0.5, max_rows: int = 50_000,
                 depth: int = 4):
        self.store, self.every, self.max_rows = store, every, max_rows
        self.rows: list[tuple] = []
        self.done: list[tuple[int, int]] = []
        self.last = time.monotonic()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MetadataWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(flush=exc_type is None)

    def add(self, item: dict) -> None:
        """Take the ``chunks`` and ``units_done`` of one batch (a dataset item)."""
        c = item["chunks"]
        if isinstance(c, Chunks):
            self.rows.extend(zip(c.id, c.unit_no, c.record_id, c.chunk_no, c.char_start,
                                 c.char_end, c.text))
        else:
            self.rows.extend((r["unit_no"] << 32 | r["chunk_no"], r["unit_no"], r["record_id"],
                              r["chunk_no"], r["char_start"], r["char_end"], r["text"]) for r in c)
        self.done.extend((int(u), int(n)) for u, n in item["units_done"])
        if time.monotonic() - self.last > self.every or len(self.rows) > self.max_rows:
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
            self._queue.put((self.rows, self.done))
        self.rows, self.done, self.last = [], [], time.monotonic()

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
                        db = db or self.store.connect(BUSY_TIMEOUT_MS)
                        rows, done = work
                        if rows:
                            self.store.insert_chunk_rows(rows, db)
                        if done:
                            self.store.mark_units_done(done, db)
                except BaseException as exc:  # re-raised in the caller's thread
                    self._error = exc
                finally:
                    self._queue.task_done()
        finally:
            if db is not None:
                db.close()

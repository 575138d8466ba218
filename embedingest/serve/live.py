"""The index a server answers from, opened again when a build has changed it.

build-index updates an index in place (new files added, changed ones redone, removed
ones dropped) and rewrites its manifest, by rename, as its last step. A server that kept
the index it opened would go on answering from the old shards, and ``/files/ID`` would
serve a file's new text beside a hit's old one. So each request first looks at the
manifest (one ``stat``, at most every ``check_every`` seconds); when it is another file
than the one opened, the index is opened anew and requests from then on use it. The
query encoder is kept when the model and prompts stay the same. A request holds the
index it started with to its end; the old one is left to the garbage collector, not
closed under a request still reading it. An index that cannot be opened (a build that
damaged it, a folder being replaced) keeps the old one answering, logged.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..index.search import Index
from ..index.store import MANIFEST_NAME, IndexStore

log = logging.getLogger("embedingest")


def _signature(path: Path) -> tuple | None:
    """Which manifest file is there (inode, size, change time), None when none is."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class LiveIndex:
    """``current()``: the index to answer a request from. ``reopen(encoder)`` opens the
    index again with the query encoder given (None: its own model, loaded anew)."""

    def __init__(self, index: Index, reopen: Callable[[object], Index] | None = None,
                 check_every: float = 1.0):
        self._index = index
        self._reopen = reopen
        self._check_every = check_every
        self._manifest = Path(index.store.folder) / MANIFEST_NAME if reopen is not None else None
        self._seen = _signature(self._manifest) if self._manifest is not None else None
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def current(self) -> Index:
        if self._manifest is None or time.monotonic() - self._checked < self._check_every:
            return self._index
        with self._lock:
            if time.monotonic() - self._checked >= self._check_every:
                self._checked = time.monotonic()
                seen = _signature(self._manifest)
                if seen is not None and seen != self._seen:
                    self._swap(seen)
            return self._index

    def _swap(self, seen: tuple) -> None:
        old = self._index
        try:
            manifest = IndexStore(old.store.folder, read_only=True).read_manifest()
            same_model = (manifest.model.get("name"), manifest.dim, manifest.prompts) == (
                old.manifest.model.get("name"), old.manifest.dim, old.manifest.prompts)
            self._index = self._reopen(old.loaded_encoder if same_model else None)
        except Exception as exc:  # the old index answers on; the next change is tried again
            log.warning("the index at %s changed but cannot be opened again (%s); still answering "
                        "from the one opened before", old.store.folder, exc)
        else:
            log.info("the index at %s changed: opened again (%d vectors, %d before)",
                     old.store.folder, self._index.ntotal, old.ntotal)
        self._seen = seen

    def close(self) -> None:
        self._index.close()

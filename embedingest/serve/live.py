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

from ..index.search import Index, path_signature
from ..index.shard_store import ASIDE_DIR, answering_folder
from ..index.store import MANIFEST_NAME, IndexStore

log = logging.getLogger("embedingest")


class LiveIndex:
    """``current()``: the index to answer a request from. ``reopen(encoder)`` opens the
    index again with the query encoder given (None: its own model, loaded anew)."""

    def __init__(self, index: Index, reopen: Callable[[object], Index] | None = None,
                 check_every: float = 1.0, folder: str | os.PathLike | None = None):
        self._index = index
        self._reopen = reopen
        self._check_every = check_every
        # the folder asked for: the index may be answered from its .overwritten/ meanwhile
        self._folder = folder = Path(folder if folder is not None else index.store.folder)
        self._manifests = ((folder / MANIFEST_NAME, folder / ASIDE_DIR / MANIFEST_NAME)
                           if reopen is not None else None)
        self._seen = self._signature()
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _signature(self) -> tuple | None:
        """Which manifests are there: the folder's and a set-aside one (while a rebuild
        with --overwrite runs, the index before it is answered from)."""
        if self._manifests is None:
            return None
        found = tuple(path_signature(path) for path in self._manifests)
        return found if found[0] is not None or found[1] is not None else None

    def refresh(self) -> Index:
        """Open the index again now (a request found a shard it opened replaced), unless
        another request did meanwhile; the index to answer from."""
        stale = self._index
        with self._lock:
            if self._index is stale and self._reopen is not None:
                self._checked = time.monotonic()
                self._swap(self._signature())
            return self._index

    def current(self) -> Index:
        if self._manifests is None or time.monotonic() - self._checked < self._check_every:
            return self._index
        with self._lock:
            if time.monotonic() - self._checked >= self._check_every:
                self._checked = time.monotonic()
                seen = self._signature()
                if seen is not None and seen != self._seen:
                    self._swap(seen)
            return self._index

    def _swap(self, seen: tuple) -> None:
        old = self._index
        try:
            manifest = IndexStore(answering_folder(self._folder), read_only=True).read_manifest()
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

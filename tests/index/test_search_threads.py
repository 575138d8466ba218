"""An open index searched from several threads, and its segments scanned side by side."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from index_fixtures import unit_vectors
from index_fixtures import build_index

from embedingest.index import search
from embedingest.index.search import open_index


def test_segments_scanned_in_threads_equal_brute_force(tmp_path, monkeypatch):
    built = build_index(tmp_path, n_units=8, chunks=25, commit_every=30, workers=3)
    queries = unit_vectors(7, seed=11)
    monkeypatch.setattr(search, "PARALLEL_FROM", 0)
    with open_index(built.store.folder) as index:
        assert len(index.shards) > 3
        scores, ids = index.search_raw(queries, 15)
        assert index._pool is not None  # the threaded path ran
    want_s, want_i = built.brute_force(queries, 15)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_allclose(scores, want_s, rtol=1e-5)


def test_hits_from_many_threads_at_once(tmp_path):
    built = build_index(tmp_path, n_units=4, chunks=20)
    queries = unit_vectors(24, seed=3)
    with open_index(built.store.folder) as index:
        alone = [index.search_vectors(q, k=3)[0] for q in queries]
        with ThreadPoolExecutor(6) as pool:  # each thread reads the metadata on its own connection
            together = list(pool.map(lambda q: index.search_vectors(q, k=3)[0], queries))
    assert together == alone and all(h.text for hits in together for h in hits)


def test_shards_are_scanned_side_by_side_only_when_there_is_enough_to_scan(tmp_path, monkeypatch):
    """Threads for two shards or more holding ``PARALLEL_FROM`` vectors between them, at most
    one a shard and one a core, named for what they do; one shard, or fewer vectors, are
    scanned on the caller's thread (no pool is made)."""
    two = build_index(tmp_path / "two", n_units=2, chunks=20, commit_every=1000, workers=2)
    one = build_index(tmp_path / "one", n_units=2, chunks=20, commit_every=1000, workers=1)
    queries = unit_vectors(2, seed=1)

    def pooled(folder, parallel_from):
        monkeypatch.setattr(search, "PARALLEL_FROM", parallel_from)
        with open_index(folder) as index:
            index.search_raw(queries, 5)
            named = [t.name for t in threading.enumerate() if t.name.startswith("embedingest-search_")]
            found = len(index.shards), index.ntotal, index._pool and index._pool._max_workers, bool(named)
            index.close()  # and again on leaving the block: closing twice is harmless
        return found
    assert pooled(two.store.folder, 40) == (2, 40, min(2, os.cpu_count()), True)
    assert pooled(two.store.folder, 41) == (2, 40, None, False)
    assert pooled(one.store.folder, 0) == (1, 40, None, False)

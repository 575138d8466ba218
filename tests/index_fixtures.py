"""Helpers of the index tests: seeded unit vectors and an index folder built the way the
build job does it (units in units.sqlite, rows and vectors through the shard writers)."""

import numpy as np

from embedingest.index.store import Manifest, vector_ids

DIM = 16


def unit_vectors(n, seed=0, dim=DIM):
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class Built:
    """The store plus every vector and id fed to the sinks, for brute-force checks."""

    def __init__(self, store, emb, ids, unit_nos):
        self.store, self.emb, self.ids, self.unit_nos = store, emb, ids, unit_nos

    def brute_force(self, queries, k, metric="ip", keep=None):
        emb, ids = (self.emb, self.ids) if keep is None else (self.emb[keep], self.ids[keep])
        if metric == "ip":
            scores = queries @ emb.T
            order = np.argsort(-scores, axis=1)[:, :k]
        else:
            scores = ((queries[:, None, :] - emb[None]) ** 2).sum(-1)
            order = np.argsort(scores, axis=1)[:, :k]
        return np.take_along_axis(scores, order, 1), ids[order]


def build_index(folder, n_units=6, chunks=20, factory="Flat", metric="ip", commit_every=50,
                   workers=2, seed=0):
    """Units doc0.txt.. of ``chunks`` chunks each, fed in batches of 17 dealt round robin
    to ``workers`` shard writers (each batch's rows as Arrow bytes, a unit declared
    finished with the batch of its last chunk). ``store`` is a ShardStore."""
    from embedingest.index.shard_store import ShardStore
    from embedingest.index.shards import BatchMeta, encode_chunks
    from embedingest.sinks.shard_writer import ShardWriterFactory

    store = ShardStore(folder)
    store.create_or_open(Manifest(model={"name": "test-model", "path": "/nowhere"}, dim=DIM,
                                  metric=metric, factory=factory))
    trained = store.train_index(factory, DIM, metric, unit_vectors(500, seed=seed + 99))
    unit_nos = store.upsert_units(
        {"key": f"doc{u}.txt", "size": 100 * u, "mtime_ns": u, "sha256": f"h{u}"} for u in range(n_units))
    rows = [(int(vector_ids(no, [c])[0]), key, f"rec{no}", c, 10 * c, 10 * c + 9, f"text {key} {c}")
            for key, no in unit_nos.items() for c in range(chunks)]
    ids = np.array([r[0] for r in rows], dtype=np.int64)
    emb = unit_vectors(len(ids), seed=seed)
    spec = ShardWriterFactory(str(store.folder), DIM, factory=factory, metric=metric,
                              commit_every=commit_every, trained=trained)
    sinks = [spec(w) for w in range(workers)]
    for b, start in enumerate(range(0, len(ids), 17)):  # batches dealt round robin
        part = rows[start:start + 17]
        done = tuple((r[0] >> 32, chunks) for r in part if r[3] == chunks - 1)
        meta = BatchMeta(b, encode_chunks(*(list(col) for col in zip(*part))), done)
        sinks[b % workers](meta, {"emb": emb[start:start + 17], "ids": ids[start:start + 17]})
    for sink in sinks:
        sink.close()
    store.update_shards()
    return Built(store, emb, ids, unit_nos)



class _V1:
    def __init__(self, folder):
        self.folder = folder

    def close(self):
        pass


def build_v1(folder):
    """The files by which a format-1 index is known (a manifest without a format field,
    ``metadata.sqlite`` with its chunks table, ``segments/`` with a segment and its ids
    sidecar), for the tests that it is refused and wiped, never read."""
    import json
    import sqlite3
    from pathlib import Path
    from types import SimpleNamespace

    folder = Path(folder)
    (folder / "segments").mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({
        "model": {"name": "test-model", "path": "/nowhere"}, "dim": DIM, "metric": "ip",
        "factory": "Flat", "segments": [{"name": "seg-r-w0-00000", "count": 1}]}))
    db = sqlite3.connect(folder / "metadata.sqlite")
    db.execute("CREATE TABLE chunks(id INTEGER PRIMARY KEY, text TEXT)")
    db.commit()
    db.close()
    (folder / "segments" / "seg-r-w0-00000.faiss").write_bytes(b"\0" * 64)
    (folder / "segments" / "seg-r-w0-00000.ids.npy").write_bytes(b"\0" * 64)
    return SimpleNamespace(store=_V1(folder))

"""Helpers of the index tests: seeded unit vectors and an index folder built the way the
build job does it (units and chunk rows in the metadata, vectors through the shard sink)."""

import numpy as np

from embedingest.index.store import IndexStore, Manifest, vector_ids
from embedingest.sinks.faiss_shards import FaissShardSinkFactory

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
    to ``workers`` sinks."""
    store = IndexStore(folder)
    store.create_or_open(Manifest(model={"name": "test-model", "path": "/nowhere"}, dim=DIM,
                                  metric=metric, factory=factory))
    trained = store.train_index(factory, DIM, metric, unit_vectors(500, seed=seed + 99))
    unit_nos = store.upsert_units(
        {"key": f"doc{u}.txt", "size": 100 * u, "mtime_ns": u, "sha256": f"h{u}",
         "n_chunks": chunks, "status": "done"} for u in range(n_units))
    store.insert_chunks(
        (no, f"rec{no}", c, 10 * c, 10 * c + 9, f"text {key} {c}")
        for key, no in unit_nos.items() for c in range(chunks))
    ids = np.concatenate([vector_ids(no, np.arange(chunks)) for no in unit_nos.values()])
    emb = unit_vectors(len(ids), seed=seed)
    factory_ = FaissShardSinkFactory(str(store.folder), DIM, factory=factory, metric=metric,
                                     commit_every=commit_every, trained=trained)
    sinks = [factory_(w) for w in range(workers)]
    for b, start in enumerate(range(0, len(ids), 17)):  # batches dealt round robin
        sinks[b % workers](b, {"emb": emb[start:start + 17], "ids": ids[start:start + 17]})
    for sink in sinks:
        sink.close()
    store.update_shards()
    return Built(store, emb, ids, unit_nos)


def build_index_v2(folder, n_units=6, chunks=20, factory="Flat", metric="ip", commit_every=50,
                   workers=2, seed=0):
    """:func:`build_index` in index format 2: the same units, rows and vectors, written by
    shard writers (each batch's rows as Arrow bytes, a unit declared finished with the
    batch of its last chunk). ``store`` is a ShardStore."""
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

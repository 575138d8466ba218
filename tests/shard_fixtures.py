"""Helpers of the format-2 index tests: a folder of shards written the way build-index's
consumers write them (batches dealt round robin to several shard writers, each batch's
rows as Arrow IPC bytes, a unit declared finished with the batch of its last chunk)."""

from dataclasses import dataclass

import numpy as np

from embedingest.index.shards import BatchMeta, encode_chunks
from embedingest.index.store import IndexStore, Manifest
from embedingest.sinks.shard_writer import ShardWriterFactory

DIM = 16


def unit_vectors(n, seed=0, dim=DIM):
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@dataclass
class Built:
    folder: object
    emb: np.ndarray
    ids: np.ndarray
    rows: dict  # id -> {column: value}
    written: list

    def brute_force(self, queries, k):
        scores = queries @ self.emb.T
        order = np.argsort(-scores, axis=1)[:, :k]
        return np.take_along_axis(scores, order, 1), self.ids[order]


def chunk_row(unit, c, key):
    text = f"text of {key} chunk {c} " + "word " * (c % 7) + "\0nul" * (c == 3)
    return {"id": unit << 32 | c, "source": key, "record_id": None if unit % 2 else f"rec{unit}",
            "chunk_no": c, "span_start": 10 * c, "span_end": 10 * c + len(text), "text": text}


def batches(units, chunks, batch=17):
    """(rows, units_done) per batch, units in order, their chunks in order."""
    rows = [chunk_row(u, c, f"docs/doc{u}.txt") for u in units for c in range(chunks)]
    out = []
    for start in range(0, len(rows), batch):
        part = rows[start:start + batch]
        done = tuple((r["id"] >> 32, chunks) for r in part if r["chunk_no"] == chunks - 1)
        out.append((part, done))
    return out


def meta_of(no, part, done):
    cols = {k: [r[k] for r in part] for k in part[0]} if part else {k: [] for k in (
        "id", "source", "record_id", "chunk_no", "span_start", "span_end", "text")}
    return BatchMeta(no, encode_chunks(cols["id"], cols["source"], cols["record_id"], cols["chunk_no"],
                                       cols["span_start"], cols["span_end"], cols["text"]), done)


def write_manifest(folder, factory="Flat", metric="ip", generation=0):
    store = IndexStore(folder)
    folder.mkdir(parents=True, exist_ok=True)
    store.write_manifest(Manifest(model={"name": "test-model", "path": "/nowhere"}, dim=DIM, metric=metric,
                                  factory=factory, format=2, generation=generation,
                                  corpus_path="/data/corpus"))
    return store


def build_shards(folder, n_units=6, chunks=20, factory="Flat", commit_every=50, workers=2, seed=0,
                 save_embeddings=True, row_group_rows=8, run_id="run1", trained=None):
    write_manifest(folder, factory)
    spec = ShardWriterFactory(str(folder), DIM, factory, commit_every=commit_every, trained=trained,
                              save_embeddings=save_embeddings, row_group_rows=row_group_rows,
                              run_id=run_id)
    sinks = [spec(w) for w in range(workers)]
    plan = batches(range(n_units), chunks)
    ids = np.array([r["id"] for part, _ in plan for r in part], dtype=np.int64)
    emb = unit_vectors(len(ids), seed=seed)
    start = 0
    for b, (part, done) in enumerate(plan):
        sinks[b % workers](meta_of(b, part, done), {"emb": emb[start:start + len(part)],
                                                    "ids": ids[start:start + len(part)]})
        start += len(part)
    written = [w for sink in sinks for w in sink.close()]
    rows = {r["id"]: r for part, _ in plan for r in part}
    return Built(folder, emb, ids, rows, written)


def parquet_reads(monkeypatch) -> list:
    """Record the ``columns`` of every ``pyarrow.parquet.ParquetFile.read`` from now on (the
    read still happens): which columns a reader pulls from a shard's Parquet file."""
    import pyarrow.parquet as pq

    reads: list = []
    real = pq.ParquetFile.read

    def spy(self, columns=None, **kw):
        reads.append(columns)
        return real(self, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read", spy)
    return reads


def recommit_file(shard, kind: str) -> None:
    """Give ``shard``'s commit record the size and sha256 of its ``kind`` file as it is now:
    a file changed on disk (by a test playing an attacker) that passes the record's check."""
    import hashlib
    import json

    data = (shard.folder / shard.record["files"][kind]["name"]).read_bytes()
    record = json.loads(shard.commit_path().read_text())
    record["files"][kind].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    shard.commit_path().write_text(json.dumps(record))

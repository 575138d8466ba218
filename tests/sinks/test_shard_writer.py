"""The shard writer as the egress engine's sink: rows travel as the batch id, each
consumer commits its own shards."""

import hashlib
import json
import pickle
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)
from shard_fixtures import DIM, batches, meta_of, unit_vectors

from embedingest import EgressEngine
from embedingest.errors import ConfigError
from embedingest.index.lookup import ShardRows
from embedingest.index.shards import finished_units, incomplete_units, list_shards, read_ids
from embedingest.index.store import IndexStore
from embedingest.sinks.shard_writer import ShardWriter, ShardWriterFactory, commit_finished


def test_consumers_commit_every_row_and_vector_sent_through_the_engine(tmp_path):
    plan = batches(range(9), 13, batch=16)
    ids = np.array([r["id"] for part, _ in plan for r in part], dtype=np.int64)
    emb = unit_vectors(len(ids), seed=2)
    spec = ShardWriterFactory(str(tmp_path), DIM, commit_every=40, save_embeddings=True, run_id="e")
    start = 0
    with EgressEngine(spec, num_consumers=2, num_slots=3, device="cpu",
                      slot_spec={"emb": ((16, DIM), "float32"), "ids": ((16,), "int64")}) as engine:
        for b, (part, done) in enumerate(plan):
            n = len(part)
            engine.submit(meta_of(b, part, done), {"emb": torch.from_numpy(emb[start:start + n]),
                                                   "ids": ids[start:start + n]})
            start += n
    written = [w for result in engine.closed_results for w in result]
    assert sum(w["count"] for w in written) == len(ids) and {w["name"][:9] for w in written} == {"shard-e-w"}
    shards = list_shards(tmp_path / "shards")
    assert incomplete_units(shards) == set() and finished_units(shards) == {u: 13 for u in range(9)}
    rows = ShardRows(shards)
    got = rows.table(ids)
    assert got == {r["id"]: r for part, _ in plan for r in part}
    for shard in shards:
        stored = np.load(shard.path("emb"))
        assert np.array_equal(stored, emb[np.searchsorted(ids, rows.shard_ids(rows.shards.index(shard)))]
                              .astype(np.float16))


def feed(sink, plan, emb, ids):
    start = 0
    for b, (part, done) in enumerate(plan):
        n = len(part)
        sink(meta_of(b, part, done), {"emb": emb[start:start + n], "ids": ids[start:start + n]})
        start += n


def plan_of(units, chunks, batch=17):
    plan = batches(units, chunks, batch=batch)
    return plan, np.array([r["id"] for part, _ in plan for r in part], dtype=np.int64)


def shard_vectors(folder):
    """(record, faiss index) of each committed shard, in name order."""
    out = []
    for shard in list_shards(Path(folder) / "shards"):
        out.append((shard, faiss.read_index(str(shard.path("faiss"))) if shard.rows else None))
    return out


def test_commit_every_splits_one_writer_into_exact_shards(tmp_path):
    plan, ids = plan_of(range(5), 50, batch=30)  # 250 rows in batches of 30
    emb = unit_vectors(len(ids), seed=4)
    sink = ShardWriterFactory(str(tmp_path), DIM, run_id="r1", commit_every=100)(3)
    feed(sink, plan, emb, ids)
    written = sink.close()
    assert written == [{"name": f"shard-r1-w3-{p:05d}", "count": c} for p, c in enumerate((100, 100, 50))]
    assert sink.close() == written  # closing twice commits nothing more
    got = shard_vectors(tmp_path)
    assert [s.name for s, _ in got] == [w["name"] for w in written]
    np.testing.assert_array_equal(np.concatenate([read_ids(s) for s, _ in got]), ids)
    for shard, index in got:
        mine = read_ids(shard)
        np.testing.assert_array_equal(faiss.vector_to_array(index.id_map), mine)
        _, found = index.search(emb[np.searchsorted(ids, mine)], 1)
        np.testing.assert_array_equal(found[:, 0], mine)


def test_uncommitted_rows_are_not_written_and_an_empty_close_writes_nothing(tmp_path):
    plan, ids = plan_of(range(3), 50, batch=50)
    sink = ShardWriterFactory(str(tmp_path), DIM, run_id="r", commit_every=100)(0)
    feed(sink, plan, unit_vectors(len(ids)), ids)
    assert [s.rows for s in list_shards(tmp_path / "shards")] == [100]  # a crash now loses 50
    assert ShardWriterFactory(str(tmp_path), DIM, run_id="e")(1).close() == []
    assert not list((tmp_path / "shards").glob("shard-e-*"))
    sink.close()
    assert not [p for p in (tmp_path / "shards").iterdir() if ".tmp-" in p.name]


def test_the_writer_copies_the_slot_it_is_given(tmp_path):
    (part, done), = batches([0], 10, batch=10)
    slot_emb, slot_ids = unit_vectors(10), np.array([r["id"] for r in part], dtype=np.int64)
    emb, ids = slot_emb.copy(), slot_ids.copy()
    sink = ShardWriterFactory(str(tmp_path), DIM, run_id="r", save_embeddings=True)(0)
    sink(meta_of(0, part, done), {"emb": slot_emb, "ids": slot_ids})
    slot_emb[:] = 0  # the engine reuses the slot for the next batch
    slot_ids[:] = -5
    sink.close()
    ((shard, index),) = shard_vectors(tmp_path)
    np.testing.assert_array_equal(faiss.vector_to_array(index.id_map), ids)
    np.testing.assert_array_equal(index.index.reconstruct_n(0, 10), emb)
    np.testing.assert_array_equal(np.load(shard.path("emb")), emb.astype(np.float16))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_inputs(tmp_path, dtype):
    (part, done), = batches([0], 20, batch=20)
    emb = unit_vectors(20)
    bits = (emb.view(np.uint32) >> 16).astype(np.uint16)  # bf16 as the engine delivers it
    sent = bits if dtype == "bfloat16" else emb.astype(np.float16)
    expected = (bits.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else \
        emb.astype(np.float16).astype(np.float32)
    sink = ShardWriterFactory(str(tmp_path), DIM, run_id="r")(0)
    sink(meta_of(0, part, done), {"emb": sent, "ids": np.array([r["id"] for r in part])})
    sink.close()
    ((_, index),) = shard_vectors(tmp_path)
    np.testing.assert_array_equal(index.index.reconstruct_n(0, 20), expected)  # exactly the sent values
    with pytest.raises(ConfigError, match="embeddings of dtype float64 cannot be indexed"):
        ShardWriterFactory(str(tmp_path), DIM, run_id="d")(0)(
            meta_of(0, part, done), {"emb": emb.astype(np.float64), "ids": np.array([r["id"] for r in part])})


def test_the_factory_pickles_and_validates(tmp_path):
    factory = ShardWriterFactory(tmp_path, DIM, metric="l2", run_id="p", commit_every=5)
    clone = pickle.loads(pickle.dumps(factory))
    assert clone == factory and isinstance(clone.folder, str)
    sink = clone(2)
    plan, ids = plan_of([0], 7)
    feed(sink, plan, unit_vectors(7), ids)
    assert [w["count"] for w in sink.close()] == [5, 2]
    assert faiss.read_index(str(list_shards(tmp_path / "shards")[0].path("faiss"))).metric_type == faiss.METRIC_L2
    with pytest.raises(ConfigError, match="shard shard-p-w2-00000 already exists .*run id 'p' was used before"):
        clone(2)(meta_of(0, *plan[0]), {"emb": unit_vectors(7), "ids": ids})
    for kw, message in [({"run_id": "a-b"}, "run id 'a-b' may hold only"),
                        ({"metric": "cosine"}, "unknown metric 'cosine'"),
                        ({"factory": "IVF4,Flat"}, "'IVF4,Flat' needs training"),
                        ({"factory": "Nonsense"}, "faiss cannot build index factory 'Nonsense' for dim 16"),
                        ({"dim": 0}, "dim must be positive, got 0"),
                        ({"commit_every": 0}, "commit_every must be positive, got 0"),
                        ({"row_group_rows": -1}, "row_group_rows must be positive, got -1"),
                        ({"trained": tmp_path / "none.faiss"}, "trained index '.*none.faiss' does not exist")]:
        with pytest.raises(ConfigError, match=message):
            ShardWriterFactory(tmp_path, **{"dim": DIM, **kw})
    with pytest.raises(ConfigError, match=r"embeddings of shape \(3, 8\) for 3 ids, expected \(3, 16\)"):
        ShardWriterFactory(tmp_path, DIM, run_id="q")(0)(meta_of(0, *batches([1], 3)[0]),
                                                         {"emb": np.zeros((3, 8), np.float32),
                                                          "ids": np.array([1 << 32, 1 << 32 | 1, 1 << 32 | 2])})


def test_trained_ivf_shards_and_a_trained_index_of_another_dim(tmp_path):
    trained = IndexStore(tmp_path).train_index("IVF4,Flat", DIM, "ip", unit_vectors(400, seed=1))
    plan, ids = plan_of(range(2), 50)
    sink = ShardWriterFactory(tmp_path, DIM, factory="IVF4,Flat", run_id="t", commit_every=60,
                              trained=trained)(0)
    feed(sink, plan, unit_vectors(len(ids)), ids)
    assert [w["count"] for w in sink.close()] == [60, 40]
    trained_ivf = faiss.read_index(str(trained))  # kept: its quantizer is part of it
    centroids = faiss.downcast_index(trained_ivf.quantizer).reconstruct_n(0, 4)
    for _, index in shard_vectors(tmp_path):
        ivf = faiss.downcast_index(index.index)
        assert isinstance(ivf, faiss.IndexIVFFlat)
        np.testing.assert_array_equal(faiss.downcast_index(ivf.quantizer).reconstruct_n(0, 4), centroids)
    with pytest.raises(ConfigError, match="has dim 16, not 8"):
        ShardWriterFactory(tmp_path, 8, factory="IVF4,Flat", run_id="u", trained=trained)(0)


def test_a_trained_index_whose_header_claims_more_vectors_than_the_file_holds_is_refused_small(tmp_path):
    """A damaged trained.faiss (its centroid count raised, the file's size kept) is named,
    read within the file's size: faiss would allocate what the header claims."""
    trained = IndexStore(tmp_path).train_index("IVF4,Flat", DIM, "ip", unit_vectors(400, seed=1))
    data = bytearray(trained.read_bytes())
    count = (4 * DIM).to_bytes(8, "little")  # the quantizer's vector bytes: 4 centroids of DIM floats
    at = data.find(count)
    assert at > 0
    data[at:at + 8] = (1 << 40).to_bytes(8, "little")
    trained.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"cannot read .*trained.* the file is damaged; delete it and run "
                                          r"build-index again \(it is trained again\)"):
        ShardWriterFactory(tmp_path, DIM, factory="IVF4,Flat", run_id="u", trained=trained)(0)


def test_a_shards_folder_that_is_a_link_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "shards").symlink_to(outside)
    with pytest.raises(ConfigError, match="shards' .*is a symbolic link"):
        ShardWriterFactory(tmp_path / "idx", DIM, run_id="l")(0)
    assert list(outside.iterdir()) == []


def unit_batch(unit, chunks):
    (rows, done), = batches([unit], chunks, batch=chunks)
    return rows, done


def file_entry(path):
    data = Path(path).read_bytes()
    return {"name": Path(path).name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("order", [(5, 2), (2, 5)])
def test_the_commit_record_holds_every_field_and_the_id_range_of_all_batches(tmp_path, order):
    """A writer's batches need not come in id order (a unit redone under its old number
    comes after higher ones): the range covers them all. The vectors of generation 2
    go to the .g2.faiss file."""
    spec = ShardWriterFactory(tmp_path, DIM, run_id="k", generation=2, row_group_rows=4, save_embeddings=True)
    writer = ShardWriter(spec, "shard-k-w0-00003", replaces=["shard-j-w1-00000"])
    for seed, unit in enumerate(order):
        rows, done = unit_batch(unit, 3)
        writer.add(unit_vectors(3, seed=seed), np.array([r["id"] for r in rows]), meta_of(0, rows, done).chunks, done)
    record = writer.commit()
    folder = tmp_path / "shards"
    name = "shard-k-w0-00003"
    assert sorted(p.name for p in folder.iterdir()) == [f"{name}.{s}" for s in (
        "commit.json", "emb.npy", "g2.faiss", "parquet")]
    assert record == {
        "format": 2, "name": name, "rows": 6, "id_min": 2 << 32, "id_max": 5 << 32 | 2, "dim": DIM,
        "factory": "Flat", "generation": 2, "row_group_rows": 4,
        "files": {kind: file_entry(folder / f"{name}.{suffix}")
                  for kind, suffix in (("parquet", "parquet"), ("emb", "emb.npy"), ("faiss", "g2.faiss"))},
        "units": [[2, 5], [3, 3]], "replaces": ["shard-j-w1-00000"], "run": "k", "created": record["created"]}
    assert list(record["files"]) == ["parquet", "emb", "faiss"]
    assert json.loads((folder / f"{name}.commit.json").read_text()) == record
    marks = commit_finished(spec, [(9, 0), (8, 4)], part=2)
    assert {k: v for k, v in marks.items() if k != "created"} == {
        "format": 2, "name": "shard-k-w9999-00002", "rows": 0, "id_min": 0, "id_max": -1, "dim": DIM,
        "factory": "Flat", "generation": 2, "row_group_rows": 4, "files": {}, "units": [[8, 9], [4, 0]],
        "replaces": [], "run": "k"}



def test_a_batch_s_unit_hashes_go_to_the_shard_that_finishes_its_units(tmp_path):
    """The loader's hashes of the units a batch finishes travel in its ``BatchMeta``; a
    batch that ``commit_every`` cuts in two gives them, with its finished units, to the
    part that holds its end (the first part finishes none, so it may hold none)."""
    from embedingest.index.shards import BatchMeta

    (rows, done), = batches([3, 4], 6, batch=12)  # one batch, units 3 and 4 end in it
    hashes = ((3, "a" * 64), (4, "b" * 64))
    meta = meta_of(0, rows, done)
    sink = ShardWriterFactory(str(tmp_path), DIM, run_id="h", commit_every=8)(0)
    sink(BatchMeta(meta.no, meta.chunks, meta.units_done, hashes),
         {"emb": unit_vectors(12), "ids": np.array([r["id"] for r in rows], dtype=np.int64)})
    assert sink.close() == [{"name": "shard-h-w0-00000", "count": 8}, {"name": "shard-h-w0-00001", "count": 4}]
    first, last = list_shards(tmp_path / "shards")
    assert (first.rows, first.units, first.unit_hashes) == (8, (), ())
    assert "unit_sha256" not in first.record
    assert (last.rows, last.units, last.unit_hashes) == (4, ((3, 6), (4, 6)), hashes)
    assert last.record["unit_sha256"] == {"3": "a" * 64, "4": "b" * 64}

def test_a_writer_holds_less_than_a_row_group_of_rows(tmp_path, monkeypatch):
    """Rows go to the temporary Parquet file a row group at a time as they come, not at
    the commit: a writer's memory is one row group of text, whatever the shard's size."""
    import pyarrow.parquet as pq

    written = []
    real = pq.ParquetWriter.write_table

    def spy(self, table, row_group_size=None):
        written.append((table.num_rows, row_group_size))
        return real(self, table, row_group_size=row_group_size)
    monkeypatch.setattr(pq.ParquetWriter, "write_table", spy)
    plan, ids = plan_of(range(4), 10, batch=4)  # 40 rows in batches of 4, groups of 8
    sink = ShardWriterFactory(tmp_path, DIM, run_id="g", row_group_rows=8)(0)
    emb = unit_vectors(len(ids))
    for b, (part, done) in enumerate(plan):
        sink(meta_of(b, part, done), {"emb": emb[4 * b:4 * b + 4], "ids": ids[4 * b:4 * b + 4]})
        sink._current()._stored()  # the writer's thread is a few batches behind
        sent = 4 * (b + 1)
        assert sum(n for n, _ in written) == sent - sent % 8  # only whole groups, all of them
    sink.close()
    assert written == [(8, 8)] * 5
    (shard,) = list_shards(tmp_path / "shards")
    meta = pq.read_metadata(shard.path("parquet"))
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [8] * 5


def test_refusals_say_what_is_wrong_word_for_word(tmp_path):
    spec = ShardWriterFactory(tmp_path, DIM, run_id="w")
    with pytest.raises(ConfigError) as err:
        ShardWriter(spec, "shard-w-0")
    assert str(err.value) == "'shard-w-0' is not a shard name (shard-<run>-w<worker>-<part>)"
    commit_finished(spec, [(1, 0)])
    with pytest.raises(ConfigError) as err:
        ShardWriter(spec, "shard-w-w9999-00000")
    assert str(err.value) == (f"shard shard-w-w9999-00000 already exists in {str(tmp_path / 'shards')!r}: run id "
                              "'w' was used before; start each run with a new one")
    missing = tmp_path / "none.faiss"
    with pytest.raises(ConfigError) as err:
        ShardWriterFactory(tmp_path, DIM, trained=missing)
    assert str(err.value) == (f"trained index {str(missing)!r} does not exist; train one with "
                              "IndexStore.train_index")
    sink = spec(0)
    with pytest.raises(ConfigError) as err:
        sink(5, {"emb": unit_vectors(1), "ids": np.array([0])})
    assert str(err.value) == ("batch 5 carries no chunk metadata: submit a BatchMeta as the batch id to a "
                              "shard writer")
    rows, done = unit_batch(1, 3)
    moved = [dict(r, chunk_no=r["chunk_no"] + 1) for r in rows]  # ids right, chunk numbers not
    with pytest.raises(ConfigError) as err:
        sink(meta_of(0, moved, done), {"emb": unit_vectors(3), "ids": np.array([r["id"] for r in rows])})
    assert str(err.value) == ("shard shard-w-w0-00000: chunk numbers of a batch are not the low half of "
                              "their vector ids (unit_no << 32 | chunk_no)")
    sink.close()


def test_the_smallest_settings_work(tmp_path):
    spec = ShardWriterFactory(tmp_path, 1, run_id="s", commit_every=1, row_group_rows=1)
    sink = spec(0)
    rows, done = unit_batch(0, 3)
    sink(meta_of(0, rows, done), {"emb": np.ones((3, 1), np.float32), "ids": np.array([r["id"] for r in rows])})
    assert sink.close() == [{"name": f"shard-s-w0-0000{p}", "count": 1} for p in range(3)]
    shards = list_shards(tmp_path / "shards")
    assert [read_ids(s).tolist() for s in shards] == [[0], [1], [2]]
    assert finished_units(shards) == {0: 3} and incomplete_units(shards) == set()


def test_a_sink_holds_the_writers_lock_until_it_closes(tmp_path):
    """A new build waits for the writers of the last one (index/lock.py): the lock is
    shared from the sink's start to its close."""
    import fcntl
    import os

    from embedingest.index.lock import WRITERS_LOCK

    def taken():
        fd = os.open(tmp_path / WRITERS_LOCK, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False
    sink = ShardWriterFactory(tmp_path, DIM, run_id="l")(0)
    assert taken()
    sink.close()
    assert not taken()
    sink.close()
    assert not taken()


def test_parquet_files_are_zstd_with_dictionaries_and_id_statistics(tmp_path):
    """What lookups rely on: the id column's statistics (row groups found by id range),
    the repeated source and record id columns dictionary-encoded, everything zstd."""
    import pyarrow.parquet as pq

    plan, ids = plan_of(range(2), 20)
    sink = ShardWriterFactory(tmp_path, DIM, run_id="z", row_group_rows=16)(0)
    feed(sink, plan, unit_vectors(len(ids)), ids)
    sink.close()
    (shard,) = list_shards(tmp_path / "shards")
    meta = pq.read_metadata(shard.path("parquet"))
    assert meta.num_row_groups == 3
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        columns = {group.column(c).path_in_schema: group.column(c) for c in range(group.num_columns)}
        assert {name: col.compression for name, col in columns.items()} == dict.fromkeys(columns, "ZSTD")
        assert [name for name, col in columns.items() if col.is_stats_set] == ["id"]
        assert (columns["id"].statistics.min, columns["id"].statistics.max) == (
            int(ids[16 * g]), int(ids[min(16 * g + 15, len(ids) - 1)]))
        assert [name for name, col in columns.items() if col.has_dictionary_page] == ["source", "record_id"]


def test_a_writer_with_remote_uploads_each_shard_it_commits(s3, tmp_path):
    url = s3.url("ix")
    sink = ShardWriterFactory(tmp_path, DIM, run_id="up", remote=url, commit_every=10, save_embeddings=True)(0)
    plan, ids = plan_of([0], 15)
    feed(sink, plan, unit_vectors(len(ids)), ids)
    assert sink.close() == [{"name": "shard-up-w0-00000", "count": 10}, {"name": "shard-up-w0-00001", "count": 5}]
    local = sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert len(local) == 8
    assert sorted(p.rsplit("/", 1)[1] for p in s3.fs.find(f"{s3.name}/ix")) == local
    for name in local:
        assert s3.fs.cat_file(f"{s3.name}/ix/shards/{name}") == (tmp_path / "shards" / name).read_bytes()


def _writer(tmp_path, **kw):
    return ShardWriter(ShardWriterFactory(str(tmp_path), DIM, run_id="t", **kw), "shard-t-w0-00000")


def _batches(n_batches, size=4):
    plan, ids = plan_of(range(n_batches), size, batch=size)
    emb = unit_vectors(len(ids))
    for b, (part, done) in enumerate(plan):
        meta = meta_of(b, part, done)
        yield emb[size * b:size * (b + 1)], ids[size * b:size * (b + 1)], meta.chunks, meta.units_done


def test_add_returns_before_the_batch_is_stored_and_the_commit_waits_for_it(tmp_path, monkeypatch):
    """A slow store (a faiss index doubling its storage, a slow disk) holds up the writer's
    thread, not add(): the engine's slot is free at once. The commit has every row. The
    thread is named for the shard (a stack dump, or a test, tells the writers' threads
    apart)."""
    import threading
    import time

    from embedingest.sinks import shard_writer

    real, threads, names = shard_writer.ShardWriter._store, set(), set()

    def slow(self, *args):
        threads.add(threading.get_ident())
        names.add(threading.current_thread().name)
        time.sleep(0.2)
        return real(self, *args)

    monkeypatch.setattr(shard_writer.ShardWriter, "_store", slow)
    w = _writer(tmp_path)
    sent = list(_batches(3))
    t0 = time.perf_counter()
    for emb, ids, chunks, done in sent:
        w.add(emb, ids, chunks, done)
    assert time.perf_counter() - t0 < 0.15
    record = w.commit()
    assert time.perf_counter() - t0 >= 0.6 and record["rows"] == 12
    assert threads and threading.get_ident() not in threads
    assert names == {"embedingest-shard-t-w0-00000_0"}  # one thread, named for its shard
    got = faiss.read_index(str(tmp_path / "shards" / record["files"]["faiss"]["name"]))
    np.testing.assert_array_equal(faiss.vector_to_array(got.id_map),
                                  np.concatenate([ids for _, ids, _, _ in sent]))


def test_the_writer_s_thread_is_at_most_store_behind_batches_behind(tmp_path, monkeypatch):
    import threading

    from embedingest.sinks import shard_writer

    monkeypatch.setattr(shard_writer, "STORE_BEHIND", 2)
    gate, real = threading.Event(), shard_writer.ShardWriter._store
    monkeypatch.setattr(shard_writer.ShardWriter, "_store", lambda self, *a: (gate.wait(), real(self, *a)))
    w = _writer(tmp_path)
    sent = list(_batches(4))
    w.add(*sent[0])
    w.add(*sent[1])
    third = threading.Thread(target=w.add, args=sent[2])
    third.start()
    third.join(0.3)
    assert third.is_alive()  # two batches not stored yet: the third waits
    gate.set()
    third.join(5)
    assert not third.is_alive()
    w.add(*sent[3])
    assert w.commit()["rows"] == 16


def test_an_error_of_the_writer_s_thread_is_raised_by_the_next_call(tmp_path, monkeypatch):
    """The thread's error (here the disk full while a row group is written) is raised,
    itself, by the commit (or a later add): never lost, never a silent short shard."""
    import errno
    import threading

    from embedingest.sinks import shard_writer

    def full(self, final):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard_writer.ShardWriter, "_write_row_groups", full)
    w = _writer(tmp_path, row_group_rows=4)
    for batch in _batches(2):
        try:
            w.add(*batch)
        except OSError:
            pytest.fail("the error of a batch is raised by a later call, not by its own add")
    with pytest.raises(OSError, match="No space left on device") as err:
        w.commit()
    assert err.value.errno == errno.ENOSPC
    for again in (w.commit, lambda: w.add(*next(_batches(1)))):  # broken for good: no short shard
        with pytest.raises(OSError, match="No space left on device"):
            again()
    assert not list((tmp_path / "shards").glob("*.commit.json"))
    assert not [t for t in threading.enumerate() if t.name.startswith("embedingest-shard-t")]


def test_an_interrupted_wait_keeps_the_batch_and_the_commit_still_has_it(tmp_path, monkeypatch):
    """Ctrl-C (or the engine's SIGTERM) while the commit waits for the writer's thread is
    not the thread's error: the batch stays queued, and a later commit stores and writes
    every row."""
    import threading

    from embedingest.sinks import shard_writer

    gate, real = threading.Event(), shard_writer.ShardWriter._store
    monkeypatch.setattr(shard_writer.ShardWriter, "_store", lambda self, *a: (gate.wait(), real(self, *a)))
    w = _writer(tmp_path)
    for batch in _batches(3):
        w.add(*batch)
    first = w._storing[0]

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(first, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        w.commit()
    assert w._broken is None and len(w._storing) == 3
    monkeypatch.undo()
    gate.set()
    assert w.commit()["rows"] == 12


def test_after_the_thread_s_error_the_commit_waits_for_the_store_already_running(tmp_path, monkeypatch):
    """When a batch's store fails, the next one may already be running in the writer's
    thread (a running store cannot be cancelled): the commit that raises the error waits
    for it to end, so no thread of the writer still adds to its index or writes its files
    once the error is out. The batches behind it are dropped unstored."""
    import errno
    import threading

    from embedingest.sinks import shard_writer

    calls, running, release, ended = [], threading.Event(), threading.Event(), threading.Event()

    def store(self, *args):
        calls.append(len(calls))
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        running.set()
        release.wait(5)
        ended.set()

    monkeypatch.setattr(shard_writer.ShardWriter, "_store", store)
    w = _writer(tmp_path)
    for batch in _batches(3):
        w.add(*batch)
    assert running.wait(5)  # batch 0's store failed, batch 1's runs, batch 2's waits
    timer = threading.Timer(0.3, release.set)
    timer.start()
    with pytest.raises(OSError, match="No space left on device"):
        w.commit()
    assert ended.is_set()  # batch 1's store was over before the error came out
    assert calls == [0, 1]  # batch 2's never ran
    assert not [t for t in threading.enumerate() if t.name.startswith("embedingest-shard-t")]
    timer.join()


def test_the_add_that_waits_for_the_oldest_store_raises_its_error(tmp_path, monkeypatch):
    """An add that finds STORE_BEHIND batches unstored waits for the oldest: that batch's
    error is raised there (and by the commit), even though the batches after it were
    stored: never a shard short of the failed batch."""
    import errno

    from embedingest.sinks import shard_writer

    monkeypatch.setattr(shard_writer, "STORE_BEHIND", 2)
    real, calls = shard_writer.ShardWriter._store, []

    def store(self, *args):
        calls.append(len(calls))
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args)

    monkeypatch.setattr(shard_writer.ShardWriter, "_store", store)
    w = _writer(tmp_path)
    sent = list(_batches(4))
    w.add(*sent[0])
    w.add(*sent[1])
    with pytest.raises(OSError, match="No space left on device"):
        w.add(*sent[2])  # waits for batch 0's store
    with pytest.raises(OSError, match="No space left on device"):
        w.commit()
    assert not list((tmp_path / "shards").glob("*.commit.json"))

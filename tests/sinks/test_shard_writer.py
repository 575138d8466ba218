"""The shard writer as the egress engine's sink: rows travel as the batch id, each
consumer commits its own shards."""

import pickle
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch
from shard_fixtures import DIM, batches, meta_of, unit_vectors

from embedingest import EgressEngine
from embedingest.errors import ConfigError
from embedingest.index.lookup import ShardRows
from embedingest.index.shards import finished_units, incomplete_units, list_shards, read_ids
from embedingest.index.store import IndexStore
from embedingest.sinks.shard_writer import ShardWriterFactory


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


def test_a_shards_folder_that_is_a_link_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "shards").symlink_to(outside)
    with pytest.raises(ConfigError, match="shards' .*is a symbolic link"):
        ShardWriterFactory(tmp_path / "idx", DIM, run_id="l")(0)
    assert list(outside.iterdir()) == []

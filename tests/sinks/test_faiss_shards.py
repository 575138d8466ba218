import pickle
import tempfile
from pathlib import Path

import faiss
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedingest.errors import ConfigError
from embedingest.sinks.faiss_shards import FaissShardSinkFactory, sidecar_path

DIM = 16


def vectors(n, seed=0, dim=DIM):
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def feed(sink, emb, ids, batch=30):
    for start in range(0, len(ids), batch):
        sink(start, {"emb": emb[start:start + batch], "ids": ids[start:start + batch]})


def read_segments(folder):
    out = []
    for path in sorted((Path(folder) / "segments").glob("seg-*.faiss")):
        out.append((path.name, faiss.read_index(str(path)), np.load(sidecar_path(path))))
    return out


def test_commit_every_splits_into_exact_segments(tmp_path):
    emb, ids = vectors(250), np.arange(250, dtype=np.int64) + (7 << 32)
    sink = FaissShardSinkFactory(str(tmp_path), DIM, run_id="r1", commit_every=100)(3)
    feed(sink, emb, ids)
    written = sink.close()
    assert written == [{"name": f"seg-r1-w3-{p:05d}.faiss", "count": c} for p, c in enumerate((100, 100, 50))]
    segs = read_segments(tmp_path)
    assert [s[0] for s in segs] == [w["name"] for w in written]
    np.testing.assert_array_equal(np.concatenate([s[2] for s in segs]), ids)
    for _, index, side in segs:
        assert isinstance(index, faiss.IndexIDMap)
        np.testing.assert_array_equal(faiss.vector_to_array(index.id_map), side)
        _, found = index.search(emb[side - (7 << 32)], 1)
        np.testing.assert_array_equal(found[:, 0], side)
    assert sink.close() == written


def test_uncommitted_vectors_are_not_written_and_empty_close_writes_nothing(tmp_path):
    sink = FaissShardSinkFactory(tmp_path, DIM, run_id="r", commit_every=100)(0)
    feed(sink, vectors(150), np.arange(150, dtype=np.int64))
    assert [s[2].size for s in read_segments(tmp_path)] == [100]  # a crash now loses 50
    empty = FaissShardSinkFactory(tmp_path, DIM, run_id="e")(1)
    assert empty.close() == []
    assert not list((tmp_path / "segments").glob("seg-e-*"))
    assert not [p for p in (tmp_path / "segments").iterdir() if ".tmp-" in p.name]


def test_sink_copies_the_slot_it_is_given(tmp_path):
    slot_emb, slot_ids = vectors(40), np.arange(40, dtype=np.int64)
    emb, ids = slot_emb.copy(), slot_ids.copy()
    sink = FaissShardSinkFactory(tmp_path, DIM, run_id="r")(0)
    sink("b", {"emb": slot_emb, "ids": slot_ids})
    slot_emb[:] = 0
    slot_ids[:] = -5
    sink.close()
    (_, index, side), = read_segments(tmp_path)
    np.testing.assert_array_equal(side, ids)
    np.testing.assert_allclose(index.index.reconstruct_n(0, 40), emb)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_inputs(tmp_path, dtype):
    emb = vectors(20)
    sent = (emb.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bfloat16" else emb.astype(np.float16)
    sink = FaissShardSinkFactory(tmp_path, DIM, run_id="r")(0)
    sink(0, {"emb": sent, "ids": np.arange(20, dtype=np.int64)})
    sink.close()
    (_, index, _), = read_segments(tmp_path)
    np.testing.assert_allclose(index.index.reconstruct_n(0, 20), emb, atol=1e-2)


def test_factory_pickles_and_validates(tmp_path):
    factory = FaissShardSinkFactory(tmp_path, DIM, metric="l2", run_id="p", commit_every=5)
    clone = pickle.loads(pickle.dumps(factory))
    assert clone == factory and isinstance(clone.folder, str)
    sink = clone(2)
    sink(0, {"emb": vectors(7), "ids": np.arange(7, dtype=np.int64)})
    assert [w["count"] for w in sink.close()] == [5, 2]
    with pytest.raises(ConfigError, match="run id 'p' was used before"):
        clone(2)
    with pytest.raises(ConfigError, match="'a-b'"):
        FaissShardSinkFactory(tmp_path, DIM, run_id="a-b")
    with pytest.raises(ConfigError, match="'cosine'"):
        FaissShardSinkFactory(tmp_path, DIM, metric="cosine")
    with pytest.raises(ConfigError, match="'IVF4,Flat' needs training"):
        FaissShardSinkFactory(tmp_path, DIM, factory="IVF4,Flat")
    with pytest.raises(ConfigError, match="'Nonsense'"):
        FaissShardSinkFactory(tmp_path, DIM, factory="Nonsense")
    with pytest.raises(ConfigError, match=r"shape \(3, 8\)"):
        FaissShardSinkFactory(tmp_path, DIM, run_id="q")(0)(0, {"emb": np.zeros((3, 8), np.float32),
                                                                "ids": np.arange(3)})


def test_trained_ivf_segments(tmp_path):
    from embedingest.index.store import IndexStore
    trained = IndexStore(tmp_path).train_index("IVF4,Flat", DIM, "ip", vectors(400, seed=1))
    sink = FaissShardSinkFactory(tmp_path, DIM, factory="IVF4,Flat", run_id="t",
                                 commit_every=60, trained=trained)(0)
    feed(sink, vectors(100), np.arange(100, dtype=np.int64))
    assert [w["count"] for w in sink.close()] == [60, 40]
    for _, index, _ in read_segments(tmp_path):
        assert isinstance(faiss.downcast_index(index.index), faiss.IndexIVFFlat)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=8), commit_every=st.integers(1, 50))
def test_segments_partition_the_stream(sizes, commit_every):
    n = sum(sizes)
    emb, ids = vectors(n, seed=n), np.arange(n, dtype=np.int64) * 3
    with tempfile.TemporaryDirectory() as folder:
        sink = FaissShardSinkFactory(folder, DIM, run_id="h", commit_every=commit_every)(0)
        start = 0
        for size in sizes:
            sink(start, {"emb": emb[start:start + size], "ids": ids[start:start + size]})
            start += size
        counts = [w["count"] for w in sink.close()]
        full, rest = divmod(n, commit_every)
        assert counts == [commit_every] * full + ([rest] if rest else [])
        segs = read_segments(folder)
        got = np.concatenate([s[2] for s in segs]) if segs else np.empty(0, np.int64)
        np.testing.assert_array_equal(got, ids)


def test_a_segments_folder_that_is_a_link_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "segments").symlink_to(outside)
    with pytest.raises(ConfigError, match="segments' .*is a symbolic link"):
        FaissShardSinkFactory(tmp_path / "idx", DIM, run_id="l")(0)
    assert list(outside.iterdir()) == []

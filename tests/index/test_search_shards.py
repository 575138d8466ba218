"""open_index over an index of format 2: every shard searched, rows from the Parquet files."""

import re

import numpy as np
import pytest
from shard_fixtures import DIM, build_shards, unit_vectors

from embedingest.errors import ConfigError
from embedingest.index.reindex import reindex
from embedingest.index.search import open_index
from embedingest.index.shards import list_shards, read_ids


def test_search_equals_brute_force_and_hits_carry_their_rows(tmp_path):
    built = build_shards(tmp_path / "ix", n_units=7, chunks=19, commit_every=30, workers=3)
    q = unit_vectors(4, seed=3)
    with open_index(tmp_path / "ix") as index:
        assert index.ntotal == len(built.ids) and index.rows is not None
        hits = index.search_vectors(q, k=7)
    scores, ids = built.brute_force(q, 7)
    for row_hits, row_scores, row_ids in zip(hits, scores, ids):
        assert [h.id for h in row_hits] == row_ids.tolist()
        assert np.allclose([h.score for h in row_hits], row_scores, atol=1e-6)
        for h in row_hits:
            r = built.rows[h.id]
            assert (h.source, h.record_id, h.chunk_no, h.char_start, h.char_end, h.text) == (
                r["source"], r["record_id"], r["chunk_no"], r["span_start"], r["span_end"], r["text"])


def test_after_reindex_search_reads_the_new_generation(tmp_path):
    built = build_shards(tmp_path / "ix", n_units=6, chunks=20, commit_every=50, workers=2)
    reindex(tmp_path / "ix", "IVF2,Flat", search_params="nprobe=2")
    q = unit_vectors(3, seed=4)
    with open_index(tmp_path / "ix") as index:
        assert index.params == "nprobe=2"
        got = [[h.id for h in hits] for hits in index.search_vectors(q, k=5)]
    emb16 = built.emb.astype(np.float16).astype(np.float32)
    exact = np.argsort(-(q @ emb16.T), axis=1)[:, :5]
    assert got == built.ids[exact].tolist()


def test_vectors_out_of_their_rows_order_are_a_config_error_naming_the_shard(tmp_path):
    import faiss

    build_shards(tmp_path / "ix", n_units=2, chunks=10, commit_every=100, workers=1)
    (shard,) = list_shards(tmp_path / "ix" / "shards")
    index = faiss.read_index(str(shard.path("faiss")))
    ids = faiss.vector_to_array(index.id_map)
    faiss.copy_array_to_vector(ids[::-1].copy(), index.id_map)  # same size, other order
    faiss.write_index(index, str(shard.path("faiss")))
    with pytest.raises(ConfigError, match=rf"vectors of shard {shard.name} are not in the order of its rows"):
        open_index(tmp_path / "ix")


def test_an_empty_index_of_format_2_opens_and_finds_nothing(tmp_path):
    from shard_fixtures import write_manifest

    write_manifest(tmp_path / "ix")
    with open_index(tmp_path / "ix") as index:
        assert index.ntotal == 0
        assert index.search_vectors(np.ones((1, DIM), np.float32), k=3) == [[]]


def test_vectors_whose_highest_id_is_not_the_shard_s_are_a_damaged_shard(tmp_path):
    """The lowest and the highest id must both be the record's (one alone is not enough)."""
    import faiss

    build_shards(tmp_path / "ix", n_units=2, chunks=10, commit_every=100, workers=1)
    (shard,) = list_shards(tmp_path / "ix" / "shards")
    path = shard.path("faiss")
    index = faiss.read_index(str(path))
    ids = faiss.vector_to_array(index.id_map)
    ids[ids.argmax()] += 1  # the lowest id still matches
    faiss.copy_array_to_vector(ids, index.id_map)
    faiss.write_index(index, str(path))
    with pytest.raises(ConfigError) as err:
        open_index(tmp_path / "ix")
    assert str(err.value) == (
        f"{str(path)!r} holds 20 vectors of dim {DIM}, but its shard has 20 rows (or other ids) and the "
        f"manifest says dim {DIM}: the shard is damaged; delete that shard's files (every file named "
        f"{shard.name}.*) and run the same build-index command again: the units it held are redone")


@pytest.mark.parametrize("kind", ["no id map", "other dim"])
def test_a_vectors_file_without_ids_or_of_another_dim_is_a_damaged_shard(tmp_path, kind):
    """The file read for a shard (here given beside it, past the size check of its record):
    its count, its dim and its ids are each checked."""
    import faiss

    import embedingest.index.search as search_mod
    from embedingest.index.store import IndexStore

    build_shards(tmp_path / "ix", n_units=2, chunks=10, commit_every=100, workers=1)
    (shard,) = list_shards(tmp_path / "ix" / "shards")
    dim = DIM if kind == "no id map" else 8
    index = faiss.IndexFlatIP(dim)
    if kind == "other dim":
        index = faiss.IndexIDMap(index)
        index.add_with_ids(unit_vectors(20, dim=dim), read_ids(shard))
    else:
        index.add(unit_vectors(20))
    path = tmp_path / "other.faiss"
    faiss.write_index(index, str(path))
    manifest = IndexStore(tmp_path / "ix").read_manifest()
    with pytest.raises(ConfigError) as err:
        search_mod._load_shards([shard], lambda s: path, manifest, None)
    assert str(err.value) == (
        f"{str(path)!r} holds 20 vectors of dim {dim}, but its shard has 20 rows (or other ids) and the "
        f"manifest says dim {DIM}: the shard is damaged; delete that shard's files (every file named "
        f"{shard.name}.*) and run the same build-index command again: the units it held are redone")


def test_a_shard_the_manifest_names_gone_without_a_replacement_is_warned_of(tmp_path, caplog):
    """Deleted shard files (commit record and all): search answers from the rest, but says
    which shards the manifest names that are gone and how many vectors they held (before:
    nothing). A removal's replaced shards are not lost, also before the manifest catches up."""
    import logging

    from embedingest.index.shard_store import ShardStore

    built = build_shards(tmp_path / "ix", n_units=6, chunks=20, commit_every=50, workers=2)
    with ShardStore(tmp_path / "ix") as store:
        store.update_shards()
        store.remove_units([0])  # replaces the shards that held unit 0; the manifest not updated
    with caplog.at_level(logging.WARNING, logger="embedingest"):
        with open_index(tmp_path / "ix") as index:
            assert index.ntotal == len(built.ids) - 20
    assert caplog.records == []
    with ShardStore(tmp_path / "ix") as store:
        store.clean_garbage()
        manifest = store.update_shards()
    gone = [s for s in list_shards(tmp_path / "ix" / "shards") if s.rows][0]
    count = next(seg["count"] for seg in manifest.segments if seg["name"] == gone.name)
    for path in (tmp_path / "ix" / "shards").glob(f"{gone.name}.*"):
        path.unlink()
    with caplog.at_level(logging.WARNING, logger="embedingest"):
        with open_index(tmp_path / "ix") as index:
            assert index.ntotal == len(built.ids) - 20 - count
    (record,) = caplog.records
    assert record.getMessage() == (
        f"the manifest of {tmp_path / 'ix'} names 1 shard(s) not in {tmp_path / 'ix' / 'shards'} "
        f"({gone.name}; {count} vectors): their files were deleted or moved, so results leave them "
        "out; put them back, or run build-index on the corpus again to redo their units")


def test_odd_search_arguments_are_taken_or_refused_by_name(tmp_path):
    """A numpy k (faiss took only Python's int: a TypeError), a generator of queries (it
    gave no results), NaN or complex vectors (nothing, or silently made real), and an
    index used after close() (it answered with nothing): each works or is refused."""
    built = build_shards(tmp_path / "ix", n_units=2, chunks=10, commit_every=100, workers=1)
    q = unit_vectors(2, seed=5)
    index = open_index(tmp_path / "ix")
    hits = index.search_vectors(q, k=np.int64(3))
    assert [len(h) for h in hits] == [3, 3] and [h.id for h in hits[0]] == built.brute_force(q, 3)[1][0].tolist()
    for bad, message in [(np.full((1, DIM), np.nan, np.float32), "NaN or infinite"),
                         (q.astype(np.complex64), "complex numbers")]:
        with pytest.raises(ConfigError, match=message):
            index.search_vectors(bad, k=3)
    for bad in (None, b"bread", bytearray(b"x")):  # bytes were read as numbers: "query 0 (98) is empty"
        with pytest.raises(ConfigError, match=rf"^queries={re.escape(repr(bad))}: give a text or a list of texts"):
            index.search(bad)
    index.close()

    class Encoder:
        def encode(self, texts):
            return unit_vectors(len(texts), seed=len(texts[0]))

    with open_index(tmp_path / "ix", encoder=Encoder()) as by_text:
        assert [len(h) for h in by_text.search((t for t in ["one", "three"]), k=2)] == [2, 2]
        assert [len(h) for h in by_text.search(np.array(["one", "three"]), k=2)] == [2, 2]
    for call in (lambda: index.search_vectors(q, k=3), lambda: index.chunks([0])):
        with pytest.raises(ConfigError, match=r"was closed: open it again with open_index"):
            call()

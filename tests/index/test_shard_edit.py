"""Removing units from shards: replaced whole, the switch is the new commit record."""

import faiss
import numpy as np
import pyarrow.parquet as pq
import pytest
from shard_fixtures import DIM, build_shards, recommit_file, unit_vectors

import embedingest.index.shard_edit as shard_edit
from embedingest.index.lookup import ShardRows
from embedingest.index.shards import clean_shards, finished_units, incomplete_units, list_shards, read_ids
from embedingest.outfiles import write_faiss_index


def vectors_by_id(shards):
    out = {}
    for shard in shards:
        if shard.rows:
            index = faiss.read_index(str(shard.path("faiss")))
            ids = faiss.vector_to_array(index.id_map)
            assert np.array_equal(ids, read_ids(shard))
            inner = faiss.downcast_index(index.index)
            if isinstance(inner, faiss.IndexIVF):
                inner.make_direct_map()
            for i, v in zip(ids.tolist(), inner.reconstruct_n(0, index.ntotal)):
                out[i] = v
    return out


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat", "HNSW8"])
def test_removed_units_leave_rows_vectors_and_marks_of_the_others_exactly(tmp_path, factory):
    folder = tmp_path / "ix"
    template = None
    trained = None
    if factory != "Flat":
        template = faiss.index_factory(DIM, factory, faiss.METRIC_INNER_PRODUCT)
        template.train(unit_vectors(300, seed=5))
        trained = tmp_path / "trained.faiss"
        write_faiss_index(template, trained)
    built = build_shards(folder, n_units=6, chunks=11, commit_every=25, workers=2, factory=factory,
                         trained=str(trained) if trained else None)
    before = vectors_by_id(list_shards(folder / "shards"))
    n = shard_edit.remove_units(folder / "shards", [1, 4], template=template, run_id="x")
    assert n == 22
    shards = list_shards(folder / "shards")
    assert incomplete_units(shards) == set()
    assert finished_units(shards) == {u: 11 for u in (0, 2, 3, 5)}
    kept = {i: r for i, r in built.rows.items() if i >> 32 not in (1, 4)}
    rows = ShardRows(shards)
    assert {i: c.text for i, c in rows.chunks(built.ids).items()} == {i: r["text"] for i, r in kept.items()}
    after = vectors_by_id(shards)
    assert set(after) == set(kept)
    for i, v in after.items():
        assert np.array_equal(v, before[i])  # codes untouched (HNSW: flat storage, re-added exactly)
    assert shard_edit.remove_units(folder / "shards", [1, 4], template=template) == 0  # nothing left


def test_a_crash_after_the_new_record_hides_the_old_shard_and_clean_finishes(tmp_path, monkeypatch):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=3, chunks=5, commit_every=100, workers=1)
    (old,) = list_shards(folder / "shards")

    def crash(shard):
        raise KeyboardInterrupt
    monkeypatch.setattr(shard_edit, "delete_shard", crash)
    with pytest.raises(KeyboardInterrupt):
        shard_edit.remove_units(folder / "shards", [0], run_id="y")
    (new,) = list_shards(folder / "shards")
    assert new.replaces == (old.name,) and new.rows == 10
    assert old.commit_path().exists()
    clean_shards(folder / "shards")
    assert not any(p.name.startswith(old.name) for p in (folder / "shards").iterdir())
    assert pq.read_table(new.path("parquet")).num_rows == 10


def test_removing_every_unit_of_a_shard_leaves_a_mark_only_shard_or_nothing(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=5, commit_every=100, workers=1)
    shard_edit.remove_units(folder / "shards", [0, 1], run_id="z")
    shards = list_shards(folder / "shards")
    assert [(s.rows, s.files, s.units) for s in shards] == [(0, {}, ())]
    clean_shards(folder / "shards")
    assert list((folder / "shards").iterdir()) == []


def test_a_rewritten_shard_keeps_small_zstd_row_groups(tmp_path):
    """A lookup reads one row group per hit: the shard a removal writes has groups of
    ROW_GROUP_ROWS rows, compressed like the writers' (whatever the old shard had)."""
    from embedingest.index.shard_edit import remove_units
    from embedingest.sinks.shard_writer import ROW_GROUP_ROWS

    folder = tmp_path / "ix"
    build_shards(folder, n_units=3, chunks=40, commit_every=200, workers=1, row_group_rows=8)
    assert remove_units(folder / "shards", {1}) == 40
    (shard,) = [s for s in list_shards(folder / "shards") if s.rows]
    meta = pq.read_metadata(shard.path("parquet"))
    sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    assert sizes == [ROW_GROUP_ROWS] * 2 + [80 - 2 * ROW_GROUP_ROWS]
    assert {meta.row_group(0).column(c).compression for c in range(meta.num_columns)} == {"ZSTD"}


def test_a_rewritten_shard_keeps_the_saved_embeddings_of_its_kept_rows(tmp_path):
    from embedingest.index.shard_edit import remove_units

    folder = tmp_path / "ix"
    built = build_shards(folder, n_units=3, chunks=10, commit_every=100, workers=1, save_embeddings=True)
    assert remove_units(folder / "shards", {1}) == 10
    (shard,) = [s for s in list_shards(folder / "shards") if s.rows]
    ids = read_ids(shard)
    assert sorted(ids.tolist()) == sorted(built.ids[(built.ids >> 32) != 1].tolist())
    expected = built.emb[np.searchsorted(built.ids, ids)].astype(np.float16)
    np.testing.assert_array_equal(np.load(shard.path("emb")), expected)


def test_a_kind_that_cannot_be_edited_in_place_needs_the_template(tmp_path):
    from embedingest.index.shard_edit import remove_units
    from embedingest.index.store import IndexStore

    folder = tmp_path / "ix"
    trained = IndexStore(folder).train_index("HNSW8", DIM, "ip", unit_vectors(10))
    build_shards(folder, n_units=2, chunks=4, workers=1, factory="HNSW8", trained=trained)
    with pytest.raises(ValueError, match=r"^removing vectors from shard-run1-w0-00000 needs the empty index template$"):
        remove_units(folder / "shards", {1})


def test_the_template_is_made_once_and_only_for_a_shard_that_needs_it(tmp_path):
    """``template`` may be a function: called once, for the first shard faiss cannot edit in
    place, never for units no shard holds rows of (an IVF index that has not trained yet)."""
    from embedingest.index.shard_edit import remove_units
    from embedingest.index.store import IndexStore

    calls = []

    def template():
        calls.append("made")
        return faiss.index_factory(DIM, "HNSW8", faiss.METRIC_INNER_PRODUCT)

    assert remove_units(tmp_path / "none" / "shards", {1}, template=template) == 0
    flat = tmp_path / "flat"
    build_shards(flat, n_units=4, chunks=10, workers=2)
    assert remove_units(flat / "shards", {1, 9}, template=template) == 10 and calls == []  # edited in place
    trained = IndexStore(tmp_path).train_index("HNSW8", DIM, "ip", unit_vectors(10))
    for units, gone in (((0, 1, 2, 3), 40), ((1,), 10)):
        hnsw = tmp_path / f"hnsw{len(units)}"
        build_shards(hnsw, n_units=4, chunks=10, workers=2, factory="HNSW8", trained=trained)
        assert len([s for s in list_shards(hnsw / "shards") if s.rows]) == 2  # unit 1 in both
        assert remove_units(hnsw / "shards", units, template=template) == gone
    assert calls == ["made"]  # not for shards that lose every row; once for two that keep some


def test_the_replacing_shards_records_say_exactly_what_they_hold(tmp_path):
    """Each rewritten shard: named after the removal's run, parts in order, the kept
    rows' id range (empty: 0, -1), the old shard's settings, the finished-marks of the
    units left, its creation time."""
    import re

    from embedingest.index.shard_edit import remove_units
    from embedingest.sinks.shard_writer import ROW_GROUP_ROWS

    folder = tmp_path / "ix"
    build_shards(folder, n_units=3, chunks=10, commit_every=8, workers=1)
    old = list_shards(folder / "shards")
    assert [s.rows for s in old] == [8, 8, 8, 6]
    old_ids = [read_ids(s).tolist() for s in old]
    assert remove_units(folder / "shards", {0, 2}, run_id="x") == 20
    new = list_shards(folder / "shards")
    assert [s.name for s in new] == [f"shard-rmx-w0-0000{p}" for p in range(4)]
    for before, before_ids, after in zip(old, old_ids, new):
        kept = [i for i in before_ids if i >> 32 == 1]
        assert read_ids(after).tolist() == kept
        record = {k: v for k, v in after.record.items() if k not in ("files", "created")}
        marks = [(u, n) for u, n in before.units if u == 1]
        assert record == {"format": 2, "name": after.name, "rows": len(kept),
                          "id_min": min(kept) if kept else 0, "id_max": max(kept) if kept else -1,
                          "dim": DIM, "factory": "Flat", "generation": 0, "row_group_rows": ROW_GROUP_ROWS,
                          "units": [[u for u, _ in marks], [n for _, n in marks]],
                          "replaces": [before.name], "run": "rmx"}
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", after.record["created"])
        assert sorted(after.files) == (["emb", "faiss", "parquet"] if kept else [])
        assert after.verify() is None
    assert finished_units(new) == {1: 10}


def test_a_shard_of_finished_marks_only_loses_the_marks_of_removed_units(tmp_path):
    """A shard without rows is rewritten only when it marks a removed unit; the shards
    after one left alone are still edited."""
    from embedingest.index.shard_edit import remove_units
    from embedingest.sinks.shard_writer import ShardWriterFactory, commit_finished

    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=5, commit_every=100, workers=1)
    commit_finished(ShardWriterFactory(str(folder), DIM, run_id="m"), [(7, 0), (8, 0)])
    names = [s.name for s in list_shards(folder / "shards")]
    assert names == ["shard-m-w9999-00000", "shard-run1-w0-00000"]
    assert remove_units(folder / "shards", {0}, run_id="a") == 5  # the marks' shard comes first, untouched
    assert [s.name for s in list_shards(folder / "shards")] == ["shard-m-w9999-00000", "shard-rma-w0-00000"]
    assert remove_units(folder / "shards", {7}, run_id="b") == 0
    shards = {s.name: s for s in list_shards(folder / "shards")}
    marks = shards["shard-rmb-w0-00000"]
    assert (marks.rows, marks.id_min, marks.id_max, marks.files, marks.units, marks.replaces) == (
        0, 0, -1, {}, ((8, 0),), ("shard-m-w9999-00000",))
    assert finished_units(shards.values()) == {1: 5, 8: 0}


def test_vectors_out_of_their_rows_order_are_refused(tmp_path):
    """A shard whose faiss ids are not its Parquet rows' order (same file size, so only
    the rewrite can tell) is not rewritten with rows and vectors mismatched."""
    from embedingest.index.shard_edit import remove_units

    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=5, commit_every=100, workers=1)
    (shard,) = list_shards(folder / "shards")
    index = faiss.read_index(str(shard.path("faiss")))
    ids = faiss.vector_to_array(index.id_map)
    faiss.copy_array_to_vector(ids[::-1].copy(), index.id_map)
    faiss.write_index(index, str(shard.path("faiss")))
    assert list_shards(folder / "shards") == [shard]
    with pytest.raises(ValueError, match=r"^the vectors of shard-run1-w0-00000 are not in the order of its rows$"):
        remove_units(folder / "shards", {1})
    assert list_shards(folder / "shards") == [shard]


def test_a_shard_emptied_by_a_removal_has_an_empty_id_range(tmp_path):
    from embedingest.index.shard_edit import remove_units

    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=5, commit_every=100, workers=1)
    assert remove_units(folder / "shards", [0], run_id="e") == 5
    (shard,) = list_shards(folder / "shards")
    assert (shard.name, shard.rows, shard.id_min, shard.id_max, shard.files, shard.units) == (
        "shard-rme-w0-00000", 0, 0, -1, {}, ())


def test_a_rewritten_shard_keeps_the_hashes_of_the_units_it_still_finishes(tmp_path):
    from embedingest.index.shard_edit import remove_units
    from embedingest.index.shards import finished_hashes
    from embedingest.sinks.shard_writer import ShardWriterFactory, commit_finished

    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=5, commit_every=100, workers=1)
    commit_finished(ShardWriterFactory(str(folder), DIM, run_id="m"), [(7, 0), (8, 0), (9, 0)],
                    unit_hashes=[(7, "7" * 64), (8, "8" * 64)])
    assert remove_units(folder / "shards", {7}, run_id="b") == 0
    shards = list_shards(folder / "shards")
    assert finished_hashes(shards) == {8: "8" * 64}
    assert finished_units(shards) == {0: 5, 8: 0, 9: 0}


def test_a_removal_refuses_a_rows_file_of_other_columns_instead_of_passing_it_on(tmp_path):
    """Before: a rows file without its text column was rewritten as it was, under a new
    shard's name and a fresh hash, so the damage passed to the replacing shard."""
    from embedingest.errors import ConfigError

    folder = tmp_path / "ix"
    build_shards(folder, n_units=3, chunks=5, commit_every=100, workers=1)
    (shard,) = list_shards(folder / "shards")
    path = shard.path("parquet")
    pq.write_table(pq.read_table(path).drop_columns(["text"]), path)
    recommit_file(shard, "parquet")
    with pytest.raises(ConfigError, match=rf"^shard {shard.name} in .* is damaged: its parquet file is not a "
                                          r"shard's rows file \(it lacks the column text\); delete that shard's files"):
        shard_edit.remove_units(folder / "shards", [1], run_id="x")
    assert [s.name for s in list_shards(folder / "shards")] == [shard.name]  # nothing rewritten


def test_a_removal_refuses_saved_embeddings_of_another_shape(tmp_path):
    """Before: half-width embeddings (their record made to match) were cut by the rows kept
    and written into the replacing shard, which passed them on to reindex and export."""
    from embedingest.errors import ConfigError
    from embedingest.index.shards import EMB_SUFFIX

    folder = tmp_path / "ix"
    build_shards(folder, n_units=3, chunks=5, commit_every=100, workers=1)
    (shard,) = list_shards(folder / "shards")
    path = folder / "shards" / f"{shard.name}{EMB_SUFFIX}"
    np.save(path, np.load(path).reshape(-1, DIM // 2))
    recommit_file(shard, "emb")
    with pytest.raises(ConfigError, match=rf"^shard {shard.name} in .* is damaged: its emb file '{shard.name}"
                                          rf"\.emb\.npy' is not its vectors \(it holds an array of shape \(30, 8\)"):
        shard_edit.remove_units(folder / "shards", [1], run_id="x")
    assert [s.name for s in list_shards(folder / "shards")] == [shard.name]

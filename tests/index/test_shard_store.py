"""ShardStore: the format-2 folder's manifest, units and shards, as the build uses them."""

import json
import os

import numpy as np
import pytest
from index_fixtures import build_v1
from shard_fixtures import DIM, batches, build_shards, meta_of, unit_vectors

from embedingest.errors import ConfigError
from embedingest.index.shard_store import ShardStore
from embedingest.index.shards import list_shards, read_ids
from embedingest.index.store import Manifest
from embedingest.sinks.shard_writer import ShardWriterFactory


def visible(folder):
    """The folder's files, without lock files and sqlite's journals."""
    return sorted(n for n in os.listdir(folder) if not n.startswith(".") and not n.endswith(("-wal", "-shm")))


def manifest(factory="Flat"):
    return Manifest(model={"name": "test-model", "path": "/nowhere"}, dim=DIM, factory=factory,
                    corpus_path="/data/corpus")


def write_units(store, folder, units, chunks, run_id, drop_last_batch=False):
    sink = ShardWriterFactory(str(folder), DIM, run_id=run_id)(0)
    plan = batches(units, chunks)
    if drop_last_batch:
        plan = plan[:-1]
    for b, (part, done) in enumerate(plan):
        ids = np.array([r["id"] for r in part], dtype=np.int64)
        sink(meta_of(b, part, done), {"emb": unit_vectors(len(ids), seed=b), "ids": ids})
    sink.close()


def test_units_are_done_when_their_shards_say_so(tmp_path):
    store = ShardStore(tmp_path / "ix")
    m = store.create_or_open(manifest())
    assert m.format == 2 and json.loads((tmp_path / "ix" / "manifest.json").read_text())["format"] == 2
    nos = store.upsert_units([{"key": f"doc{u}.txt", "size": u, "status": "pending", "n_chunks": 0}
                              for u in range(3)])
    assert set(nos.values()) == {1, 2, 3}
    assert {u.status for u in store.units().values()} == {"pending"}
    write_units(store, tmp_path / "ix", [1, 2], 10, "a")
    units = store.units()
    assert [(units[f"doc{u}.txt"].status, units[f"doc{u}.txt"].n_chunks) for u in range(3)] == [
        ("done", 10), ("done", 10), ("pending", 0)]
    assert store.reconcile() == set()
    store.sync_status()
    assert store.db.execute("SELECT unit_no, status, n_chunks FROM units ORDER BY unit_no").fetchall() == [
        (1, "done", 10), (2, "done", 10), (3, "pending", 0)]
    assert store.update_shards().segments == [{"name": "shard-a-w0-00000", "count": 20}]
    assert visible(tmp_path / "ix") == ["manifest.json", "shards", "units.sqlite"]
    assert store.chunks([1 << 32 | 3])[1 << 32 | 3].text.startswith("text of docs/doc1.txt chunk 3")


def test_a_stopped_writer_leaves_its_units_to_redo_and_strays_are_found(tmp_path):
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(manifest())
    # unit numbers 1, 2, keyed as the rows name their files (a row naming another is another index's)
    store.upsert_units([{"key": "docs/doc1.txt"}, {"key": "docs/doc2.txt"}])
    write_units(store, tmp_path / "ix", [1, 2], 20, "a", drop_last_batch=True)  # 40 rows: last batch lost
    assert store.reconcile() == {2}
    write_units(store, tmp_path / "ix", [9], 3, "b")  # a unit no row names
    assert store.reconcile() == {2, 9}
    assert store.remove_units({2, 9}) == 20 - 6 + 3
    store.clean_garbage()
    assert store.reconcile() == set()
    assert {u.key: u.status for u in store.units().values()} == {"docs/doc1.txt": "done", "docs/doc2.txt": "pending"}


def test_unit_numbers_are_never_given_twice(tmp_path):
    """The highest number ever given is found in units.sqlite's counter, its rows and the
    commit records; spend_unit_nos makes AUTOINCREMENT count on from it."""
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(manifest())
    assert store.highest_unit_no() == 0
    store.spend_unit_nos(0)  # nothing to skip on a fresh index: numbering starts at 1
    assert store.upsert_units([{"key": "a"}, {"key": "b"}]) == {"a": 1, "b": 2}
    store.delete_units([2])
    assert store.highest_unit_no() == 2  # the counter keeps it: AUTOINCREMENT gives 3 next
    write_units(store, tmp_path / "ix", [40], 2, "w")  # vectors of a unit no row names
    assert store.highest_unit_no() == 40
    store.spend_unit_nos(store.highest_unit_no())
    store.spend_unit_nos(7)  # never back
    assert store.upsert_units([{"key": "c"}]) == {"c": 41}
    assert store.highest_unit_no() == 41



def test_a_fresh_index_counts_on_from_the_highest_number_its_shards_hold(tmp_path):
    """Before any unit row, AUTOINCREMENT has no counter: spend_unit_nos makes one at the
    highest number a shard holds (here 1, a killed writer's), so the next unit is 2, not
    1 again, nor 3."""
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(manifest())
    write_units(store, tmp_path / "ix", [1], 2, "w")  # vectors of a unit no row names
    assert store.highest_unit_no() == 1
    store.spend_unit_nos(store.highest_unit_no())
    assert store.upsert_units([{"key": "a"}]) == {"a": 2}


def test_the_shards_hashes_fill_only_the_unit_rows_that_have_none(tmp_path):
    """A unit's sha256 comes from the shard that finished it (the loader hashed the file)
    only where its row has none, in units() and in what sync_status writes: a row's own
    hash is kept."""
    from embedingest.sinks.shard_writer import commit_finished

    store = ShardStore(tmp_path / "ix")
    store.create_or_open(manifest())
    nos = store.upsert_units([{"key": "a", "sha256": "a" * 64}, {"key": "b"}, {"key": "c"}])
    commit_finished(ShardWriterFactory(str(tmp_path / "ix"), DIM, run_id="m"), [(nos["a"], 0), (nos["b"], 0)],
                    unit_hashes=[(nos["a"], "f" * 64), (nos["b"], "b" * 64)])
    expected = {"a": "a" * 64, "b": "b" * 64, "c": None}
    assert {k: u.sha256 for k, u in store.units().items()} == expected
    store.sync_status()
    assert dict(store.db.execute("SELECT key, sha256 FROM units")) == expected
    assert dict(store.db.execute("SELECT key, status FROM units")) == {"a": "done", "b": "done", "c": "pending"}

def test_a_format_1_folder_is_refused_and_overwritten_only_when_asked(tmp_path):
    folder = tmp_path / "ix"
    build_v1(folder).store.close()
    with pytest.raises(ConfigError, match=r"is in format 1 .*\n  embedingest build-index CORPUS --out "):
        ShardStore(folder).create_or_open(manifest())
    assert (folder / "metadata.sqlite").is_file()  # untouched
    store = ShardStore(folder)
    store.create_or_open(manifest(), overwrite=True)
    assert visible(folder) == ["manifest.json", "shards"]


def test_other_settings_are_refused_once_a_shard_holds_vectors(tmp_path):
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(manifest())
    assert store.create_or_open(manifest("HNSW8")).factory == "HNSW8"  # nothing built yet
    store.upsert_units([{"key": "a"}])
    write_units(store, tmp_path / "ix", [1], 2, "a")
    with pytest.raises(ConfigError, match="was built with .*'HNSW8'.*use --overwrite"):
        store.create_or_open(manifest("Flat"))


def test_wipe_keeps_the_user_s_files_in_folders_named_shards_and_segments(tmp_path):
    """--overwrite of an --out folder that held the user's own ``shards/`` or
    ``segments/`` deleted those folders whole; now only the index's files go, and a
    folder left empty."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=2, workers=1)
    (folder / "shards" / "notes.txt").write_text("mine")
    (folder / "segments").mkdir()
    (folder / "segments" / "mask.png").write_bytes(b"png")
    (folder / "segments" / "seg-r-w0-00000.faiss").write_bytes(b"x")
    ShardStore(folder).wipe()
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if not p.name.startswith(".")) == [
        "segments", "segments/mask.png", "shards", "shards/notes.txt"]
    (folder / "shards" / "notes.txt").unlink()
    (folder / "segments" / "mask.png").unlink()
    build_shards(folder, n_units=1, chunks=2, workers=1)
    ShardStore(folder).wipe()
    assert not (folder / "shards").exists() and not (folder / "segments").exists()


def test_wipe_removes_every_file_of_both_formats_and_nothing_else(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=2, workers=1)
    (folder / "trained.g3.faiss").write_bytes(b"x")
    (folder / "units.sqlite").write_bytes(b"")
    (folder / "mine.txt").write_text("keep")
    ShardStore(folder).wipe()
    assert visible(folder) == ["mine.txt"]
    assert list_shards(folder / "shards") == []


def test_wipe_starts_the_folder_again_at_generation_0(tmp_path):
    from shard_fixtures import write_manifest

    folder = tmp_path / "ix"
    write_manifest(folder, generation=2)
    store = ShardStore(folder)
    assert store.generation == 2 and store.trained_path.name == "trained.g2.faiss"
    store.wipe()
    assert store.generation == 0 and store.trained_path == folder / "trained.faiss"


def test_remove_units_after_a_reindex_edits_that_generation(tmp_path):
    from embedingest.index.reindex import reindex
    from embedingest.index.search import open_index

    folder = tmp_path / "ix"
    built = build_shards(folder, n_units=3, chunks=10, commit_every=12, workers=1, save_embeddings=True)
    reindex(folder, "Flat")
    store = ShardStore(folder)
    assert store.generation == 1
    assert store.remove_units({1}) == 10
    keep = (built.ids >> 32) != 1
    with open_index(folder) as index:
        _, ids = index.search_raw(unit_vectors(3, seed=5), 30)
    assert sorted(ids[0].tolist()) == sorted(built.ids[keep].tolist())


def test_remove_units_of_a_flat_index_needs_no_manifest(tmp_path):
    """Flat vectors are edited in place: no template, so a folder whose manifest is gone
    still has its units removed rather than a 'not an index' error."""
    folder = tmp_path / "ix"
    write_units(None, folder, [1, 2], 5, "a")
    store = ShardStore(folder)
    assert not store.exists() and store.remove_units({2}) == 5
    assert {int(i) >> 32 for s in list_shards(folder / "shards") if s.rows for i in read_ids(s)} == {1}


@pytest.mark.parametrize("shards", [False, True])
def test_units_no_shard_holds_go_without_the_trained_index_a_training_factory_needs(tmp_path, shards):
    """A run of an IVF index stopped or refused while it trained leaves units in
    units.sqlite, no shard and no trained file: removing those units asked for an empty
    index of the factory, untrained, and every later run failed with "needs training"."""
    folder = tmp_path / "ix"
    if shards:  # shards holding only other units, or only their finished-marks: no vectors edited
        write_units(None, folder, [1], 5, "a")
    store = ShardStore(folder)
    store.create_or_open(manifest("IVF32,Flat"))
    store.upsert_units([{"key": f"doc{u}.txt", "status": "pending", "n_chunks": 0} for u in (1, 2, 3)])
    assert not store.trained_path.exists()
    assert store.remove_units({2, 3}) == 0
    store.delete_units({2, 3})
    assert {u.unit_no for u in store.units().values()} == {1}
    assert {int(i) >> 32 for s in list_shards(folder / "shards") if s.rows for i in read_ids(s)} == ({1} if shards else set())
    with pytest.raises(ConfigError, match="needs training"):  # the template is still made where needed
        store.empty_index()


def test_units_keep_every_field_of_their_row(tmp_path):
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(manifest())
    store.upsert_units([{"key": "a", "size": 5, "mtime_ns": 123456789, "sha256": "ab"}])
    write_units(store, tmp_path / "ix", [1], 3, "a")
    (unit,) = store.units().values()
    assert (unit.unit_no, unit.key, unit.size, unit.mtime_ns, unit.sha256, unit.n_chunks, unit.status) == (
        1, "a", 5, 123456789, "ab", 3, "done")


def test_clean_garbage_after_a_reindex_keeps_that_generations_vectors(tmp_path):
    """Only temporary files go: the shards' vectors are in their .g1.faiss files now."""
    from embedingest.index.reindex import reindex

    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=5, commit_every=6, workers=1, save_embeddings=True)
    reindex(folder, "Flat")
    store = ShardStore(folder)
    before = sorted(os.listdir(folder / "shards"))
    assert sum(n.endswith(".g1.faiss") for n in before) == 2
    (folder / ".manifest.json.tmp-1").write_bytes(b"x")
    assert store.clean_garbage() == [".manifest.json.tmp-1"]
    assert sorted(os.listdir(folder / "shards")) == before
    assert [s.rows for s in store.committed()] == [6, 4]


def test_reconcile_against_the_expected_chunk_counts(tmp_path):
    """Units the plan expects but no shard holds, and rows of units it does not expect."""
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(manifest())
    write_units(store, tmp_path / "ix", [1, 2], 10, "a")
    assert store.reconcile({1: 10, 2: 10}) == set()
    assert store.reconcile({1: 10, 3: 4}) == {2, 3}
    assert store.reconcile({1: 11, 2: 10}) == {1}


def test_create_makes_the_folder_and_its_missing_parents(tmp_path):
    folder = tmp_path / "new" / "nested" / "ix"
    ShardStore(folder).create_or_open(manifest())
    assert visible(folder) == ["manifest.json", "shards"]


def test_reopening_an_index_takes_its_generation_and_trained_file(tmp_path):
    from shard_fixtures import write_manifest

    folder = tmp_path / "ix"
    store = ShardStore(folder)  # made before the index was (as by a waiting build)
    write_manifest(folder, generation=2)
    assert store.create_or_open(manifest()).generation == 2
    assert (store.generation, store.trained_path) == (2, folder / "trained.g2.faiss")
    again = ShardStore(folder)
    again.create_or_open(manifest())
    assert (again.generation, again.trained_path) == (2, folder / "trained.g2.faiss")


def test_new_settings_of_an_index_without_vectors_are_logged_and_its_trained_file_goes(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="embedingest")
    folder = tmp_path / "ix"
    store = ShardStore(folder)
    assert store.create_or_open(manifest("IVF4,Flat")).generation == 0
    assert store.trained_path == folder / "trained.faiss"
    store.trained_path.write_bytes(b"trained for IVF4")
    old, new = manifest("IVF4,Flat").describe(), manifest("Flat").describe()
    caplog.clear()
    assert store.create_or_open(manifest("Flat")).factory == "Flat"
    assert [r.getMessage() for r in caplog.records] == [
        f"the index at {folder} holds no shard yet: its settings ({old}) become {new}"]
    assert not (folder / "trained.faiss").exists()
    assert json.loads((folder / "manifest.json").read_text())["factory"] == "Flat"


def test_other_settings_are_refused_even_when_a_shard_with_vectors_is_damaged(tmp_path):
    """The refusal says what to do (--overwrite), not that a shard is damaged."""
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(manifest())
    write_units(store, tmp_path / "ix", [1], 2, "a")
    (shard,) = list_shards(tmp_path / "ix" / "shards")
    with open(shard.path("parquet"), "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(ConfigError) as err:
        store.create_or_open(manifest("HNSW8"))
    assert str(err.value) == (
        f"the index at {str(tmp_path / 'ix')!r} was built with {manifest().describe()}, not "
        f"{manifest('HNSW8').describe()}: leave out --index (or pass --index 'Flat') to update it as it is "
        "(a reindex changes the factory), use --overwrite to rebuild it, or another folder")


def test_update_shards_writes_the_changes_and_the_shard_list_into_the_given_manifest(tmp_path):
    store = ShardStore(tmp_path / "ix")
    m = store.create_or_open(manifest())
    write_units(store, tmp_path / "ix", [1], 3, "a")
    m.search = {"params": "nprobe=4"}  # held by the caller, not yet written
    out = store.update_shards(m, corpus_path="/data/other")
    assert out is m and (m.corpus_path, m.segments) == ("/data/other", [{"name": "shard-a-w0-00000", "count": 3}])
    data = json.loads((tmp_path / "ix" / "manifest.json").read_text())
    assert (data["corpus_path"], data["search"], data["segments"]) == (
        "/data/other", {"params": "nprobe=4"}, [{"name": "shard-a-w0-00000", "count": 3}])


def test_shards_after_a_reindex_are_that_generations_vectors(tmp_path):
    from embedingest.index.reindex import reindex

    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=5, commit_every=6, workers=1, save_embeddings=True)
    reindex(folder, "Flat")
    store = ShardStore(folder)
    assert [(v.name, v.path, v.count, v.shard.name, v.ids_path) for v in store.shards()] == [
        (f"shard-run1-w0-0000{p}", folder / "shards" / f"shard-run1-w0-0000{p}.g1.faiss", n,
         f"shard-run1-w0-0000{p}", folder / "shards" / f"shard-run1-w0-0000{p}.parquet") for p, n in ((0, 6), (1, 4))]


def test_a_read_only_store_never_makes_the_units_database(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=2, workers=1)
    store = ShardStore(folder, read_only=True)
    assert store.read_only and store.generation == 0
    with pytest.raises(ConfigError, match="units.sqlite' does not exist"):
        store.units()
    assert not (folder / "units.sqlite").exists()

import json
import os

import faiss
import numpy as np
import pytest
from index_fixtures import DIM, build_index, unit_vectors

from embedingest.errors import ConfigError
from embedingest.index.lock import RUN_LOCK, WRITERS_LOCK
from embedingest.index.search import open_index
from embedingest.index.shard_store import ShardStore
from embedingest.index.store import IndexStore, Manifest, Unit


def manifest(**kw):
    """The settings :func:`build_index` builds with, changed by ``kw``."""
    return Manifest(**{"model": {"name": "test-model", "path": "/nowhere"}, "dim": DIM, **kw})


def all_ids(store):
    return np.sort(np.concatenate([s.ids() for s in store.shards()]))


# -- manifest ---------------------------------------------------------------------------

def test_manifest_create_reopen_and_mismatch(tmp_path):
    store = ShardStore(tmp_path / "ix")
    first = store.create_or_open(manifest(corpus="c1"))
    data = json.loads(store.manifest_path.read_text())
    assert data["dim"] == DIM and data["metric"] == "ip" and data["factory"] == "Flat"
    assert data["version"] and data["created"] and data["corpus"] == "c1" and data["format"] == 2
    assert store.create_or_open(manifest()).created == first.created
    # No shard yet (a first build stopped before its first commit): other settings are
    # taken, and a trained index of the old ones goes with them.
    store.train_index("IVF2,Flat", DIM, "ip", unit_vectors(100))
    assert store.create_or_open(manifest(factory="HNSW8")).factory == "HNSW8"
    assert json.loads(store.manifest_path.read_text())["factory"] == "HNSW8"
    assert not store.trained_path.exists()
    assert store.create_or_open(manifest()).factory == "Flat"
    build_index(store.folder, n_units=1, chunks=2, workers=1)
    for bad, what in [({"dim": 8}, "dim 8"), ({"metric": "l2"}, "metric l2"),
                      ({"model": {"name": "other"}}, "'other'"), ({"factory": "HNSW8"}, "'HNSW8'")]:
        with pytest.raises(ConfigError, match=f"{what}.*--overwrite"):
            store.create_or_open(manifest(**bad))
    assert store.create_or_open(manifest(dim=8), overwrite=True).dim == 8
    assert not [p for p in store.folder.iterdir() if ".tmp-" in p.name]


def test_not_an_index_names_the_folder(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path / "nope")):
        IndexStore(tmp_path / "nope").read_manifest()
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(ConfigError, match="manifest.json"):
        IndexStore(tmp_path).read_manifest()


@pytest.mark.parametrize("kind", ["link", "pipe"])
def test_a_manifest_that_is_a_link_or_a_pipe_is_refused_at_once_and_an_overwrite_replaces_it(tmp_path, kind):
    """A manifest was read through a link (one pointing outside the index was taken for its
    own) and one replaced by a named pipe was 'no manifest.json'."""
    build_index(tmp_path / "ix", n_units=1, chunks=2, workers=1)
    store = ShardStore(tmp_path / "ix")
    real = store.manifest_path.read_bytes()
    store.manifest_path.unlink()
    if kind == "link":
        (tmp_path / "elsewhere.json").write_bytes(real)
        store.manifest_path.symlink_to(tmp_path / "elsewhere.json")
    else:
        os.mkfifo(store.manifest_path)
    what = "a symbolic link" if kind == "link" else "a named pipe"
    with pytest.raises(ConfigError, match=rf"cannot read .*manifest.json.*{what}.*rebuild the index with --overwrite"):
        store.read_manifest()
    with pytest.raises(ConfigError, match="manifest.json"):
        open_index(store.folder)
    store.create_or_open(manifest(), overwrite=True)
    assert not store.manifest_path.is_symlink() and store.read_manifest().dim == DIM
    if kind == "link":
        assert (tmp_path / "elsewhere.json").read_bytes() == real


def test_update_segments_and_wipe(tmp_path):
    built = build_index(tmp_path, n_units=3, chunks=20, commit_every=25)
    m = built.store.update_shards(corpus="fp")
    assert sum(s["count"] for s in m.segments) == 60 and m.corpus == "fp"
    (built.store.folder / "mine.txt").write_text("keep")
    built.store.wipe()
    left = sorted(p.name for p in built.store.folder.iterdir())
    assert [name for name in left if name not in (RUN_LOCK, WRITERS_LOCK)] == ["mine.txt"]


# -- units ------------------------------------------------------------------------------

def test_units(tmp_path):
    store = IndexStore(tmp_path)
    nos = store.upsert_units([{"key": "a", "n_chunks": 2, "status": "pending"}, {"key": "b"}])
    assert store.upsert_units([{"key": "a", "n_chunks": 3, "status": "done"}]) == {"a": nos["a"]}
    assert store.units(["a", "zzz"])["a"].n_chunks == 3
    store.upsert_units([{"key": "a", "size": 7}])  # fields left out keep their value
    assert store.units()["a"] == Unit(nos["a"], "a", 7, None, None, 3, "done")
    with store.db as db:
        db.execute("DELETE FROM units WHERE key = 'a'")
    assert list(store.units()) == ["b"]
    assert store.upsert_units([{"key": "a"}])["a"] == nos["b"] + 1  # unit numbers are never reused
    for _ in range(3):  # and updating a unit spends none
        store.upsert_units([{"key": "a", "size": 1}, {"key": "b", "size": 2}])
    assert store.upsert_units([{"key": "c"}])["c"] == nos["b"] + 2
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(("-wal", "-shm"))) == [
        "units.sqlite"]


# -- shards -----------------------------------------------------------------------------

def test_reconcile_complete(tmp_path):
    built = build_index(tmp_path, n_units=4, chunks=30)
    assert built.store.reconcile() == set()
    np.testing.assert_array_equal(all_ids(built.store), np.sort(built.ids))


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat", "HNSW8", "SQ8", "IVF4,PQ4x4"])
def test_remove_units_removes_exactly_their_ids(tmp_path, factory):
    built = build_index(tmp_path, n_units=6, chunks=20, factory=factory, commit_every=40)
    store, nos = built.store, list(built.unit_nos.values())
    gone = {nos[1], nos[4]}
    segments_before = store.shards()
    queries = unit_vectors(5, seed=7)
    with open_index(store.folder, params="nprobe=4" if "IVF" in factory else None) as before:
        raw_before = before.search_raw(queries, 200)
    assert store.remove_units(gone) == 40
    keep = ~np.isin(built.ids >> 32, list(gone))
    np.testing.assert_array_equal(all_ids(store), np.sort(built.ids[keep]))
    assert store.reconcile({n: 20 for n in nos if n not in gone}) == set()
    assert len(store.shards()) <= len(segments_before)
    assert store.clean_garbage() == []  # the replaced shards are gone already
    params = {"IVF4,Flat": "nprobe=4", "IVF4,PQ4x4": "nprobe=4", "HNSW8": "efSearch=256"}.get(factory)
    with open_index(store.folder, params=params) as index:
        scores, ids = index.search_raw(queries, 200)
        for row_s, row_i, b_s, b_i in zip(scores, ids, *raw_before):
            assert not np.isin(row_i, built.ids[~keep]).any()
            if factory != "HNSW8":  # kept vectors keep their codes: same scores as before
                mask = ~np.isin(b_i, built.ids[~keep])
                np.testing.assert_array_equal(row_i[:mask.sum()], b_i[mask][:len(row_i)])
                np.testing.assert_allclose(row_s[:mask.sum()], b_s[mask][:len(row_s)], rtol=1e-5)
        if factory in ("Flat", "IVF4,Flat", "HNSW8"):
            want_s, want_i = built.brute_force(queries, 10, keep=keep)
            np.testing.assert_array_equal(ids[:, :10], want_i)
            np.testing.assert_allclose(scores[:, :10], want_s, rtol=1e-5)


def test_remove_units_of_absent_units_does_nothing(tmp_path):
    built = build_index(tmp_path, n_units=2, chunks=5)
    names = [s.name for s in built.store.shards()]
    assert built.store.remove_units([12345]) == 0
    assert [s.name for s in built.store.shards()] == names


# -- training ---------------------------------------------------------------------------

def test_train_index(tmp_path):
    store = IndexStore(tmp_path)
    assert store.train_index("Flat", DIM, "ip", unit_vectors(10)) is None
    path = store.train_index("IVF4,Flat", DIM, "ip", unit_vectors(300))
    index = faiss.read_index(str(path))
    assert index.is_trained and index.ntotal == 0 and index.nlist == 4
    with pytest.raises(ConfigError, match="IVF64,Flat.*3 vectors"):
        store.train_index("IVF64,Flat", DIM, "ip", unit_vectors(3))
    with pytest.raises(ConfigError, match=r"shape \(10, 4\)"):
        store.train_index("IVF4,Flat", DIM, "ip", np.zeros((10, 4)))


# -- a tampered or damaged folder --------------------------------------------------------

@pytest.mark.parametrize("field,value,expected", [
    ("dim", "16", "a positive integer"), ("dim", 0, "a positive integer"), ("dim", True, "a positive integer"),
    ("metric", "cosine", "one of"), ("metric", 3, "one of"), ("factory", ["Flat"], "a faiss factory string"),
    ("model", "m", "an object"), ("model", {"name": 3}, "an object"), ("segments", 5, "a list"),
    ("segments", [{"name": "x"}], "a list"), ("format", "1", "an integer"), ("corpus", 3, "a string or null"),
    ("chunking", {"tokens": 16, "overlap": 16}, "an object"), ("chunking", {"tokens": "16", "overlap": 0}, "an object"),
    ("chunking", {"tokens": 16}, "an object"), ("chunking", [16, 4], "an object"),
    # before: format 0 or -1 was refused as a format-1 index 'with chunk metadata in metadata.sqlite'
    ("format", 0, "an index format"), ("format", -1, "an index format"),
    ("segments", [{"name": "x", "count": -5}], "a list"),  # before: warned of as '-5 vectors' lost
    # before: 250 digits were "[Errno 36] File name too long" (trained.g<g>.faiss), naming no field
    ("generation", 10**250, "an integer from 0 to 2147483647"), ("generation", 2**31, "an integer from 0"),
    ("generation", -1, "an integer from 0"), ("generation", 1.5, "an integer from 0"),
])
def test_a_manifest_field_of_the_wrong_type_is_a_clear_error(tmp_path, field, value, expected):
    store = ShardStore(tmp_path)
    store.create_or_open(manifest())
    (tmp_path / "units.sqlite").touch()  # an index's (a lone manifest.json is another program's)
    data = json.loads(store.manifest_path.read_text())
    store.manifest_path.write_text(json.dumps({**data, field: value}))
    with pytest.raises(ConfigError, match=rf"manifest.json: {field} is .*not {expected}.*--overwrite"):
        ShardStore(tmp_path).read_manifest()
    with pytest.raises(ConfigError, match=rf"manifest.json: {field} is"):
        open_index(tmp_path)


def test_links_in_place_of_the_units_database_or_the_shards_folder_are_refused(tmp_path):
    built = build_index(tmp_path / "ix", n_units=1, chunks=3)
    store = built.store
    store.close()
    other = tmp_path / "other.sqlite"
    other.write_bytes(b"")
    for name in ("units.sqlite", "units.sqlite-wal", "units.sqlite-journal"):
        moved = store.folder / name
        kept = tmp_path / "kept"
        if moved.exists():
            moved.rename(kept)
        moved.symlink_to(other)
        for read_only in (False, True):
            with pytest.raises(ConfigError, match=f"{name}' is a symbolic link"):
                ShardStore(store.folder, read_only=read_only).units()
        moved.unlink()
        if kept.exists():
            kept.rename(moved)
    assert other.read_bytes() == b""
    elsewhere = tmp_path / "elsewhere"
    store.shards_dir.rename(elsewhere)
    store.shards_dir.symlink_to(elsewhere)
    listing = sorted(p.name for p in elsewhere.iterdir())
    with pytest.raises(ConfigError, match="shards' .*is a symbolic link"):
        ShardStore(store.folder).create_or_open(Manifest(model={"name": "test-model", "path": "/nowhere"},
                                                         dim=DIM, factory="Flat"))
    with pytest.raises(ConfigError, match="shards' .*is a symbolic link"):
        open_index(store.folder)
    ShardStore(store.folder).wipe()  # removes the link, not what it points to
    assert not store.shards_dir.exists() and sorted(p.name for p in elsewhere.iterdir()) == listing


def test_a_reader_creates_nothing_and_a_damaged_units_database_is_a_clear_error(tmp_path):
    store = IndexStore(tmp_path, read_only=True)
    with pytest.raises(ConfigError, match="units.sqlite' does not exist.*build-index command again"):
        store.units()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    (tmp_path / "units.sqlite").write_bytes(b"not a database" * 500)
    for read_only in (True, False):
        with pytest.raises(ConfigError, match="units.sqlite' .*damaged.*--overwrite"):
            IndexStore(tmp_path, read_only=read_only).units()


DISK_FULL = """
import resource, sys
from embedingest.index.store import IndexStore
folder, limit = sys.argv[1], int(sys.argv[2])
if limit:  # no tmpfs: each file this process writes stops at ``limit`` bytes
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
store = IndexStore(folder)
try:
    for n in range(200):
        store.upsert_units({"key": f"doc{n}-{c}-" + "x" * 400, "size": c} for c in range(50))
except OSError as exc:
    print(exc.errno, exc)
"""


def test_sqlite_on_a_full_disk_is_an_os_error_naming_the_database(tmp_path):
    """A real tmpfs of 256 KB: "database or disk is full" comes out as ENOSPC naming
    units.sqlite, which the CLI prints as one line (where mounting is not allowed, the
    file cut by RLIMIT_FSIZE comes out as EIO the same way)."""
    import subprocess
    import sys

    from fault_helpers import small_tmpfs

    with small_tmpfs(tmp_path / "fs", 256 * 1024) as fs:
        folder, limit = (fs, 0) if fs is not None else (tmp_path, 256 * 1024)
        proc = subprocess.run([sys.executable, "-c", DISK_FULL, str(folder), str(limit)],
                              capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and "units.sqlite" in proc.stdout, proc.stdout + proc.stderr
    if fs is not None:
        assert proc.stdout.startswith("28 ") and "database or disk is full" in proc.stdout, proc.stdout
    else:  # a file cut by RLIMIT_FSIZE is an I/O error to sqlite
        assert proc.stdout.startswith("5 ") and "disk I/O error" in proc.stdout, proc.stdout


def test_upsert_numbers_new_keys_in_their_order_and_updates_known_ones(tmp_path):
    """New keys get ascending numbers in the order given, known keys keep theirs and take
    only the fields given; a key given twice in one call is one unit, its second row an
    update; numbers past what a vector id holds roll the whole call back."""
    import pytest

    from embedingest.errors import EmbedingestError
    from embedingest.index import store as store_module

    store = IndexStore(tmp_path / "ix")
    assert store.upsert_units([{"key": "b", "size": 1}, {"key": "a", "size": 2}]) == {"b": 1, "a": 2}
    nos = store.upsert_units([{"key": "c"}, {"key": "a", "sha256": "s"}, {"key": "d", "size": 4}])
    assert nos == {"c": 3, "a": 2, "d": 4}
    rows = store.db.execute("SELECT unit_no, key, size, sha256 FROM units ORDER BY unit_no").fetchall()
    assert rows == [(1, "b", 1, None), (2, "a", 2, "s"), (3, "c", None, None), (4, "d", 4, None)]
    assert store.upsert_units([{"key": "e", "size": 5}, {"key": "e", "mtime_ns": 9}]) == {"e": 5}
    assert store.units()["e"].size == 5 and store.units()["e"].mtime_ns == 9
    store_module.MAX_UNIT_NO, old = 6, store_module.MAX_UNIT_NO
    try:
        with pytest.raises(EmbedingestError, match="unit number 7 of 'g' does not fit"):
            store.upsert_units([{"key": "f"}, {"key": "g"}])
    finally:
        store_module.MAX_UNIT_NO = old
    assert sorted(store.units()) == ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize("suffix", ["", "-wal", "-journal"])
@pytest.mark.parametrize("kind", ["named pipe", "folder"])
def test_a_units_database_that_is_a_pipe_or_a_folder_is_named_with_what_to_do(tmp_path, suffix, kind):
    """Before: sqlite's 'disk I/O error', given as a failing disk ('[Errno 5] I/O error ...;
    fix the cause'), for a named pipe, a build that waited for good (SIGTERM too) on a pipe
    in place of the journal, and 'unable to open database file' for a folder."""
    built = build_index(tmp_path / "ix", n_units=1, chunks=3)
    built.store.close()
    path = built.store.folder / f"units.sqlite{suffix}"
    if path.exists():
        path.unlink()
    os.mkfifo(path) if kind == "named pipe" else path.mkdir()
    said = "a named pipe (FIFO)" if kind == "named pipe" else "a folder"
    for read_only in (False, True):
        with pytest.raises(ConfigError) as err:
            ShardStore(built.store.folder, read_only=read_only).units()
        assert str(err.value) == (f"{str(path)!r} is {said}, not a file of the index's units database: move it "
                                  "away and run the same build-index command again"
                                  + (" (the units it would name are redone)" if not suffix else ""))


def test_a_reader_of_the_units_database_creates_no_journal_file(tmp_path):
    """Before: the read-only store (reindex's) opened the database in sqlite's read-only
    mode, which made units.sqlite-wal and -shm (and -shm beside a -wal left by a stopped
    build). Now: immutable with no -wal or an empty one; a -wal holding changes without its
    -shm is named, with what to do."""
    store = IndexStore(tmp_path)
    store.upsert_units([{"key": "a.txt", "size": 1}])
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["units.sqlite"]
    with IndexStore(tmp_path, read_only=True) as reader:
        assert list(reader.units()) == ["a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["units.sqlite"]
    (tmp_path / "units.sqlite-wal").write_bytes(b"")
    with IndexStore(tmp_path, read_only=True) as reader:
        assert list(reader.units()) == ["a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["units.sqlite", "units.sqlite-wal"]
    (tmp_path / "units.sqlite-wal").unlink()
    writer = IndexStore(tmp_path)
    writer.upsert_units([{"key": "b.txt", "size": 2}])
    held = (tmp_path / "units.sqlite-wal").read_bytes()
    with IndexStore(tmp_path, read_only=True) as reader:  # a writer's own files: read through them
        assert sorted(reader.units()) == ["a.txt", "b.txt"]
    writer.close()
    (tmp_path / "units.sqlite-wal").write_bytes(held)
    with pytest.raises(ConfigError, match=r"units.sqlite-wal' holds changes .* run the same build-index command"):
        IndexStore(tmp_path, read_only=True).units()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["units.sqlite", "units.sqlite-wal"]

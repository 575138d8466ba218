"""IndexStore and ShardStore: wipe, model identity, an empty index, many units, removal
from other index kinds: cases that mutation testing found untested (docs/TESTING.md)."""

from __future__ import annotations

import errno
import sqlite3

import faiss
import numpy as np
import pytest
from index_fixtures import DIM, build_index, unit_vectors

from embedingest.errors import ConfigError, EmbedingestError
from embedingest.index.search import open_index
from embedingest.index.shard_store import ShardStore
from embedingest.index.store import IndexStore, Manifest, model_identity, vector_ids


def test_model_identity_is_the_name_else_the_path():
    assert model_identity({"name": "m", "path": "/a"}) == "m"
    assert model_identity({"path": "/models/mine"}) == "/models/mine"
    assert model_identity({}) is None
    a = Manifest(model={"path": "/models/a"}, dim=4)
    assert a.compatible_with(Manifest(model={"path": "/models/a"}, dim=4))
    assert not a.compatible_with(Manifest(model={"path": "/models/b"}, dim=4))


def test_overwrite_of_a_folder_without_shards_and_with_sqlite_side_files(tmp_path):
    store = ShardStore(tmp_path)
    store.create_or_open(Manifest(model={"path": "/models/a"}, dim=4))
    store.close()
    (tmp_path / "shards").rmdir()  # nothing committed yet
    for name in ("units.sqlite-wal", "units.sqlite-shm", "metadata.sqlite-wal", "metadata.sqlite-shm"):
        (tmp_path / name).write_bytes(b"x")  # what a killed sqlite writer leaves (of either format)
    # nothing committed: the folder takes the new run's settings (a first build that failed)
    store = ShardStore(tmp_path)
    assert store.create_or_open(Manifest(model={"path": "/models/b"}, dim=4)).model == {"path": "/models/b"}
    store.close()
    ShardStore(tmp_path).wipe()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    store = ShardStore(tmp_path)
    m = store.create_or_open(Manifest(model={"path": "/models/b"}, dim=4), overwrite=True)
    store.close()
    assert m.model == {"path": "/models/b"}


def test_an_index_with_no_shards_reconciles_to_nothing(tmp_path):
    store = ShardStore(tmp_path)
    store.create_or_open(Manifest(model={"name": "m"}, dim=DIM))
    assert store.shards() == [] and store.reconcile() == set() and store.reconcile({}) == set()
    store.close()


def test_more_units_than_one_query_batch(tmp_path):
    store = IndexStore(tmp_path)
    nos = store.upsert_units([{"key": f"k{i}"} for i in range(1200)])
    got = store.units([f"k{i}" for i in range(1200)] + ["absent"])
    assert {k: u.unit_no for k, u in got.items()} == nos and len(set(nos.values())) == 1200
    store.close()


@pytest.mark.parametrize("factory, params", [("PCA8,IVF4,PQ4x4", "nprobe=4"), ("IVF16,Flat", "nprobe=16"),
                                             ("HNSW8_SQ8", "efSearch=256")])
def test_remove_units_from_other_index_kinds(tmp_path, factory, params):
    """A transform over IVF-PQ (lists edited in place: the kept codes, hence scores, stay;
    rebuilt, PQ would re-quantise them),
    IVF with empty lists among full ones, and a trained HNSW kind (rebuilt from the
    stored vectors into a clone of the trained index)."""
    built = build_index(tmp_path, n_units=3, chunks=8, factory=factory, commit_every=100, workers=1)
    store = built.store
    if factory == "IVF16,Flat":
        (seg,) = store.shards()
        segment = faiss.read_index(str(seg.path))  # kept: the IVF below is part of it
        ivf = faiss.extract_index_ivf(segment)
        sizes = [ivf.invlists.list_size(i) for i in range(ivf.nlist)]
        last = max(i for i, n in enumerate(sizes) if n)
        assert 0 in sizes[:last], sizes  # an empty list before a full one
    queries = unit_vectors(4, seed=3)
    with open_index(store.folder, params=params) as index:
        before = index.search_raw(queries, 24)
    gone = list(built.unit_nos.values())[1]
    assert store.remove_units([gone]) == 8
    keep = (built.ids >> 32) != gone
    with open_index(store.folder, params=params) as index:
        scores, ids = index.search_raw(queries, 16)
    assert sorted(np.unique(ids).tolist()) == sorted(built.ids[keep].tolist())
    if "HNSW" not in factory:  # edited in place: what was kept is found as before
        for s, i, bs, bi in zip(scores, ids, *before):
            mask = np.isin(bi, built.ids[keep])
            np.testing.assert_array_equal(i, bi[mask])
            np.testing.assert_allclose(s, bs[mask], rtol=1e-5)


def test_vector_ids_check_both_halves():
    from embedingest.errors import EmbedingestError
    from embedingest.index.store import MAX_UNIT_NO

    assert vector_ids(0, [0, 5]).tolist() == [0, 5]  # unit 0 is a valid number
    assert vector_ids(3, [2**32 - 1]).tolist() == [(3 << 32) | (2**32 - 1)]
    assert vector_ids(2, np.array([1, 2], dtype=np.int32)).dtype == np.int64
    with pytest.raises(EmbedingestError) as err:
        vector_ids(MAX_UNIT_NO + 1, [0])
    assert str(err.value) == f"unit number {MAX_UNIT_NO + 1} does not fit in a vector id"
    for bad in ([-1, 3], [0, 2**32]):  # each end on its own
        with pytest.raises(EmbedingestError, match=r"chunk numbers of unit 7 must lie in \[0, 2\*\*32\)"):
            vector_ids(7, bad)


def test_manifest_from_dict_names_what_is_wrong():
    with pytest.raises(ConfigError) as err:
        Manifest.from_dict([1, 2])
    assert str(err.value) == "manifest is not a JSON object: rebuild the index with --overwrite"
    with pytest.raises(ConfigError) as err:
        Manifest.from_dict({"metric": "ip"}, where="x/manifest.json")
    assert str(err.value) == "x/manifest.json lacks dim, model: rebuild the index with --overwrite"
    with pytest.raises(ConfigError, match=r"^manifest has format 3, newer than this embedingest"):
        Manifest.from_dict({"model": {}, "dim": 4, "format": 3})
    m = Manifest.from_dict({"model": {"name": "m"}, "dim": 4, "unknown_later_field": 1})
    assert (m.model, m.dim, m.format) == ({"name": "m"}, 4, 1)


# -- survivors of the store.py mutation run of 2026-12-02 (docs/TESTING.md) -------------

def test_manifest_field_of_the_wrong_type_names_the_fix():
    with pytest.raises(ConfigError) as err:
        Manifest.from_dict({"model": {}, "dim": "4"}, where="m.json")
    assert str(err.value) == ("m.json: dim is '4', not a positive integer; the manifest was changed "
                              "or damaged: put back the value it was built with, or rebuild the "
                              "index with --overwrite")


def test_a_manifest_generation_too_long_for_a_file_name_is_named_with_the_fix(tmp_path):
    """A generation of 250 digits was "[Errno 36] File name too long" of a path naming no
    field (trained.g<g>.faiss, a shard's .g<g>.faiss), from build-index and search alike."""
    from embedingest.index.shards import MAX_GENERATION

    with pytest.raises(ConfigError) as err:
        Manifest.from_dict({"model": {}, "dim": 4, "generation": 10**250}, where="m.json")
    assert str(err.value) == (f"m.json: generation is {10**250!r}, not an integer from 0 to 2147483647; the "
                              "manifest was changed or damaged: put back the value it was built with, or "
                              "rebuild the index with --overwrite")
    assert Manifest.from_dict({"model": {}, "dim": 4, "generation": MAX_GENERATION}).generation == MAX_GENERATION


@pytest.mark.parametrize("name, value, wanted", [
    ("search", "x", "an object with a string params and a positive integer k"),
    ("search", {"k": "ten"}, "an object with a string params and a positive integer k"),
    ("search", {"k": 0}, "an object with a string params and a positive integer k"),
    ("search", {"params": 5}, "an object with a string params and a positive integer k"),
    ("prompts", None, 'an object of texts ({"document": ..., "query": ...})'),
    ("prompts", {"document": "", "query": 5}, 'an object of texts ({"document": ..., "query": ...})'),
    ("corpus_path", ["a"], "a string or null"),
])
def test_search_defaults_and_prompts_of_the_wrong_type_are_named_not_a_traceback(name, value, wanted):
    """search and open_index gave AttributeError, ValueError or TypeError tracebacks for these."""
    with pytest.raises(ConfigError) as err:
        Manifest.from_dict({"model": {}, "dim": 4, name: value}, where="m.json")
    assert str(err.value) == (f"m.json: {name} is {value!r}, not {wanted}; the manifest was changed or "
                              "damaged: put back the value it was built with, or rebuild the index with "
                              "--overwrite")
    ok = Manifest.from_dict({"model": {}, "dim": 4, "search": {"params": "nprobe=4", "k": 3},
                             "prompts": {"query": "query: "}})
    assert (ok.search, ok.prompts) == ({"params": "nprobe=4", "k": 3}, {"query": "query: "})


def test_unreadable_manifest_names_the_file_and_the_fix(tmp_path):
    store = IndexStore(tmp_path)
    (tmp_path / "units.sqlite").write_bytes(b"")  # an index's folder (a lone manifest.json is another program's)
    store.manifest_path.write_text("{", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        store.read_manifest()
    message = str(err.value)
    assert message.startswith(f"cannot read {str(store.manifest_path)!r}: Expecting property name")
    assert message.endswith("; rebuild the index with --overwrite")


def test_manifest_bytes_are_indented_utf8_json_with_a_utc_timestamp(tmp_path, monkeypatch):
    import calendar
    import json
    import time
    from dataclasses import asdict

    monkeypatch.setenv("TZ", "Asia/Tokyo")  # local time 9 h off UTC: _now must not use it
    time.tzset()
    try:
        store = IndexStore(tmp_path)
        manifest = Manifest(model={"name": "modèle-ß"}, dim=4)
        store.write_manifest(manifest)
    finally:
        monkeypatch.undo()
        time.tzset()
    raw = store.manifest_path.read_bytes()
    assert raw == (json.dumps(asdict(manifest), indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    assert '"name": "modèle-ß"'.encode() in raw and b'\n  "dim": 4,\n' in raw
    updated = store.read_manifest().updated
    assert abs(calendar.timegm(time.strptime(updated, "%Y-%m-%dT%H:%M:%SZ")) - time.time()) < 120


def test_package_version_and_its_fallback(monkeypatch):
    from importlib import metadata

    from embedingest.index import store as store_module

    assert store_module.package_version() == metadata.version("embedingest") != "0+unknown"

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(store_module.importlib_metadata, "version", not_installed)
    assert store_module.package_version() == "0+unknown"


def test_vector_ids_take_the_largest_unit_number_and_unsigned_chunks():
    from embedingest.index.store import MAX_UNIT_NO

    assert vector_ids(MAX_UNIT_NO, [0, 1]).tolist() == [MAX_UNIT_NO << 32, (MAX_UNIT_NO << 32) | 1]
    ids = vector_ids(2, np.array([1, 2], dtype=np.uint64))
    assert ids.dtype == np.int64 and ids.tolist() == [(2 << 32) | 1, (2 << 32) | 2]


def test_train_index_makes_missing_parents_and_names_the_faiss_error(tmp_path):
    rng = np.random.default_rng(0)
    store = IndexStore(tmp_path / "a" / "b")
    path = store.train_index("IVF4,Flat", 8, "l2", rng.standard_normal((64, 8)))
    assert path == store.trained_path and path.is_file()
    with pytest.raises(ConfigError) as err:
        IndexStore(tmp_path / "c").train_index("IVF16,Flat", 8, "l2", rng.standard_normal((4, 8)))
    message = str(err.value)
    assert message.startswith("cannot train 'IVF16,Flat' on 4 vectors: ")
    assert "None" not in message and "Number of training points" in message
    assert message.endswith("; use a larger sample (--train-size), or on 4 vectors use at most 4 lists (IVF4) or at "
                            "most 2 bits per code (PQ, e.g. PQ16x2)")
    # the whole corpus in the sample: a larger --train-size cannot help
    with pytest.raises(ConfigError) as err:
        IndexStore(tmp_path / "d").train_index("IVF16,Flat", 8, "l2", rng.standard_normal((4, 8)), more=False)
    assert str(err.value).endswith("; the corpus gives only 4 vectors: add documents, or on 4 vectors use at most 4 "
                                   "lists (IVF4) or at most 2 bits per code (PQ, e.g. PQ16x2)")


def test_damaged_trained_index_says_how_to_redo_it(tmp_path):
    store = IndexStore(tmp_path)
    manifest = Manifest(model={"name": "m"}, dim=8, factory="IVF4,Flat", metric="l2")
    store.write_manifest(manifest)
    store.trained_path.write_bytes(b"not a faiss index")
    with pytest.raises(ConfigError) as err:
        store.empty_index(manifest)
    message = str(err.value)
    assert message.startswith(f"cannot read {str(store.trained_path)!r} (")
    assert message.endswith("): the file is damaged; delete it and run build-index again "
                            "(it is trained again)")


def test_wipe_removes_tmp_files_and_leaves_side_files_of_other_names(tmp_path):
    store = IndexStore(tmp_path)
    store.write_manifest(Manifest(model={"name": "m"}, dim=4))
    (tmp_path / ".manifest.json.tmp-123").write_text("x")
    (tmp_path / "manifest.json-wal").write_text("not ours")
    store.wipe()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json-wal"]
    IndexStore(tmp_path / "missing").wipe()  # a folder that is not there: nothing to do
    assert not (tmp_path / "missing").exists()


def test_close_twice_and_use_again(tmp_path):
    store = IndexStore(tmp_path)
    store.db.execute("select 1")
    store.close()
    store.close()
    assert store.db.execute("select 1").fetchone() == (1,)
    store.close()


def test_batches_split_without_overlap():
    from embedingest.index.store import _batches

    assert list(_batches(list(range(5)), 2)) == [[0, 1], [2, 3], [4]]
    assert list(_batches([])) == []


# -- _sqlite_error: what each sqlite error becomes (mutation testing, docs/TESTING.md) ----


def _sqlite_exc(message: str, name: str, code: int) -> sqlite3.Error:
    """An error as sqlite3 raises it from the library: its result code's name and number."""
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorname = name
    exc.sqlite_errorcode = code
    return exc


@pytest.mark.parametrize("name", ["SQLITE_FULL", "SQLITE_IOERR_WRITE", "SQLITE_IOERR"])
def test_a_full_disk_or_an_io_error_of_sqlite_is_an_os_error_naming_the_database(tmp_path, name):
    from embedingest.index.store import _sqlite_error

    path = tmp_path / "units.sqlite"
    if name == "SQLITE_FULL":
        exc = _sqlite_exc("database or disk is full", name, 13)
        errno_, text = errno.ENOSPC, "No space left on device (sqlite: database or disk is full)"
    else:
        exc = _sqlite_exc("disk I/O error", name, 778 if name != "SQLITE_IOERR" else 10)
        errno_, text = errno.EIO, "I/O error (sqlite: disk I/O error)"
    out = _sqlite_error(exc, path)
    assert type(out) is OSError
    assert (out.errno, out.strerror, out.filename) == (errno_, text, str(path))
    assert str(out) == f"[Errno {errno_}] {text}: {str(path)!r}"


@pytest.mark.parametrize("name", ["SQLITE_CORRUPT", "SQLITE_CORRUPT_INDEX", "SQLITE_NOTADB"])
def test_a_damaged_database_is_a_config_error_naming_it_and_the_fix(tmp_path, name):
    from embedingest.index.store import _sqlite_error

    path = tmp_path / "units.sqlite"
    out = _sqlite_error(_sqlite_exc("database disk image is malformed", name, 11), path)
    assert type(out) is ConfigError
    assert str(out) == (f"cannot read {str(path)!r} (database disk image is malformed): the index's "
                        "metadata is damaged; rebuild the index with --overwrite")


def test_a_database_without_the_units_table_is_damaged_and_other_errors_name_the_database(tmp_path):
    from embedingest.index.store import _sqlite_error

    path = tmp_path / "units.sqlite"
    db = sqlite3.connect(":memory:")
    with pytest.raises(sqlite3.Error) as no_table:  # sqlite's own: SQLITE_ERROR
        db.execute("SELECT * FROM units")
    with pytest.raises(sqlite3.Error) as syntax:
        db.execute("SELEC 1")
    db.close()
    with pytest.raises(sqlite3.Error) as closed:  # raised by Python's module: no sqlite_errorname
        db.execute("SELECT 1")
    assert no_table.value.sqlite_errorname == "SQLITE_ERROR"
    assert not hasattr(closed.value, "sqlite_errorname")

    out = _sqlite_error(no_table.value, path)
    assert type(out) is ConfigError
    assert str(out) == (f"cannot read {str(path)!r} (no such table: units): the index's metadata is "
                        "damaged; rebuild the index with --overwrite")
    for exc in (syntax.value, closed.value, _sqlite_exc("database is locked", "SQLITE_BUSY", 5)):
        out = _sqlite_error(exc, path)
        assert type(out) is EmbedingestError
        assert str(out) == f"metadata database {str(path)!r}: {exc}"

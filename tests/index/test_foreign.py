"""A shard copied in from another index (its files whole and agreeing with their own
commit record) is refused by open_index and export, by name, with what to do; nothing
of the folder is created or changed to tell (embedingest.index.foreign)."""

import json
import logging
import os
import shutil
import sqlite3

import numpy as np
import pytest
from index_fixtures import build_index
from shard_fixtures import build_shards

from embedingest.errors import ConfigError
from embedingest.index.export import export_index
from embedingest.index.search import open_index
from embedingest.index.shard_store import ShardStore
from embedingest.index.shards import list_shards


def one_shard_index(folder, seed=0, n_units=4):
    """An index of one listed shard (units 1..n_units, keys doc<u>.txt, 10 chunks each),
    its units database closed (as a build leaves it: no -wal file)."""
    built = build_index(folder, n_units=n_units, chunks=10, commit_every=1000, workers=1, seed=seed)
    built.store.close()
    return built


def copy_shard(shard, folder, name=None):
    """``shard``'s files into ``folder`` (an index's shards folder), renamed to ``name``
    with its record saying so (as a user who renames the files and the record would)."""
    name = name or shard.name
    for path in shard.folder.glob(f"{shard.name}.*"):
        target = folder / path.name.replace(shard.name, name)
        if path.name.endswith(".commit.json"):
            record = json.loads(path.read_text())
            record["name"] = name
            for info in record["files"].values():
                info["name"] = info["name"].replace(shard.name, name)
            target.write_text(json.dumps(record))
        else:
            shutil.copyfile(path, target)


def drop_shard(shard):
    for path in shard.folder.glob(f"{shard.name}.*"):
        path.unlink()


def folder_state(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino)
                  for p in folder.rglob("*"))


def test_a_shard_of_another_index_in_place_of_one_is_refused_naming_it(tmp_path):
    """Before: search answered with the other index's rows (sources this index has not) and
    export wrote them; now its rows are compared with this index's units."""
    one_shard_index(tmp_path / "a")
    build_shards(tmp_path / "b", n_units=4, chunks=10, commit_every=1000, workers=1)
    (mine,) = list_shards(tmp_path / "a" / "shards")
    (theirs,) = list_shards(tmp_path / "b" / "shards")
    drop_shard(mine)
    copy_shard(theirs, tmp_path / "a" / "shards")
    where = tmp_path / "a" / "shards" / f"{theirs.name}.parquet"
    expected = (f"shard {theirs.name} ({str(where)!r}) is not this index's: its row of id 0 is of "
                f"'docs/doc0.txt', but this index has no unit 0 (in {str(tmp_path / 'a' / 'units.sqlite')!r}); "
                f"it was copied in from another index: move its files (every file named {theirs.name}.*) out "
                f"of the index and put back the shard of this index it took the place of (the manifest lists "
                f"{mine.name}, not in the folder), or run the same build-index command again, which "
                "deletes it and redoes the units it held")
    with pytest.raises(ConfigError) as err:
        open_index(tmp_path / "a")
    assert str(err.value) == expected
    with pytest.raises(ConfigError) as err:
        export_index(tmp_path / "a", tmp_path / "out")
    assert str(err.value) == expected
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_shard_of_another_index_beside_this_one_s_is_refused_for_its_ids(tmp_path):
    """Both indexes number their units from 1: the copy holds this index's ids. Before:
    a hit of the copy's vectors got this index's row of that id (another text), and export
    wrote every id twice."""
    built = one_shard_index(tmp_path / "a")
    one_shard_index(tmp_path / "b", seed=1)
    (mine,) = list_shards(tmp_path / "a" / "shards")
    (theirs,) = list_shards(tmp_path / "b" / "shards")
    theirs_name = theirs.name.replace("-w0-", "-w7-")  # the names hold the run's time: made to differ
    copy_shard(theirs, tmp_path / "a" / "shards", theirs_name)
    first = int(built.ids.min())
    with pytest.raises(ConfigError) as err:
        open_index(tmp_path / "a")
    assert str(err.value).startswith(
        f"shard {theirs_name} ({str(tmp_path / 'a' / 'shards' / (theirs_name + '.parquet'))!r}), which the "
        f"manifest does not list, holds ids that shard {mine.name} holds too (e.g. id {first}: unit 1, chunk 0): "
        f"it is not this index's (copied in from another index, or left by a build that was stopped); move its "
        f"files (every file named {theirs_name}.*) out of the index and put back the shard of this index it "
        "took the place of, or run the same build-index command again, which deletes it and redoes the units "
        "it held")
    with pytest.raises(ConfigError, match=f"shard {theirs_name} .*, which the manifest does not list, holds ids"):
        export_index(tmp_path / "a", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # once the manifest lists both (a build ran meanwhile), neither is the odd one: both named
    ShardStore(tmp_path / "a").update_shards()
    with pytest.raises(ConfigError) as err:
        open_index(tmp_path / "a")
    first, second = sorted((mine.name, theirs_name))  # in the order they are listed: by name
    assert str(err.value).startswith(f"shards {first} (") and f") and {second} (" in str(err.value)
    assert "hold the same ids (e.g. id" in str(err.value) and str(err.value).endswith(
        "or run the same build-index command again: it removes the units held twice and redoes them")
    for path in (tmp_path / "a" / "shards").glob(f"{theirs_name}.*"):
        path.unlink()
    ShardStore(tmp_path / "a").update_shards()
    with open_index(tmp_path / "a") as index:  # as the message says: the copy out, the index whole
        assert index.ntotal == len(built.ids)


def test_a_shard_renamed_as_one_of_this_index_s_is_refused_by_its_count(tmp_path):
    """The other index's shard under this index's shard's name (the record's name edited to
    match): the manifest lists another count for that name."""
    one_shard_index(tmp_path / "a")
    one_shard_index(tmp_path / "b", seed=1, n_units=3)
    (mine,) = list_shards(tmp_path / "a" / "shards")
    (theirs,) = list_shards(tmp_path / "b" / "shards")
    drop_shard(mine)
    copy_shard(theirs, tmp_path / "a" / "shards", mine.name)
    expected = (f"shard {mine.name} ({str(mine.path('parquet'))!r}) holds 30 rows, but the manifest lists 40 "
                f"for the shard of that name: it is not the shard this index wrote (copied in from another "
                f"index?); put back this index's own files of shard {mine.name}, or run the same build-index "
                "command again, which deletes it and redoes the units it held")
    for attempt in (lambda: open_index(tmp_path / "a"), lambda: export_index(tmp_path / "a", tmp_path / "out")):
        with pytest.raises(ConfigError) as err:
            attempt()
        assert str(err.value) == expected


def test_telling_reads_the_units_database_without_creating_or_changing_a_file(tmp_path, caplog):
    """search changes nothing in the folder (sqlite's read-only mode makes -wal and -shm
    files): the database is read as immutable once its writer closed it; without it, or
    with a journal file that is no file (a named pipe: sqlite would wait on it for good),
    the shards are searched uncompared, said."""
    built = one_shard_index(tmp_path / "a")
    folder = tmp_path / "a"
    before = folder_state(folder)
    with open_index(folder) as index:
        assert len(index.search_vectors(built.emb[:2], k=3)[0]) == 3
    assert folder_state(folder) == before
    os.mkfifo(folder / "units.sqlite-wal")
    with caplog.at_level(logging.WARNING, logger="embedingest"):
        with open_index(folder) as index:
            assert index.ntotal == len(built.ids)
    assert [r.getMessage() for r in caplog.records] == [
        f"{folder / 'units.sqlite-wal'} is not a regular file: the shards are not compared with the index's units"]
    (folder / "units.sqlite-wal").unlink()
    (folder / "units.sqlite").unlink()
    with open_index(folder) as index:  # an index read from its shards alone, as before
        assert index.ntotal == len(built.ids)


def test_a_build_s_own_open_units_database_is_read_with_its_journal(tmp_path):
    """A build holding units.sqlite open (its -wal file there) is read through its journal:
    the units it planned since the last checkpoint are known, no shard of it is taken
    for another index's."""
    built = build_index(tmp_path / "a", n_units=3, chunks=10, commit_every=1000, workers=1)
    assert (tmp_path / "a" / "units.sqlite-wal").exists()
    with open_index(tmp_path / "a") as index:
        got = index.search_vectors(built.emb[:1], k=1)[0][0]
        assert got.id == int(built.ids[0]) and got.source == "doc0.txt"
    built.store.close()


def test_shared_ids_are_found_in_one_pass_over_the_sorted_ids():
    from embedingest.index.lookup import first_shared

    ids = [np.array([5, 1, 9]), np.array([2, 3]), np.array([7, 3])]
    flat = np.concatenate(ids)
    order = np.argsort(flat, kind="stable")
    offsets = np.cumsum([0] + [len(a) for a in ids])
    assert first_shared(flat[order], order, offsets) == (3, 1, 2)
    assert first_shared(np.arange(4), np.arange(4), np.array([0, 2, 4])) is None


# -- a build deletes what readers refuse (ShardStore.drop_foreign, called by clean_garbage) ---------

def test_a_build_deletes_a_shard_renamed_as_one_of_this_index_s_and_its_units_are_redone(tmp_path, caplog):
    """Before: the build kept it (its unit numbers were this index's, whole), listed it,
    and readers refused the index until it was taken out by hand. Now the cleaning a build
    starts with deletes it, saying why; nothing then declares its units done."""
    one_shard_index(tmp_path / "a")
    one_shard_index(tmp_path / "b", seed=1, n_units=3)
    (mine,) = list_shards(tmp_path / "a" / "shards")
    (theirs,) = list_shards(tmp_path / "b" / "shards")
    drop_shard(mine)
    copy_shard(theirs, tmp_path / "a" / "shards", mine.name)
    other = folder_state(tmp_path / "b")
    store = ShardStore(tmp_path / "a")
    with caplog.at_level(logging.WARNING, logger="embedingest"):
        gone = store.clean_garbage()
    assert [r.getMessage() for r in caplog.records] == [
        f"shard {mine.name} ({str(mine.path('parquet'))!r}) holds 30 rows, but the manifest lists 40 for the shard "
        "of that name: it is not the shard this index wrote (copied in from another index?); it is deleted, and "
        "the units it held are redone"]
    assert sorted(gone) == sorted(f"{mine.name}.{kind}" for kind in ("commit.json", "faiss", "parquet"))
    assert not list((tmp_path / "a" / "shards").iterdir())
    assert {u.status for u in store.units().values()} == {"pending"} and store.reconcile() == set()
    assert folder_state(tmp_path / "b") == other
    store.close()


def test_a_build_deletes_every_copy_holding_this_index_s_ids_and_keeps_its_own(tmp_path):
    """Two copies of another index's shard beside this index's one, of the same files and
    unit numbers (so their sources are this index's keys): each holds this index's ids. The
    three pairs share their lowest id; taking the first pair alone left the second copy, and
    the units all three hold were then redone. Both copies go, this index's shard stays."""
    built = one_shard_index(tmp_path / "a")
    one_shard_index(tmp_path / "b", seed=1)
    (mine,) = list_shards(tmp_path / "a" / "shards")
    (theirs,) = list_shards(tmp_path / "b" / "shards")
    copies = [theirs.name.replace("-w0-", f"-w{w}-") for w in (7, 8)]
    for name in copies:
        copy_shard(theirs, tmp_path / "a" / "shards", name)
    store = ShardStore(tmp_path / "a")
    assert {name.split(".")[0] for name in store.clean_garbage()} == set(copies)
    assert [s.name for s in store.committed()] == [mine.name] and store.reconcile() == set()
    assert {u.status for u in store.units().values()} == {"done"}
    store.update_shards()
    store.close()
    with open_index(tmp_path / "a") as index:
        assert index.ntotal == len(built.ids)


def test_shards_of_one_stopped_build_holding_one_id_are_left_to_the_units_redone(tmp_path):
    """Two shards the manifest does not list holding the same ids (a build stopped after
    writing units twice): neither is known to be a copy, so neither is deleted whole; the
    units held twice are what a build redoes, as before."""
    one_shard_index(tmp_path / "a")
    (mine,) = list_shards(tmp_path / "a" / "shards")
    copy_shard(mine, tmp_path / "a" / "shards", mine.name.replace("-w0-", "-w1-"))
    store = ShardStore(tmp_path / "a")
    manifest = store.read_manifest()
    manifest.segments = []
    store.write_manifest(manifest)
    assert store.clean_garbage() == []
    assert len(store.committed()) == 2 and store.reconcile() == {1, 2, 3, 4}
    store.close()


def test_a_units_database_made_again_empty_tells_no_shard_foreign(tmp_path, caplog):
    """A build opening an index whose units.sqlite was deleted makes it again, empty: that
    is no record of the index's units, so no shard is taken for another index's (every
    unit the shards hold is redone, as before); search of such an index answers uncompared."""
    built = one_shard_index(tmp_path / "a")
    (tmp_path / "a" / "units.sqlite").unlink()
    store = ShardStore(tmp_path / "a")
    with caplog.at_level(logging.WARNING, logger="embedingest"):
        assert store.clean_garbage() == []
    assert not caplog.records and store.reconcile() == {1, 2, 3, 4}
    store.close()
    with open_index(tmp_path / "a") as index:
        assert index.ntotal == len(built.ids)


def test_every_pair_of_shards_holding_one_id_is_found_with_its_lowest_id(tmp_path):
    """Three shards of units 0..2 (one twice more): pairs of neighbours in the sorted ids
    missed the first and the third."""
    from embedingest.index.foreign import ParquetIds

    build_shards(tmp_path / "a", n_units=3, chunks=4, commit_every=1000, workers=1)
    (shard,) = list_shards(tmp_path / "a" / "shards")
    for w in (1, 2):
        copy_shard(shard, tmp_path / "a" / "shards", shard.name.replace("-w0-", f"-w{w}-"))
    rows = ParquetIds(list_shards(tmp_path / "a" / "shards"))
    assert [s.name for s in rows.shards] == [shard.name.replace("-w0-", f"-w{w}-") for w in (0, 1, 2)]
    assert rows.shared_ids() == [(0, 0, 1), (0, 0, 2), (0, 1, 2)]
    assert rows.shared_id() == (0, 0, 1)
    assert ParquetIds([shard]).shared_ids() == []


def leftover_wal(folder, changed: bool):
    """A ``units.sqlite-wal`` without its ``-shm``, as a stopped build or a copy of the
    folder leaves it: empty, or holding a change never written into the database."""
    wal = folder / "units.sqlite-wal"
    if not changed:
        wal.write_bytes(b"")
        return wal
    db = sqlite3.connect(folder / "units.sqlite")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("UPDATE units SET size = size + 1")
    db.commit()
    held = wal.read_bytes()
    db.close()  # checkpoints and deletes the -wal and -shm files
    wal.write_bytes(held)
    return wal


def test_search_with_a_leftover_wal_file_creates_no_file_and_still_compares_when_it_holds_nothing(tmp_path):
    """Before: a -wal left without its -shm was opened read-only, and sqlite made
    units.sqlite-shm in the folder (search changes nothing there). An empty one is read
    as immutable: nothing created, a shard of another index still refused by its units."""
    built = one_shard_index(tmp_path / "a")
    folder = tmp_path / "a"
    leftover_wal(folder, changed=False)
    before = folder_state(folder)
    with open_index(folder) as index:
        assert len(index.search_vectors(built.emb[:2], k=3)[0]) == 3
    assert folder_state(folder) == before
    build_shards(tmp_path / "b", n_units=4, chunks=10, commit_every=1000, workers=1)
    (mine,), (theirs,) = list_shards(folder / "shards"), list_shards(tmp_path / "b" / "shards")
    drop_shard(mine)
    copy_shard(theirs, folder / "shards")
    before = folder_state(folder)
    with pytest.raises(ConfigError, match="but this index has no unit 0"):
        open_index(folder)
    assert folder_state(folder) == before


def test_a_leftover_wal_file_holding_changes_is_named_with_what_to_do_and_nothing_is_created(tmp_path, caplog):
    """Read as immutable it would miss the changes (a unit taken for another index's),
    read-only it would make the -shm: the shards are searched uncompared, said."""
    built = one_shard_index(tmp_path / "a")
    folder = tmp_path / "a"
    wal = leftover_wal(folder, changed=True)
    assert wal.stat().st_size > 0
    before = folder_state(folder)
    with caplog.at_level(logging.WARNING, logger="embedingest"):
        with open_index(folder) as index:
            assert len(index.search_vectors(built.emb[:2], k=3)[0]) == 3
    assert folder_state(folder) == before
    assert [r.getMessage() for r in caplog.records] == [
        f"{str(wal)!r} holds changes to the index's units that were never written into units.sqlite, and its "
        "units.sqlite-shm file is gone (a build was stopped, or the folder copied without it): reading it "
        "would create files in the index folder; run the same build-index command again, which takes the "
        "changes in; until then the shards are not compared with the index's units"]


def test_with_a_writer_holding_the_units_database_open_search_compares_and_creates_no_file(tmp_path):
    """A writer's -wal and -shm are there: read-only through them (immutable is not safe
    while it writes), which makes no file; a shard of another index is still refused."""
    one_shard_index(tmp_path / "a")
    folder = tmp_path / "a"
    build_shards(tmp_path / "b", n_units=4, chunks=10, commit_every=1000, workers=1)
    (mine,), (theirs,) = list_shards(folder / "shards"), list_shards(tmp_path / "b" / "shards")
    drop_shard(mine)
    copy_shard(theirs, folder / "shards")
    writer = sqlite3.connect(folder / "units.sqlite")
    try:
        assert writer.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        writer.execute("UPDATE units SET size = size + 1")
        writer.commit()
        names = sorted(p.name for p in folder.rglob("*"))
        assert {"units.sqlite-wal", "units.sqlite-shm"} <= set(names)
        with pytest.raises(ConfigError, match="but this index has no unit 0"):
            open_index(folder)
        assert sorted(p.name for p in folder.rglob("*")) == names
    finally:
        writer.close()

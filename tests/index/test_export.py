"""export: Parquet files that pandas and pyarrow read as they are."""

import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from shard_fixtures import DIM, build_shards, recommit_file

from embedingest.errors import ConfigError
from embedingest.index.export import export_index
from embedingest.index.lock import IndexBusy, RunLock, no_build_running
from embedingest.index.shards import EMB_SUFFIX, list_shards


def test_export_writes_every_row_with_its_embedding(tmp_path):
    built = build_shards(tmp_path / "ix", n_units=5, chunks=9, commit_every=20, workers=2)
    summary = export_index(tmp_path / "ix", tmp_path / "out")
    assert summary == {"index": str(tmp_path / "ix"), "to": str(tmp_path / "out"), "files": 3,
                       "rows": 45, "embeddings": True}
    df = pd.read_parquet(tmp_path / "out")  # the folder as one dataset
    assert list(df.columns) == ["id", "source", "record_id", "chunk_no", "span_start", "span_end", "text",
                                "embedding"]
    assert sorted(df["id"].tolist()) == sorted(built.ids.tolist())
    for row in df.itertuples(index=False):
        want = built.rows[row.id]
        assert (row.source, row.chunk_no, row.span_start, row.span_end, row.text) == (
            want["source"], want["chunk_no"], want["span_start"], want["span_end"], want["text"])
        assert (row.record_id if isinstance(row.record_id, str) else None) == want["record_id"]
        emb = built.emb[np.searchsorted(built.ids, row.id)]
        assert np.array_equal(np.asarray(row.embedding, np.float32), emb.astype(np.float16).astype(np.float32))
    schema = pq.read_schema(next((tmp_path / "out").glob("*.parquet")))
    assert str(schema.field("embedding").type) == f"fixed_size_list<element: float>[{DIM}]"
    assert (tmp_path / "out" / "_SUCCESS").is_file()


def test_export_without_saved_embeddings(tmp_path):
    build_shards(tmp_path / "ix", n_units=2, chunks=3, workers=1, save_embeddings=False)
    assert export_index(tmp_path / "ix", tmp_path / "out")["embeddings"] is False
    assert "embedding" not in pd.read_parquet(tmp_path / "out").columns
    with pytest.raises(ConfigError) as err:
        export_index(tmp_path / "ix", tmp_path / "out2", embeddings=True)
    assert str(err.value) == (f"the index at {str(tmp_path / 'ix')!r} kept no embeddings (it was built "
                              "without --save-embeddings): export without them, or rebuild the index "
                              "with --save-embeddings")
    assert export_index(tmp_path / "ix", tmp_path / "out3", embeddings=False)["embeddings"] is False


def test_export_with_or_without_the_embeddings_an_index_kept(tmp_path):
    """embeddings=True or False is what the caller asked for, when the index kept them."""
    build_shards(tmp_path / "ix", n_units=2, chunks=3, workers=1)
    assert export_index(tmp_path / "ix", tmp_path / "with", embeddings=True)["embeddings"] is True
    assert "embedding" in pd.read_parquet(tmp_path / "with").columns
    assert export_index(tmp_path / "ix", tmp_path / "without", embeddings=False)["embeddings"] is False
    assert "embedding" not in pd.read_parquet(tmp_path / "without").columns


def test_export_refuses_a_full_folder_and_one_inside_the_index(tmp_path):
    build_shards(tmp_path / "ix", n_units=1, chunks=3, workers=1)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError) as err:
        export_index(tmp_path / "ix", tmp_path / "out")
    assert str(err.value) == (f"export folder {str(tmp_path / 'out')!r} is not empty: choose a new folder or "
                              "pass --overwrite (overwrite=True)")
    (tmp_path / "out" / "shard-older_export-w1-00003.parquet").write_bytes(b"old")
    (tmp_path / "out" / "_SUCCESS").write_bytes(b"old")
    summary = export_index(tmp_path / "ix", tmp_path / "out", overwrite=True)
    # the older export's Parquet files go (a dataset reader would read them too); others stay
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["mine.txt", "_SUCCESS"] + [f"{s.name}.parquet" for s in list_shards(tmp_path / "ix" / "shards") if s.rows])
    assert summary["files"] == 1 and (tmp_path / "out" / "_SUCCESS").read_bytes() == b""
    with pytest.raises(ConfigError, match="is inside the index"):
        export_index(tmp_path / "ix", tmp_path / "ix" / "x")


def test_export_after_a_reindex(tmp_path):
    from embedingest.index.reindex import reindex

    build_shards(tmp_path / "ix", n_units=2, chunks=3, workers=1)
    reindex(tmp_path / "ix", "HNSW8")
    assert export_index(tmp_path / "ix", tmp_path / "out")["rows"] == 6


def test_export_to_a_url_is_refused_with_how_to_copy_it(tmp_path):
    """export writes a local folder only; the refusal says how to get it into the bucket
    (checked before the index is read: no bucket is needed)."""
    with pytest.raises(ConfigError) as err:
        export_index(tmp_path / "ix", "s3://bucket/out")
    assert str(err.value) == ("export writes a local folder, not 's3://bucket/out': export to a folder, "
                              "then copy it (e.g. aws s3 sync FOLDER URL)")


def test_export_names_a_folder_without_an_index_and_an_export_folder_inside_it(tmp_path):
    """Both refusals name the folders (checked before any shard is read)."""
    with pytest.raises(ConfigError) as err:
        export_index(tmp_path / "nothing", tmp_path / "out")
    assert str(err.value) == f"{str(tmp_path / 'nothing')!r} is not an embedingest index (no manifest.json)"
    (tmp_path / "ix").mkdir()
    (tmp_path / "ix" / "units.sqlite").write_bytes(b"")
    (tmp_path / "ix" / "manifest.json").write_text('{"format": 2}')
    for to in (tmp_path / "ix", tmp_path / "ix" / "x" / "y"):
        with pytest.raises(ConfigError) as err:
            export_index(tmp_path / "ix", to)
        assert str(err.value) == (f"export folder {str(to)!r} is inside the index {str(tmp_path / 'ix')!r}: "
                                  "choose a folder outside it")


def test_export_files_are_zstd_in_row_groups_of_row_group_rows_and_made_durable(tmp_path, monkeypatch):
    """Large zstd row groups (for scans), and ``_SUCCESS`` renamed last with the folder
    fsynced after it: a reader that sees ``_SUCCESS`` after a power cut sees every file."""
    import embedingest.index.export as export
    import embedingest.outfiles as outfiles

    build_shards(tmp_path / "ix", n_units=2, chunks=5, workers=1)
    monkeypatch.setattr(export, "ROW_GROUP_ROWS", 4)
    synced = []
    real = outfiles.fsync_dir
    monkeypatch.setattr(outfiles, "fsync_dir", lambda folder: (synced.append(
        (folder, sorted(p.name for p in folder.iterdir()))), real(folder)))
    export_index(tmp_path / "ix", tmp_path / "out")
    (path,) = (tmp_path / "out").glob("*.parquet")
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [4, 4, 2]
    assert {meta.row_group(0).column(c).compression for c in range(meta.num_columns)} == {"ZSTD"}
    assert synced[-1] == (tmp_path / "out", sorted(["_SUCCESS", path.name]))


def test_export_of_a_shard_with_other_vectors_than_rows_names_it(tmp_path):
    """A vectors file of the committed size but another shape (6 half-width vectors for
    3 rows) is refused by name, not exported beside the wrong rows (its bytes are not those
    committed)."""
    build_shards(tmp_path / "ix", n_units=1, chunks=3, workers=1)
    (shard,) = [s for s in list_shards(tmp_path / "ix" / "shards") if s.rows]
    emb = shard.folder / f"{shard.name}{EMB_SUFFIX}"
    size = emb.stat().st_size
    with open(emb, "wb") as fh:
        np.save(fh, np.zeros((6, DIM // 2), np.float16))
    assert emb.stat().st_size == size
    with pytest.raises(ConfigError) as err:
        export_index(tmp_path / "ix", tmp_path / "out")
    assert str(err.value).startswith(f"shard {shard.name} in {str(shard.folder)!r} is damaged: its emb file "
                                     f"'{shard.name}{EMB_SUFFIX}' does not hold the bytes that were committed")


def test_export_overwrite_never_removes_through_a_link(tmp_path):
    """An older export's file that is a symbolic link is refused, not deleted (nor its target)."""
    build_shards(tmp_path / "ix", n_units=1, chunks=3, workers=1)
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere.parquet").write_bytes(b"theirs")
    old = tmp_path / "out" / "shard-old_run-w0-00000.parquet"
    old.symlink_to(tmp_path / "elsewhere.parquet")
    with pytest.raises(ConfigError) as err:
        export_index(tmp_path / "ix", tmp_path / "out", overwrite=True)
    assert str(err.value) == (f"{str(old)!r} is a symbolic link; embedingest never "
                              "writes through links in its folders: remove the link (or use another folder)")
    assert old.is_symlink() and (tmp_path / "elsewhere.parquet").read_bytes() == b"theirs"


def test_export_overwrite_replaces_only_an_export_s_own_files(tmp_path):
    """--overwrite removes what an export writes (Parquet files named as shards, _SUCCESS),
    an older export's shards of other names too; the user's own Parquet files are refused
    (a reader of the folder would read them with the export), never deleted."""
    build_shards(tmp_path / "ix", n_units=1, chunks=3, workers=1)
    out = tmp_path / "out"
    out.mkdir()
    stale = out / "shard-old_run-w3-00002.parquet"
    for path, data in [(stale, b"old"), (out / "_SUCCESS", b""), (out / "mine.parquet", b"theirs"),
                       (out / "notes.txt", b"notes"), (out / "shard-x.parquet", b"not a shard name")]:
        path.write_bytes(data)
    with pytest.raises(ConfigError) as err:
        export_index(tmp_path / "ix", out, overwrite=True)
    assert str(err.value) == (f"export folder {str(out)!r} holds Parquet files no export wrote ('mine.parquet', "
                              "'shard-x.parquet'), which a reader of the folder would read with the export: "
                              "move them or choose another folder")
    assert stale.read_bytes() == b"old" and (out / "mine.parquet").read_bytes() == b"theirs"
    (out / "mine.parquet").rename(tmp_path / "mine.parquet")
    (out / "shard-x.parquet").unlink()
    summary = export_index(tmp_path / "ix", out, overwrite=True)
    (shard,) = [s for s in list_shards(tmp_path / "ix" / "shards") if s.rows]
    assert sorted(p.name for p in out.iterdir()) == sorted(["_SUCCESS", f"{shard.name}.parquet", "notes.txt"])
    assert summary["rows"] == 3


def test_export_while_a_build_writes_the_index_is_refused_and_holds_a_build_off(tmp_path):
    """An export during a build wrote the half-updated index (the changed files' chunks
    dropped, the new ones not yet in) and marked it complete with _SUCCESS."""
    build_shards(tmp_path / "ix", n_units=3, chunks=4, commit_every=20, workers=1)
    with RunLock(tmp_path / "ix", writers=False):
        with pytest.raises(IndexBusy) as err:
            export_index(tmp_path / "ix", tmp_path / "out")
    assert str(err.value).startswith(f"a build (pid {os.getpid()}) is writing {tmp_path / 'ix'}: "
                                     "what export would read now is half of its update; run export again")
    assert not (tmp_path / "out").exists()
    with no_build_running(tmp_path / "ix", "export"):  # and a build that starts meanwhile waits for none: refused
        with pytest.raises(IndexBusy, match="another build"):
            RunLock(tmp_path / "ix", writers=False).__enter__()
    assert export_index(tmp_path / "ix", tmp_path / "out")["rows"] == 12


def test_export_and_reindex_refuse_an_unfinished_overwrite(tmp_path):
    """A build-index --overwrite killed after its first shards: export wrote those (less
    than half the index) with a _SUCCESS, and reindex rebuilt them, while search answered
    from the whole old index set aside."""
    from embedingest.index.reindex import reindex
    from embedingest.index.shard_store import SetAside, ShardStore, drop_set_aside

    folder = tmp_path / "ix"
    build_shards(folder, n_units=5, chunks=9, commit_every=20)
    SetAside(ShardStore(folder))  # as the rebuild does before it writes
    build_shards(folder, n_units=2, chunks=9, commit_every=20, run_id="run2")  # its first shards
    for call in (lambda: export_index(folder, tmp_path / "out"), lambda: reindex(folder, "HNSW8")):
        with pytest.raises(ConfigError, match=r"is being rebuilt with --overwrite, or a rebuild was stopped .*"
                                              r"\.overwritten/ holds the index from before it.*finish the rebuild"):
            call()
    assert not (tmp_path / "out").exists()
    drop_set_aside(folder)  # the rebuild finished
    assert export_index(folder, tmp_path / "out")["rows"] == 18


@pytest.mark.parametrize("kind, tamper", [
    ("parquet", lambda b: os.urandom(len(b))),  # pyarrow's "magic bytes not found", with a traceback
    ("emb.npy", lambda b: os.urandom(len(b))),  # numpy's "pickled (object) data", with a traceback
    ("emb.npy", lambda b: b[:128] + bytes(len(b) - 128)),  # zero vectors, exported without a word
])
def test_export_refuses_a_shard_whose_files_are_not_those_committed(tmp_path, kind, tamper):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=3, chunks=9, commit_every=20)
    victim = sorted((folder / "shards").glob(f"*.{kind}"))[0]
    victim.write_bytes(tamper(victim.read_bytes()))
    with pytest.raises(ConfigError, match=rf"^shard {victim.name.split('.')[0]} in .* is damaged: its "
                                          rf"\w+ file '{victim.name}' does not hold the bytes that were committed; "
                                          r"delete that shard's files"):
        export_index(folder, tmp_path / "out")
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    if kind == "emb.npy":  # without the embeddings, the rows are whole
        assert export_index(folder, tmp_path / "rows", embeddings=False)["rows"] == 27


def test_an_export_folder_under_a_file_is_named(tmp_path):
    """Before: the disk-full style message, '[Errno 20] Not a directory ...; what was
    committed before is kept: fix the cause'."""
    build_shards(tmp_path / "ix", n_units=1, chunks=3, workers=1)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"^cannot make the export folder '.*afile/sub': Not a directory "
                                          r"\(.*\); choose another folder$"):
        export_index(tmp_path / "ix", tmp_path / "afile" / "sub")


def test_export_and_reindex_refuse_a_shards_folder_that_is_a_link(tmp_path):
    """Export read the shards through the link (search refused it), and reindex wrote its
    new vectors through it, outside the index folder."""
    from embedingest.index.reindex import reindex

    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=5, workers=1)
    (folder / "shards").rename(tmp_path / "moved")
    (folder / "shards").symlink_to(tmp_path / "moved")
    before = sorted(os.listdir(tmp_path / "moved"))
    for call in (lambda: export_index(folder, tmp_path / "out"), lambda: reindex(folder, "HNSW8")):
        with pytest.raises(ConfigError, match=r"shards' is a symbolic link; embedingest never writes through links"):
            call()
    assert sorted(os.listdir(tmp_path / "moved")) == before and not (tmp_path / "out").exists()


def test_export_refuses_a_rows_file_of_other_columns_whose_record_was_made_to_match(tmp_path):
    """Before: exported as it was (a column missing, or one added), and _SUCCESS written."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=5, workers=1)
    (shard,) = list_shards(folder / "shards")
    path = shard.path("parquet")
    pq.write_table(pq.read_table(path).drop_columns(["text"]), path)
    recommit_file(shard, "parquet")
    with pytest.raises(ConfigError) as err:
        export_index(folder, tmp_path / "out")
    assert str(err.value) == (f"shard {shard.name} in {str(folder / 'shards')!r} is damaged: its parquet file is "
                              f"not a shard's rows file (it lacks the column text); delete that shard's files "
                              f"(every file named {shard.name}.*) and run the same build-index command again: "
                              "the units it held are redone")
    assert not (tmp_path / "out" / "_SUCCESS").exists()


def test_export_refuses_a_folder_inside_the_index_s_corpus(tmp_path):
    """``export --to`` inside the corpus folder the manifest records: the next build-index
    of that corpus read the export's Parquet rows as documents (34 vectors for 17, every
    hit twice). Refused, as one inside the index is, before anything is written."""
    from dataclasses import replace

    from embedingest.index.store import IndexStore

    build_shards(tmp_path / "ix", n_units=1, chunks=3, workers=1)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    store = IndexStore(tmp_path / "ix")
    store.write_manifest(replace(store.read_manifest(), corpus_path=str(corpus)))
    for to in (corpus, corpus / "exported", corpus / "a" / "b"):
        with pytest.raises(ConfigError) as err:
            export_index(tmp_path / "ix", to)
        assert str(err.value) == (
            f"export folder {str(to)!r} is inside {str(corpus)!r}, the corpus folder of the index "
            f"{str(tmp_path / 'ix')!r}: its next build-index would read the export's rows as documents; "
            "choose a folder outside the corpus")
    assert sorted(p.name for p in corpus.iterdir()) == []
    assert export_index(tmp_path / "ix", tmp_path / "beside")["rows"] == 3


def test_an_export_folder_is_told_from_a_spark_output_by_its_files_names(tmp_path):
    """What build-index passes over as an export: ``_SUCCESS`` and Parquet files all named
    as shards are. Spark writes ``_SUCCESS`` too, beside ``part-*.parquet``."""
    from embedingest.index.export import is_export_folder

    build_shards(tmp_path / "ix", n_units=1, chunks=3, workers=1)
    export_index(tmp_path / "ix", tmp_path / "out")
    assert is_export_folder(tmp_path / "out")
    (tmp_path / "out" / "notes.txt").write_text("a user's file beside: still an export")
    assert is_export_folder(tmp_path / "out")
    (tmp_path / "out" / "PART.PARQUET").write_bytes(b"PAR1")
    assert not is_export_folder(tmp_path / "out")
    spark = tmp_path / "spark"
    spark.mkdir()
    (spark / "_SUCCESS").write_bytes(b"")
    (spark / "part-00000-1f2e.snappy.parquet").write_bytes(b"PAR1")
    assert not is_export_folder(spark)
    stopped = tmp_path / "stopped"  # no _SUCCESS, no Parquet: neither is an export
    stopped.mkdir()
    (stopped / "shard-r-w0-00000.parquet").write_bytes(b"PAR1")
    assert not is_export_folder(stopped) and not is_export_folder(tmp_path / "nothing")
    (spark / "part-00000-1f2e.snappy.parquet").unlink()
    assert not is_export_folder(spark)


def test_an_export_stopped_part_way_is_finished_by_the_same_command_and_leaves_no_temporary_file(tmp_path):
    """A full disk or a kill left some Parquet files, or a temporary one, and no _SUCCESS:
    the message said to run the same command again, which refused the folder as not
    empty; and --overwrite left the killed export's temporary file for good."""
    build_shards(tmp_path / "ix", n_units=3, chunks=5, workers=2)
    clean = export_index(tmp_path / "ix", tmp_path / "clean")
    names = sorted(p.name for p in (tmp_path / "clean").iterdir())
    out = tmp_path / "out"
    out.mkdir()
    first = next(n for n in names if n.endswith(".parquet"))
    (out / first).write_bytes((tmp_path / "clean" / first).read_bytes())  # what the disk held
    (out / f".{names[-1]}.tmp-4321").write_bytes(b"PAR1 half")  # a killed write
    again = export_index(tmp_path / "ix", out)
    assert again["rows"] == clean["rows"] and sorted(p.name for p in out.iterdir()) == names
    assert pd.read_parquet(out).equals(pd.read_parquet(tmp_path / "clean"))
    (out / ".shard-x-w0-00000.parquet.tmp-7").write_bytes(b"half")  # beside a finished export
    with pytest.raises(ConfigError, match="is not empty"):
        export_index(tmp_path / "ix", out)
    export_index(tmp_path / "ix", out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == names
    (out / ".mine.tmp-3").write_text("the user's")  # no export's name: kept, and the folder is the user's
    export_index(tmp_path / "ix", out, overwrite=True)
    assert (out / ".mine.tmp-3").read_text() == "the user's"


def test_two_exports_into_one_folder_at_once_the_second_is_refused(tmp_path):
    """Both wrote their files and said so, exit 0: the folder held two indexes' rows."""
    from embedingest.index import export as export_mod

    build_shards(tmp_path / "ix", n_units=2, chunks=5, workers=1)
    out = tmp_path / "out"
    out.mkdir()
    with export_mod._exporting(out):
        with pytest.raises(IndexBusy) as err:
            export_index(tmp_path / "ix", out)
    assert str(err.value) == f"another export is writing {str(out)!r}; wait for it to end, or choose another folder"
    assert list(out.iterdir()) == []
    assert export_index(tmp_path / "ix", out)["files"] >= 1

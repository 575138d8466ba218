"""Index format 2 shards: what the writers commit, what a crash leaves, what is complete."""

import json
import logging
import os
import re
import subprocess
import sys

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shard_fixtures import DIM, batches, build_shards, meta_of, parquet_reads, unit_vectors

from embedingest.errors import ConfigError
from embedingest.index.shards import (
    CHUNK_COLUMNS,
    BatchMeta,
    arrow_column,
    clean_shards,
    decode_chunks,
    delete_shard,
    encode_chunks,
    faiss_name,
    finished_units,
    incomplete_units,
    list_shards,
    read_commit,
    read_ids,
)
from embedingest.sinks.shard_writer import ShardWriter, ShardWriterFactory


def test_each_writer_commits_whole_shards_with_rows_vectors_and_embeddings(tmp_path):
    built = build_shards(tmp_path / "ix", n_units=6, chunks=20, commit_every=50, workers=2)
    shards = list_shards(tmp_path / "ix" / "shards")
    assert sorted(s.rows for s in shards) == [2, 18, 50, 50]  # batches of 17: 68 and 52 rows
    assert {s.name for s in shards} == {w["name"] for w in built.written}
    seen = []
    for shard in shards:
        table = pq.read_table(shard.path("parquet"))
        assert table.column_names == list(CHUNK_COLUMNS)
        ids = table.column("id").to_numpy()
        assert [shard.id_min, shard.id_max] == [ids.min(), ids.max()]
        for row in table.to_pylist():
            assert row == built.rows[row["id"]]  # every column exactly, NUL included
        index = faiss.read_index(str(shard.path("faiss")))
        assert np.array_equal(faiss.vector_to_array(index.id_map), ids)  # same order
        emb = np.load(shard.path("emb"))
        where = np.searchsorted(built.ids, ids)
        assert emb.dtype == np.float16 and np.array_equal(emb, built.emb[where].astype(np.float16))
        assert np.array_equal(index.index.reconstruct_n(0, index.ntotal), built.emb[where])
        assert shard.verify() is None
        seen.extend(ids.tolist())
    assert sorted(seen) == sorted(built.ids.tolist())  # each id once
    assert incomplete_units(shards) == set()
    assert finished_units(shards) == {u: 20 for u in range(6)}


def test_row_groups_hold_the_configured_rows(tmp_path):
    build_shards(tmp_path / "ix", n_units=2, chunks=20, commit_every=100, workers=1, row_group_rows=8)
    (shard,) = list_shards(tmp_path / "ix" / "shards")
    meta = pq.read_metadata(shard.path("parquet"))
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [8] * 5


def test_commit_record_is_written_last_and_a_shard_without_one_is_invisible(tmp_path, monkeypatch):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=10, commit_every=100, workers=1, run_id="ok")
    import embedingest.sinks.shard_writer as sw

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies before the commit record
    monkeypatch.setattr(sw, "write_commit", crash)
    spec = ShardWriterFactory(str(folder), DIM, save_embeddings=True, run_id="dead")
    sink = spec(0)
    part, done = batches([5], 4)[0]
    sink(meta_of(0, part, done), {"emb": unit_vectors(4), "ids": np.array([r["id"] for r in part])})
    with pytest.raises(KeyboardInterrupt):
        sink.close()
    names = sorted(os.listdir(folder / "shards"))
    assert [n for n in names if "dead" in n] == [f"shard-dead-w0-00000.{s}" for s in ("emb.npy", "faiss", "parquet")]
    shards = list_shards(folder / "shards")
    assert [s.name for s in shards] == ["shard-ok-w0-00000"]
    assert incomplete_units(shards) == set()
    removed = clean_shards(folder / "shards")
    assert sorted(removed) == [f"shard-dead-w0-00000.{s}" for s in ("emb.npy", "faiss", "parquet")]
    assert not any("dead" in n for n in os.listdir(folder / "shards"))


def test_a_damaged_shard_is_named_to_readers_and_redone_by_writers(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=4, chunks=10, commit_every=15, workers=1)
    shards = list_shards(folder / "shards")
    victim = shards[1]
    lost = {int(i) >> 32 for i in read_ids(victim)} | {u for u, _ in victim.units}
    with open(victim.path("parquet"), "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(ConfigError) as err:
        list_shards(folder / "shards")
    assert f"shard {victim.name} in" in str(err.value)
    assert "holds 100 bytes" in str(err.value)
    assert f"delete that shard's files (every file named {victim.name}.*)" in str(err.value)
    removed = clean_shards(folder / "shards")
    assert f"{victim.name}.commit.json" in removed and f"{victim.name}.parquet" in removed
    left = list_shards(folder / "shards")
    assert victim.name not in {s.name for s in left}
    assert lost == {0, 1, 2} and incomplete_units(left) == lost  # units it held or finished, no others


def test_a_commit_record_that_is_not_one_is_a_config_error_naming_it(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=5, workers=1)
    (shard,) = list_shards(folder / "shards")
    shard.commit_path().write_text("{not json")
    with pytest.raises(ConfigError, match=r"cannot read the commit record .*shard-run1-w0-00000\.commit\.json"):
        list_shards(folder / "shards")
    data = dict(shard.record, files={"faiss": {"name": "../../etc/passwd", "size": 1}})
    shard.commit_path().write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="is not a file of the shard"):
        list_shards(folder / "shards")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["named pipe", "link to /dev/zero", "link to a record outside"])
def test_a_commit_record_that_is_no_regular_file_is_refused_at_once_never_followed(tmp_path, kind):
    """Before: a record replaced by a named pipe, or by a link to /dev/zero, hung search and
    build for ever (read_text waited on the pipe, or read zeros without end); a link to a
    record outside the index was read as the shard's."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=5, workers=1)
    (shard,) = list_shards(folder / "shards")
    path = shard.commit_path()
    outside = tmp_path / "outside.commit.json"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    if kind == "named pipe":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero" if kind == "link to /dev/zero" else outside)
    what = "a named pipe (FIFO)" if kind == "named pipe" else "a symbolic link"
    with pytest.raises(ConfigError) as err:
        list_shards(folder / "shards")
    assert str(err.value).startswith(f"cannot read the commit record {str(path)!r} (NotRegularFile: not a "
                                     f"regular file: {what}); delete that shard's files")
    assert f"{shard.name}.commit.json" in clean_shards(folder / "shards")  # the pipe or link, not its target
    assert not os.path.lexists(path) and outside.is_file() and list_shards(folder / "shards") == []


@pytest.mark.parametrize("change", ["sha256 gone", "sha256 not hex", "parquet entry gone", "faiss entry gone",
                                    "rows 0"])
def test_a_record_without_a_file_s_hash_or_a_file_of_its_rows_is_refused(tmp_path, change):
    """Before: export and search ended in KeyError tracebacks ('sha256', 'parquet')."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=5, workers=1)
    (shard,) = list_shards(folder / "shards")
    files = json.loads(json.dumps(shard.record["files"]))
    record = dict(shard.record)
    if change == "sha256 gone":
        del files["parquet"]["sha256"]
    elif change == "rows 0":  # export and search skipped the shard without a word
        record["rows"] = 0
    elif change == "sha256 not hex":
        files["emb"]["sha256"] = "z" * 64
    else:
        del files[change.split()[0]]
    shard.commit_path().write_text(json.dumps(dict(record, files=files)))
    with pytest.raises(ConfigError, match=r"cannot read the commit record .*(is not a file of the shard|names no "
                                          r"(parquet|faiss) file|says 0 rows but names files).*delete that shard's "
                                          r"files"):
        list_shards(folder / "shards")


@pytest.mark.parametrize("generation", ["abc", [1], 1e999, -1, True, 2**31, 10**250])
def test_a_record_of_a_generation_that_is_no_number_is_refused(tmp_path, generation):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=5, workers=1)
    (shard,) = list_shards(folder / "shards")
    shard.commit_path().write_text(json.dumps(dict(shard.record, generation=generation)))
    with pytest.raises(ConfigError, match=r"generation .* is not a generation number"):
        list_shards(folder / "shards")


@pytest.mark.parametrize("key, value", [("rows", "5"), ("rows", 5.0), ("rows", -5), ("rows", True),
                                        ("id_min", "0"), ("id_max", 4.5)])
def test_a_record_whose_rows_or_ids_are_no_whole_numbers_is_refused(tmp_path, key, value):
    """``"rows": "12"`` or ``12.5`` was read through ``int()`` as if a writer had written it."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=5, workers=1)
    (shard,) = list_shards(folder / "shards")
    shard.commit_path().write_text(json.dumps(dict(shard.record, **{key: value})))
    with pytest.raises(ConfigError, match=rf"cannot read the commit record .*\(ValueError: {key} {re.escape(repr(value))} "
                                          r"is not a whole number.*delete that shard's files"):
        list_shards(folder / "shards")


@pytest.mark.parametrize("kind, name", [
    ("emb", "{shard}.d/../../../outside/victim.npy"),  # began as a shard name: it passed, was read and deleted
    ("emb", "{shard}.emb.npy/../../x.emb.npy"),
    ("emb", "shard-other-w0-00000.emb.npy"),  # another shard's file
    ("faiss", "{shard}.emb.npy"),  # a file of the shard, of another kind
    ("parquet", "{shard}.parquet.bak"),
])
def test_a_record_naming_anything_but_its_shards_own_file_is_refused(tmp_path, kind, name):
    """A record's file names are read, and deleted when the shard is rewritten: a tampered
    one made build-index delete a file outside the index."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=5, workers=1)
    (shard,) = list_shards(folder / "shards")
    files = dict(shard.record["files"], **{kind: {"name": name.format(shard=shard.name), "size": 10}})
    shard.commit_path().write_text(json.dumps(dict(shard.record, files=files)))
    with pytest.raises(ConfigError, match=rf"its '{kind}' entry .* is not a file of the shard"):
        list_shards(folder / "shards")


def test_a_replacement_hides_the_shard_it_replaces_and_clean_deletes_it(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=5, workers=1, commit_every=100)
    (old,) = list_shards(folder / "shards")
    spec = ShardWriterFactory(str(folder), DIM, run_id="rm1")
    writer = ShardWriter(spec, "shard-rm1-w0-00000", replaces=[old.name])
    part, done = batches([0], 5)[0]
    writer.add(unit_vectors(5), np.array([r["id"] for r in part]), meta_of(0, part, done).chunks, done)
    writer.commit()
    (new,) = list_shards(folder / "shards")
    assert new.name == "shard-rm1-w0-00000" and new.replaces == (old.name,)
    assert incomplete_units([new]) == set()
    removed = clean_shards(folder / "shards")
    assert set(removed) == {f"{old.name}.{s}" for s in ("commit.json", "emb.npy", "faiss", "parquet")}


def test_a_shard_may_hold_only_finished_units_and_delete_shard_removes_every_file(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=3, workers=1)
    sink = ShardWriterFactory(str(folder), DIM, run_id="empty")(0)
    sink(meta_of(0, [], ((7, 0),)), {"emb": np.zeros((0, DIM), np.float32), "ids": np.zeros(0, np.int64)})
    assert sink.close() == [{"name": "shard-empty-w0-00000", "count": 0}]
    shards = list_shards(folder / "shards")
    empty = next(s for s in shards if s.name == "shard-empty-w0-00000")
    assert (empty.rows, empty.files, empty.units) == (0, {}, ((7, 0),))
    for shard in shards:
        delete_shard(shard)
    assert os.listdir(folder / "shards") == []


def test_incomplete_units_finds_missing_duplicate_and_undeclared_rows(tmp_path):
    folder = tmp_path / "ix"
    spec = ShardWriterFactory(str(folder), DIM, run_id="r")

    def shard(part_no, rows, done):
        writer = ShardWriter(spec, f"shard-r-w0-{part_no:05d}")
        ids = np.array([r["id"] for r in rows], dtype=np.int64)
        writer.add(unit_vectors(len(ids)), ids, meta_of(0, rows, ()).chunks, done)
        writer.commit()

    rows = {u: [r for part, _ in batches([u], 4) for r in part] for u in range(6)}
    shard(0, rows[0] + rows[1][:2], [(0, 4), (1, 4)])  # unit 1: two rows missing
    shard(1, rows[2] + rows[2][:1], [(2, 4)])  # unit 2: a duplicate row
    shard(2, rows[3], [])  # unit 3: never declared finished
    shard(3, rows[4], [(4, 4)])
    shard(4, [], [(4, 4)])  # unit 4 declared twice
    shard(5, rows[5][1:], [(5, 3)])  # unit 5: chunk 0 missing, ids up to 3
    shards = list_shards(folder / "shards")
    assert incomplete_units(shards) == {1, 2, 3, 4, 5}
    assert incomplete_units(shards, expected={0: 4, 9: 2}) == {1, 2, 3, 4, 5, 9}


def test_chunk_rows_round_trip_as_arrow_bytes_and_garbage_is_refused():
    data = encode_chunks([1 << 32 | 2], ["a.txt"], [None], [2], [5], [9], ["hé\0"])
    assert isinstance(data, bytes)
    assert decode_chunks(data).to_pylist() == [{"id": 1 << 32 | 2, "source": "a.txt", "record_id": None,
                                                "chunk_no": 2, "span_start": 5, "span_end": 9,
                                                "text": "hé\0"}]
    with pytest.raises(ConfigError, match="chunk metadata of 5 bytes is not a record batch"):
        decode_chunks(b"12345")
    assert repr(BatchMeta(7, data, ((1, 3),))) == "batch 7"


def _as_pyarrow_makes_it(values, type_):
    """What ``pa.array`` makes of ``values``, or the type of error it raises."""
    try:
        return pa.array(values, type=type_)
    except Exception as exc:  # noqa: BLE001 - compared with arrow_column's
        return type(exc)


_MAYBE_INT = st.one_of(st.none(), st.integers(-(1 << 64), 1 << 64))
_MAYBE_TEXT = st.one_of(st.none(), st.text(max_size=12))  # surrogates included: not UTF-8


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.tuples(st.just(pa.int64()), st.lists(_MAYBE_INT, max_size=8)),
                 st.tuples(st.just(pa.int32()), st.lists(_MAYBE_INT, max_size=8)),
                 st.tuples(st.just(pa.int64()), st.lists(st.floats(), max_size=3)),  # NaN: refused
                 st.tuples(st.just(pa.string()), st.lists(_MAYBE_TEXT, max_size=8))))
def test_arrow_column_is_what_pa_array_makes(case):
    """The columns built from buffers (no pandas import) equal pyarrow's own, nulls
    included, and values pyarrow refuses are refused with its error."""
    type_, values = case
    expected = _as_pyarrow_makes_it(values, type_)
    if isinstance(expected, type):
        with pytest.raises(expected):
            arrow_column(values, type_)
        return
    column = arrow_column(values, type_)
    assert column.type == type_ and column.null_count == expected.null_count
    assert column.equals(expected) and column.to_pylist() == expected.to_pylist()
    column.validate(full=True)


def test_arrow_column_takes_numpy_columns():
    assert arrow_column(np.array([1, 2], dtype=np.uint32), pa.int64()).to_pylist() == [1, 2]
    assert arrow_column(np.array([1 << 62], dtype=np.uint64), pa.int64()).to_pylist() == [1 << 62]
    assert arrow_column(np.array([7], dtype=np.int64), pa.int32()).type == pa.int32()


def test_encoding_a_batch_does_not_import_pandas():
    """Each tokenizing worker encodes its batches' rows; importing pandas there (what
    ``pa.array`` does) delayed every worker's first batch."""
    code = ("import sys; from embedingest.index.shards import encode_chunks; "
            "text = 'a chunk of a document, ' * 40; "
            "encode_chunks([1, 2], ['a.md', 'a.md'], [None, '7'], [0, 1], [0, 960], [960, 1920], [text, text]); "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_sink_refuses_batches_without_metadata_or_with_other_ids(tmp_path):
    sink = ShardWriterFactory(str(tmp_path / "ix"), DIM, run_id="x")(0)
    part, done = batches([0], 3)[0]
    ids = np.array([r["id"] for r in part])
    with pytest.raises(ConfigError, match="batch 5 carries no chunk metadata"):
        sink(5, {"emb": unit_vectors(3), "ids": ids})
    with pytest.raises(ConfigError, match="the 3 metadata rows of a batch do not match its 3 vector ids"):
        sink(meta_of(0, part, done), {"emb": unit_vectors(3), "ids": ids[::-1].copy()})
    sink.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_units=st.integers(1, 6), chunks=st.integers(1, 9), commit_every=st.integers(1, 40),
       workers=st.integers(1, 3), row_group_rows=st.integers(1, 16))
def test_any_split_commits_every_row_once_and_complete(tmp_path_factory, n_units, chunks, commit_every,
                                                      workers, row_group_rows):
    folder = tmp_path_factory.mktemp("ix")
    built = build_shards(folder, n_units=n_units, chunks=chunks, commit_every=commit_every,
                         workers=workers, row_group_rows=row_group_rows, save_embeddings=False)
    shards = list_shards(folder / "shards")
    assert all(s.rows <= commit_every for s in shards)
    ids = np.concatenate([read_ids(s) for s in shards if s.rows])
    assert sorted(ids.tolist()) == sorted(built.ids.tolist())
    assert incomplete_units(shards) == set()


def test_finished_marks_that_came_after_the_last_batch_get_a_shard_of_their_own(tmp_path):
    from embedingest.sinks.shard_writer import commit_finished

    folder = tmp_path / "ix"
    spec = ShardWriterFactory(str(folder), DIM, run_id="m")
    sink = spec(0)
    part, _ = batches([3], 5)[0]
    sink(meta_of(0, part, ()), {"emb": unit_vectors(5), "ids": np.array([r["id"] for r in part])})
    sink.close()
    assert incomplete_units(list_shards(folder / "shards")) == {3}  # rows, no mark yet
    assert commit_finished(spec, []) is None
    record = commit_finished(spec, [(3, 5), (4, 0)])
    assert (record["name"], record["rows"], record["files"]) == ("shard-m-w9999-00000", 0, {})
    shards = list_shards(folder / "shards")
    assert incomplete_units(shards) == set() and finished_units(shards) == {3: 5, 4: 0}


def test_verify_names_the_file_whose_bytes_changed_and_sizes_come_first(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=5, workers=1, save_embeddings=True)
    (shard,) = list_shards(folder / "shards")
    assert shard.verify() is None
    path = shard.path("emb")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # same size, other bytes: only the hash can tell
    path.write_bytes(data)
    assert shard.check_sizes() is None
    assert shard.verify() == f"its emb file '{shard.name}.emb.npy' does not hold the bytes that were committed"
    path.write_bytes(data + b"x")
    assert shard.verify() == f"its emb file '{shard.name}.emb.npy' holds {len(data) + 1} bytes, not {len(data)}"


def test_hashing_file_is_a_write_only_stream_that_leaves_the_real_file_open():
    """pyarrow and numpy write through it; closing it (as a writer that owns its sink
    does) must not close the temporary file, which atomic_file checks and renames."""
    import hashlib
    import io

    from embedingest.index.shards import HashingFile

    real = io.BytesIO()
    out = HashingFile(real)
    assert out.writable() and not out.seekable() and not out.closed
    assert out.write(b"abc") == 3 and out.write(bytearray(b"de")) == 2 and out.tell() == 5
    out.flush()
    out.close()
    assert out.closed and not real.closed and real.getvalue() == b"abcde"
    assert out.summary("x") == {"name": "x", "size": 5, "sha256": hashlib.sha256(b"abcde").hexdigest()}


def test_hashing_file_hashes_large_writes_beside_them_and_returns_after_both():
    """A write of HASH_BESIDE_BYTES or more is hashed in the hashing thread; the digest is
    the whole stream's, in order, and a buffer the caller changes after ``write`` returned
    does not change it (the hash of that write was done by then)."""
    import hashlib
    import io

    from embedingest.index import shards
    from embedingest.index.shards import HASH_BESIDE_BYTES, HashingFile

    rng = np.random.default_rng(3)
    parts = [rng.bytes(HASH_BESIDE_BYTES + 17), b"small", rng.bytes(3 * HASH_BESIDE_BYTES)]
    real = io.BytesIO()
    out = HashingFile(real)
    buffer = bytearray(parts[0])
    out.write(buffer)
    buffer[:] = b"\0" * len(buffer)  # reused by the caller: already hashed and written
    out.write(parts[1])
    out.write(memoryview(parts[2]))
    whole = b"".join(parts)
    assert real.getvalue() == whole
    assert out.summary("f") == {"name": "f", "size": len(whole), "sha256": hashlib.sha256(whole).hexdigest()}
    assert shards._hasher is not None and shards._hasher._threads  # the large writes went there


FORKED_HASH = """
import hashlib, io, os, sys
from embedingest.index.shards import HASH_BESIDE_BYTES, HashingFile
data = b"x" * (2 * HASH_BESIDE_BYTES)
HashingFile(io.BytesIO()).write(data)  # the parent's hashing thread exists
pid = os.fork()
if pid == 0:
    out = HashingFile(io.BytesIO())
    out.write(data)
    os._exit(0 if out.summary("f")["sha256"] == hashlib.sha256(data).hexdigest() else 3)
print(os.waitpid(pid, 0)[1])
"""


def test_a_forked_child_hashes_in_a_thread_of_its_own():
    """The parent's hashing thread does not exist in a forked child (a tokenizing worker,
    a device process): its first large write must start another, not wait forever."""
    proc = subprocess.run([sys.executable, "-c", FORKED_HASH], capture_output=True, text=True,
                          timeout=60, check=True)
    assert proc.stdout.strip() == "0", proc.stderr


def test_clean_names_everything_it_deletes_warns_and_keeps_finished_marks(tmp_path, caplog):
    """Unreadable records, replaced shards, damaged shards and a removal's empty record
    are all deleted and all named (several of each kind); a shard of finished-marks
    only, and a replacement that keeps some marks, stay."""
    from embedingest.sinks.shard_writer import commit_finished

    folder = tmp_path / "ix"
    build_shards(folder, n_units=4, chunks=10, commit_every=15, workers=1)  # parts 0, 1, 2
    shards_dir = folder / "shards"
    part = [f"shard-run1-w0-{p:05d}" for p in range(3)]
    bad = [shards_dir / "shard-bad-w0-00000.commit.json", shards_dir / "shard-bad-w0-00001.commit.json"]
    bad[0].write_text("{not json")
    bad[1].write_text("[]")
    expected_errors = []
    for path in bad:
        with pytest.raises(ConfigError) as err:
            read_commit(path)
        expected_errors.append(str(err.value))
    sizes = {}
    for name in part[1:]:  # damaged: 100 bytes of parquet left
        path = shards_dir / f"{name}.parquet"
        sizes[name] = path.stat().st_size
        with open(path, "r+b") as fh:
            fh.truncate(100)
    spec = ShardWriterFactory(str(folder), DIM, run_id="rm1")
    ShardWriter(spec, "shard-rm1-w0-00000", replaces=[part[0]]).commit()  # removes part 0, keeps nothing
    commit_finished(ShardWriterFactory(str(folder), DIM, run_id="m"), [(7, 0)])
    commit_finished(ShardWriterFactory(str(folder), DIM, run_id="n"), [(8, 0), (9, 0)])
    keeper = ShardWriter(spec, "shard-rm1-w0-00001", replaces=["shard-n-w9999-00000"])  # unit 9 removed
    keeper.add(np.zeros((0, DIM), np.float32), np.zeros(0, np.int64), meta_of(0, [], ()).chunks, [(8, 0)])
    keeper.commit()

    with caplog.at_level(logging.WARNING, logger="embedingest"):
        removed = clean_shards(shards_dir)
    assert sorted(removed) == sorted(
        [p.name for p in bad] + ["shard-n-w9999-00000.commit.json", "shard-rm1-w0-00000.commit.json"]
        + [f"{n}.{s}" for n in part for s in ("commit.json", "emb.npy", "faiss", "parquet")])
    assert len(removed) == len(set(removed))
    assert caplog.messages == expected_errors + [
        f"shard {name} is damaged (its parquet file '{name}.parquet' holds 100 bytes, not {sizes[name]}): "
        "it is deleted and its units are redone" for name in part[1:]]
    left = list_shards(shards_dir)
    assert [s.name for s in left] == ["shard-m-w9999-00000", "shard-rm1-w0-00001"]
    assert finished_units(left) == {7: 0, 8: 0}
    assert sorted(os.listdir(shards_dir)) == ["shard-m-w9999-00000.commit.json", "shard-rm1-w0-00001.commit.json"]


def test_a_unit_declared_with_0_chunks_and_again_with_its_rows_is_incomplete(tmp_path):
    """Two marks of one unit disagree (an empty unit, then one of 4 chunks): redo it,
    although the later mark matches the rows."""
    from embedingest.sinks.shard_writer import commit_finished

    folder = tmp_path / "ix"
    commit_finished(ShardWriterFactory(str(folder), DIM, run_id="a"), [(2, 0), (3, 0)])
    writer = ShardWriter(ShardWriterFactory(str(folder), DIM, run_id="b"), "shard-b-w0-00000")
    ((rows, _),) = batches([2], 4)
    writer.add(unit_vectors(4), np.array([r["id"] for r in rows]), meta_of(0, rows, ()).chunks, [(2, 4)])
    writer.commit()
    shards = list_shards(folder / "shards")
    assert [s.units for s in shards] == [((2, 0), (3, 0)), ((2, 4),)]
    assert incomplete_units(shards) == {2}
    assert incomplete_units(shards[1:]) == set()
    commit_finished(ShardWriterFactory(str(folder), DIM, run_id="c"), [(3, 0)])
    assert incomplete_units(list_shards(folder / "shards")) == {2}  # an empty unit marked twice is fine


def test_known_units_count_units_of_finished_marks_alone(tmp_path):
    from embedingest.sinks.shard_writer import commit_finished

    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=3, workers=1)
    commit_finished(ShardWriterFactory(str(folder), DIM, run_id="m"), [(5, 0)])
    shards = list_shards(folder / "shards")
    assert incomplete_units(shards, known={0, 1, 5}) == set()
    assert incomplete_units(shards, known={0, 1}) == {5}  # marked, no rows, not a unit of the index
    assert incomplete_units(shards, known={1, 5}) == {0}


def test_read_commit_refuses_what_is_not_a_record_of_the_shard_word_for_word(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=5, workers=1)
    (shard,) = list_shards(folder / "shards")
    path, good = shard.commit_path(), dict(shard.record)
    advice = ("; delete that shard's files (every file named shard-run1-w0-00000.*) and run the same "
              "build-index command again: the units it held are redone")

    def refusal(text):
        path.write_text(text if isinstance(text, str) else json.dumps(text))
        with pytest.raises(ConfigError) as err:
            read_commit(path)
        return str(err.value)

    def says(why):
        return f"cannot read the commit record {str(path)!r} ({why}){advice}"

    assert refusal("{not json") == says("JSONDecodeError: Expecting property name enclosed in double "
                                        "quotes: line 1 column 2 (char 1)")
    not_this = "ValueError: it is not a commit record of this shard in format 2"
    assert refusal(dict(good, name="shard-run1-w0-00001")) == says(not_this)  # another shard's record
    assert refusal(dict(good, format=1)) == says(not_this)
    assert refusal(dict(good, files=list(good["files"].values()))) == says(not_this)
    assert refusal({k: v for k, v in good.items() if k != "files"}) == says("KeyError: 'files'")
    odd = {"name": "shard-run1-w0-00000.txt", "size": 3, "sha256": "0"}
    assert refusal(dict(good, files=dict(good["files"], text=odd))) == says(
        f"ValueError: its 'text' entry {odd!r} is not a file of the shard")
    sized = dict(good["files"]["parquet"], size="1777")
    assert refusal(dict(good, files=dict(good["files"], parquet=sized))) == says(
        f"ValueError: its 'parquet' entry {sized!r} is not a file of the shard")
    assert refusal(dict(good, units=[[0, 1], [5]])) == says(
        "ValueError: zip() argument 2 is shorter than argument 1")
    assert refusal(dict(good, replaces=["../shard-run1-w0-00001"])) == says(
        "ValueError: replaces ('../shard-run1-w0-00001',) is not a list of shard names")
    assert refusal(dict(good, replaces=[7])) == says("ValueError: replaces (7,) is not a list of shard names")

    path.write_text(json.dumps({k: v for k, v in good.items() if k != "replaces"}))  # an older record
    assert read_commit(path) == shard and read_commit(path).replaces == ()
    path.unlink()  # a record read from object storage: its text is given, the path is only its name
    assert read_commit(path, json.dumps(good).encode()) == shard


@pytest.mark.parametrize("unit, n, why", [
    (2**70, 5, f"units holds the unit number {2**70}, not a whole number from 0 to 2147483647"),
    (2**31, 5, f"units holds the unit number {2**31}, not a whole number from 0 to 2147483647"),
    (1.5, 5, "units holds the unit number 1.5, not a whole number from 0 to 2147483647"),
    (-1, 5, "units holds the unit number -1, not a whole number from 0 to 2147483647"),
    (True, 5, "units holds the unit number True, not a whole number from 0 to 2147483647"),
    ("0", 5, "units holds the unit number '0', not a whole number from 0 to 2147483647"),
    (0, 2.5, "units gives unit 0 2.5 chunks, not a whole number from 0 to 4294967296"),
    (0, -5, "units gives unit 0 -5 chunks, not a whole number from 0 to 4294967296"),
    (0, 2**32 + 1, f"units gives unit 0 {2**32 + 1} chunks, not a whole number from 0 to 4294967296"),
])
def test_a_record_whose_finished_units_no_writer_can_write_is_refused_naming_the_value(tmp_path, unit, n, why):
    """A unit number 2**70 (its unit_sha256 key made to match) was an OverflowError of every
    later update (numpy's int64); 1.5 matched no id, so an update took the unit's rows
    for strays and removed them, exiting 0."""
    from embedingest.sinks.shard_writer import commit_finished

    folder = tmp_path / "ix"
    record = commit_finished(ShardWriterFactory(str(folder), DIM, run_id="m"), [(0, 5)],
                             unit_hashes=[(0, "a" * 64)])
    path = folder / "shards" / "shard-m-w9999-00000.commit.json"
    path.write_text(json.dumps(dict(record, units=[[unit], [n]], unit_sha256={str(unit): "a" * 64})))
    redo = ("delete that shard's files (every file named shard-m-w9999-00000.*) and run the same "
            "build-index command again: the units it held are redone")
    with pytest.raises(ConfigError) as err:
        list_shards(folder / "shards")
    assert str(err.value) == f"cannot read the commit record {str(path)!r} (ValueError: {why}); {redo}"
    for shape in ([[0]], [[0], [5], [1]], "0:5", {"0": 5}, [[0], 5]):
        path.write_text(json.dumps(dict(record, units=shape)))
        with pytest.raises(ConfigError, match=r"\(ValueError: units is not a pair of lists \[unit numbers, "
                                              r"chunk counts\]\)"):
            read_commit(path)
    assert clean_shards(folder / "shards") == [path.name]  # a build redoes the units of such a shard


def test_check_sizes_names_the_file_and_what_is_wrong(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=5, workers=1)
    (shard,) = list_shards(folder / "shards")
    name, parquet = shard.name, shard.path("parquet")
    assert shard.check_sizes() is None and shard.check_sizes(0) is None
    assert shard.check_sizes(1) == f"its vectors file '{name}.g1.faiss' is missing"  # after a reindex
    g1 = shard.faiss_path(1)
    g1.symlink_to(shard.path("faiss"))
    assert shard.check_sizes(1) == f"its vectors file '{name}.g1.faiss' is missing"  # a link is not followed
    g1.unlink()
    g1.write_bytes(b"new vectors: their size is in no record")
    shard.path("faiss").unlink()  # the old generation's vectors are gone after a reindex
    assert shard.check_sizes(1) is None
    assert shard.check_sizes(0) == (f"its faiss file '{name}.faiss' cannot be read (No such file or directory)")

    data = parquet.read_bytes()
    parquet.unlink()
    assert shard.check_sizes(1) == f"its parquet file '{name}.parquet' cannot be read (No such file or directory)"
    parquet.write_bytes(data + b"x")
    assert shard.check_sizes(1) == f"its parquet file '{name}.parquet' holds {len(data) + 1} bytes, not {len(data)}"
    # the vectors listed first: the files after them are still checked
    first = type(shard)(**{**{f: getattr(shard, f) for f in shard.__dataclass_fields__},
                           "files": {"faiss": shard.files["faiss"], "parquet": shard.files["parquet"]}})
    assert first.check_sizes(1) == f"its parquet file '{name}.parquet' holds {len(data) + 1} bytes, not {len(data)}"
    copy = tmp_path / "copy.parquet"
    copy.write_bytes(data)
    parquet.unlink()
    parquet.symlink_to(copy)  # the right size behind a link
    assert shard.check_sizes(1) == f"its parquet file '{name}.parquet' is not a regular file (a link?)"
    with pytest.raises(ConfigError) as err:
        list_shards(folder / "shards", generation=1)
    assert str(err.value) == (
        f"shard {name} in {str(folder / 'shards')!r} is damaged: its parquet file '{name}.parquet' is not a "
        f"regular file (a link?); delete that shard's files (every file named {name}.*) and run the same "
        "build-index command again: the units it held are redone")


def test_faiss_names_by_generation(tmp_path):
    assert faiss_name("shard-a-w0-00001") == faiss_name("shard-a-w0-00001", 0) == "shard-a-w0-00001.faiss"
    assert faiss_name("shard-a-w0-00001", 12) == "shard-a-w0-00001.g12.faiss"
    build_shards(tmp_path, n_units=1, chunks=2, workers=1)
    (shard,) = list_shards(tmp_path / "shards")
    assert shard.faiss_path() == shard.path("faiss") == tmp_path / "shards" / "shard-run1-w0-00000.faiss"
    assert shard.faiss_path(3) == tmp_path / "shards" / "shard-run1-w0-00000.g3.faiss"


def test_a_commit_record_says_when_it_was_made_and_is_made_durable(tmp_path, monkeypatch):
    """The record's rename is fsynced with its folder: the record that makes a shard exist
    survives a power cut once the commit returns."""
    import calendar
    import time

    import embedingest.outfiles as outfiles
    from embedingest.index.shards import write_commit

    synced = []
    real = outfiles.fsync_dir
    monkeypatch.setattr(outfiles, "fsync_dir", lambda folder: (synced.append(
        (folder, sorted(p.name for p in folder.iterdir()))), real(folder)))
    before = time.time()
    build_shards(tmp_path / "ix", n_units=1, chunks=2, workers=1)
    after = time.time()
    (shard,) = list_shards(tmp_path / "ix" / "shards")
    created = shard.record["created"]
    assert int(before) <= calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ")) <= after
    assert (tmp_path / "ix" / "shards", sorted(os.listdir(tmp_path / "ix" / "shards"))) in synced
    synced.clear()
    write_commit(tmp_path, {"name": "shard-x-w0-00000", "rows": 0})
    assert synced == [(tmp_path, sorted(os.listdir(tmp_path)))] and "shard-x-w0-00000.commit.json" in synced[0][1]


def test_chunk_rows_of_another_schema_are_refused_with_both_schemas():
    import pyarrow as pa

    other = pa.record_batch([pa.array([1], pa.int64())], names=["id"])
    with pytest.raises(ConfigError) as err:
        decode_chunks(other)
    from embedingest.index.shards import CHUNK_SCHEMA
    assert str(err.value) == f"chunk metadata has schema {other.schema}, not the shard schema {CHUNK_SCHEMA}"


def test_read_ids_reads_only_the_id_column(tmp_path, monkeypatch):
    build_shards(tmp_path, n_units=2, chunks=3, workers=1)
    (shard,) = list_shards(tmp_path / "shards")
    reads = parquet_reads(monkeypatch)
    ids = read_ids(shard)
    assert ids.dtype == np.int64 and ids.tolist() == [u << 32 | c for u in range(2) for c in range(3)]
    assert reads == [["id"]]


def test_now_is_utc_whatever_the_local_zone(monkeypatch):
    import calendar
    import time

    from embedingest.index.shards import now

    monkeypatch.setenv("TZ", "XYZ-5:30")  # five and a half hours east of UTC, no tz database needed
    time.tzset()
    try:
        before = int(time.time())
        stamp = calendar.timegm(time.strptime(now(), "%Y-%m-%dT%H:%M:%SZ"))
        assert before <= stamp <= time.time()
    finally:
        monkeypatch.undo()
        time.tzset()


def test_the_loaders_hashes_are_recorded_with_the_units_they_finish(tmp_path):
    """A unit's content hash, made by the loader, is in the commit record of the shard that
    finishes the unit, read back as ``unit_hashes``; a hash for a unit no batch finished is
    refused, and a record whose hashes are not hex digests of its own units is damaged."""
    from embedingest.index.shards import finished_hashes, read_commit
    from embedingest.sinks.shard_writer import commit_finished

    folder = tmp_path / "ix"
    spec = ShardWriterFactory(str(folder), DIM, run_id="m")
    record = commit_finished(spec, [(3, 5), (4, 0)], unit_hashes=[(4, "b" * 64)])
    assert record["unit_sha256"] == {"4": "b" * 64}
    assert "unit_sha256" not in commit_finished(spec, [(5, 1)], part=1)
    shards = list_shards(folder / "shards")
    assert finished_hashes(shards) == {4: "b" * 64}
    writer = ShardWriter(spec, "shard-m-w0-00007")
    with pytest.raises(ConfigError, match="a hash for unit 6, which no batch finished"):
        writer.add(np.zeros((0, DIM), np.float32), np.zeros(0, np.int64), meta_of(0, [], ()).chunks,
                   [(5, 1)], [(6, "c" * 64)])
    path = folder / "shards" / "shard-m-w9999-00000.commit.json"
    for bad in ({"3": "B" * 64}, {"9": "b" * 64}, {"4": "b" * 63}, ["4"], {"x": "b" * 64}):
        path.write_text(json.dumps(dict(record, unit_sha256=bad)))
        with pytest.raises(ConfigError, match="unit_sha256"):
            read_commit(path)


def test_a_records_bad_unit_hashes_are_named_word_for_word(tmp_path):
    """The refusal of a record's ``unit_sha256`` names the entry and says what it should be."""
    from embedingest.sinks.shard_writer import commit_finished

    folder = tmp_path / "ix"
    record = commit_finished(ShardWriterFactory(str(folder), DIM, run_id="m"), [(3, 5)],
                             unit_hashes=[(3, "a" * 64)])
    path = folder / "shards" / "shard-m-w9999-00000.commit.json"
    redo = ("delete that shard's files (every file named shard-m-w9999-00000.*) and run the same "
            "build-index command again: the units it held are redone")
    for bad, why in ((["3"], "unit_sha256 ['3'] is not a mapping of unit numbers to hashes"),
                     ({"4": "a" * 64}, f"unit_sha256 entry '4': '{'a' * 64}' is not the sha256 of a "
                                       "unit the shard finishes")):
        path.write_text(json.dumps(dict(record, unit_sha256=bad)))
        with pytest.raises(ConfigError) as err:
            read_commit(path)
        assert str(err.value) == f"cannot read the commit record {str(path)!r} (ValueError: {why}); {redo}"


def test_schema_problem_names_what_makes_a_rows_file_no_shard_s():
    from embedingest.index.shards import CHUNK_SCHEMA, schema_problem

    assert schema_problem(CHUNK_SCHEMA) is None
    assert schema_problem(CHUNK_SCHEMA.remove(6)) == "it lacks the column text"
    assert schema_problem(CHUNK_SCHEMA.remove(6).remove(1)) == "it lacks the columns source, text"
    assert schema_problem(CHUNK_SCHEMA.append(pa.field("extra", pa.int64()))) == \
        "it has columns a shard has not (extra)"
    assert schema_problem(CHUNK_SCHEMA.set(6, pa.field("text", pa.int64()))) == \
        "its column text is of type int64, not string"
    assert schema_problem(CHUNK_SCHEMA.set(6, pa.field("text", pa.large_string()))) == \
        "its column text is of type large_string, not string"
    moved = pa.schema([CHUNK_SCHEMA.field(n) for n in ("source", "id", *CHUNK_COLUMNS[2:])])
    assert schema_problem(moved) == ("its columns are in the order source, id, record_id, chunk_no, span_start, "
                                     "span_end, text, not id, source, record_id, chunk_no, span_start, span_end, text")
    twice = pa.schema([*CHUNK_SCHEMA, pa.field("text", pa.string())])
    assert schema_problem(twice) == "it has columns a shard has not (one twice)"

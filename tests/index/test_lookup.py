"""Id -> row through the shards' Parquet files."""

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shard_fixtures import build_shards

import embedingest.index.lookup as lookup
from embedingest.index.lookup import ShardRows
from embedingest.index.shards import list_shards
from embedingest.index.store import Chunk


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_shards(tmp_path_factory.mktemp("ix") / "ix", n_units=7, chunks=23, commit_every=40,
                        workers=3, row_group_rows=8)


def expected_chunk(row):
    return Chunk(row["id"], row["id"] >> 32, row["source"], row["record_id"], row["chunk_no"],
                 row["span_start"], row["span_end"], row["text"])


def test_every_id_maps_to_its_own_row(built):
    rows = ShardRows(list_shards(built.folder / "shards"))
    assert len(rows) == len(built.ids)
    got = rows.chunks(built.ids)
    assert got == {i: expected_chunk(r) for i, r in built.rows.items()}


def test_unknown_ids_are_absent_and_locate_says_minus_one(built):
    rows = ShardRows(list_shards(built.folder / "shards"))
    known = int(built.ids[5])
    unknown = [-1, 0 | 99, (99 << 32), known + (1 << 40), 2**62]
    assert set(rows.chunks(unknown + [known])) == {known}
    shard, row = rows.locate(unknown)
    assert shard.tolist() == [-1] * 5 and row.tolist() == [-1] * 5
    assert rows.table([]) == {}


def test_only_asked_columns_are_read(built):
    rows = ShardRows(list_shards(built.folder / "shards"))
    i = int(built.ids[-1])
    assert rows.table([i], columns=["text"]) == {i: {"id": i, "text": built.rows[i]["text"]}}


def test_a_lookup_reads_only_the_asked_columns_of_the_row_groups_hit(built, monkeypatch):
    """id and chunk_no come from the id: asking only for them reads nothing; otherwise
    the row group holding the id is read, with the columns asked for."""
    import pyarrow.parquet as pq

    reads = []
    real = pq.ParquetFile.read_row_groups

    def spy(self, groups, columns=None, **kw):
        reads.append((list(groups), columns))
        return real(self, groups, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy)
    rows = ShardRows(list_shards(built.folder / "shards"), threads=1)
    no = max(range(len(rows.shards)), key=lambda n: rows.shards[n].rows)
    assert rows.shards[no].rows > 9
    i = int(rows.shard_ids(no)[9])  # row 9: the second row group of 8 rows
    assert rows.table([i], columns=["chunk_no"]) == {i: {"id": i, "chunk_no": built.rows[i]["chunk_no"]}}
    assert reads == []
    assert rows.table([i], columns=["text", "chunk_no"]) == {
        i: {"id": i, "text": built.rows[i]["text"], "chunk_no": built.rows[i]["chunk_no"]}}
    assert reads == [([1], ["text"])]


def test_an_empty_index_has_no_rows(tmp_path):
    rows = ShardRows([])
    assert len(rows) == 0 and rows.chunks([1, 2]) == {}


def test_more_shards_than_open_files_still_map_every_id(built, monkeypatch):
    monkeypatch.setattr(lookup, "OPEN_FILES", 1)
    rows = ShardRows(list_shards(built.folder / "shards"))
    ids = np.random.default_rng(0).permutation(built.ids)
    for start in range(0, len(ids), 10):
        part = ids[start:start + 10]
        assert rows.chunks(part) == {int(i): expected_chunk(built.rows[int(i)]) for i in part}
    assert len(rows._files) == 1


def test_open_files_are_kept_and_reused_up_to_the_bound(built, monkeypatch):
    """A lookup reuses the Parquet files it has open (opening one costs a footer read);
    beyond OPEN_FILES the least recently used is dropped and opened again when needed."""
    monkeypatch.setattr(lookup, "OPEN_FILES", 2)
    rows = ShardRows(list_shards(built.folder / "shards"))
    opened = []
    real_open = rows._open
    monkeypatch.setattr(rows, "_open", lambda no: opened.append(no) or real_open(no))
    first = [int(rows.shard_ids(no)[0]) for no in range(len(rows.shards))]
    assert len(first) >= 3
    for _ in range(3):  # the files opened at start-up: none opened again
        rows.chunks(first[:2])
    assert opened == []
    rows.chunks([first[2]])  # a third file: opened, and the least recently used one dropped
    rows.chunks([first[1]])
    rows.chunks([first[0]])
    assert opened == [2, 0] and list(rows._files) == [1, 0]


def test_threads_share_one_reader(built):
    rows = ShardRows(list_shards(built.folder / "shards"))
    errors, ids = [], list(built.ids)

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(30):
                part = rng.choice(ids, 10)
                assert rows.chunks(part) == {int(i): expected_chunk(built.rows[int(i)]) for i in part}
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_subset_of_ids_in_any_order(built, data):
    rows = ShardRows(list_shards(built.folder / "shards"))
    picked = data.draw(st.lists(st.sampled_from(built.ids.tolist()), max_size=25))
    assert rows.chunks(picked) == {i: expected_chunk(built.rows[i]) for i in picked}


def test_shard_ids_are_each_shards_ids_in_row_order(built):
    from embedingest.index.shards import read_ids

    rows = ShardRows(list_shards(built.folder / "shards"))
    for no, shard in enumerate(rows.shards):
        assert np.array_equal(rows.shard_ids(no), read_ids(shard))


def test_row_groups_are_read_from_the_footer_when_the_record_gives_no_size(built):
    import dataclasses

    shards = [dataclasses.replace(s, record={k: v for k, v in s.record.items() if k != "row_group_rows"})
              for s in list_shards(built.folder / "shards")]
    rows = ShardRows(shards)
    assert rows.chunks(built.ids) == {i: expected_chunk(r) for i, r in built.rows.items()}
    assert all(np.array_equal(a, b) for a, b in zip(rows._group_starts,
                                                     ShardRows(list_shards(built.folder / "shards"))._group_starts))


def test_locate_of_one_row_a_scalar_and_a_grid(tmp_path):
    """An index of one row, ids above and below it; a scalar id; a 2-D grid of ids (as
    faiss returns them) comes back flat."""
    one = build_shards(tmp_path / "one", n_units=1, chunks=1, workers=1)
    rows = ShardRows(list_shards(one.folder / "shards"))
    (only,) = one.ids.tolist()
    shard, row = rows.locate([only - 1, only, only + 1])
    assert shard.tolist() == [-1, 0, -1] and row.tolist() == [-1, 0, -1]
    assert [a.tolist() for a in rows.locate(only)] == [[0], [0]]
    assert [a.tolist() for a in rows.locate(np.array([[only, -1], [only + 5, only]]))] == [[0, -1, -1, 0],
                                                                                          [0, -1, -1, 0]]

"""Id -> row through the shards' Parquet files."""

import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shard_fixtures import build_shards, parquet_reads, recommit_file

import embedingest.index.lookup as lookup
from embedingest.errors import ConfigError
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
    assert reads == [([1], ["id", "text"])]  # the ids too: the rows must be the ones opened


def test_a_shard_a_build_replaced_or_removed_since_is_a_change_not_damage(tmp_path, monkeypatch):
    """A served index of more shards than files kept open: a build's rewrite or removal of
    a shard answered 422 'the shard is damaged; delete its files' (or, rewritten under its
    name, the rows at the old positions). Now IndexChanged says to search again; a shard
    whose commit record is still there but whose rows file is gone is damaged, as before."""
    import shutil

    built = build_shards(tmp_path / "ix", n_units=4, chunks=9, commit_every=10, workers=1)
    other = build_shards(tmp_path / "other", n_units=4, chunks=9, commit_every=10, workers=1, seed=7)
    monkeypatch.setattr(lookup, "OPEN_FILES", 1)
    rows = ShardRows(list_shards(built.folder / "shards"), threads=1)
    second = rows.shards[1]
    a, b = int(rows.shard_ids(0)[0]), int(rows.shard_ids(1)[0])
    assert rows.chunks([b]) and rows.chunks([a])  # the second shard's file dropped, the first's open
    parquet = second.path("parquet")
    mine = parquet.read_bytes()
    shutil.copyfile(next(p for p in sorted((other.folder / "shards").glob("*.parquet"))
                         if p.read_bytes() != mine), parquet)  # rewritten under its name
    with pytest.raises(lookup.IndexChanged, match=f"shard {second.name} holds other rows than when the index "
                                                   "was opened: a build rewrote it; search again"):
        rows.chunks([b])
    parquet.unlink()
    assert rows.chunks([a])  # the first shard's file open again: the second's dropped
    with pytest.raises(ConfigError) as err:  # its commit record is there: damaged
        rows.chunks([b])
    assert not isinstance(err.value, lookup.IndexChanged) and "the shard is damaged" in str(err.value)
    (second.folder / f"{second.name}.commit.json").unlink()  # removed whole: a build's removal
    assert rows.chunks([a])
    with pytest.raises(lookup.IndexChanged, match=f"shard {second.name} was removed since the index was opened"):
        rows.chunks([b])


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
    # one thread: two shards read side by side would use their files in either order
    rows = ShardRows(list_shards(built.folder / "shards"), threads=1)
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


@pytest.mark.parametrize("size", [0, 1, 3, 5, 9, 16, 1000, "8"])
def test_a_record_whose_row_group_size_is_not_the_files_reads_the_footer(built, size):
    """Row groups of 8 rows; a record that says another size (or none that is a positive
    integer) must not place rows in the wrong group: the starts come from the footer."""
    import dataclasses

    real = list_shards(built.folder / "shards")
    shards = [dataclasses.replace(s, record={**s.record, "row_group_rows": size}) for s in real]
    rows = ShardRows(shards)
    footer = [np.cumsum([0] + [8] * (s.rows // 8) + ([s.rows % 8] if s.rows % 8 else [])) for s in real]
    assert [a.tolist() for a in rows._group_starts] == [f.tolist() for f in footer]
    assert rows.chunks(built.ids) == {i: expected_chunk(r) for i, r in built.rows.items()}


def test_the_record_size_gives_the_same_starts_as_the_footer(built):
    rows = ShardRows(list_shards(built.folder / "shards"))
    assert [a.tolist() for a in rows._group_starts] == [
        list(range(0, s.rows, 8)) + [s.rows] for s in rows.shards]


def test_ids_given_by_the_caller_are_checked_against_the_row_groups(built):
    """open_index passes the ids of the faiss files: a shard whose ids differ from its
    rows' in the first or the last row group (their min/max statistics) is refused."""
    from embedingest.errors import ConfigError
    from embedingest.index.shards import read_ids

    shards = list_shards(built.folder / "shards")
    ids = [read_ids(s) for s in shards]
    rows = ShardRows(shards, ids=ids)
    assert rows.chunks(built.ids) == {i: expected_chunk(r) for i, r in built.rows.items()}
    assert all(np.array_equal(rows.shard_ids(n), ids[n]) for n in range(len(shards)))
    no = max(range(len(shards)), key=lambda n: shards[n].rows)
    last = (shards[no].rows - 1) // 8 * 8
    for at in (0, last, shards[no].rows - 1):
        bad = [a.copy() for a in ids]
        bad[no][at] -= 1 << 40
        with pytest.raises(ConfigError) as err:
            ShardRows(shards, ids=bad)
        assert str(err.value) == (
            f"the vectors of shard {shards[no].name} are not in the order of its rows in "
            f"{str(shards[no].path('parquet'))!r}: the shard is damaged; delete that shard's files (every file "
            f"named {shards[no].name}.*) and run the same build-index command again: the units it held are redone")
    with pytest.raises(ValueError, match=f"^{len(shards) - 1} id arrays for {len(shards)} shards with rows$"):
        ShardRows(shards, ids=ids[1:])
    short = [a.copy() for a in ids]
    short[no] = short[no][:-1]
    with pytest.raises(ConfigError, match=f"holds {shards[no].rows} rows, but its commit record says "
                                          f"{shards[no].rows}: the shard is damaged"):
        ShardRows(shards, ids=short)


def test_a_shard_whose_rows_are_not_its_records_count_is_named(built):
    import dataclasses

    from embedingest.errors import ConfigError

    shards = list_shards(built.folder / "shards")
    wrong = dataclasses.replace(shards[1], rows=shards[1].rows + 1)
    with pytest.raises(ConfigError) as err:
        ShardRows([shards[0], wrong])
    assert str(err.value) == (
        f"{str(wrong.path('parquet'))!r} holds {shards[1].rows} rows, but its commit record says "
        f"{wrong.rows}: the shard is damaged; delete that shard's files (every file named {wrong.name}.*) and run "
        "the same build-index command again: the units it held are redone")


def test_a_file_that_is_not_parquet_is_named_with_what_to_do(tmp_path):
    from embedingest.errors import ConfigError

    one = build_shards(tmp_path / "ix", n_units=1, chunks=3, workers=1)
    (shard,) = list_shards(one.folder / "shards")
    path = shard.path("parquet")
    path.write_bytes(b"\0" * path.stat().st_size)
    with pytest.raises(ConfigError) as err:
        ShardRows([shard])
    message = str(err.value)
    assert message.startswith(f"cannot read {str(path)!r} (")
    assert message.endswith(f"): the shard is damaged; delete that shard's files (every file named {shard.name}.*) "
                            "and run the same build-index command again: the units it held are redone")


def test_files_read_through_an_opener_are_named_by_where(built):
    """Shards in object storage: files opened by the caller's opener, named in errors by
    ``where``."""
    import dataclasses
    import io

    from embedingest.errors import ConfigError

    shards = list_shards(built.folder / "shards")
    opened = []

    def opener(shard):
        opened.append(shard.name)
        return io.BytesIO(shard.path("parquet").read_bytes())

    rows = ShardRows(shards, opener=opener, where=lambda s: f"s3://bucket/ix/{s.name}.parquet")
    assert opened == [s.name for s in shards]
    assert rows.chunks(built.ids) == {i: expected_chunk(r) for i, r in built.rows.items()}
    wrong = dataclasses.replace(shards[0], rows=shards[0].rows + 1)
    with pytest.raises(ConfigError, match=f"^'s3://bucket/ix/{wrong.name}.parquet' holds {shards[0].rows} rows"):
        ShardRows([wrong], opener=opener, where=lambda s: f"s3://bucket/ix/{s.name}.parquet")


def test_a_closed_reader_opens_its_files_and_threads_again(built):
    rows = ShardRows(list_shards(built.folder / "shards"), threads=2)
    part = built.ids[::7]
    want = {int(i): expected_chunk(built.rows[int(i)]) for i in part}
    assert rows.chunks(part) == want and rows._pool is not None
    rows.close()
    assert rows._pool is None and len(rows._files) == 0
    assert rows.chunks(part) == want
    rows.close()


@pytest.mark.parametrize("groups", [[8, 8, 4, 8], [4, 4, 8, 12]])
def test_irregular_row_groups_as_many_as_the_record_implies_are_read_from_the_footer(tmp_path, groups):
    """A file of 28 rows in 4 groups, as a record of 8-row groups implies, but not of 8
    rows each but the last: the starts must come from the footer."""
    import pyarrow.parquet as pq

    from embedingest.index.shards import CHUNK_SCHEMA

    one = build_shards(tmp_path / "ix", n_units=1, chunks=28, commit_every=100, workers=1, row_group_rows=8)
    (shard,) = list_shards(one.folder / "shards")
    table = pq.read_table(shard.path("parquet"))
    with pq.ParquetWriter(shard.path("parquet"), CHUNK_SCHEMA) as writer:
        start = 0
        for size in groups:
            writer.write_table(table.slice(start, size), row_group_size=size)
            start += size
    rows = ShardRows([shard])
    assert rows._group_starts[0].tolist() == np.cumsum([0] + groups).tolist()
    assert rows.chunks(one.ids) == {i: expected_chunk(r) for i, r in one.rows.items()}


def test_ids_of_the_highest_unit_numbers_map_to_their_own_rows(tmp_path):
    """Unit numbers up to MAX_UNIT_NO make ids near 2**63: neighbouring chunks differ in
    bits a float64 cannot hold, so the ids must stay integers all the way."""
    from shard_fixtures import DIM, batches, meta_of, unit_vectors, write_manifest

    from embedingest.index.store import MAX_UNIT_NO
    from embedingest.sinks.shard_writer import ShardWriterFactory

    folder = tmp_path / "ix"
    write_manifest(folder)
    units = [MAX_UNIT_NO - 1, MAX_UNIT_NO]
    sink = ShardWriterFactory(str(folder), DIM, run_id="big")(0)
    plan = batches(units, 5)
    for b, (part, done) in enumerate(plan):
        ids = np.array([r["id"] for r in part], dtype=np.int64)
        sink(meta_of(b, part, done), {"emb": unit_vectors(len(ids), seed=b), "ids": ids})
    sink.close()
    want = {r["id"]: expected_chunk(r) for part, _ in plan for r in part}
    rows = ShardRows(list_shards(folder / "shards"))
    assert rows.chunks(list(want)) == want
    shard, row = rows.locate(list(want))
    assert shard.tolist() == [0] * 10 and row.tolist() == list(range(10))


class Footer:
    """A Parquet footer of row groups of ``sizes`` rows whose id statistics are ``stats``
    ((min, max) per group, or None for a file written without them); it records which
    groups are asked for."""

    def __init__(self, sizes, stats=None):
        self.sizes, self.stats, self.asked = sizes, stats, []
        self.num_row_groups = len(sizes)

    def row_group(self, g):
        from types import SimpleNamespace

        self.asked.append(g)
        st = None if self.stats is None else SimpleNamespace(has_min_max=True, min=self.stats[g][0],
                                                              max=self.stats[g][1])
        return SimpleNamespace(num_rows=self.sizes[g], column=lambda c: SimpleNamespace(statistics=st))


def shard_of(rows, size):
    from embedingest.index.shards import Shard

    return Shard(None, "shard-f-w0-00000", rows, 0, rows - 1, {}, (), (), {"row_group_rows": size})


@pytest.mark.parametrize("rows, size", [(1000, 32), (1024, 32), (5, 1), (7, 8)])
def test_regular_row_groups_are_placed_from_the_record_asking_the_footer_once(rows, size):
    """A shard has thousands of row groups: when the record's size fits the file's group
    count and last group, only the last group's size is read."""
    sizes = [size] * (rows // size) + ([rows % size] if rows % size else [])
    footer = Footer(sizes)
    starts = lookup._group_starts(footer, shard_of(rows, size))
    assert starts.dtype == np.int64 and starts.tolist() == list(range(0, rows, size)) + [rows]
    assert footer.asked == [len(sizes) - 1]


def test_ids_are_checked_against_sixteen_row_groups_spread_over_the_file():
    sizes = [4] * 100
    ids = np.arange(400, dtype=np.int64)
    starts = np.arange(0, 401, 4)
    footer = Footer(sizes, [(4 * g, 4 * g + 3) for g in range(100)])
    assert lookup._groups_match(footer, starts, ids)
    assert footer.asked == [0, 6, 13, 19, 26, 33, 39, 46, 52, 59, 66, 72, 79, 85, 92, 99]
    assert len(footer.asked) == lookup.CHECKED_GROUPS
    moved = ids.copy()
    moved[6 * 4] = -1  # in a group that is checked
    assert not lookup._groups_match(Footer(sizes, footer.stats), starts, moved)


def test_ids_of_a_file_without_statistics_are_taken_as_given():
    assert lookup._groups_match(Footer([4, 4, 2]), np.array([0, 4, 8, 10]), np.arange(10, dtype=np.int64))


def test_opening_reads_only_the_id_column_of_each_shard(built, monkeypatch):
    reads = parquet_reads(monkeypatch)
    shards = list_shards(built.folder / "shards")
    rows = ShardRows(shards)
    assert reads == [["id"]] * len(shards)
    assert sorted(np.concatenate([rows.shard_ids(n) for n in range(len(shards))]).tolist()) == sorted(
        built.ids.tolist())
    rows.close()


def test_opening_with_the_callers_ids_reads_no_column(built, monkeypatch):
    """open_index hands over the ids of the faiss files it loaded: ShardRows then checks
    them against the row groups' statistics and reads no column of any file."""
    shards = list_shards(built.folder / "shards")
    ids = [pq.read_table(s.path("parquet"), columns=["id"]).column(0).to_numpy() for s in shards]
    reads = parquet_reads(monkeypatch)
    rows = ShardRows(shards, ids=ids)
    assert reads == []
    for n, shard_ids in enumerate(ids):
        assert rows.shard_ids(n).tolist() == shard_ids.tolist()
    rows.close()


def _rewrite_rows(shard, change):
    """Write ``change(table)`` over a shard's rows file and give its record the new size
    and hash: a rows file that passes every check but its columns'."""
    path = shard.path("parquet")
    pq.write_table(change(pq.read_table(path)), path, row_group_size=8)
    recommit_file(shard, "parquet")


@pytest.mark.parametrize("change, problem", [
    (lambda t: t.drop_columns(["text"]), "it lacks the column text"),
    (lambda t: t.drop_columns(["source"]), "it lacks the column source"),
    (lambda t: t.set_column(6, "text", pa.array(range(len(t)))),
     "its column text is of type int64, not string"),
    (lambda t: t.append_column("extra", pa.array(range(len(t)))),
     "it has columns a shard has not (extra)"),
])
def test_a_rows_file_of_other_columns_is_named_never_a_traceback_or_a_number_as_text(tmp_path, change, problem):
    """Before: a missing column was a KeyError traceback at the first hit ('Field "text"
    does not exist in schema'), a text column of numbers gave hits whose text was an int
    (search's output then failed with AttributeError)."""
    from embedingest.errors import ConfigError

    one = build_shards(tmp_path / "ix", n_units=2, chunks=5, workers=1)
    (shard,) = list_shards(one.folder / "shards")
    _rewrite_rows(shard, change)
    (shard,) = list_shards(one.folder / "shards")
    with pytest.raises(ConfigError) as err:
        ShardRows([shard])
    assert str(err.value) == (f"{str(shard.path('parquet'))!r} is not a shard's rows file ({problem}): the shard "
                              f"is damaged; delete that shard's files (every file named {shard.name}.*) and run the "
                              "same build-index command again: the units it held are redone")


def test_rows_out_of_their_vectors_order_are_damage_not_a_change_to_search_again(tmp_path):
    """Two rows of a row group swapped (the group's smallest and largest ids kept, so the
    check at open passes) and the record made to match. Before: 'holds other rows than when
    the index was opened: a build rewrote it; search again', for ever (serve: 503 'the
    index is being updated'), though nothing was rebuilding it."""
    from embedingest.index.shards import read_ids

    one = build_shards(tmp_path / "ix", n_units=2, chunks=5, workers=1)
    (shard,) = list_shards(one.folder / "shards")
    ids = read_ids(shard)
    _rewrite_rows(shard, lambda t: t.take(pa.array([1, 0, *range(2, len(t))])))
    (shard,) = list_shards(one.folder / "shards")
    rows = ShardRows([shard], ids=[ids])  # the ids as open_index has them: from the vectors file
    assert rows.chunks([int(ids[3])])[int(ids[3])].chunk_no == 3  # rows in their place are read
    with pytest.raises(ConfigError) as err:
        rows.chunks([int(ids[0])])
    assert not isinstance(err.value, lookup.IndexChanged)
    assert str(err.value) == (f"the rows of shard {shard.name} in {str(shard.path('parquet'))!r} are not in the "
                              f"order of its vectors (the row of id {ids[0]} holds id {ids[1]}): the shard is "
                              f"damaged; delete that shard's files (every file named {shard.name}.*) and run the "
                              "same build-index command again: the units it held are redone")

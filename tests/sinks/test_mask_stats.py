"""The per-image statistics' Parquet parts, beyond ``test_masks.py``'s round trip: the
folder's other files, the part names, the column types, the rows kept by a drop. What
mutation testing found missing (docs/TESTING.md, "masks.py and mask_stats.py with mutmut")."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from embedingest.errors import ConfigError
from embedingest.sinks import mask_stats
from embedingest.sinks.mask_stats import StatsWriter, drop_stats_rows, part_files, row_counts


def rows(out) -> dict[str, dict]:
    return {r["source"]: r for r in ds.dataset(out / "stats").to_table().to_pylist()}


def test_only_visible_parquet_files_are_parts(tmp_path):
    writer = StatsWriter(str(tmp_path), ["bg"])
    writer.add("a.png", np.zeros((1, 2), np.uint8))
    writer.close()
    [part] = part_files(tmp_path)
    (tmp_path / "stats" / "notes.txt").write_text("not a part")
    (tmp_path / "stats" / ".old.parquet").write_bytes(b"hidden, not a part")
    (tmp_path / "stats" / f".{part.name}.tmp-1").write_bytes(b"a commit killed halfway")
    assert part_files(tmp_path) == [part] and set(row_counts(tmp_path)) == {"a.png"}


def test_parts_are_numbered_per_process_so_one_clock_tick_never_overwrites_a_part(tmp_path, monkeypatch):
    monkeypatch.setattr(mask_stats.time, "time_ns", lambda: 5)  # a coarse clock: every commit at once
    writer = StatsWriter(str(tmp_path), ["bg"], rows_per_part=1)
    for name in ("a", "b", "c"):
        writer.add(name, np.zeros((1, 1), np.uint8))
    assert [p.name for p in part_files(tmp_path)] == [f"part-5-{os.getpid()}-{n}.parquet" for n in range(3)]
    assert set(row_counts(tmp_path)) == {"a", "b", "c"} and writer.committed == 3


def test_the_columns_are_int32_sizes_and_float32_shares_and_a_pixel_counts_whole(tmp_path):
    writer = StatsWriter(str(tmp_path), ["bg", "x"])
    writer.add("one.png", np.ones((1, 1), np.uint8))
    writer.close()
    [part] = part_files(tmp_path)
    schema = pq.read_schema(part)
    assert [(f.name, f.type) for f in schema] == [("source", pa.string()), ("width", pa.int32()),
                                                  ("height", pa.int32()), ("bg", pa.float32()),
                                                  ("x", pa.float32())]
    assert rows(tmp_path)["one.png"] == {"source": "one.png", "width": 1, "height": 1, "bg": 0.0, "x": 1.0}


def test_a_drop_goes_through_every_part_and_of_nothing_drops_nothing(tmp_path):
    writer = StatsWriter(str(tmp_path), ["bg"], rows_per_part=2)
    for name in ("a", "b", "c", "d"):
        writer.add(name, np.zeros((1, 1), np.uint8))
    first, second = part_files(tmp_path)  # a, b; then c, d
    drop_stats_rows(tmp_path, set())
    assert part_files(tmp_path) == [first, second]
    drop_stats_rows(tmp_path, {"c"})  # the first part has none of them: the second is still read
    assert set(row_counts(tmp_path)) == {"a", "b", "d"} and first in part_files(tmp_path)


def test_a_part_that_does_not_read_back_whole_is_not_written(tmp_path, monkeypatch):
    writer = StatsWriter(str(tmp_path), ["bg"])
    writer.add("a", np.zeros((1, 1), np.uint8))

    class Short:
        num_rows = 0

    monkeypatch.setattr(pq, "read_metadata", lambda source: Short())
    with pytest.raises(OSError, match=r"^stats part .*/stats/part-\d+-\d+-0\.parquet did not read back "
                                      r"with its 1 rows$"):
        writer.close()
    assert part_files(tmp_path) == [] and writer.committed == 0


def _victim_folder(tmp_path):
    """A folder outside the output with a part of another table and a temporary-looking
    file: neither may be read, written or deleted by the stats of ``tmp_path/out``."""
    victim = tmp_path / "victim"
    writer = StatsWriter(str(tmp_path / "elsewhere"), ["bg"])
    writer.add("theirs.png", np.zeros((1, 1), np.uint8))
    writer.close()
    victim.mkdir()
    [theirs] = part_files(tmp_path / "elsewhere")
    (victim / theirs.name).write_bytes(theirs.read_bytes())
    (victim / ".x.parquet.tmp-1").write_bytes(b"someone's")
    return victim, {p.name: p.read_bytes() for p in victim.iterdir()}


def test_a_stats_folder_that_is_a_link_is_refused_never_read_written_or_deleted_through(tmp_path):
    victim, before = _victim_folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stats").symlink_to(victim)
    message = rf"^'{out}/stats' \(the --stats folder\) is a symbolic link; .*: remove the link"
    writer = StatsWriter(str(out), ["bg"])
    writer.add("a.png", np.zeros((1, 1), np.uint8))
    with pytest.raises(ConfigError, match=message):
        writer.close()
    for call in (part_files, row_counts, lambda o: drop_stats_rows(o, {"theirs.png"})):
        with pytest.raises(ConfigError, match=message):
            call(out)
    assert {p.name: p.read_bytes() for p in victim.iterdir()} == before


def test_a_part_that_is_a_link_is_no_part_and_its_target_is_not_read(tmp_path):
    victim, before = _victim_folder(tmp_path)
    out = tmp_path / "out"
    writer = StatsWriter(str(out), ["bg"])
    writer.add("a.png", np.zeros((1, 1), np.uint8))
    writer.close()
    [own] = part_files(out)
    [theirs] = [p for p in victim.iterdir() if p.suffix == ".parquet"]
    (out / "stats" / "part-1-1-0.parquet").symlink_to(theirs)
    assert part_files(out) == [own] and set(row_counts(out)) == {"a.png"}
    drop_stats_rows(out, {"theirs.png"})
    assert {p.name: p.read_bytes() for p in victim.iterdir()} == before
    assert sorted(p.name for p in (out / "stats").iterdir()) == [own.name], "the link deleted, not its target"


@pytest.mark.parametrize("damage", ["cut", "empty", "garbage", "no source"])
def test_a_damaged_part_is_lost_rows_never_a_crash_and_a_drop_deletes_it(tmp_path, damage, caplog):
    """A part cut short (or empty, garbage, a Parquet file without ``source``) stopped every
    run with Arrow's traceback, --overwrite included: now its rows count as lost (its
    images have no row, so resume redoes them) with a warning naming it, and the drop
    before they are redone deletes it; the other parts are kept whole."""
    writer = StatsWriter(str(tmp_path), ["bg"], rows_per_part=2)
    for name in ("a", "b", "c", "d"):
        writer.add(name, np.zeros((1, 1), np.uint8))
    first, second = part_files(tmp_path)
    data = {"cut": first.read_bytes()[:-30], "empty": b"", "garbage": os.urandom(300)}.get(damage)
    if data is None:
        pq.write_table(pa.table({"x": [1]}), first)
    else:
        first.write_bytes(data)
    with caplog.at_level("WARNING", "embedingest"):
        assert row_counts(tmp_path) == {"c": 1, "d": 1}
    assert f"stats part {first} is damaged (" in caplog.text
    drop_stats_rows(tmp_path, {"a", "b"})
    assert part_files(tmp_path) == [second] and set(row_counts(tmp_path)) == {"c", "d"}
    assert f"deleting the damaged stats part {first}" in caplog.text


def test_the_user_s_own_files_in_the_stats_folder_are_never_read_rewritten_or_deleted(tmp_path):
    """An --out whose ``stats/`` folder held the user's own Parquet files: before, they
    counted as parts, so a resume deleted one without a ``source`` column as damaged and
    rewrote one with it, and --overwrite (with --stats or without) deleted both."""
    folder = tmp_path / "stats"
    folder.mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), folder / "sales.parquet")
    pq.write_table(pa.table({"source": ["a"], "v": [1]}), folder / "mine.parquet")
    pq.write_table(pa.table({"source": ["a"]}), folder / "part-00000-1b2c-c000.snappy.parquet")  # Spark's
    theirs = {p.name: p.read_bytes() for p in folder.iterdir()}
    writer = StatsWriter(str(tmp_path), ["bg"])
    writer.add("a", np.zeros((1, 1), np.uint8))
    writer.close()
    [own] = part_files(tmp_path)
    assert own.name not in theirs and row_counts(tmp_path) == {"a": 1}
    drop_stats_rows(tmp_path, {"a"})
    assert part_files(tmp_path) == [] and row_counts(tmp_path) == {}
    mask_stats.remove_parts(tmp_path)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == theirs

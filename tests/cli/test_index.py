"""``embedingest export``: a shard copied in from another index is refused by name before
any file is written (before: its rows exported, ids twice)."""

from __future__ import annotations

from click.testing import CliRunner
from corpus_fixtures import TOPICS
from index_pair_fixtures import copy_shard, drop_shard, shard_names

from embedingest.cli import main



def export(index, to):
    return CliRunner().invoke(main, ["export", str(index), "--to", str(to)])


def test_export_refuses_a_shard_of_another_index_and_writes_nothing(indexes):
    a, b = indexes / "a", indexes / "b"
    first, second = shard_names(a)
    drop_shard(a, first)
    copy_shard(b, shard_names(b)[1], a)  # units 4..6: ids a's second shard holds
    r = export(a, indexes / "out")
    assert r.exit_code == 1
    assert f"which the manifest does not list, holds ids that shard {second} holds too" in r.output
    assert not (indexes / "out").exists()
    (indexes / "out").mkdir()
    drop_shard(a, shard_names(b)[1])
    copy_shard(b, shard_names(b)[0], a)  # units 1..3: no id twice, but b's files
    r = export(a, indexes / "out")
    assert r.exit_code == 1 and f"shard {shard_names(b)[0]} (" in r.output and "is not this index's" in r.output
    assert not list((indexes / "out").iterdir())


def test_export_of_an_index_whole_writes_each_id_once(indexes):
    import pyarrow.parquet as pq

    r = export(indexes / "a", indexes / "out")
    assert r.exit_code == 0, r.output
    table = pq.read_table(indexes / "out")
    assert sorted(table.column("id").to_pylist()) == [u << 32 for u in range(1, 7)]
    assert sorted(table.column("text").to_pylist()) == sorted(TOPICS[:6])

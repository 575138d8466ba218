"""build-index repairs an index holding a shard copied in from another index (in place of
one of its shards, or beside them): the build names the copy, deletes it, redoes the units
it held, and the index is then the one a clean build of the corpus makes, which search and
export read. Before, a build of the unchanged corpus kept such a copy (its unit numbers
were the index's and looked whole) and listed it, and search and export refused the index
until the copy was moved out by hand."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from corpus_fixtures import TOPICS
from index_pair_fixtures import FAST, build_two_indexes, copy_shard, drop_shard, shard_names

from embedingest import build_index, open_index
from embedingest.errors import ConfigError
from embedingest.index.export import export_index


@pytest.fixture(scope="module")
def two_indexes(tmp_path_factory) -> Path:
    """:mod:`index_pair_fixtures`' ``a`` and ``b``, and ``clean``, a's corpus built in one run."""
    root = build_two_indexes(tmp_path_factory.mktemp("foreign"))
    build_index(root / "corpus_a", out=str(root / "clean"), **FAST)
    return root


@pytest.fixture
def indexes(two_indexes, tmp_path) -> Path:
    """A copy of the indexes for one test to change. The corpora are not copied: a copy
    would move their files' ctimes, and a unit whose hash only the deleted shard held is
    then given a fresh number (as any whose stamp moved), unlike in a clean build."""
    for name in ("a", "b", "clean"):
        shutil.copytree(two_indexes / name, tmp_path / name, symlinks=True)
    return tmp_path


def exported_rows(index: Path, to: Path) -> list[tuple]:
    export_index(index, to)
    table = pq.read_table(to, columns=["id", "source", "chunk_no", "text"])
    return sorted(zip(*(table.column(c).to_pylist() for c in table.column_names)))


@pytest.mark.parametrize("case", ["in place", "in place, holding ids of another shard", "beside"])
def test_a_build_deletes_a_shard_of_another_index_and_redoes_its_units(two_indexes, indexes, caplog, case):
    """``in place``: b's first shard (units 1..3, b's files) for a's first: no id twice,
    told by its rows' sources against units.sqlite; a's units 1..3 are redone.
    ``in place, holding ids of another shard``: b's second shard (units 4..6) for a's
    first: a's second shard holds its ids; a's units 1..3 are redone, 4..6 kept.
    ``beside``: b's first shard added beside a's two: a's first holds its ids; nothing of
    a is redone."""
    a, b = indexes / "a", indexes / "b"
    mine, theirs = shard_names(a)[0], shard_names(b)[1 if "holding" in case else 0]
    if case != "beside":
        drop_shard(a, mine)
    kept = shard_names(a)
    copy_shard(b, theirs, a)
    with pytest.raises(ConfigError, match=f"shard {theirs} "):
        open_index(a)
    b_files = sorted((p.name, p.read_bytes()) for p in (b / "shards").iterdir())
    with caplog.at_level(logging.WARNING, logger="embedingest"):
        s = build_index(two_indexes / "corpus_a", out=str(a), **FAST)
    told = [r.getMessage() for r in caplog.records if theirs in r.getMessage()]
    assert len(told) == 1 and told[0].startswith(f"shard {theirs} ("), told
    assert told[0].endswith("it is deleted, and the units it held are redone")
    if case == "in place":
        found = re.search(r"is not this index's: its row of id (\d+) is of 'b(\d)\.txt', but unit (\d) of "
                          r"this index is 'a(\d)\.txt' \(in (.*)\); it was copied in from another index: it "
                          "is deleted", told[0])
        assert found and found[2] == found[4] and int(found[1]) >> 32 == int(found[3]) == int(found[2]) + 1
        assert found[5] == repr(str(a / "units.sqlite"))
    else:
        assert "which the manifest does not list, holds ids that shard " in told[0]
    assert not list((a / "shards").glob(f"{theirs}.*"))
    assert set(kept) <= set(shard_names(a))  # this index's own shards stay as they were
    assert sorted((p.name, p.read_bytes()) for p in (b / "shards").iterdir()) == b_files
    assert (s["exit_code"], s["units_indexed"], s["vectors_total"]) == (0, 0 if case == "beside" else 3, 6)
    assert theirs not in {seg["name"] for seg in json.loads((a / "manifest.json").read_text())["segments"]}
    assert exported_rows(a, indexes / "out") == exported_rows(indexes / "clean", indexes / "out_clean")
    with open_index(a) as index:
        hits = [h[0] for h in index.search(TOPICS[:6], k=1)]
    assert [(h.source, h.text) for h in hits] == [(f"a{i}.txt", TOPICS[i]) for i in range(6)]
    again = build_index(two_indexes / "corpus_a", out=str(a), **FAST)
    assert (again["units_unchanged"], again["units_indexed"], again["vectors_removed"]) == (6, 0, 0)

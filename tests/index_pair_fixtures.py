"""Two real indexes of a few text files each, built with the bundled model, for the tests
of shards copied from one index into another (tests/cli, tests/jobs/test_build_index_foreign.py):
``a`` of the files a0..a5, ``b`` of b0..b5, each by two runs (three files, then three
more), so each holds two shards and both number their units 1..6."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from corpus_fixtures import TOPICS

FAST = dict(num_workers=0, num_consumers=1, batch_size=8)


def build_two_indexes(root: Path) -> Path:
    """``root/a`` and ``root/b``, with their corpora ``root/corpus_a`` and ``root/corpus_b``."""
    from embedingest import build_index

    for name, texts in (("a", TOPICS[:6]), ("b", TOPICS[6:12])):
        corpus = root / f"corpus_{name}"
        corpus.mkdir()
        for part in (range(3), range(3, 6)):
            for i in part:
                (corpus / f"{name}{i}.txt").write_text(texts[i])
            build_index(corpus, out=str(root / name), **FAST)
    return root


def shard_names(index: Path) -> list[str]:
    """The index's shards with rows, by the ids they hold: the first run's (units 1..3)
    first. (Their names hold the run's time to the second, then a random part: two runs in
    one second sort either way.)"""
    records = [json.loads(p.read_text()) for p in (index / "shards").glob("*.commit.json")]
    return [r["name"] for r in sorted(records, key=lambda r: r["id_min"]) if r["rows"]]


def copy_shard(src: Path, name: str, dest: Path) -> None:
    """Every file of shard ``name`` of the index ``src`` into the index ``dest`` (a copy:
    what a user does who takes a shard from one index to another)."""
    for path in (src / "shards").glob(f"{name}.*"):
        shutil.copyfile(path, dest / "shards" / path.name)


def drop_shard(index: Path, name: str) -> None:
    for path in (index / "shards").glob(f"{name}.*"):
        path.unlink()

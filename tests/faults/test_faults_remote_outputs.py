"""A build into object storage (moto's S3 server on 127.0.0.1) whose shard writer is
killed mid-run, in real processes (the CLI and its spawned consumers): readers see only
whole shards, and the same command run again ends with the index a local build makes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fault_helpers import build_args, check_exactly_once, expected_chunks, make_corpus
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)

from embedingest import open_index


def contents(index_path, cache) -> tuple:
    """Every vector's id and score for a few fixed queries, and every row: the whole index."""
    kw = {"cache_dir": cache} if str(index_path).startswith("s3://") else {}
    with open_index(index_path, **kw) as index:
        q = np.random.default_rng(0).standard_normal((3, index.manifest.dim)).astype(np.float32)
        scores, ids = index.search_raw(q, k=index.ntotal)
        rows = index.chunks(ids[0].tolist())
        return (sorted(zip(ids[0].tolist(), np.round(scores[0], 5).tolist())),
                sorted(ids[1].tolist()), sorted((i, r.source, r.chunk_no, r.text) for i, r in rows.items()))


@pytest.mark.slow
def test_a_writer_killed_mid_build_shows_only_whole_shards_and_the_rerun_completes(cli, s3, tmp_path):
    corpus = make_corpus(tmp_path / "corpus", 10, seed=3)
    url = s3.url("ix")
    # the consumer dies just after its 3rd commit record is renamed on disk, before its upload
    run = cli("build-index", corpus, "--out", url, *build_args(),
              env={"EMBEDINGEST_FI_KILL": "consumer:*.commit.json:3:after"})
    assert run.wait() == 1, run.describe()
    run.assert_no_leftovers()
    s3.fs.invalidate_cache()
    names = [p.rsplit("/", 1)[1] for p in s3.fs.find(f"{s3.name}/ix/shards")]
    manifest = json.loads(s3.fs.cat_file(f"{s3.name}/ix/manifest.json"))
    listed = {s["name"] for s in manifest["segments"]}
    assert listed and all(f"{n}.commit.json" in names for n in listed)
    with open_index(url, cache_dir=tmp_path / "cache") as index:  # whole shards only: it opens
        assert index.ntotal == sum(s["count"] for s in manifest["segments"])
    assert ".run.lock" not in [p.rsplit("/", 1)[1] for p in s3.fs.find(f"{s3.name}/ix")]

    again = cli("build-index", corpus, "--out", url, *build_args(), "--json")
    assert again.wait() == 0, again.describe()
    assert json.loads(again.stdout)["units_unchanged"] >= 1  # the whole shards were kept
    # the bucket's index, copied whole to disk: every chunk once, every shard whole and listed
    s3.fs.invalidate_cache()
    s3.fs.get(f"{s3.name}/ix/", str(tmp_path / "copy"), recursive=True)
    check_exactly_once(tmp_path / "copy", expected_chunks(corpus))
    assert contents(url, tmp_path / "cache") == contents(tmp_path / "copy", None)

"""build-index into object storage (moto's S3 server on 127.0.0.1): the same index as the
same build on disk, resumed by re-running, a failed build leaving no visible half shard,
and one build at a time (the lease object; the manifest's conditional write)."""

from __future__ import annotations

import json
import time

import pytest
from corpus_fixtures import TOPICS as ALL_TOPICS
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)

from embedingest import build_index, open_index
from embedingest.errors import ConfigError
from embedingest.index.lock import IndexBusy
from embedingest.index.remote_store import LEASE_NAME, Lease, Remote, RemoteBuild

FAST = {"num_workers": 0, "num_consumers": 2, "batch_size": 8, "chunk_tokens": 32, "overlap": 8,
        "commit_every": 16}
TOPICS = ALL_TOPICS[:6]


def corpus(root, names=range(6)):
    root.mkdir(parents=True, exist_ok=True)
    for i in names:
        (root / f"doc{i}.txt").write_text(" ".join(TOPICS[i:] + TOPICS[:i]) * 2)
    return root


def everything(index_path, cache) -> list:
    """Every hit of every topic, by id: scores (so the vectors) and each chunk's row."""
    kw = {"cache_dir": cache} if str(index_path).startswith("s3://") else {}
    with open_index(index_path, **kw) as index:
        return [sorted((h.id, round(h.score, 5), h.source, h.record_id, h.chunk_no, h.char_start,
                        h.char_end, h.text) for h in hits)
                for hits in index.search(TOPICS, k=len(index))]


def objects(s3, prefix) -> list[str]:
    s3.fs.invalidate_cache()
    return sorted(p.split(f"{prefix}/", 1)[1] for p in s3.fs.find(f"{s3.name}/{prefix}"))


# (how many shards a build writes depends on which writer gets which batch: not compared)
SUMMARY_KEYS = ("units_seen", "units_indexed", "units_unchanged", "units_removed", "docs", "chunks",
                "vectors_total", "skipped", "exit_code")


@pytest.mark.slow
def test_build_to_s3_equals_the_local_build_and_resumes(s3, tmp_path):
    docs = corpus(tmp_path / "corpus")
    url = s3.url("indexes/docs")
    local = build_index(str(docs), out=str(tmp_path / "local"), **FAST)
    remote = build_index(str(docs), out=url, **FAST)
    assert {k: remote[k] for k in SUMMARY_KEYS} == {k: local[k] for k in SUMMARY_KEYS}
    assert remote["index"] == url and remote["report"] == f"{url}/skipped.jsonl"
    assert local["segments"] > 1  # several shards, of two writers
    assert everything(url, tmp_path / "cache") == everything(tmp_path / "local", None)
    names = objects(s3, "indexes/docs")
    assert {"manifest.json", "units.sqlite", "skipped.jsonl"} <= set(names)
    assert LEASE_NAME not in names  # released
    assert all(n.startswith("shards/shard-") for n in names if "/" in n)
    manifest = json.loads(s3.fs.cat(f"{s3.name}/indexes/docs/manifest.json"))
    assert sum(s["count"] for s in manifest["segments"]) == local["vectors_total"]

    again = build_index(str(docs), out=url, **FAST)
    assert (again["units_unchanged"], again["units_indexed"], again["vectors_total"]) == (6, 0, local["vectors_total"])
    assert objects(s3, "indexes/docs") == names

    (docs / "doc2.txt").write_text("A changed file about lighthouses and the sea. " * 6)
    (docs / "doc5.txt").unlink()
    local2 = build_index(str(docs), out=str(tmp_path / "local"), **FAST)
    remote2 = build_index(str(docs), out=url, **FAST)
    assert {k: remote2[k] for k in SUMMARY_KEYS} == {k: local2[k] for k in SUMMARY_KEYS}
    assert (remote2["units_indexed"], remote2["units_removed"]) == (1, 1)
    assert everything(url, tmp_path / "cache") == everything(tmp_path / "local", None)
    left = objects(s3, "indexes/docs")
    committed = {n.removeprefix("shards/").removesuffix(".commit.json") for n in left
                 if n.endswith(".commit.json")}
    manifest = json.loads(s3.fs.cat(f"{s3.name}/indexes/docs/manifest.json"))
    # replaced shards are gone; every shard left is named by the manifest (or holds only marks)
    assert {s["name"] for s in manifest["segments"]} <= committed
    assert all(n.split(".")[0].removeprefix("shards/") in committed for n in left if n.startswith("shards/"))


@pytest.mark.slow
def test_a_build_stopped_before_its_commit_shows_nothing_new_and_the_rerun_keeps_its_work(
        s3, tmp_path, monkeypatch):
    docs = corpus(tmp_path / "corpus", names=range(3))
    url = s3.url("ix")
    build_index(str(docs), out=url, **FAST)
    first = everything(url, tmp_path / "cache")
    names = objects(s3, "ix")
    corpus(tmp_path / "corpus", names=range(3, 6))

    def stopped(self):
        raise KeyboardInterrupt  # the build's process stopped after its writers, before its commit

    monkeypatch.setattr(RemoteBuild, "commit", stopped)
    with pytest.raises(KeyboardInterrupt):
        build_index(str(docs), out=url, **FAST)
    monkeypatch.undo()
    uploaded = [n for n in objects(s3, "ix") if n not in names]
    assert any(n.endswith(".commit.json") for n in uploaded)  # the writers' shards are in the bucket
    assert LEASE_NAME not in objects(s3, "ix")
    # a writer killed between its files and its commit record leaves these
    for n in uploaded:
        if n.endswith((".parquet", ".faiss")):
            s3.put(f"ix/shards/shard-dead_1-w0-00000.{n.rsplit('.', 1)[1]}", b"half")
    # readers see the manifest's shards only: the first build, whole
    assert everything(url, tmp_path / "cache") == first

    done = build_index(str(docs), out=url, **FAST)
    assert (done["units_unchanged"], done["units_indexed"]) == (6, 0)  # the stopped run's work is kept
    build_index(str(docs.parent / "corpus"), out=str(tmp_path / "local"), **FAST)
    assert everything(url, tmp_path / "cache") == everything(tmp_path / "local", None)
    assert not any("dead_1" in n for n in objects(s3, "ix"))  # garbage deleted


@pytest.mark.slow
def test_overwrite_replaces_every_shard_of_the_bucket(s3, tmp_path):
    url = s3.url("ix")
    build_index(str(corpus(tmp_path / "a", names=range(4))), out=url, **FAST)
    before = [n for n in objects(s3, "ix") if n.startswith("shards/")]
    docs = corpus(tmp_path / "b", names=[4, 5])
    summary = build_index(str(docs), out=url, overwrite=True, **FAST)
    hits = everything(url, tmp_path / "cache")[0]
    assert len(hits) == summary["vectors_total"] == summary["chunks"]
    assert {h[2] for h in hits} == {"doc4.txt", "doc5.txt"}
    assert not set(before) & set(objects(s3, "ix"))


def test_a_second_build_is_refused_while_the_lease_is_held_and_takes_an_expired_one(s3, tmp_path):
    url = s3.url("ix")
    with Lease(Remote(url), run="other"):
        with pytest.raises(IndexBusy, match=rf"another build \(run 'other', pid \d+ on host .*\) holds "
                                            rf"{url}/\.run\.lock until"):
            with RemoteBuild(url):
                pass
    assert LEASE_NAME not in objects(s3, "ix")
    # a build killed without releasing its lease: taken over once expired
    s3.put(f"ix/{LEASE_NAME}", json.dumps({"run": "dead", "host": "h", "pid": 1,
                                          "expires": time.time() - 1}).encode())
    with RemoteBuild(url) as build:
        assert json.loads(s3.fs.cat(f"{s3.name}/ix/{LEASE_NAME}"))["pid"] != 1
        assert build.folder.is_dir()
    assert LEASE_NAME not in objects(s3, "ix") and not build.folder.exists()


def test_a_lost_lease_or_a_manifest_changed_meanwhile_is_never_overwritten(s3, tmp_path):
    url = s3.url("ix")
    manifest = {"format": 2, "model": {"name": "m"}, "dim": 4, "segments": []}
    s3.put("ix/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(IndexBusy, match=r"another build changed s3://.*/ix/manifest\.json while this "
                                        r"one ran, so it was not overwritten"):
        with RemoteBuild(url) as build:
            assert json.loads((build.folder / "manifest.json").read_text()) == manifest
            s3.put("ix/manifest.json", json.dumps({**manifest, "dim": 8}).encode())  # another writer
    assert json.loads(s3.fs.cat(f"{s3.name}/ix/manifest.json"))["dim"] == 8

    lease = Lease(Remote(url), seconds=0.4)
    with pytest.raises(IndexBusy, match="this build lost its lease"):
        with lease:
            s3.put(f"ix/{LEASE_NAME}", b"{}")  # taken by another build: the renewal fails
            time.sleep(0.6)
            lease.check()
    assert lease.lost is not None


def test_urls_that_cannot_hold_an_index_are_refused_before_anything_runs(s3, tmp_path):
    docs = corpus(tmp_path / "corpus", names=[0])
    with pytest.raises(ConfigError, match="cannot list 's3://no-such-bucket-here/ix'.*no such bucket"):
        build_index(str(docs), out="s3://no-such-bucket-here/ix", **FAST)
    with pytest.raises(ConfigError, match="is a whole bucket: give the index a prefix"):
        build_index(str(docs), out=s3.url(), **FAST)
    with pytest.raises(ConfigError, match="an index in object storage lives at an s3:// URL"):
        build_index(str(docs), out="memory://somewhere/ix", **FAST)
    from click.testing import CliRunner

    from embedingest.cli import main

    result = CliRunner().invoke(main, ["build-index", str(docs), "--out", "s3://no-such-bucket-here/ix"])
    assert result.exit_code == 1 and "cannot list 's3://no-such-bucket-here/ix'" in result.output
    assert not (tmp_path / "indexes").exists()


def test_missing_credentials_name_the_url_and_the_variables(s3, tmp_path, monkeypatch):
    import s3fs

    from embedingest.index.search import open_index as open_any

    docs = corpus(tmp_path / "corpus", names=[0])
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    s3fs.S3FileSystem.clear_instance_cache()
    for call in (lambda: build_index(str(docs), out=s3.url("ix"), **FAST),
                 lambda: open_any(s3.url("ix"), cache_dir=tmp_path / "c")):
        with pytest.raises(ConfigError) as info:
            call()
        message = str(info.value)
        assert message.startswith(f"cannot list '{s3.url('ix')}': no credentials found"), message
        assert "AWS_ACCESS_KEY_ID" in message and "AWS_PROFILE" in message


def test_chunks_with_no_room_for_text_are_refused_before_the_bucket_gets_an_index(s3, tmp_path):
    """Checked under the index's lease before the manifest is made: the working folder's
    manifest would be committed to the bucket as the build ends, error or not."""
    docs = corpus(tmp_path / "corpus", names=[0])
    url = s3.url("indexes/tiny")
    with pytest.raises(ConfigError, match="^--chunk-tokens 2 leaves no token of a chunk for text: each chunk holds "
                                          "the 2 special tokens the model adds; give --chunk-tokens 3 or more$"):
        build_index(str(docs), out=url, **{**FAST, "chunk_tokens": 2, "overlap": 0})
    assert "manifest.json" not in objects(s3, "indexes/tiny")

"""The pieces of an index in object storage (``embedingest.index.remote_store``), each on
its own against moto's S3 server on 127.0.0.1: the prefix's calls, the lease, and a
build's mirror, pull and commit of shards written by ``tests/shard_fixtures.py``."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sqlite3
import time

import pytest
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)
from shard_fixtures import build_shards

from embedingest.errors import ConfigError
from embedingest.index import remote_store
from embedingest.index.lock import IndexBusy
from embedingest.index.remote_store import LEASE_NAME, Lease, Remote, RemoteBuild, precondition_failed


def objects(s3, prefix) -> dict[str, bytes]:
    """{key below ``prefix``: its bytes}, read afresh."""
    s3.fs.invalidate_cache()
    return {p.split(f"{prefix}/", 1)[1]: s3.fs.cat_file(p) for p in s3.fs.find(f"{s3.name}/{prefix}")}


def files(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_pull_brings_the_whole_shards_committed_since_the_mirror_and_names_those_it_leaves_out(
        s3, tmp_path, caplog, monkeypatch):
    first = build_shards(tmp_path / "first", n_units=2, chunks=5, workers=1, run_id="one")
    url = s3.upload(tmp_path / "first", "ix")
    with RemoteBuild(url) as build:
        assert files(build.folder / "shards") == files(tmp_path / "first" / "shards")
        later = build_shards(tmp_path / "later", n_units=2, chunks=20, workers=2, run_id="two")
        assert [w["name"] for w in first.written + later.written] == [
            "shard-one-w0-00000", "shard-two-w0-00000", "shard-two-w1-00000"]
        pulled = {n: b for n, b in files(tmp_path / "later" / "shards").items() if "-w1-" in n}
        for name, body in pulled.items():
            s3.put(f"ix/shards/{name}", body)
        record = (tmp_path / "later" / "shards" / "shard-two-w0-00000.commit.json").read_bytes()
        s3.put("ix/shards/shard-two-w0-00000.commit.json", record)  # its files not uploaded
        s3.put("ix/shards/shard-bad-w0-00000.commit.json", b'{"format": 2, "na')
        s3.put("ix/shards/shard-bad-w0-00001.commit.json", json.dumps([1, 2]).encode())
        s3.put("ix/shards/notes.commit.json", b"not a shard's")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="embedingest"):
            build.pull_shards()
        assert files(build.folder / "shards") == {**files(tmp_path / "first" / "shards"), **pulled}
        assert [r.getMessage() for r in caplog.records] == [
            f"cannot read the commit record {url}/shards/shard-bad-w0-00000.commit.json (JSONDecodeError: "
            "Unterminated string starting at: line 1 column 15 (char 14)): that shard is left out and "
            "its units are redone",
            f"cannot read the commit record {url}/shards/shard-bad-w0-00001.commit.json (TypeError: "
            "list indices must be integers or slices, not str): that shard is left out and its units "
            "are redone",
            f"shard shard-two-w0-00000.commit.json in {url} lacks whole objects: its units are redone"]
        downloads = []
        monkeypatch.setattr(build.remote, "download", lambda rel, local: downloads.append(rel))
        build.pull_shards()  # what it pulled is not downloaded again
        assert downloads == []
    with RemoteBuild(url, overwrite=True) as build:  # the shards it found are gone, never pulled
        build.pull_shards()
        assert files(build.folder / "shards") == {}


def _s3_error(code: str) -> OSError:
    exc = OSError(code)
    exc.response = {"Error": {"Code": code}}
    return exc


def test_only_a_failed_condition_is_a_precondition_failure_on_the_error_or_its_cause():
    assert precondition_failed(_s3_error("PreconditionFailed"))
    assert precondition_failed(_s3_error("ConditionalRequestConflict"))
    assert not precondition_failed(_s3_error("NoSuchKey"))
    assert not precondition_failed(OSError("no response"))
    wrapped = OSError("wrapped")
    wrapped.__cause__ = _s3_error("PreconditionFailed")
    assert precondition_failed(wrapped)
    wrapped.__cause__ = _s3_error("AccessDenied")
    assert not precondition_failed(wrapped)
    other = OSError("no error code")
    other.response = {"ResponseMetadata": {"HTTPStatusCode": 500}}
    assert not precondition_failed(other)
    odd = OSError("odd")
    odd.response = "PreconditionFailed"  # not a mapping: not boto's response
    assert not precondition_failed(odd)


def test_a_remote_is_the_url_s_bucket_and_prefix_and_names_its_objects_by_url():
    remote = Remote("s3://bucket/some/ix//")
    assert (remote.url, remote.root, remote.bucket, remote.prefix) == (
        "s3://bucket/some/ix", "bucket/some/ix", "bucket", "some/ix")
    assert remote.where("shards/a.faiss") == "s3://bucket/some/ix/shards/a.faiss"
    assert remote.fresh("shards/a.faiss") == "bucket/some/ix/shards/a.faiss"
    remote = Remote("s3://bucket/ixX/")
    assert (remote.url, remote.root, remote.prefix) == ("s3://bucket/ixX", "bucket/ixX", "ixX")


@pytest.mark.parametrize("url", ["memory://somewhere/ix", "gs://bucket/ix", "s3://bucket/ix::memory://x",
                                 "S3://bucket/ix", "/local/ix"])
def test_urls_other_than_s3_are_refused_with_what_to_give(url):
    with pytest.raises(ConfigError) as info:
        Remote(url)
    assert str(info.value) == (
        f"cannot keep an index at {url!r}: an index in object storage lives at an s3:// URL (S3 or an "
        "S3-compatible server, AWS_ENDPOINT_URL_S3), whose conditional writes make its commits safe; "
        "give an s3://bucket/prefix or a local folder")


def test_a_whole_bucket_is_refused_with_a_prefix_to_give():
    for url in ("s3://bucket", "s3://bucket/"):
        with pytest.raises(ConfigError) as info:
            Remote(url)
        assert str(info.value) == ("'s3://bucket' is a whole bucket: give the index a prefix of its own, "
                                   "e.g. s3://bucket/my-index")


def test_a_missing_backend_names_the_url_and_the_extra_to_install(monkeypatch):
    import fsspec.core

    def missing(url):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec.core, "url_to_fs", missing)
    with pytest.raises(ConfigError) as info:
        Remote("s3://bucket/ix")
    assert str(info.value) == ("cannot use 's3://bucket/ix': Install s3fs to access S3 "
                               "(pip install 'embedingest[remote]')")


def test_puts_are_conditional_when_asked_and_reads_see_the_store_afresh(s3):
    remote = Remote(s3.url("ix"))
    assert remote.etag("a.json") is None
    etag = remote.put("a.json", b"one", if_none_match=True)
    assert remote.etag("a.json") == etag and remote.read("a.json") == b"one"
    with pytest.raises(OSError) as info:
        remote.put("a.json", b"two", if_none_match=True)
    assert precondition_failed(info.value)
    with pytest.raises(OSError) as info:
        remote.put("a.json", b"two", if_match='"not-its-etag"')
    assert precondition_failed(info.value)
    assert remote.read("a.json") == b"one"
    second = remote.put("a.json", b"two", if_match=etag)
    assert second != etag and remote.read("a.json") == b"two"
    remote.put("a.json", b"three")
    s3.put("ix/shards/b.bin", b"12345")
    assert remote.listing() == {"a.json": 5}
    assert remote.listing("shards") == remote.listing("shards/") == {"b.bin": 5}
    assert remote.listing("none") == {}
    s3.put("ix/shards/b.bin", b"123")  # behind the remote's back: seen at once
    assert remote.listing("shards") == {"b.bin": 3}
    assert remote.read_many(["a.json", "shards/b.bin"]) == {"a.json": b"three", "shards/b.bin": b"123"}
    assert remote.read_many([]) == {}


def test_downloads_are_whole_and_deletes_keep_to_their_condition(s3, tmp_path):
    remote = Remote(s3.url("ix"))
    body = bytes(range(256)) * 40000  # more than one block of the copy
    etag = remote.put("big.bin", body)
    remote.download("big.bin", tmp_path / "big.bin")
    assert (tmp_path / "big.bin").read_bytes() == body and os.listdir(tmp_path) == ["big.bin"]
    with pytest.raises(OSError) as info:
        remote.delete("big.bin", if_match='"not-its-etag"')
    assert precondition_failed(info.value) and remote.etag("big.bin") == etag
    remote.delete("big.bin", if_match=etag)
    assert remote.etag("big.bin") is None
    remote.put("small.bin", b"x")
    remote.delete("small.bin")
    assert remote.listing() == {}
    (tmp_path / "up.bin").write_bytes(b"uploaded")
    remote.upload(tmp_path / "up.bin", "shards/up.bin")
    assert s3.fs.cat_file(f"{s3.name}/ix/shards/up.bin") == b"uploaded"


def test_a_lease_holds_who_builds_until_when_and_is_renewed_then_deleted(s3):
    remote = Remote(s3.url("ix"))
    with Lease(remote, run="r1", seconds=1.2) as lease:
        first = json.loads(s3.fs.cat_file(f"{s3.name}/ix/{LEASE_NAME}"))
        assert {k: first[k] for k in ("run", "host", "pid")} == {
            "run": "r1", "host": socket.gethostname(), "pid": os.getpid()}
        assert time.time() + 0.5 < first["expires"] <= time.time() + 1.2
        assert lease.etag == remote.etag(LEASE_NAME)
        assert (lease._thread.name, lease._thread.daemon) == ("embedingest-lease", True)
        time.sleep(0.5)  # a renewal every 0.3 s
        renewed = json.loads(s3.fs.cat_file(f"{s3.name}/ix/{LEASE_NAME}"))
        assert renewed["expires"] > first["expires"] and lease.etag == remote.etag(LEASE_NAME)
        lease.check()
    assert remote.etag(LEASE_NAME) is None and lease.lost is None


def test_a_lease_another_build_holds_is_refused_naming_it_and_an_expired_or_garbled_one_taken(s3, caplog):
    url = s3.url("ix")
    expires = time.time() + 100
    held = json.dumps({"run": "other", "host": "h", "pid": 7, "expires": expires}).encode()
    s3.put(f"ix/{LEASE_NAME}", held)
    with pytest.raises(IndexBusy) as info:
        with Lease(Remote(url), run="mine"):
            pass
    assert str(info.value) == (
        f"another build (run 'other', pid 7 on host 'h') holds {url}/.run.lock until "
        f"{time.strftime('%H:%M:%S UTC', time.gmtime(expires))}; wait for it to end, or if it was "
        "stopped run again after that time (the index resumes)")
    assert s3.fs.cat_file(f"{s3.name}/ix/{LEASE_NAME}") == held
    for old in (json.dumps({"run": "dead", "expires": time.time() - 1}).encode(), b"{garbled",
                json.dumps({"run": "no-time"}).encode(), json.dumps([1]).encode()):
        s3.put(f"ix/{LEASE_NAME}", old)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="embedingest"), Lease(Remote(url), run="mine") as lease:
            assert json.loads(s3.fs.cat_file(f"{s3.name}/ix/{LEASE_NAME}"))["run"] == "mine"
        assert lease.lost is None and Remote(url).etag(LEASE_NAME) is None
        run = "'dead'" if b"dead" in old else "None"  # an unreadable lease names no run
        assert [r.getMessage() for r in caplog.records] == [
            f"took over the expired lease of {url} (run {run})"]


def test_a_lease_taken_by_another_build_first_is_refused(s3, monkeypatch):
    url = s3.url("ix")
    s3.put(f"ix/{LEASE_NAME}", json.dumps({"run": "dead", "expires": 0}).encode())
    remote = Remote(url)
    real = remote.put

    def put(rel, data, **kw):
        if "if_match" in kw:  # the take-over: another build's write got there first
            s3.put(f"ix/{LEASE_NAME}", b"theirs")
        return real(rel, data, **kw)

    monkeypatch.setattr(remote, "put", put)
    with pytest.raises(IndexBusy) as info:
        with Lease(remote, run="mine"):
            pass
    assert str(info.value) == (f"another build took {url}/.run.lock just now; wait for it to end and "
                               "run again")
    assert info.value.__cause__ is None and s3.fs.cat_file(f"{s3.name}/ix/{LEASE_NAME}") == b"theirs"


def test_a_lost_lease_says_so_whole_and_is_left_to_its_new_holder(s3):
    url = s3.url("ix")
    lease = Lease(Remote(url), seconds=1.6)
    with lease:
        s3.put(f"ix/{LEASE_NAME}", b"theirs")
        time.sleep(0.8)
        with pytest.raises(IndexBusy) as info:
            lease.check()
    assert str(info.value) == (
        f"this build lost its lease on {url} (it was not renewed in 2 s and another build took it); "
        "nothing it uploaded is lost: run the same command again to commit it")
    assert precondition_failed(lease.lost) and s3.fs.cat_file(f"{s3.name}/ix/{LEASE_NAME}") == b"theirs"


def test_a_failed_renewal_is_logged_and_tried_again(s3, monkeypatch, caplog):
    url = s3.url("ix")
    remote = Remote(url)
    real, calls = remote.put, []

    def put(rel, data, **kw):
        calls.append(kw)
        if len(calls) == 2:
            raise OSError("the network is down")
        return real(rel, data, **kw)

    monkeypatch.setattr(remote, "put", put)
    with caplog.at_level(logging.WARNING, logger="embedingest"), Lease(remote, seconds=0.4) as lease:
        time.sleep(0.45)
    assert len(calls) >= 3 and lease.lost is None and remote.etag(LEASE_NAME) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"could not renew the lease of {url} (the network is down); trying again"]


def test_a_checkpoint_uploads_the_build_s_own_shards_trained_file_and_a_whole_units_snapshot(
        s3, tmp_path, monkeypatch):
    build_shards(tmp_path / "local", n_units=2, chunks=5, workers=1, run_id="own")
    s3.put("ix/manifest.json", (tmp_path / "local" / "manifest.json").read_bytes())
    url = s3.url("ix")
    with RemoteBuild(url) as build:
        shutil.copytree(tmp_path / "local" / "shards", build.folder / "shards", dirs_exist_ok=True)
        (build.folder / "trained.faiss").write_bytes(b"trained")
        (build.folder / "skipped.jsonl").write_text("{}\n")
        db = sqlite3.connect(build.folder / "units.sqlite")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE units (no INTEGER)")
        db.executemany("INSERT INTO units VALUES (?)", [(1,), (2,)])
        db.commit()  # in the WAL, not yet in the database file
        assert (build.folder / "units.sqlite-wal").stat().st_size > 0
        build.checkpoint()
        db.close()
        bucket = objects(s3, "ix")
        assert sorted(bucket) == sorted([".run.lock", "manifest.json", "trained.faiss", "units.sqlite"]
                                        + [f"shards/{n}" for n in files(tmp_path / "local" / "shards")])
        assert {n: bucket[f"shards/{n}"] for n in files(tmp_path / "local" / "shards")} == \
            files(tmp_path / "local" / "shards")
        assert bucket["trained.faiss"] == b"trained"
        (tmp_path / "copy.sqlite").write_bytes(bucket["units.sqlite"])
        with sqlite3.connect(tmp_path / "copy.sqlite") as copy:
            assert copy.execute("SELECT no FROM units").fetchall() == [(1,), (2,)]
        assert not (build.folder / ".units-snapshot.sqlite").exists()
        uploads, shards = [], []
        monkeypatch.setattr(build.remote, "upload", lambda local, rel: uploads.append(rel))
        real = remote_store.upload_shard
        monkeypatch.setattr(remote_store, "upload_shard", lambda url, folder, record: (
            shards.append(record["name"]), real(url, folder, record)))
        build.checkpoint()  # the shards are in the bucket already
        assert (uploads, shards) == (["trained.faiss", "units.sqlite"], [])
        s3.fs.rm_file(f"{s3.name}/ix/shards/shard-own-w0-00000.faiss")  # lost: the shard goes again
        build.checkpoint()
        assert shards == ["shard-own-w0-00000"] and uploads == ["trained.faiss", "units.sqlite"] * 2
        assert objects(s3, "ix")["shards/shard-own-w0-00000.faiss"] == bucket["shards/shard-own-w0-00000.faiss"]


def test_a_reindexed_index_is_mirrored_with_its_generation_s_vectors_and_a_checkpoint_uploads_none(
        s3, tmp_path, monkeypatch):
    local = tmp_path / "local"
    name = build_shards(local, n_units=2, chunks=5, workers=1, run_id="old").written[0]["name"]
    (local / "shards" / f"{name}.faiss").rename(local / "shards" / f"{name}.g1.faiss")  # reindexed
    manifest = json.loads((local / "manifest.json").read_text()) | {"generation": 1}
    (local / "manifest.json").write_text(json.dumps(manifest))
    with RemoteBuild(s3.upload(local, "ix")) as build:
        assert files(build.folder / "shards") == files(local / "shards")
        sqlite3.connect(build.folder / "units.sqlite").close()
        uploads = []
        monkeypatch.setattr(build.remote, "upload", lambda path, rel: uploads.append(rel))
        build.checkpoint()
        assert uploads == ["units.sqlite"]


def test_a_lease_its_holder_deleted_meanwhile_is_created_anew_unless_another_build_is_first(s3, monkeypatch):
    url = s3.url("ix")
    for rival in (False, True):
        s3.put(f"ix/{LEASE_NAME}", json.dumps({"run": "ending", "expires": time.time() + 100}).encode())
        remote = Remote(url)
        etag, read = remote.etag, remote.read

        def gone(rel):  # the holder ends: its lease is deleted just before the take-over looks
            s3.fs.rm_file(f"{s3.name}/ix/{rel}")
            return etag(rel)

        def raced(rel):  # and another build creates one before this build does
            if rival:
                s3.put(f"ix/{rel}", b"theirs")
            return read(rel)

        monkeypatch.setattr(remote, "etag", gone)
        monkeypatch.setattr(remote, "read", raced)
        if rival:
            with pytest.raises(IndexBusy) as info:
                with Lease(remote, run="mine"):
                    pass
            assert str(info.value) == (f"another build took {url}/.run.lock just now; wait for it to end "
                                       "and run again")
            assert s3.fs.cat_file(f"{s3.name}/ix/{LEASE_NAME}") == b"theirs"
        else:
            with Lease(remote, run="mine"):
                assert json.loads(s3.fs.cat_file(f"{s3.name}/ix/{LEASE_NAME}"))["run"] == "mine"
            assert sorted(objects(s3, "ix")) == []


def _bad_record_warning(url, name, error):
    return (f"cannot read the commit record {url}/shards/{name}.commit.json ({error}): that shard is "
            "left out and its units are redone")


def test_a_build_mirrors_the_index_and_its_commit_keeps_only_the_live_shards(s3, tmp_path, caplog, monkeypatch):
    local = tmp_path / "local"
    old = [w["name"] for w in build_shards(local, n_units=2, chunks=20, workers=2, run_id="old").written]
    assert old == ["shard-old-w0-00000", "shard-old-w1-00000"]
    (local / "skipped.jsonl").write_text('{"source": "x"}\n')
    (local / "trained.faiss").write_bytes(b"trained")
    manifest = json.loads((local / "manifest.json").read_text()) | {"corpus_path": "/data/córpus"}
    (local / "manifest.json").write_text(json.dumps(manifest))
    url = s3.upload(local, "ix")
    s3.put("ix/notes.txt", b"not the index's")
    s3.put("ix/shards/shard-bad-w0-00000.commit.json", b"{")
    s3.put("ix/shards/shard-bad-w0-00000.parquet", b"p")
    s3.put("ix/shards/stray.bin", b"s")
    s3.put("ix/shards/notes.commit.json", b"not a shard's")
    caplog.set_level(logging.WARNING, logger="embedingest")
    with RemoteBuild(url) as build:
        mirrored = {n: b for n, b in files(local).items() if n != ".writers.lock"}
        assert files(build.folder) == mirrored | {"shards/shard-bad-w0-00000.commit.json": b"{"}
        assert build.found == set(objects(s3, "ix"))
        assert build.manifest_etag == Remote(url).etag("manifest.json")
        bad = _bad_record_warning(url, "shard-bad-w0-00000", "JSONDecodeError: Expecting property name "
                                  "enclosed in double quotes: line 1 column 2 (char 1)")
        assert [r.getMessage() for r in caplog.records] == [bad]
        (build.folder / "shards" / "shard-bad-w0-00000.commit.json").unlink()  # as the local build does
        # the build's own work: shard w0 replaced by one of its own, w1 and the skip report dropped
        new = build_shards(tmp_path / "new", n_units=2, chunks=5, workers=1, run_id="new").written[0]["name"]
        record = json.loads((tmp_path / "new" / "shards" / f"{new}.commit.json").read_text())
        (tmp_path / "new" / "shards" / f"{new}.commit.json").write_text(json.dumps(record | {"replaces": [old[0]]}))
        shutil.copytree(tmp_path / "new" / "shards", build.folder / "shards", dirs_exist_ok=True)
        for path in (build.folder / "shards").glob(f"{old[1]}.*"):
            path.unlink()
        (build.folder / "skipped.jsonl").unlink()
        # another machine's writers: one shard with its vectors cut short, one whole
        other = build_shards(tmp_path / "other", n_units=2, chunks=20, workers=2, run_id="two").written
        cut = [f"{other[0]['name']}.emb.npy", f"{other[0]['name']}.faiss"]
        for name, body in files(tmp_path / "other" / "shards").items():
            s3.put(f"ix/shards/{name}", body[:-1] if name in cut else body)
        deletes, real = [], build.remote.delete

        def delete(rel, if_match=None):
            deletes.append((rel, if_match is not None))
            real(rel, if_match)
            if rel in ("shards/stray.bin", "skipped.jsonl"):  # a store that says it was gone already
                raise FileNotFoundError(rel)

        monkeypatch.setattr(build.remote, "delete", delete)
        commits, commit = [], build.commit
        monkeypatch.setattr(build, "commit", lambda: commits.append(commit()))
        caplog.clear()
    assert commits == [json.loads((local / "manifest.json").read_text()) | {
        "segments": [{"name": new, "count": 10}, {"name": other[1]["name"], "count": 17}]}]
    assert s3.fs.cat_file(f"{s3.name}/ix/manifest.json") == (
        json.dumps(commits[0], indent=2, ensure_ascii=False) + "\n").encode()
    assert [r.getMessage() for r in caplog.records] == [
        f"shard {other[0]['name']} in {url} lacks whole objects ({', '.join(cut)}): it is left "
        "out and its units are redone by the next build"]
    gone = [f"shards/{n}" for n in ("notes.commit.json", "shard-bad-w0-00000.commit.json", f"{old[0]}.commit.json",
                                     f"{old[1]}.commit.json", f"{other[0]['name']}.commit.json",
                                     "shard-bad-w0-00000.parquet", f"{old[0]}.emb.npy", f"{old[0]}.faiss",
                                     f"{old[0]}.parquet", f"{old[1]}.emb.npy", f"{old[1]}.faiss",
                                     f"{old[1]}.parquet", f"{other[0]['name']}.emb.npy",
                                     f"{other[0]['name']}.faiss",
                                     f"{other[0]['name']}.parquet", "stray.bin")]
    assert deletes == [(rel, False) for rel in gone + ["skipped.jsonl"]] + [(".run.lock", True)]
    assert sorted(objects(s3, "ix")) == sorted(
        [".writers.lock", "manifest.json", "notes.txt", "trained.faiss"]
        + [f"shards/{n}" for n in files(tmp_path / "new" / "shards")]
        + [f"shards/{other[1]['name']}{s}" for s in (".commit.json", ".emb.npy", ".faiss", ".parquet")])


def test_the_first_commit_creates_the_manifest_unless_another_build_created_one_meanwhile(s3, tmp_path):
    build_shards(tmp_path / "local", n_units=2, chunks=5, workers=1, run_id="one")
    manifest = json.loads((tmp_path / "local" / "manifest.json").read_text())
    url = s3.url("ix")
    with RemoteBuild(url, run="r7") as build:
        assert build.manifest_etag is None and files(build.folder) == {}
        assert build.folder.name.startswith("embedingest-index-")
        assert json.loads(s3.fs.cat_file(f"{s3.name}/ix/{LEASE_NAME}"))["run"] == "r7"
        shutil.copytree(tmp_path / "local", build.folder, dirs_exist_ok=True)
    assert json.loads(s3.fs.cat_file(f"{s3.name}/ix/manifest.json")) == manifest | {
        "segments": [{"name": "shard-one-w0-00000", "count": 10}]}
    s3.fs.rm_file(f"{s3.name}/ix/manifest.json")
    with pytest.raises(IndexBusy) as info:
        with RemoteBuild(url) as build:
            assert build.manifest_etag is None
            shutil.copy(tmp_path / "local" / "manifest.json", build.folder / "manifest.json")
            s3.put("ix/manifest.json", b"theirs")
    assert str(info.value) == (
        f"another build changed {url}/manifest.json while this one ran, so it was not overwritten; "
        "nothing is lost (this run's shards are uploaded): run the same command again to commit them")
    assert info.value.__cause__ is None and s3.fs.cat_file(f"{s3.name}/ix/manifest.json") == b"theirs"


def test_a_lease_in_a_bucket_that_cannot_be_written_names_the_url(s3):
    with pytest.raises(ConfigError) as info:
        with Lease(Remote("s3://no-such-bucket-here/ix")):
            pass
    assert str(info.value).startswith("cannot list 's3://no-such-bucket-here/ix': no such bucket, object "
                                      "or prefix (")
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_the_end_of_a_lease_waits_for_a_renewal_under_way_then_deletes_the_lease(s3, monkeypatch):
    remote = Remote(s3.url("ix"))
    real = remote.put

    def put(rel, data, **kw):
        if kw.get("if_match"):  # a slow renewal
            time.sleep(0.3)
        return real(rel, data, **kw)

    monkeypatch.setattr(remote, "put", put)
    with Lease(remote, seconds=0.4) as lease:
        time.sleep(0.15)  # the first renewal (at 0.1 s) under way
    assert not lease._thread.is_alive() and lease.lost is None and remote.etag(LEASE_NAME) is None


def test_the_end_of_a_lease_deletes_only_its_own_and_never_raises(s3, monkeypatch):
    url = s3.url("ix")
    with Lease(Remote(url)):
        s3.put(f"ix/{LEASE_NAME}", b"theirs")  # taken before a renewal noticed
    assert s3.fs.cat_file(f"{s3.name}/ix/{LEASE_NAME}") == b"theirs"
    s3.fs.rm_file(f"{s3.name}/ix/{LEASE_NAME}")
    remote = Remote(url)

    def delete(rel, if_match=None):
        raise OSError("the network is down")

    monkeypatch.setattr(remote, "delete", delete)
    with Lease(remote):
        pass
    held = json.loads(s3.fs.cat_file(f"{s3.name}/ix/{LEASE_NAME}"))
    assert (held["run"], held["pid"]) == ("", os.getpid())


def test_a_build_that_failed_raises_its_own_error_and_logs_a_commit_that_failed_too(s3, tmp_path, caplog):
    build_shards(tmp_path / "local", n_units=2, chunks=5, workers=1, run_id="one")
    url = s3.upload(tmp_path / "local", "ix")
    with pytest.raises(RuntimeError) as info:
        with RemoteBuild(url):
            s3.put("ix/manifest.json", b"theirs")
            raise RuntimeError("the build's own")
    assert str(info.value) == "the build's own"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        f"could not commit {url} after the build failed: another build changed {url}/manifest.json while "
        "this one ran, so it was not overwritten; nothing is lost (this run's shards are uploaded): run the "
        "same command again to commit them"]


def test_a_checkpoint_before_the_first_manifest_uploads_the_shards_as_generation_0(s3, tmp_path):
    build_shards(tmp_path / "local", n_units=2, chunks=5, workers=1, run_id="own")
    with RemoteBuild(s3.url("ix")) as build:
        shutil.copytree(tmp_path / "local" / "shards", build.folder / "shards", dirs_exist_ok=True)
        build.checkpoint()
    assert objects(s3, "ix") == {f"shards/{n}": b for n, b in files(tmp_path / "local" / "shards").items()}

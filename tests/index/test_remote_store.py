"""The pieces of an index in object storage (``embedingest.index.remote_store``), each on
its own against moto's S3 server on 127.0.0.1: the prefix's calls, the lease, and a
build's mirror, pull and commit of shards written by ``tests/shard_fixtures.py``."""

from __future__ import annotations

import json
import logging

import pytest
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)
from shard_fixtures import build_shards

from embedingest.errors import ConfigError
from embedingest.index.remote_store import Remote, RemoteBuild, precondition_failed


def objects(s3, prefix) -> dict[str, bytes]:
    """{key below ``prefix``: its bytes}, read afresh."""
    s3.fs.invalidate_cache()
    return {p.split(f"{prefix}/", 1)[1]: s3.fs.cat_file(p) for p in s3.fs.find(f"{s3.name}/{prefix}")}


def files(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_pull_brings_the_whole_shards_committed_since_the_mirror_and_names_those_it_leaves_out(
        s3, tmp_path, caplog):
    first = build_shards(tmp_path / "first", n_units=2, chunks=5, workers=1, run_id="one")
    url = s3.upload(tmp_path / "first", "ix")
    with RemoteBuild(url) as build:
        assert files(build.folder / "shards") == files(tmp_path / "first" / "shards")
        later = build_shards(tmp_path / "later", n_units=2, chunks=20, workers=2, run_id="two")
        assert [w["name"] for w in first.written + later.written] == [
            "shard-one-w0-00000", "shard-two-w0-00000", "shard-two-w1-00000"]
        pulled = {n: b for n, b in files(tmp_path / "later" / "shards").items() if "-w0-" in n}
        for name, body in pulled.items():
            s3.put(f"ix/shards/{name}", body)
        record = (tmp_path / "later" / "shards" / "shard-two-w1-00000.commit.json").read_bytes()
        s3.put("ix/shards/shard-two-w1-00000.commit.json", record)  # its files not uploaded
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
            f"shard shard-two-w1-00000.commit.json in {url} lacks whole objects: its units are redone"]
        build.pull_shards()  # what it pulled is not downloaded again
        assert files(build.folder / "shards") == {**files(tmp_path / "first" / "shards"), **pulled}


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
    odd = OSError("odd")
    odd.response = "PreconditionFailed"  # not a mapping: not boto's response
    assert not precondition_failed(odd)


def test_a_remote_is_the_url_s_bucket_and_prefix_and_names_its_objects_by_url():
    remote = Remote("s3://bucket/some/ix//")
    assert (remote.url, remote.root, remote.bucket, remote.prefix) == (
        "s3://bucket/some/ix", "bucket/some/ix", "bucket", "some/ix")
    assert remote.where("shards/a.faiss") == "s3://bucket/some/ix/shards/a.faiss"
    assert remote.fresh("shards/a.faiss") == "bucket/some/ix/shards/a.faiss"


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

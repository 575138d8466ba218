"""Inputs in object storage, against a real S3-compatible server on 127.0.0.1 (moto's):
listed as a local folder is walked, read as local files are, bad objects reported, and
a bucket that cannot be listed a clear error naming the URL and what to do."""

from __future__ import annotations

import bz2
import gzip
import json
import os
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from PIL import Image
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)
from segment_fixtures import bad_files, image_tree

from embedingest.errors import ConfigError
from embedingest.sources.files import walk_files
from embedingest.sources.image_decode import ImageRejected, header_size, open_rgb
from embedingest.sources.remote import (RemoteFile, access_error, is_remote, local_path, same_store,
                                        stamp, walk_remote)
from embedingest.sources.text import TEXT_EXTENSIONS, iter_records


def text_tree(root):
    """A folder of every text format (compressed too), hidden and other files, subfolders."""
    lines = "\n".join(json.dumps({"id": f"r{i}", "text": f"record {i} é"}) for i in range(5)).encode()
    files = {
        "a.txt": "plain notes, café".encode("cp1252"),
        "b.jsonl.zst": zstandard.ZstdCompressor().compress(lines),
        "c.jsonl.gz": gzip.compress(lines),
        "d.csv.bz2": bz2.compress(b"id,text\nx,one cell\ny,another\n"),
        "sub/e.md": b"# Title\n\nBody.\n",
        "sub/deeper/f.jsonl": lines,
        "sub/.hidden.txt": b"not read",
        ".git/g.txt": b"not read",
        "image.bin": b"\x00\x01",
        "cut.jsonl.zst": zstandard.ZstdCompressor().compress(lines)[:-3],
    }
    table = pa.table({"id": ["p1", "p2"], "text": ["first row", "second row"]})
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    pq.write_table(table, root / "sub" / "t.parquet")


def read(path):
    skipped = []
    records = list(iter_records(path, on_skip=lambda w, r: skipped.append((w, r))))
    return records, skipped


def test_urls_and_local_paths():
    assert is_remote("s3://b/k") and is_remote("hf://datasets/o/n") and is_remote("simplecache::s3://b")
    assert not is_remote("file:///tmp/x") and not is_remote("/tmp/x") and not is_remote("c:/x")
    assert not is_remote(os.path.join("s3:", "x"))
    assert local_path("file:///tmp/corpus") == "/tmp/corpus" and local_path("rel/x") == "rel/x"
    for path in ("/tmp/sp ace/ü", "/tmp/100%", "/tmp/caf\udce9"):  # as Path.as_uri() writes them
        assert local_path(pathlib.PurePosixPath(path).as_uri()) == path
    assert local_path("file:///tmp/sp ace") == "/tmp/sp ace"


def test_a_prefix_lists_as_its_folder_walks_and_reads_the_same(s3, tmp_path):
    text_tree(tmp_path)
    url = s3.upload(tmp_path, "corpus")
    others_local, others_remote = [], []
    local = [p.relative_to(tmp_path).as_posix()
             for p in walk_files(tmp_path, TEXT_EXTENSIONS, on_other=others_local.append)]
    remote = list(walk_remote(url + "/", TEXT_EXTENSIONS, on_other=others_remote.append))
    assert [f.rel for f in remote] == local == [
        "a.txt", "b.jsonl.zst", "c.jsonl.gz", "cut.jsonl.zst", "d.csv.bz2", "sub/e.md",
        "sub/t.parquet", "sub/deeper/f.jsonl"]
    assert [f.url for f in remote] == [f"{url}/{rel}" for rel in local]
    assert [f.size for f in remote] == [(tmp_path / rel).stat().st_size for rel in local]
    assert [o.replace(url, str(tmp_path)) for o in others_remote] == others_local == [
        str(tmp_path / rel) for rel in (".git", "image.bin", "sub/.hidden.txt")]  # hidden: told, as on disk
    for f in remote:
        got, want = read(f.url), read(tmp_path / f.rel)
        assert got[0] == want[0] and (len(got[0]) > 0 or f.rel == "cut.jsonl.zst")
        assert [(w.replace(url, str(tmp_path)), r) for w, r in got[1]] == want[1]
    assert read(f"{url}/cut.jsonl.zst")[1][0][1].startswith("decompress: ")
    one = list(walk_remote(f"{url}/sub/e.md", TEXT_EXTENSIONS))
    assert [(f.rel, f.url) for f in one] == [("e.md", f"{url}/sub/e.md")]


def test_an_object_rewritten_at_the_same_size_gets_another_stamp(s3):
    s3.put("c/a.txt", b"version one")
    (first,) = walk_remote(s3.url("c"))
    s3.put("c/a.txt", b"version two")
    (second,) = walk_remote(s3.url("c"))
    assert first.size == second.size and first.mtime_ns != second.mtime_ns
    assert first.mtime_ns // 10**9 == second.mtime_ns // 10**9 or second.mtime_ns > first.mtime_ns
    assert stamp({"size": 3}) is None
    assert stamp({"mtime": 12.5}) == 12 * 10**9


def test_objects_that_go_or_break_are_reported_not_raised(s3):
    url = s3.put("c/gone.txt", b"soon deleted")
    s3.fs.rm_file(url[len("s3://"):])
    records, skipped = read(url)
    assert records == [] and skipped == [(url, skipped[0][1])]
    assert skipped[0][1].startswith("unreadable: ")
    rng = np.random.default_rng(0)
    lines = "\n".join(json.dumps({"text": rng.bytes(100).hex()}) for _ in range(2000)).encode()
    records, skipped = read(s3.put("c/cut.jsonl.gz", gzip.compress(lines)[:100_000]))
    assert 0 < len(records) < 2000 and skipped[0][1].startswith("decompress: ")
    empty = s3.put("c/empty.parquet", b"")
    assert read(empty) == ([], [(empty, "empty: the file has no bytes")])


def test_a_missing_bucket_or_prefix_names_the_url_and_what_to_do(s3):
    with pytest.raises(ConfigError, match=r"cannot list 's3://no-such-bucket-here/x': no such bucket"):
        list(walk_remote("s3://no-such-bucket-here/x"))
    with pytest.raises(ConfigError, match=rf"cannot list '{s3.url('nothing')}': no such bucket, object or prefix"):
        list(walk_remote(s3.url("nothing")))
    with pytest.raises(ConfigError, match=r"cannot read 'nosuchprotocol://x'"):
        list(walk_remote("nosuchprotocol://x"))


def test_missing_credentials_say_which_variables_to_set(s3, monkeypatch):
    import s3fs

    s3.put("c/a.txt", b"x")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(ConfigError) as info:
        list(walk_remote(s3.url("c")))
    message = str(info.value)
    assert message.startswith(f"cannot list '{s3.url('c')}': no credentials found")
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_PROFILE" in message


def test_access_errors_of_other_stores_say_what_to_do():
    class NoCredentialsError(Exception):
        pass

    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(access_error("gs://b/p", NoCredentialsError("x")))
    assert "HF_TOKEN" in str(access_error("hf://datasets/o/n", PermissionError("denied")))


def test_images_in_a_bucket_decode_as_on_disk(s3, tmp_path):
    sizes = image_tree(tmp_path)
    bad = bad_files(tmp_path)
    url = s3.upload(tmp_path, "images")
    for rel in sizes:
        picture, size = open_rgb(f"{url}/{rel}")
        want, want_size = open_rgb(tmp_path / rel)
        assert size == want_size == sizes[rel]
        assert np.array_equal(np.asarray(picture), np.asarray(want))
        assert header_size(f"{url}/{rel}") == header_size(tmp_path / rel)
    for rel, kind in bad.items():
        with pytest.raises(ImageRejected, match=kind):
            open_rgb(f"{url}/{rel}")
    with pytest.raises(ImageRejected, match="unreadable"):
        open_rgb(f"{url}/not-there.png")
    assert header_size(f"{url}/not-there.png") is None
    assert isinstance(next(walk_remote(f"{url}/rgb.png")), RemoteFile)
    assert Image.open(tmp_path / "rgb.png").size == sizes["rgb.png"]


def test_same_store_is_one_protocol_and_one_bucket():
    """Objects whose store times come from one clock: one protocol, one bucket (or host)."""
    assert same_store("s3://photos/2024/", "s3://photos/masks")
    assert same_store("S3://photos/a", "s3://photos/b")
    assert same_store("simplecache::s3://photos/a", "s3://photos/b")
    assert not same_store("s3://photos/a", "s3://masks/a")
    assert not same_store("s3://photos/a", "gs://photos/a")
    assert not same_store("s3://photos/a", "/data/photos")

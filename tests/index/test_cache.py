"""open_index over an index in object storage (moto's S3 server on 127.0.0.1): the same
hits as the same index on disk, the vectors downloaded once into the cache and checked
against their commit records, the rows read by range, and damaged or missing objects
named."""

import hashlib
import json

import pytest
from click.testing import CliRunner
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)
from shard_fixtures import build_shards, unit_vectors

from embedingest.errors import ConfigError
from embedingest.index.cache import OBJECTS_DIR, default_cache_dir
from embedingest.index.search import open_index
from embedingest.index.shard_store import ShardStore
from embedingest.index.shards import list_shards


def local_index(folder):
    """Shards of three writers, listed in the manifest as a build leaves them."""
    built = build_shards(folder, n_units=7, chunks=19, commit_every=30, workers=3)
    store = ShardStore(folder)
    store.update_shards()
    store.close()
    return built


def hits_of(index, q, k=9):
    return [[(h.id, round(h.score, 6), h.source, h.record_id, h.chunk_no, h.char_start, h.char_end, h.text)
             for h in hits] for hits in index.search_vectors(q, k=k)]


def test_search_over_s3_equals_the_folder_and_downloads_each_vector_file_once(s3, tmp_path):
    built = local_index(tmp_path / "ix")
    url = s3.upload(tmp_path / "ix", "indexes/ix")
    cache = tmp_path / "cache"
    q = unit_vectors(5, seed=3)
    with open_index(tmp_path / "ix") as local:
        want = hits_of(local, q)
    with open_index(url, cache_dir=cache) as remote:
        assert remote.ntotal == len(built.ids)
        assert hits_of(remote, q) == want
    shards = list_shards(tmp_path / "ix" / "shards")
    cached = sorted(p.name for p in (cache / OBJECTS_DIR).iterdir())
    # only the vectors, under the sha256 their records give: no Parquet file is downloaded
    assert cached == sorted(f"{s.files['faiss']['sha256']}.faiss" for s in shards if s.rows)
    before = {p.name: p.stat().st_ino for p in (cache / OBJECTS_DIR).iterdir()}
    with open_index(url, cache_dir=cache) as again:  # the same files: none downloaded again
        assert hits_of(again, q) == want
    assert {p.name: p.stat().st_ino for p in (cache / OBJECTS_DIR).iterdir()} == before


def test_only_the_shards_the_manifest_names_are_read(s3, tmp_path):
    local_index(tmp_path / "ix")
    url = s3.upload(tmp_path / "ix", "ix")
    manifest = json.loads((tmp_path / "ix" / "manifest.json").read_text())
    dropped = manifest["segments"].pop()["name"]
    s3.put("ix/manifest.json", json.dumps(manifest).encode())
    # a half-uploaded shard of a running build: its files, no record
    s3.put("ix/shards/shard-run9-w0-00000.faiss", b"partial")
    with open_index(url, cache_dir=tmp_path / "cache") as index:
        names = [s.name for s in index.rows.shards]
    assert dropped not in names and len(names) == len(manifest["segments"])


def test_a_tampered_vector_file_is_named(s3, tmp_path):
    local_index(tmp_path / "ix")
    shard = [s for s in list_shards(tmp_path / "ix" / "shards") if s.rows][1]
    path = shard.path("faiss")
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF  # same size, other bytes
    url = s3.upload(tmp_path / "ix", "ix")
    s3.put(f"ix/shards/{path.name}", bytes(data))
    with pytest.raises(ConfigError) as err:
        open_index(url, cache_dir=tmp_path / "cache")
    assert str(err.value) == (
        f"shard {shard.name} of {url} is damaged: its faiss object '{path.name}' does not hold the bytes "
        f"that were committed (sha256 {hashlib.sha256(data).hexdigest()}, not {shard.files['faiss']['sha256']}); "
        f"delete that shard's objects ({url}/shards/{shard.name}.*) and run the same build-index command "
        "again: the units it held are redone")
    assert not list((tmp_path / "cache" / OBJECTS_DIR).glob(f"{shard.files['faiss']['sha256']}*"))


def test_a_truncated_or_missing_parquet_object_is_named(s3, tmp_path):
    local_index(tmp_path / "ix")
    shard = [s for s in list_shards(tmp_path / "ix" / "shards") if s.rows][0]
    name = shard.files["parquet"]["name"]
    url = s3.upload(tmp_path / "ix", "ix")
    s3.put(f"ix/shards/{name}", shard.path("parquet").read_bytes()[:-10])
    with pytest.raises(ConfigError, match=f"shard {shard.name} of {url} is damaged: its parquet object "
                                          f"'{name}' holds {shard.files['parquet']['size'] - 10} bytes"):
        open_index(url, cache_dir=tmp_path / "cache")
    s3.fs.rm(f"{s3.name}/ix/shards/{name}")
    with pytest.raises(ConfigError, match=f"its parquet object '{name}' is missing"):
        open_index(url, cache_dir=tmp_path / "cache")
    # the vectors' object is checked by its size too, before anything is downloaded
    s3.put(f"ix/shards/{name}", shard.path("parquet").read_bytes())
    vectors = shard.files["faiss"]["name"]
    s3.put(f"ix/shards/{vectors}", shard.path("faiss").read_bytes()[:-3])
    with pytest.raises(ConfigError, match=f"shard {shard.name} of {url} is damaged: its faiss object "
                                          f"'{vectors}' holds {shard.files['faiss']['size'] - 3} bytes, not "
                                          f"{shard.files['faiss']['size']}; delete"):
        open_index(url, cache_dir=tmp_path / "cache")


def test_no_index_or_no_bucket_is_a_clear_error(s3, tmp_path):
    with pytest.raises(ConfigError, match=r"holds no embedingest index \(no manifest.json\)"):
        open_index(s3.url("nothing-here"), cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="cannot list 's3://no-such-bucket-here/ix'.*no such bucket"):
        open_index("s3://no-such-bucket-here/ix", cache_dir=tmp_path)


def test_cli_search_reads_a_url_with_a_cache_dir(s3, tmp_path, monkeypatch):
    from embedingest.cli import main

    local_index(tmp_path / "ix")
    url = s3.upload(tmp_path / "ix", "ix")

    class Encoder:  # the fixture's index has no model: queries are mapped to fixed vectors
        dim = 16

        def encode(self, texts):
            return unit_vectors(len(texts), seed=11)

    import embedingest.index.search as search

    monkeypatch.setattr(search.Index, "encoder", property(lambda self: Encoder()))
    runner = CliRunner()
    local = runner.invoke(main, ["search", str(tmp_path / "ix"), "anything", "-k", "4", "--json"])
    remote = runner.invoke(main, ["search", url, "anything", "-k", "4", "--json",
                                  "--cache-dir", str(tmp_path / "c")])
    assert local.exit_code == 0 and remote.exit_code == 0, remote.output
    assert json.loads(remote.output) == json.loads(local.output) and len(json.loads(local.output)) == 4
    assert list((tmp_path / "c" / OBJECTS_DIR).iterdir())


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "embedingest"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "embedingest"


def test_serve_answers_from_an_index_in_the_bucket(s3, tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from embedingest.cli import main
    from embedingest.serve.app import create_app

    local_index(tmp_path / "ix")
    url = s3.upload(tmp_path / "ix", "ix")
    q = unit_vectors(1, seed=11)

    class Encoder:
        dim = 16

        def encode(self, texts):
            return q

    with open_index(tmp_path / "ix") as local:
        want = [h.id for h in local.search_vectors(q, k=5)[0]]
        total = local.ntotal
    with open_index(url, encoder=Encoder(), cache_dir=tmp_path / "c") as index, \
            TestClient(create_app(index)) as client:
        info = client.get("/info").json()
        hits = client.get("/search", params={"q": "anything", "k": 5}).json()
    assert info["index"] == url and info["vectors"] == total
    assert [h["id"] for h in hits["hits"]] == want and all(h["file"] is None for h in hits["hits"])
    result = CliRunner().invoke(main, ["serve", "s3://no-such-bucket-here/ix", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 1 and "cannot list 's3://no-such-bucket-here/ix'" in result.output


def test_a_later_open_in_the_same_process_sees_shards_committed_since(s3, tmp_path):
    local_index(tmp_path / "ix")
    manifest = json.loads((tmp_path / "ix" / "manifest.json").read_text())
    late = manifest["segments"][-1]["name"]
    for path in sorted((tmp_path / "ix").rglob("*")):
        if path.is_file() and not path.name.startswith(late):
            s3.put(f"ix/{path.relative_to(tmp_path / 'ix').as_posix()}", path.read_bytes())
    s3.put("ix/manifest.json", json.dumps({**manifest, "segments": manifest["segments"][:-1]}).encode())
    with open_index(s3.url("ix"), cache_dir=tmp_path / "c") as index:
        before = index.ntotal
    import s3fs

    other = s3fs.S3FileSystem(skip_instance_cache=True)  # a build in another process commits one more shard
    for path in sorted((tmp_path / "ix" / "shards").glob(f"{late}.*")):
        other.pipe_file(f"{s3.name}/ix/shards/{path.name}", path.read_bytes())
    other.pipe_file(f"{s3.name}/ix/manifest.json", json.dumps(manifest).encode())
    with open_index(s3.url("ix"), cache_dir=tmp_path / "c") as index:
        assert index.ntotal == before + manifest["segments"][-1]["count"]


def cached(cache) -> dict:
    """{file name: size} of the vectors in the cache."""
    return {p.name: p.stat().st_size for p in (cache / OBJECTS_DIR).iterdir()}


def test_the_cache_keeps_to_its_bound_and_a_search_after_eviction_gives_the_same_hits(s3, tmp_path):
    local_index(tmp_path / "ix")
    url = s3.upload(tmp_path / "ix", "ix")
    shards = [s for s in list_shards(tmp_path / "ix" / "shards") if s.rows]
    sizes = sorted(s.files["faiss"]["size"] for s in shards)
    assert len(sizes) >= 4
    bound = sum(sizes[:2]) + 1  # bytes: about two of the files fit
    gib = bound / 2**30
    q = unit_vectors(5, seed=3)
    with open_index(tmp_path / "ix") as local:
        want = hits_of(local, q)
    cache = tmp_path / "cache"
    with open_index(url, cache_dir=cache, cache_size=gib) as index:
        assert len(cached(cache)) == len(shards)  # all in use: none evicted while open
        assert hits_of(index, q) == want
    after = cached(cache)
    assert sum(after.values()) <= bound and 0 < len(after) < len(shards)
    evicted = [s.files["faiss"]["size"] for s in shards if f"{s.files['faiss']['sha256']}.faiss" not in after]
    assert sum(after.values()) + max(evicted) > bound  # the last one it evicted was needed
    with open_index(url, cache_dir=cache, cache_size=gib) as index:  # evicted ones come back
        assert hits_of(index, q) == want
        assert len(cached(cache)) == len(shards)
    assert sum(cached(cache).values()) <= bound
    # 0: no bound
    with open_index(url, cache_dir=cache, cache_size=0) as index:
        assert hits_of(index, q) == want
    assert len(cached(cache)) == len(shards)


def test_eviction_passes_over_the_files_another_open_index_uses(s3, tmp_path):
    """Another index in the same cache (here in this process; the lock is a flock, so in
    another process alike) closing with a small bound deletes none of the open one's files."""
    local_index(tmp_path / "a")
    build_shards(tmp_path / "b", n_units=5, chunks=11, commit_every=20, workers=2, seed=7)
    with ShardStore(tmp_path / "b") as store:
        store.update_shards()
    url_a, url_b = s3.upload(tmp_path / "a", "a"), s3.upload(tmp_path / "b", "b")
    cache = tmp_path / "cache"
    q = unit_vectors(4, seed=5)
    with open_index(tmp_path / "a") as local:
        want = hits_of(local, q)
    with open_index(url_a, cache_dir=cache, cache_size=0) as a:
        mine = set(cached(cache))
        with open_index(url_b, cache_dir=cache, cache_size=1e-9):  # a bound nothing fits in
            assert set(cached(cache)) > mine
        assert set(cached(cache)) == mine  # b's files went, a's stayed
        assert hits_of(a, q) == want
    with open_index(url_b, cache_dir=cache, cache_size=1e-9):
        pass
    assert cached(cache) == {}  # none in use: all went


def test_unlink_unused_deletes_only_a_cached_file_no_index_holds(tmp_path):
    """True only when it deleted the file: a missing file, a link (never followed), a file
    an open index holds (its shared flock) and one it cannot delete are all left as they are."""
    import fcntl
    import os

    from embedingest.index.cache import _unlink_unused

    free, held, target = tmp_path / "a.faiss", tmp_path / "b.faiss", tmp_path / "target"
    for path in (free, held, target):
        path.write_bytes(b"v")
    (tmp_path / "link.faiss").symlink_to(target)
    (tmp_path / "dir.faiss").mkdir()
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        assert _unlink_unused(tmp_path / "missing.faiss") is False
        assert _unlink_unused(tmp_path / "link.faiss") is False
        assert _unlink_unused(held) is False
        assert _unlink_unused(tmp_path / "dir.faiss") is False  # unlink fails: not deleted
        assert _unlink_unused(free) is True
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.faiss", "dir.faiss", "link.faiss", "target"]
    assert target.read_bytes() == b"v" and (tmp_path / "link.faiss").is_symlink()


def test_a_parquet_object_of_the_committed_size_that_is_not_parquet_is_named_by_its_url(s3, tmp_path):
    local_index(tmp_path / "ix")
    shard = [s for s in list_shards(tmp_path / "ix" / "shards") if s.rows][0]
    name = shard.files["parquet"]["name"]
    url = s3.upload(tmp_path / "ix", "ix")
    s3.put(f"ix/shards/{name}", b"x" * shard.files["parquet"]["size"])
    with pytest.raises(ConfigError) as err:
        open_index(url, cache_dir=tmp_path / "cache")
    assert str(err.value).startswith(f"cannot read '{url}/shards/{name}' (")
    assert str(err.value).endswith(f"): the shard is damaged; delete that shard's files (every file named "
                                   f"{shard.name}.*) and run the same build-index command again: the units it "
                                   "held are redone")


def test_a_cached_vectors_file_is_used_again_only_when_whole_and_a_reindexed_one_too(s3, tmp_path):
    """A cached file cut short (a full disk, a copy stopped) is downloaded again, not
    handed to faiss; the vectors of a reindexed index (in no commit record, so no sha256)
    are kept too and not downloaded at every open."""
    from embedingest.index.reindex import reindex

    for name, again in (("ix", False), ("re", True)):
        local_index(tmp_path / name)
        if again:
            reindex(tmp_path / name, "HNSW8")  # generation 1: vectors files of other sizes
        url = s3.upload(tmp_path / name, name)
        cache = tmp_path / f"cache-{name}"
        q = unit_vectors(3, seed=2)
        with open_index(tmp_path / name) as local:
            want = hits_of(local, q)
        with open_index(url, cache_dir=cache) as index:
            assert hits_of(index, q) == want
        before = {p.name: (p.stat().st_ino, p.stat().st_size) for p in (cache / OBJECTS_DIR).iterdir()}
        with open_index(url, cache_dir=cache) as index:  # nothing downloaded again
            assert hits_of(index, q) == want
        assert {p.name: (p.stat().st_ino, p.stat().st_size) for p in (cache / OBJECTS_DIR).iterdir()} == before
        if not again:
            cut = sorted(before)[0]
            with open(cache / OBJECTS_DIR / cut, "r+b") as fh:
                fh.truncate(before[cut][1] - 7)
            with open_index(url, cache_dir=cache) as index:
                assert hits_of(index, q) == want
            assert (cache / OBJECTS_DIR / cut).stat().st_size == before[cut][1]  # downloaded whole again


def test_a_parquet_object_is_read_by_the_ranges_asked_and_vectors_downloaded_in_blocks(s3, tmp_path, monkeypatch):
    """Rows are read by range: a read of a few bytes fetches those bytes, not a block
    (s3fs's default read-ahead fetches 50 MiB, the whole object of any shard but a huge one)."""
    import s3fs

    from embedingest.index.cache import RemoteShards

    local_index(tmp_path / "ix")
    url = s3.upload(tmp_path / "ix", "ix")
    fetched = []
    real = s3fs.core.S3File._fetch_range
    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range",
                        lambda self, start, end: fetched.append((start, end)) or real(self, start, end))
    remote = RemoteShards(url, cache_dir=tmp_path / "cache")
    with remote.open_parquet(remote.shards[0]) as fh:
        assert fh.read(10) == b"PAR1" + (tmp_path / "ix" / "shards" / remote.shards[0].files["parquet"]["name"]
                                         ).read_bytes()[4:10]
    assert fetched == [(0, 10)]
    import embedingest.index.cache as cache_mod

    # the vectors are downloaded in blocks of _BLOCK, never read whole into memory
    monkeypatch.setattr(cache_mod, "_BLOCK", 512)
    asked = []
    real_read = s3fs.core.S3File.read
    monkeypatch.setattr(s3fs.core.S3File, "read", lambda self, length=-1: asked.append(length) or real_read(self, length))
    path = remote.faiss_path(remote.shards[0])
    remote.close()
    assert path.stat().st_size > 512 and set(asked) == {512}


def test_a_link_in_the_cache_is_never_followed_and_a_file_evicted_while_opening_is_named(s3, tmp_path,
                                                                                      monkeypatch):
    import re

    from embedingest.index.cache import RemoteShards

    local_index(tmp_path / "ix")
    url = s3.upload(tmp_path / "ix", "ix")
    shard = [s for s in list_shards(tmp_path / "ix" / "shards") if s.rows][0]
    (tmp_path / "elsewhere.faiss").write_bytes(shard.path("faiss").read_bytes())  # the right bytes, even
    link = tmp_path / "cache" / OBJECTS_DIR / f"{shard.files['faiss']['sha256']}.faiss"
    link.parent.mkdir(parents=True)
    link.symlink_to(tmp_path / "elsewhere.faiss")
    with open_index(url, cache_dir=tmp_path / "cache"):
        pass
    assert not link.is_symlink() and link.read_bytes() == shard.path("faiss").read_bytes()  # downloaded
    assert (tmp_path / "elsewhere.faiss").read_bytes() == shard.path("faiss").read_bytes()

    monkeypatch.setattr(RemoteShards, "_hold", lambda self, path, size: False)  # evicted at once, always
    with pytest.raises(ConfigError) as err:
        open_index(url, cache_dir=tmp_path / "c2")
    assert re.fullmatch(re.escape(f"'{tmp_path / 'c2' / OBJECTS_DIR}/") + "[0-9a-f]{64}" + re.escape(
        ".faiss' went while this index was opening (another process evicted it): open the index again"),
        str(err.value)), str(err.value)


def test_eviction_deletes_only_whole_vector_files_least_recently_used_first(tmp_path, caplog):
    """Only ``*.faiss`` files are evicted: a download under way in another process (its
    temporary name) and anything else in the folder stay; the oldest go first."""
    import logging
    import os

    from embedingest.index.cache import RemoteShards

    objects = tmp_path / OBJECTS_DIR
    objects.mkdir()
    for i, name in enumerate(["old.faiss", "new.faiss", ".new2.faiss.tmp-99", "notes.txt"]):
        (objects / name).write_bytes(b"v" * 100)
        os.utime(objects / name, ns=(10**18 + i * 10**9,) * 2)
    (tmp_path / "target.faiss").write_bytes(b"t" * 100)
    (objects / "link.faiss").symlink_to(tmp_path / "target.faiss")  # not a cached file: not counted
    os.utime(objects / "link.faiss", ns=(2 * 10**18,) * 2, follow_symlinks=False)
    shards = RemoteShards.__new__(RemoteShards)  # no bucket: evict reads only the cache
    shards.cache, shards.bound, shards.held = tmp_path, 100, {}
    caplog.set_level(logging.WARNING, logger="embedingest")
    assert shards.evict() == [objects / "old.faiss"]  # then 100 bytes: at the bound, kept
    assert sorted(p.name for p in objects.iterdir()) == [".new2.faiss.tmp-99", "link.faiss", "new.faiss",
                                                         "notes.txt"]
    assert caplog.records == []
    # a file an open index holds is passed over, and the cache above its bound said
    with open(objects / "big.faiss", "wb") as fh:
        fh.truncate(3 * 2**20 - 100)  # sparse: 3 MiB with new.faiss
    shards.held, shards.bound = {objects / "new.faiss": -1, objects / "big.faiss": -1}, 2**20
    assert shards.evict() == [] and (objects / "new.faiss").exists() and (objects / "big.faiss").exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"the cache {objects} holds 3.0 MiB of vectors, above its bound of 1.0 MiB: open indexes use them "
        "(raise --cache-size to keep them all)"]


def test_a_manifest_not_json_of_another_format_or_with_a_bad_field_is_named_by_its_url(s3, tmp_path):
    from embedingest.index.formats import CURRENT

    local_index(tmp_path / "ix")
    url = s3.upload(tmp_path / "ix", "ix")
    manifest = json.loads((tmp_path / "ix" / "manifest.json").read_text())
    with pytest.raises(ValueError) as bad_json:
        json.loads(b"{not json")
    other_format = (f"{url}/manifest.json is not an index of format {CURRENT}; rebuild it with build-index "
                    f"--out {url} --overwrite")
    for data, want in ((b"{not json", f"cannot read {url}/manifest.json: {bad_json.value}; rebuild the index "
                                      "with --overwrite"),
                       (b"[2]", other_format),
                       (json.dumps({**manifest, "format": 1}).encode(), other_format),
                       (json.dumps({**manifest, "dim": "x"}).encode(),
                        f"{url}/manifest.json: dim is 'x', not a positive integer; the manifest was changed or "
                        "damaged: put back the value it was built with, or rebuild the index with --overwrite")):
        s3.put("ix/manifest.json", data)
        with pytest.raises(ConfigError) as err:
            open_index(url, cache_dir=tmp_path / "cache")
        assert str(err.value) == want


def test_a_missing_shard_object_is_named_with_what_to_do(s3, tmp_path):
    local_index(tmp_path / "ix")
    shard = [s for s in list_shards(tmp_path / "ix" / "shards") if s.rows][0]
    name = shard.files["parquet"]["name"]
    url = s3.upload(tmp_path / "ix", "ix")
    s3.fs.rm(f"{s3.name}/ix/shards/{name}")
    with pytest.raises(ConfigError) as err:
        open_index(url, cache_dir=tmp_path / "cache")
    assert str(err.value) == (
        f"shard {shard.name} of {url} is damaged: its parquet object '{name}' is missing; delete that shard's "
        f"objects ({url}/shards/{shard.name}.*) and run the same build-index command again: the units it "
        "held are redone")


def test_the_cache_bound_is_the_default_unless_given(s3, tmp_path):
    from embedingest.index.cache import DEFAULT_CACHE_GIB, RemoteShards

    local_index(tmp_path / "ix")
    url = s3.upload(tmp_path / "ix", "ix")
    for size, bound in ((None, int(DEFAULT_CACHE_GIB * 2**30)), (0.5, 2**29), (0, None)):
        shards = RemoteShards(url, tmp_path / "cache", size)
        assert shards.bound == bound
        shards.close()
    assert DEFAULT_CACHE_GIB == 20


def test_an_index_in_object_storage_is_searched_with_its_stored_parameters_unless_given(s3, tmp_path):
    import faiss
    from index_fixtures import build_index

    built = build_index(tmp_path / "ix", n_units=4, chunks=10, factory="IVF4,Flat")
    manifest = built.store.read_manifest()
    manifest.search = {"params": "nprobe=3"}
    built.store.write_manifest(manifest)
    built.store.close()
    url = s3.upload(tmp_path / "ix", "ix")
    for given, params, nprobe in ((None, "nprobe=3", 3), ("nprobe=2", "nprobe=2", 2), ("", None, 1)):
        with open_index(url, cache_dir=tmp_path / "cache", params=given) as index:
            assert index.params == params
            assert [faiss.extract_index_ivf(s).nprobe for s in index.shards] == [nprobe] * len(index.shards)


def test_an_index_in_object_storage_keeps_the_device_prompt_encoder_runtime_and_cache_given(s3, tmp_path, monkeypatch):
    """What the caller gives reaches the index: its model is loaded on the device given, and
    its query runtime kept in the cache folder given (the loader and runtime recorded)."""
    from pathlib import Path

    from shard_fixtures import DIM

    from embedingest.stages import encoder as encoder_mod, model_folder, query_runtime

    local_index(tmp_path / "ix")
    url = s3.upload(tmp_path / "ix", "ix")
    calls = []

    class Loaded:
        dim = DIM

        def info(self):
            return {"name": "test-model"}

    monkeypatch.setattr(encoder_mod.TextEncoder, "load", staticmethod(
        lambda path, device, dtype: calls.append(("load", path, device, dtype)) or Loaded()))
    monkeypatch.setattr(model_folder, "resolve_model", lambda name: (Path(f"/resolved/{name}"), name))
    monkeypatch.setattr(query_runtime, "use_query_runtime",
                        lambda encoder, runtime, cache, threads: calls.append(("runtime", runtime, cache)))
    monkeypatch.setattr("embedingest.stages.device.resolve_device", lambda device: device)  # cuda:1 here too
    cache = tmp_path / "cache"
    with open_index(url, cache_dir=cache, device="cuda:1", query_prompt="find: ", query_runtime="onnx") as index:
        assert (index.device, index.query_prompt, index.query_runtime) == ("cuda:1", "find: ", "onnx")
        assert isinstance(index.encoder, Loaded)
    assert calls == [("load", "/resolved/test-model", "cuda:1", "fp32"), ("runtime", "onnx", cache)]
    given = object()
    with open_index(url, cache_dir=cache, encoder=given) as index:
        assert index.encoder is given
        assert (index.device, index.query_prompt, index.query_runtime) == ("cpu", "", "torch")

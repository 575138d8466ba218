"""The index and output folders under attack, through the real CLI: a disk that really
fills up, a folder tampered with (links, a forged commit record), a folder damaged or
left by a killed build. Each case ends in a clear one-line error or a correct answer,
nothing outside the folder is written, created, truncated or deleted, and the re-run
after the fault holds every chunk exactly once.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import sqlite3
from pathlib import Path

import faiss
import numpy as np
import pytest
from fault_helpers import (
    CHUNK_TOKENS,
    Run,
    check_exactly_once,
    check_index_files,
    expected_chunks,
    fill_until,
    make_corpus,
    small_tmpfs,
    wait_for,
    words,
)

from embedingest.errors import ConfigError
from embedingest.index.search import open_index
from embedingest.index.shard_store import ShardStore

pytestmark = pytest.mark.slow

ARGS = ["--device", "cpu", "--num-workers", "0", "--num-consumers", "2", "--batch-size", "16",
        "--chunk-tokens", str(CHUNK_TOKENS), "--overlap", "0", "--commit-every", "32"]


def paragraphs(root: Path, files: int = 20, per_file: int = 15, seed: int = 11) -> Path:
    """``files`` x ``per_file`` paragraphs of 20 words (one chunk each) as JSON lines."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for f in range(files):
        with open(root / f"part{f:02d}.jsonl", "w") as fh:
            for r in range(per_file):
                fh.write(json.dumps({"id": f"p{f}-{r}", "text": words(rng, 20)}) + "\n")
    return root


def build(cli, corpus: Path, out: Path, *extra, **kw):
    return cli("build-index", corpus, "--out", out, *ARGS, *extra, **kw)


def one_clear_error(run, *needles: str) -> str:
    """The run ended with exit 1 and one ``Error:`` line holding ``needles``, no traceback."""
    assert run.wait() == 1, run.describe()
    assert "Traceback" not in run.stderr and "close error" not in run.stderr, run.describe()
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("Error:"), run.describe()
    for needle in needles:
        assert needle in last, (needle, run.describe())
    return last


def n_segments(out: Path) -> int:
    """Committed shards."""
    seg = out / "shards"
    return len(list(seg.glob("shard-*.commit.json"))) if seg.is_dir() else 0


def shard_files(out: Path, suffix: str) -> list[Path]:
    return sorted((out / "shards").glob(f"shard-*{suffix}"))


def assert_no_id_twice(out: Path) -> None:
    with ShardStore(out) as store:
        ids = np.concatenate([s.ids() for s in store.shards()] or [np.empty(0, np.int64)])
    assert len(ids) == len(np.unique(ids)), "a vector id is listed twice"


# -- 1. a disk that really fills up ------------------------------------------------------


def _file_size_limit(limit: int):
    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ
    return preexec


def test_disk_full_on_a_real_tmpfs_fails_clearly_and_the_rerun_has_every_vector_once(cli, tmp_path):
    """300 paragraphs, a shard every 32 vectors, built on a 5 MB tmpfs filled until
    250, 120, then 40 KB are left: each run stops with one clear error (faiss's writes,
    the Parquet files, the commit records, sqlite, the manifest: wherever the disk
    fills), every committed shard stays whole; with the space freed, the same command finishes with every chunk once.
    Where mounting is not allowed, one run has each file it writes cut at 80 KB by
    RLIMIT_FSIZE instead (EFBIG, or EIO from sqlite); that limit also applies to the
    engine's shared-memory pool, hence 2 slots (50 KB) and shards of 64 vectors (98 KB)."""
    corpus = paragraphs(tmp_path / "corpus")
    with small_tmpfs(tmp_path / "fs", 5 * 2**20) as fs:
        out = (fs or tmp_path) / "idx"
        for free_kib in (250, 120, 40) if fs is not None else (None,):
            if fs is not None:
                filler = fill_until(fs, free_kib * 1024)
                run = build(cli, corpus, out)
                last = one_clear_error(run, "No space left on device")
                filler.unlink()
            else:
                run = build(cli, corpus, out, "--num-slots", "2", "--commit-every", "64",
                            preexec_fn=_file_size_limit(80 * 1024))
                last = one_clear_error(run)
                assert "File too large" in last or "I/O error" in last, last
            assert "what was committed before is kept" in last and "run the same command again" in last
            run.assert_no_leftovers()
            check_index_files(out)  # every committed shard loads, its ids are its Parquet rows'
            assert_no_id_twice(out)
        run = build(cli, corpus, out, "--json")
        assert run.wait() == 0, run.describe()
        check_exactly_once(out, expected_chunks(corpus))
        with open_index(out) as index:  # whole vectors: each one finds itself first
            for seg in index.shards:
                vectors = faiss.downcast_index(seg.index).reconstruct_n(0, seg.ntotal)
                np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, rtol=1e-4)
                found = index.search_raw(vectors, 1)[1][:, 0]
                assert np.array_equal(found, faiss.vector_to_array(seg.id_map))


# -- 2. a tampered index folder ----------------------------------------------------------


@pytest.fixture(scope="module")
def finished_index(tmp_path_factory):
    """One small finished index for the module (a build costs seconds of CPU)."""
    root = tmp_path_factory.mktemp("finished")
    corpus = make_corpus(root / "corpus", 3, seed=12)
    run = Run(["build-index", str(corpus), "--out", str(root / "idx"), *ARGS], root / "logs",
              cwd=root, marker=str(root))
    assert run.wait() == 0, run.describe()
    run.assert_no_leftovers()
    return corpus, root / "idx"


@pytest.fixture
def built(finished_index, tmp_path):
    """A copy of the finished index and its corpus: (corpus, index folder)."""
    corpus, out = finished_index
    shutil.copytree(corpus, tmp_path / "corpus")
    shutil.copytree(out, tmp_path / "idx", symlinks=True)
    return tmp_path / "corpus", tmp_path / "idx"


def _victim(path: Path, data: bytes = b"not yours\n") -> tuple[Path, tuple]:
    path.write_bytes(data)
    st = path.stat()
    return path, (data, st.st_mtime_ns, st.st_ino)


def _untouched(victim: tuple[Path, tuple]) -> None:
    path, (data, mtime, ino) = victim
    st = path.stat()
    assert (path.read_bytes(), st.st_mtime_ns, st.st_ino) == (data, mtime, ino), f"{path} was changed"
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name)) == [path.name]


def _forged(out: Path, name: str, record: dict) -> Path:
    path = out / "shards" / f"{name}.commit.json"
    path.write_text(json.dumps({"format": 2, "name": name, "rows": 1, "id_min": 0, "id_max": 0,
                                "units": [[], []], **record}))
    return path


def test_a_forged_commit_record_is_refused_never_followed(cli, tmp_path, built):
    """Commit records whose file entries or replaced shards name paths outside the
    shards folder: search refuses the index naming the record and saying what to delete;
    the build deletes the record (a damaged shard: its units would be redone) and never
    reads, writes or deletes the paths it names."""
    corpus, out = built
    victim = _victim(tmp_path / "victim.txt")
    forged = {"shard-x-w0-00000": {"files": {"faiss": {"name": "../../victim.txt", "size": 10}}},
              "shard-x-w0-00001": {"files": {}, "replaces": ["../../victim.txt"]}}
    for name, record in forged.items():
        path = _forged(out, name, record)
        last = one_clear_error(cli("search", out, "river"), path.name, "delete that shard")
        assert "commit record" in last, last
        run = build(cli, corpus, out)
        assert run.wait() == 0, run.describe()
        assert not path.exists()  # deleted as a damaged shard; what it names is never touched
        _untouched(victim)
    check_exactly_once(out, expected_chunks(corpus))


def test_links_in_the_index_folder_are_never_written_through(cli, tmp_path, built):
    """``.run.lock`` as a link to another file: the build is refused and the file stays as
    it was (it was truncated and given the build's pid). ``units.sqlite`` as a link to
    another database: the build is refused, the database stays as it was. ``shards/`` as
    a link to another folder: build and search are refused, nothing in that folder is
    written or deleted (a temporary-looking file there stays). A shard's file as a link
    to a file outside: a damaged shard (never read through); the build deletes the link,
    not its target. Hard links and ``.writers.lock``: tests/index/test_lock.py."""
    corpus, out = built
    victim = _victim(tmp_path / "victim.txt")
    (out / ".run.lock").unlink()
    (out / ".run.lock").symlink_to(victim[0])
    one_clear_error(build(cli, corpus, out), ".run.lock", "not a lock file embedingest made")
    _untouched(victim)
    (out / ".run.lock").unlink()

    other = tmp_path / "other.sqlite"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE mine(x)")
    db.commit()
    db.close()
    victim = (other, (other.read_bytes(), other.stat().st_mtime_ns, other.stat().st_ino))
    os.rename(out / "units.sqlite", tmp_path / "kept.sqlite")
    (out / "units.sqlite").symlink_to(other)
    one_clear_error(build(cli, corpus, out), "units.sqlite", "symbolic link")
    _untouched(victim)
    (out / "units.sqlite").unlink()
    os.rename(tmp_path / "kept.sqlite", out / "units.sqlite")

    outside = tmp_path / "outside"
    os.rename(out / "shards", outside)
    (out / "shards").symlink_to(outside)
    stale = _victim(outside / ".shard-x-w0-00000.parquet.tmp-1")
    listing = sorted(os.listdir(outside))
    one_clear_error(build(cli, corpus, out), "shards", "symbolic link")
    one_clear_error(cli("search", out, "river"), "shards", "symbolic link")
    assert sorted(os.listdir(outside)) == listing
    _untouched(stale)
    stale[0].unlink()
    (out / "shards").unlink()
    os.rename(outside, out / "shards")

    # a shard's Parquet file replaced by a link to a copy outside: a damaged shard, read
    # by nothing; the build deletes the link (not the file) and redoes the shard's units
    parquet = shard_files(out, ".parquet")[0]
    victim = _victim(tmp_path / "copy.parquet", parquet.read_bytes())
    parquet.unlink()
    parquet.symlink_to(victim[0])
    one_clear_error(cli("search", out, "river"), parquet.name, "not a regular file", "delete that shard")
    run = build(cli, corpus, out)
    assert run.wait() == 0, run.describe()
    assert not parquet.is_symlink()
    _untouched(victim)
    check_exactly_once(out, expected_chunks(corpus))


def _state(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino)
            for p in sorted(folder.rglob("*"))}


def test_search_creates_and_changes_nothing_and_needs_no_units_database(cli, tmp_path, built):
    """search reads the shards only: the folder is the same after it (no file created,
    none changed), and it answers from the shards with ``units.sqlite`` gone (it is not
    made again); the build after that redoes the units no row names, and the index is
    whole again."""
    corpus, out = built
    before = _state(out)
    run = cli("search", out, "river", "-k", "3", "--json")
    assert run.wait() == 0, run.describe()
    hits = json.loads(run.stdout)
    assert len(hits) == 3 and all(h["text"] for h in hits)
    assert _state(out) == before

    (out / "units.sqlite").unlink()
    before = _state(out)
    with open_index(out) as index:
        again = index.search_vectors(np.ones((1, 384), np.float32), 1000)[0]
    assert len(again) == sum(expected_chunks(corpus).values()) and all(h.text for h in again)
    assert _state(out) == before and not (out / "units.sqlite").exists()
    run = build(cli, corpus, out)
    assert run.wait() == 0, run.describe()
    check_exactly_once(out, expected_chunks(corpus))


def test_segment_never_writes_or_deletes_through_a_link_in_its_output(cli, tmp_path):
    """A folder of the output tree that is a link to another folder: the run stops with a
    clear error, no mask (nor anything else) lands in the other folder, and a temporary-
    looking file there is not deleted; a mask name that is a link to a file is replaced
    by the mask, the file it pointed to untouched."""
    from PIL import Image

    images = tmp_path / "images"
    (images / "a").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for rel in ("top.png", "a/inner.png"):
        Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(images / rel)
    out = tmp_path / "masks"
    out.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    stale = _victim(outside / ".inner.png.png.tmp-1")
    (out / "a").symlink_to(outside)
    victim = _victim(tmp_path / "victim.png")
    (out / "top.png.png").symlink_to(victim[0])
    args = ["segment", images, "--out", out, "--arch", "deeplabv3_mobilenet_v3_large",
            "--random-weights", "--size", "64", "--batch-size", "1", "--device", "cpu",
            "--num-workers", "0", "--num-consumers", "1"]
    one_clear_error(cli(*args), "symbolic link")
    assert sorted(os.listdir(outside)) == [stale[0].name]
    _untouched(stale)
    _untouched(victim)
    (out / "a").unlink()
    run = cli(*args)
    assert run.wait() == 0, run.describe()
    assert not (out / "top.png.png").is_symlink()
    assert Image.open(out / "top.png.png").size == (50, 40)
    assert Image.open(out / "a" / "inner.png.png").size == (50, 40)
    _untouched(victim)


# -- 3. a damaged folder, a killed build ---------------------------------------------------


def _cut(path: Path, keep: float) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def _garbage(path: Path, size: int = 5000) -> None:
    path.write_bytes(random.Random(3).randbytes(size))


def _same_size_garbage(path: Path) -> None:
    _garbage(path, path.stat().st_size)


def _manifest(out: Path, **changes) -> None:
    data = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**data, **changes}))


_ADVICE = r"delete that shard's files \(every file named shard-.*\) and run the same build-index command again"

DAMAGE = {
    "truncated faiss": (lambda out: _cut(shard_files(out, ".faiss")[0], 0.5),
                        r"shard-.*damaged: its faiss file 'shard-.*\.faiss' holds .*; " + _ADVICE),
    "faiss cut by one byte": (lambda out: _cut(shard_files(out, ".faiss")[0], 0.9999),
                              r"shard-.*damaged: its faiss file 'shard-.*\.faiss'.*" + _ADVICE),
    "garbage faiss of the same size": (lambda out: _same_size_garbage(shard_files(out, ".faiss")[-1]),
                                       r"shard-.*\.faiss.*damaged.*delete"),
    "missing parquet": (lambda out: shard_files(out, ".parquet")[0].unlink(),
                        r"shard-.*damaged: its parquet file 'shard-.*\.parquet' cannot be read.*" + _ADVICE),
    "garbage parquet of the same size": (lambda out: _same_size_garbage(shard_files(out, ".parquet")[-1]),
                                         r"shard-.*\.parquet.*damaged.*delete"),
    "garbage commit record": (lambda out: _garbage(shard_files(out, ".commit.json")[0]),
                              r"commit record '.*shard-.*\.commit\.json'.*" + _ADVICE),
    "manifest dim a string": (lambda out: _manifest(out, dim="384"), r"manifest.json: dim is '384'"),
    "manifest segments a number": (lambda out: _manifest(out, segments=5), r"manifest.json: segments is 5"),
    "manifest model a string": (lambda out: _manifest(out, model="m"), r"manifest.json: model is 'm'"),
    "manifest metric a number": (lambda out: _manifest(out, metric=3), r"manifest.json: metric is 3"),
}


def test_search_of_a_damaged_index_says_which_file_and_what_to_do(cli, tmp_path, built):
    """Each damage, in a copy of a finished index: ``embedingest search`` ends with one
    clear error naming the file and what to do, ``open_index`` raises ConfigError;
    following the advice for a damaged shard (delete its files, build again) gives back
    the whole index."""
    import re

    corpus, out = built
    query = np.zeros((1, 384), np.float32)
    query[0, 0] = 1
    kinds = set()
    for n, (name, (damage, message)) in enumerate(DAMAGE.items()):
        copy = tmp_path / f"damaged{n}"
        shutil.copytree(out, copy)
        damage(copy)
        kind = name.split()[1] if name.startswith("manifest") else name
        if kind not in kinds:  # one CLI run of each kind of file
            kinds.add(kind)
            last = one_clear_error(cli("search", copy, "river", "-k", "3"))
            assert re.search(message, last), (name, last)
        with pytest.raises(ConfigError, match=message):
            with open_index(copy) as index:
                index.search_vectors(query, 1000)
    copy = tmp_path / "damaged0"  # the truncated faiss file: as its message says
    name = shard_files(copy, ".faiss")[0].name[: -len(".faiss")]
    for path in (copy / "shards").glob(f"{name}.*"):
        path.unlink()
    run = build(cli, corpus, copy)
    assert run.wait() == 0, run.describe()
    check_exactly_once(copy, expected_chunks(corpus))


def test_a_build_deletes_damaged_shards_itself_and_redoes_their_units(cli, tmp_path, built):
    """The build needs no hand work: a truncated faiss file, a missing Parquet file and a
    commit record of garbage are each a damaged shard, deleted by the next build, whose
    units are redone; the index then holds every chunk once."""
    corpus, out = built
    _cut(shard_files(out, ".faiss")[0], 0.5)
    shard_files(out, ".parquet")[1].unlink()
    _garbage(shard_files(out, ".commit.json")[-1])
    run = build(cli, corpus, out, "--json")
    assert run.wait() == 0, run.describe()
    assert json.loads(run.stdout)["units_indexed"] >= 1
    check_exactly_once(out, expected_chunks(corpus))


def test_search_right_after_a_killed_build_answers_from_whole_shards(cli, tmp_path):
    """The build is killed (SIGKILL of the main process) after its first commits; its
    consumers commit what they hold. Rows and vectors are committed together, so search
    answers at once: every committed vector is found with its own row (a committed
    chunk's own text finds it first), nothing else. The re-run finishes the index."""
    corpus = make_corpus(tmp_path / "corpus", 6, seed=13)
    out = tmp_path / "idx"
    run = build(cli, corpus, out, "--commit-every", "4", "--batch-size", "4")
    wait_for(lambda: n_segments(out) >= 3 or not run.running(), 120, 0.005, "three commits")
    assert run.running(), run.describe()
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL, run.describe()
    run.assert_no_leftovers()
    check_index_files(out)
    with ShardStore(out, read_only=True) as store:
        ids = np.concatenate([s.ids() for s in store.shards()] or [np.empty(0, np.int64)])
        rows = store.chunks(ids.tolist())
    assert len(ids) >= 1 and len(rows) == len(ids) and all(r.text for r in rows.values())
    first = int(ids[0])
    run = cli("search", out, rows[first].text, "-k", "1000", "--json")
    assert run.wait() == 0, run.describe()
    hits = json.loads(run.stdout)
    assert hits[0]["id"] == first, (hits[0], first)
    assert sorted(h["id"] for h in hits) == sorted(ids.tolist()) and all(h["text"] for h in hits)
    run = build(cli, corpus, out, "--commit-every", "4", "--batch-size", "4")
    assert run.wait() == 0, run.describe()
    ids = check_exactly_once(out, expected_chunks(corpus))
    with open_index(out) as index:
        hits = index.search_vectors(np.ones((1, 384), np.float32), 1000)[0]
    assert sorted(h.id for h in hits) == sorted(ids.tolist()) and all(h.text for h in hits)

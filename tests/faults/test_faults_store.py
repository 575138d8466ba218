"""The index and output folders under attack, through the real CLI: a disk that really
fills up, a folder tampered with (links, a forged removal journal), a folder damaged or
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
from embedingest.index.store import CHUNK_BITS, IndexStore

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
    seg = out / "segments"
    return len(list(seg.glob("seg-*.faiss"))) if seg.is_dir() else 0


def assert_no_id_twice(out: Path) -> None:
    with IndexStore(out) as store:
        ids = np.concatenate([s.ids() for s in store.shards()] or [np.empty(0, np.int64)])
    assert len(ids) == len(np.unique(ids)), "a vector id is listed twice"


# -- 1. a disk that really fills up ------------------------------------------------------


def _file_size_limit(limit: int):
    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ
    return preexec


def test_disk_full_on_a_real_tmpfs_fails_clearly_and_the_rerun_has_every_vector_once(cli, tmp_path):
    """300 paragraphs, a segment every 32 vectors, built on a 5 MB tmpfs filled until
    250, 120, then 40 KB are left: each run stops with one clear error (faiss's writes,
    the sidecars, sqlite, the manifest: wherever the disk fills), everything committed
    stays whole; with the space freed, the same command finishes with every chunk once.
    Where mounting is not allowed, one run has each file it writes cut at 80 KB by
    RLIMIT_FSIZE instead (EFBIG, or EIO from sqlite); that limit also applies to the
    engine's shared-memory pool, hence 2 slots (50 KB) and segments of 64 vectors (98 KB)."""
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
            check_index_files(out)  # every committed segment loads, ids equal its sidecar
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


def test_a_forged_removal_journal_is_refused_never_followed(cli, tmp_path, built):
    corpus, out = built
    victim = _victim(tmp_path / "victim.txt")
    journal = out / "segments" / "replacing.json"
    journal.write_text(json.dumps({"replace": [["../../victim.txt", None]]}))
    one_clear_error(build(cli, corpus, out), "replacing.json", "delete it")
    one_clear_error(cli("search", out, "river"), "replacing.json", "delete it")
    _untouched(victim)
    journal.unlink()  # as the message says (the rest: tests/index/test_store.py)
    check_exactly_once(out, expected_chunks(corpus))


def test_links_in_the_index_folder_are_never_written_through(cli, tmp_path, built):
    """``.run.lock`` as a link to another file: the build is refused and the file stays as
    it was (it was truncated and given the build's pid). ``metadata.sqlite`` as a link to
    another database: build and search are refused, the database stays as it was (search
    added its tables and switched it to WAL). Hard links, ``.writers.lock``, the
    journal files and ``segments/``: tests/index/test_lock.py and test_store.py."""
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
    os.rename(out / "metadata.sqlite", tmp_path / "kept.sqlite")
    (out / "metadata.sqlite").symlink_to(other)
    one_clear_error(build(cli, corpus, out), "metadata.sqlite", "symbolic link")
    one_clear_error(cli("search", out, "river"), "metadata.sqlite", "symbolic link")
    _untouched(victim)
    (out / "metadata.sqlite").unlink()
    os.rename(tmp_path / "kept.sqlite", out / "metadata.sqlite")
    check_exactly_once(out, expected_chunks(corpus))


def test_search_creates_nothing_and_leaves_the_journal_mode(cli, tmp_path, built):
    """search opens the metadata read-only: a database in rollback-journal mode stays so
    (search switched it to WAL), and where none exists none is made (search made an empty
    one); the error says to finish the build, and that build gives the whole index back."""
    corpus, out = built
    db = sqlite3.connect(out / "metadata.sqlite")
    assert db.execute("PRAGMA journal_mode=DELETE").fetchone() == ("delete",)
    db.close()
    with open_index(out) as index:
        hits = index.search_vectors(np.ones((1, 384), np.float32), 3)[0]
    assert len(hits) == 3 and all(h.text for h in hits)
    db = sqlite3.connect(out / "metadata.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    db.close()
    assert not (out / "metadata.sqlite-wal").exists()

    (out / "metadata.sqlite").unlink()
    one_clear_error(cli("search", out, "river"), "metadata.sqlite", "does not exist",
                    "run the same build-index command again")
    assert not (out / "metadata.sqlite").exists()
    run = build(cli, corpus, out)  # as the message says: the vectors without rows are redone
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


def _cut_first_segment(out: Path, keep: float) -> None:
    seg = sorted((out / "segments").glob("seg-*.faiss"))[0]
    seg.write_bytes(seg.read_bytes()[: int(seg.stat().st_size * keep)])


def _garbage(path: Path) -> None:
    path.write_bytes(random.Random(3).randbytes(5000))


def _manifest(out: Path, **changes) -> None:
    data = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**data, **changes}))


DAMAGE = {
    "truncated segment": (lambda out: _cut_first_segment(out, 0.5), r"seg-.*\.faiss.*damaged.*delete that shard"),
    "segment cut by one id": (lambda out: _cut_first_segment(out, 0.999), r"seg-.*\.faiss.*damaged"),
    "garbage segment": (lambda out: _garbage(sorted((out / "segments").glob("seg-*.faiss"))[-1]),
                        r"seg-.*\.faiss.*damaged"),
    "garbage sidecar": (lambda out: _garbage(sorted((out / "segments").glob("seg-*.ids.npy"))[0]),
                        r"ids sidecar"),
    "garbage metadata": (lambda out: _garbage(out / "metadata.sqlite"), r"metadata.sqlite.*damaged.*--overwrite"),
    "manifest dim a string": (lambda out: _manifest(out, dim="384"), r"manifest.json: dim is '384'"),
    "manifest segments a number": (lambda out: _manifest(out, segments=5), r"manifest.json: segments is 5"),
    "manifest format a string": (lambda out: _manifest(out, format="1"), r"manifest.json: format is '1'"),
    "manifest model a string": (lambda out: _manifest(out, model="m"), r"manifest.json: model is 'm'"),
    "manifest metric a number": (lambda out: _manifest(out, metric=3), r"manifest.json: metric is 3"),
    "journal not JSON": (lambda out: (out / "segments" / "replacing.json").write_text("{broken"),
                         r"replacing.json.*delete it"),
    "journal of a number": (lambda out: (out / "segments" / "replacing.json").write_text('{"replace": 5}'),
                            r"replacing.json.*delete it"),
    "journal of a short pair": (lambda out: (out / "segments" / "replacing.json").write_text(
        '{"replace": [["seg-a-w0-00000.faiss"]]}'), r"replacing.json.*delete it"),
}


def test_search_of_a_damaged_index_says_which_file_and_what_to_do(cli, tmp_path, built):
    """Each damage, in a copy of a finished index: ``embedingest search`` ends with one
    clear error naming the file, ``open_index`` raises ConfigError; following the advice
    for a damaged segment (delete it, build again) gives back the whole index."""
    import re

    corpus, out = built
    query = np.zeros((1, 384), np.float32)
    query[0, 0] = 1
    kinds = set()
    for n, (name, (damage, message)) in enumerate(DAMAGE.items()):
        copy = tmp_path / f"damaged{n}"
        shutil.copytree(out, copy)
        damage(copy)
        if name.split()[-1] not in kinds:  # one CLI run of each kind (segment, metadata ...)
            kinds.add(name.split()[-1])
            last = one_clear_error(cli("search", copy, "river", "-k", "3"))
            assert re.search(message, last), (name, last)
        with pytest.raises(ConfigError, match=message):
            with open_index(copy) as index:
                index.search_vectors(query, 1000)
    copy = tmp_path / "damaged0"  # the truncated segment: as its message says
    seg = sorted((copy / "segments").glob("seg-*.faiss"))[0]
    seg.unlink()
    seg.with_name(seg.name[: -len(".faiss")] + ".ids.npy").unlink()
    run = build(cli, corpus, copy)
    assert run.wait() == 0, run.describe()
    check_exactly_once(copy, expected_chunks(corpus))


def _rows_of_committed(out: Path) -> list[tuple[int, str]]:
    with IndexStore(out, read_only=True) as store:
        ids = np.concatenate([s.ids() for s in store.shards()] or [np.empty(0, np.int64)])
        rows = store.chunks(ids.tolist())
    return [(i, rows[i].text) for i in ids.tolist() if i in rows]


def test_search_right_after_a_killed_build_answers_or_says_to_finish_it(cli, tmp_path):
    """The build is killed (SIGKILL of the main process) after its first commits, so its
    consumers commit vectors whose rows the main process had not written: search
    answers (a committed chunk's own text finds it first) or says to finish the build,
    never a traceback. The same state made certain (the rows of a committed segment
    deleted) always gets the "finish the build" error; the re-run finishes it."""
    corpus = make_corpus(tmp_path / "corpus", 6, seed=13)
    out = tmp_path / "idx"
    run = build(cli, corpus, out, "--commit-every", "4", "--batch-size", "4")
    wait_for(lambda: n_segments(out) >= 3 or not run.running(), 120, 0.005, "three commits")
    assert run.running(), run.describe()
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL, run.describe()
    run.assert_no_leftovers()
    committed = _rows_of_committed(out)
    run = cli("search", out, committed[0][1] if committed else "river", "-k", "1000", "--json")
    rc = run.wait()
    if rc == 0:
        hits = json.loads(run.stdout)
        assert all(h["text"] for h in hits)
        if committed:
            assert hits[0]["id"] == committed[0][0], (hits[0], committed[0])
    else:
        one_clear_error(run, "no metadata row", "run the same build-index command again")

    with IndexStore(out) as store:  # what the kill leaves when no row of a unit was written
        unit = int(store.shards()[0].ids()[0] >> CHUNK_BITS)
        store.db.execute(f"DELETE FROM chunks WHERE id >> {CHUNK_BITS} = ?", (unit,))
        store.db.execute("UPDATE units SET status='pending' WHERE unit_no = ?", (unit,))
        store.db.commit()
    with pytest.raises(ConfigError, match="no metadata row.*run the same build-index command again"):
        with open_index(out) as index:
            index.search_vectors(np.ones((1, 384), np.float32), 1000)
    run = build(cli, corpus, out, "--commit-every", "4", "--batch-size", "4")
    assert run.wait() == 0, run.describe()
    ids = check_exactly_once(out, expected_chunks(corpus))
    with open_index(out) as index:
        hits = index.search_vectors(np.ones((1, 384), np.float32), 1000)[0]
    assert sorted(h.id for h in hits) == sorted(ids.tolist()) and all(h.text for h in hits)

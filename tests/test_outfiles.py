"""Output files: whole or absent, on a disk that really fills up, and never through a link."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import faiss
import numpy as np
import pytest
from fault_helpers import small_tmpfs

from embedingest.errors import ConfigError
from embedingest import outfiles
from embedingest.outfiles import (
    NAME_MAX,
    PATH_MAX,
    atomic_write_bytes,
    ensure_folder,
    is_tmp_name,
    json_bytes,
    native_path,
    through_link,
    too_long,
    write_faiss_index,
    write_streamed,
)

PAGE = os.sysconf("SC_PAGE_SIZE")


def flat_index(n: int, dim: int = 384) -> faiss.Index:
    index = faiss.IndexIDMap(faiss.IndexFlatIP(dim))
    index.add_with_ids(np.random.default_rng(0).standard_normal((n, dim), dtype=np.float32),
                       np.arange(n, dtype=np.int64))
    return index


def _faiss_bytes(index) -> bytes:
    return faiss.serialize_index(index).tobytes()


# The disk fills up during faiss's last flush: faiss's own file writer buffers the tail of
# the file (under a page) and writes it when the file is closed, where a failure is only
# printed ("close error: No space left on device"); the short file then got renamed into
# place and every later read failed (read_xb_vector ...). A filesystem with room for the
# whole pages of the file but not its tail makes exactly that happen.
WRITE_IN_FULL_FS = textwrap.dedent("""
    import os, resource, sys
    import faiss, numpy as np
    from embedingest.outfiles import write_faiss_index
    folder, limit = sys.argv[1], int(sys.argv[2])
    if limit:  # no tmpfs: each file this process writes stops at ``limit`` bytes (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    index = faiss.IndexIDMap(faiss.IndexFlatIP(384))
    index.add_with_ids(np.random.default_rng(0).standard_normal((32, 384), dtype=np.float32),
                       np.arange(32, dtype=np.int64))
    try:
        write_faiss_index(index, os.path.join(folder, "seg.faiss"))
    except OSError as exc:
        print("raised", exc.errno)
""")


def test_faiss_write_error_at_the_last_flush_raises_and_renames_nothing(tmp_path):
    """On a real tmpfs with room for every page of a segment but its tail (where mounting
    is not allowed: the same write cut by RLIMIT_FSIZE at that size), writing the
    segment raises ENOSPC (EFBIG), and no file, whole or short, is left."""
    size = len(_faiss_bytes(flat_index(32)))
    assert size % PAGE, "the tail must be a part page for the last flush to fail"
    whole_pages = size // PAGE * PAGE
    with small_tmpfs(tmp_path / "fs", whole_pages) as fs:
        folder, limit = (fs, 0) if fs is not None else (tmp_path, whole_pages)
        proc = subprocess.run([sys.executable, "-c", WRITE_IN_FULL_FS, str(folder), str(limit)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["raised", str(errno.ENOSPC if fs is not None else errno.EFBIG)], \
            proc.stdout + proc.stderr
        assert sorted(os.listdir(folder)) == [], os.listdir(folder)


def test_faiss_index_written_whole_equals_faiss_own_bytes(tmp_path):
    index = flat_index(50, dim=16)
    write_faiss_index(index, tmp_path / "a.faiss")
    assert (tmp_path / "a.faiss").read_bytes() == _faiss_bytes(index)
    assert faiss.read_index(str(tmp_path / "a.faiss")).ntotal == 50
    assert os.listdir(tmp_path) == ["a.faiss"]


def test_a_streamed_file_goes_to_the_disk_while_it_is_written(tmp_path, monkeypatch):
    """Every SYNC_AHEAD_BYTES written, a background fdatasync of the temporary file starts,
    so the final fsync waits for the last part only; the bytes are those produced."""
    synced = []
    real = os.fdatasync

    def fdatasync(fd):
        synced.append(os.fstat(fd).st_size)
        real(fd)

    monkeypatch.setattr(outfiles, "SYNC_AHEAD_BYTES", 1000)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    chunks = [bytes([i]) * 400 for i in range(10)]
    write_streamed(tmp_path / "big.bin", lambda write: [write(chunk) for chunk in chunks])
    assert (tmp_path / "big.bin").read_bytes() == b"".join(chunks)
    assert synced and synced[0] == 1200 and all(size % 400 == 0 for size in synced)
    assert os.listdir(tmp_path) == ["big.bin"]


def test_sync_ahead_starts_one_sync_per_step_and_never_two_at_once(tmp_path, monkeypatch):
    """One sync after each SYNC_AHEAD_BYTES (counted from the last start); while one runs,
    none other starts, and the bytes written meanwhile count towards the next."""
    import threading

    started, release = threading.Event(), threading.Event()
    synced = []

    def fdatasync(fd):
        synced.append(os.fstat(fd).st_size)
        started.set()
        release.wait(10)

    monkeypatch.setattr(outfiles, "SYNC_AHEAD_BYTES", 1000)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    with open(tmp_path / "f", "wb") as fh, outfiles._SyncAhead(fh) as ahead:
        for _ in range(3):
            fh.write(b"a" * 500)
            ahead.wrote(500)
        first = ahead.running
        assert started.wait(10)
        for _ in range(4):  # 2,000 more bytes while the first sync is held
            fh.write(b"b" * 500)
            ahead.wrote(500)
        assert ahead.running is first and synced == [1000]
        release.set()
        first.result()
        fh.write(b"c" * 10)
        ahead.wrote(10)  # 2,510 since the first start: the second starts now
        ahead.running.result()
        fh.write(b"d" * 500)
        ahead.wrote(500)  # counted from the second start: no third yet
        assert ahead.running.done()
    assert synced == [1000, 3510]


def test_a_failed_sync_ahead_fails_the_write_and_commits_nothing(tmp_path, monkeypatch):
    """The kernel reports a write-back error to one fsync only: the background one's must
    fail the file (no file at the final name, no temporary left)."""
    def fdatasync(fd):
        raise OSError(errno.EIO, "write-back failed")

    monkeypatch.setattr(outfiles, "SYNC_AHEAD_BYTES", 100)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    with pytest.raises(OSError, match="write-back failed"):
        write_streamed(tmp_path / "x.bin", lambda write: [write(b"y" * 60) for _ in range(5)])
    assert os.listdir(tmp_path) == []
    # the last write starts the sync that fails: raised on leaving, not by a later write
    with pytest.raises(OSError, match="write-back failed"):
        write_streamed(tmp_path / "z.bin", lambda write: [write(b"y" * 60) for _ in range(2)])
    assert os.listdir(tmp_path) == []


PEAK = textwrap.dedent("""
    import faiss, numpy as np, sys
    from embedingest.outfiles import write_faiss_index
    index = faiss.IndexIDMap(faiss.IndexFlatIP(384))
    index.add_with_ids(np.zeros((100_000, 384), np.float32), np.arange(100_000))
    def kib(key):
        return int(open("/proc/self/status").read().split(key + ":")[1].split()[0])
    open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
    before = kib("VmRSS")
    write_faiss_index(index, sys.argv[1])
    print(kib("VmHWM") - before)
""")


def test_writing_a_large_segment_holds_no_second_copy(tmp_path):
    """A 150 MB segment is written streamed: peak memory grows by a few MB, not by the
    size of the index (faiss.serialize_index would add it twice)."""
    proc = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "big.faiss")],
                          capture_output=True, text=True, timeout=120, check=True)
    grown_mib = int(proc.stdout) / 1024
    assert (tmp_path / "big.faiss").stat().st_size > 150e6
    assert grown_mib < 16, f"peak memory grew by {grown_mib:.0f} MiB while writing"


REPLACE_IN_FULL_FS = textwrap.dedent("""
    import os, resource, sys
    from embedingest.outfiles import atomic_write_bytes
    folder, limit, page = sys.argv[1], int(sys.argv[2]), os.sysconf("SC_PAGE_SIZE")
    atomic_write_bytes(os.path.join(folder, "manifest.json"), b"old")
    if limit:  # no tmpfs: each file this process writes stops at ``limit`` bytes (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        atomic_write_bytes(os.path.join(folder, "manifest.json"), b"x" * 5 * page)
    except OSError as exc:
        print("raised", exc.errno)
""")


def test_a_full_disk_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    """The manifest, skip report, masks ... on a real full tmpfs (else a file cut by
    RLIMIT_FSIZE): the write raises, the previous version stays whole, no temporary file."""
    with small_tmpfs(tmp_path / "fs", 4 * PAGE) as fs:
        folder, limit = (fs, 0) if fs is not None else (tmp_path, 4 * PAGE)
        proc = subprocess.run([sys.executable, "-c", REPLACE_IN_FULL_FS, str(folder), str(limit)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.stdout.split() == ["raised", str(errno.ENOSPC if fs is not None else errno.EFBIG)], \
            proc.stdout + proc.stderr
        assert os.listdir(folder) == ["manifest.json"]
        assert (folder / "manifest.json").read_bytes() == b"old"


def test_links_at_the_final_or_temporary_name_are_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / "skipped.jsonl").symlink_to(victim)
    (out / f".a.png.tmp-{os.getpid()}").symlink_to(victim)
    atomic_write_bytes(out / "skipped.jsonl", b"new")
    atomic_write_bytes(out / "a.png", b"mask")
    assert victim.read_bytes() == b"keep"
    assert not (out / "skipped.jsonl").is_symlink() and (out / "skipped.jsonl").read_bytes() == b"new"
    assert sorted(os.listdir(out)) == ["a.png", "skipped.jsonl"]


def test_output_folders_never_go_through_a_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    ensure_folder(out, out / "a" / "b")
    assert (out / "a" / "b").is_dir()
    (out / "a" / "link").symlink_to(outside)
    with pytest.raises(ConfigError, match="link.*symbolic link"):
        ensure_folder(out, out / "a" / "link" / "c")
    with pytest.raises(ConfigError, match="not a plain path"):
        ensure_folder(out, out / "a" / ".." / "..")
    assert list(outside.iterdir()) == []
    assert through_link(out, out / "a" / "link" / "c") and not through_link(out, out / "a" / "b")
    assert through_link(out, out / ".." / "x")


@pytest.mark.parametrize("name", ["a" * 255, "b" * 200 + ".png", "é" * 127, "x" * 230 + ".overlay.jpg"])
def test_a_name_that_fits_can_be_written_however_long(tmp_path, name):
    """The temporary name (``.<name>.tmp-<pid>``) of a name near the limit would pass it:
    it keeps the name's start and a digest, stays a temporary name, and the write goes
    through."""
    target = tmp_path / name
    tmp = outfiles.tmp_path(target)
    assert len(os.fsencode(tmp.name)) <= NAME_MAX and is_tmp_name(tmp.name) and tmp.parent == tmp_path
    atomic_write_bytes(target, b"data")
    assert target.read_bytes() == b"data" and os.listdir(tmp_path) == [name]


def test_only_the_names_tmp_path_makes_are_temporary_names():
    """Any name starting with "." and holding ".tmp-" was one: a user's ``.draft.tmp-3.txt``
    or ``.mine.tmp-2`` in an output folder was deleted as a killed run's leftover."""
    png = str.endswith  # of masks: names ending .png
    assert is_tmp_name(".a.png.tmp-12") and is_tmp_name(".a.png.tmp-12", of=lambda n: png(n, ".png"))
    assert is_tmp_name(".mine.tmp-2") and not is_tmp_name(".mine.tmp-2", of=lambda n: png(n, ".png"))
    for name in (".draft.tmp-3.txt", ".tmp-3", "..tmp-3", "a.png.tmp-3", ".a.png.tmp-", ".a.png.tmp-x1"):
        assert not is_tmp_name(name), name
    long = outfiles.tmp_path(pathlib.Path("x" * 250 + ".png")).name
    assert "~" in long and is_tmp_name(long, of=lambda n: False)  # a digest stands for the name


def test_long_names_get_distinct_temporary_names_and_short_ones_keep_theirs(tmp_path):
    a, b = tmp_path / ("n" * 250 + "1"), tmp_path / ("n" * 250 + "2")
    assert outfiles.tmp_path(a) != outfiles.tmp_path(b)
    assert outfiles.tmp_path(tmp_path / "x.png").name == f".x.png.tmp-{os.getpid()}"


def test_too_long_names_the_limit_a_name_or_path_passes():
    assert too_long("/out/" + "a" * NAME_MAX) is None
    assert too_long("/out/" + "a" * (NAME_MAX + 1)) == (
        f"name too long: its output {'a' * 256!r} would be 256 bytes, over the 255 a file name may have; "
        "rename the input")
    assert too_long("/out/" + "é" * 128).startswith("name too long: ") and too_long("/out/" + "é" * 127) is None
    deep = "/out" + "/" + "/".join(["d" * 200] * 20)
    assert len(deep) < PATH_MAX and too_long(deep) is None
    deeper = deep + "/" + "e" * (PATH_MAX - len(deep) - 1)
    longest = len(os.fsencode(outfiles.tmp_path(pathlib.Path(deeper))))
    assert len(os.fsencode(deeper)) == PATH_MAX and longest > PATH_MAX and too_long(deeper) == (
        f"name too long: its output path would be {longest} bytes, over the 4095 a path may have; give a "
        "shorter --out or a shallower input folder")
    # the path fits, its temporary name (written first) would not
    tight = deep + "/" + "f" * (PATH_MAX - len(deep) - 5)
    assert len(tight) < PATH_MAX and too_long(tight).startswith("name too long: its output path would be ")


def test_native_path_names_a_file_faiss_and_arrow_can_open(tmp_path):
    """A folder named in Latin-1 has no UTF-8 text, which faiss's and Arrow's bindings
    take: the file is opened and named by /proc/self/fd for the block."""
    plain = tmp_path / "plain.faiss"
    faiss.write_index(flat_index(3, 8), str(plain))
    with native_path(plain) as name:
        assert name == str(plain)
    folder = os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9")
    os.mkdir(folder)
    odd = os.path.join(folder, "shard.faiss")
    with open(plain, "rb") as src, open(odd, "wb") as dst:
        dst.write(src.read())
    with native_path(odd) as name:
        assert name.startswith("/proc/self/fd/") and faiss.read_index(name).ntotal == 3
        fd = int(name.rsplit("/", 1)[1])
    with pytest.raises(OSError):
        os.fstat(fd)  # closed after the block


def test_json_bytes_keeps_text_readable_and_round_trips_what_utf8_cannot_hold():
    assert json_bytes({"a": "café"}) == '{\n  "a": "café"\n}\n'.encode()
    odd = {"corpus_path": os.fsdecode(b"/data/caf\xe9")}
    data = json_bytes(odd)
    assert data.isascii() and json.loads(data) == odd

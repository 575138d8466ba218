"""The run lock of an index folder: one build at a time, and none before the last
build's segment writers are gone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from embedingest.index.lock import IndexBusy, RunLock


def writer_process(folder, seconds: float) -> subprocess.Popen:
    """A process that holds the writers lock like a consumer finishing its last commit."""
    code = textwrap.dedent(f"""
        import sys, time
        from embedingest.index.lock import hold_writer_lock
        fd = hold_writer_lock({str(folder)!r})
        print("held", flush=True)
        time.sleep({seconds})
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_build_of_a_folder_fails_naming_the_holder(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(IndexBusy, match=rf"pid {__import__('os').getpid()}\b"):
            RunLock(tmp_path).__enter__()
    with RunLock(tmp_path):  # released on exit
        pass


def test_run_waits_for_the_writers_of_a_killed_build(tmp_path):
    proc = writer_process(tmp_path, 0.8)
    t0 = time.monotonic()
    with RunLock(tmp_path):
        waited = time.monotonic() - t0
        assert proc.poll() is not None, "entered while a writer still held the folder"
    assert 0.3 < waited < 10


def test_writer_killed_releases_at_once(tmp_path):
    proc = writer_process(tmp_path, 60)
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    with RunLock(tmp_path, writers_timeout=5):
        assert time.monotonic() - t0 < 1


def test_writers_that_never_finish_give_a_clear_error(tmp_path):
    proc = writer_process(tmp_path, 60)
    try:
        with pytest.raises(IndexBusy, match=r"fuser .*\.writers\.lock"):
            RunLock(tmp_path, writers_timeout=0.3).__enter__()
    finally:
        proc.kill()
        proc.wait()
    with RunLock(tmp_path):  # the failed attempt left the run lock free
        pass


def test_writers_share_the_lock_and_the_run_waits_for_the_last(tmp_path):
    short, long = writer_process(tmp_path, 0.2), writer_process(tmp_path, 1.0)
    with RunLock(tmp_path):
        assert short.poll() is not None and long.poll() is not None


def test_build_index_refuses_a_folder_in_use(tmp_path):
    from embedingest.jobs.build_index import build_index

    out = tmp_path / "index"
    with RunLock(out):
        with pytest.raises(IndexBusy, match="another build"):
            build_index([("a", "some text to index")], out=str(out), device="cpu")
    summary = build_index([("a", "some text to index")], out=str(out), device="cpu")
    assert summary["vectors_total"] == 1


@pytest.mark.parametrize("name", [".run.lock", ".writers.lock"])
@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_a_lock_file_that_is_a_link_or_no_file_is_refused_never_written(tmp_path, name, kind):
    import os

    from embedingest.errors import ConfigError

    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    folder = tmp_path / "idx"
    folder.mkdir()
    if kind == "symlink":
        (folder / name).symlink_to(victim)
    elif kind == "hardlink":
        os.link(victim, folder / name)
    else:
        os.mkfifo(folder / name)
    if kind == "hardlink" and name == ".writers.lock":  # only flocked, never written: fine
        with RunLock(folder):
            pass
    else:
        with pytest.raises(ConfigError, match=rf"{name}' is .*not a lock file embedingest made"):
            RunLock(folder).__enter__()
    assert victim.read_text() == "not yours"

"""The run lock of an index folder: one build at a time, and none before the last
build's segment writers are gone."""

from __future__ import annotations

import fcntl
import logging
import os
import select
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from embedingest.index.lock import RUN_LOCK, WRITERS_LOCK, IndexBusy, RunLock, hold_writer_lock


def writer_process(folder) -> subprocess.Popen:
    """A process that holds the writers lock like a consumer finishing its last commit,
    until its stdin is closed (or it is killed)."""
    code = textwrap.dedent(f"""
        import sys
        from embedingest.index.lock import hold_writer_lock
        fd = hold_writer_lock({str(folder)!r})
        print("held", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    if not ready:
        proc.kill()
        raise AssertionError("the writer did not get the writers lock (held exclusively by another?)")
    assert proc.stdout.readline().strip() == "held"
    return proc


def finish(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=30)


class EnterInThread:
    """``RunLock(folder).__enter__()`` in a thread; ``waiting`` is set when the lock says
    (in its log) that it waits for writers, ``entered`` once it holds the folder."""

    def __init__(self, folder, caplog):
        self.waiting, self.entered = threading.Event(), threading.Event()
        self.lock = RunLock(folder, writers_timeout=60)
        self.error = None
        self.messages = []
        handler = logging.Handler()
        handler.emit = lambda record: self.messages.append(record.getMessage()) or self.waiting.set()
        logging.getLogger("embedingest").addHandler(handler)
        caplog.set_level(logging.INFO, logger="embedingest")
        self._handler = handler
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.lock.__enter__()
            self.entered.set()
        except BaseException as exc:  # re-raised by join()
            self.error = exc

    def join(self):
        self.thread.join(timeout=60)
        logging.getLogger("embedingest").removeHandler(self._handler)
        if self.error is not None:
            raise self.error
        assert self.entered.is_set()


def test_second_build_of_a_folder_fails_naming_the_holder(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(IndexBusy) as err:  # held by this process: "another build" alone misled
            RunLock(tmp_path).__enter__()
        assert str(err.value).startswith(f"another build (pid {os.getpid()}, this process: another call still under way) "
                                         f"is writing {tmp_path}; wait for it to end")
    with RunLock(tmp_path):  # released on exit
        pass


def test_run_waits_for_the_writers_of_a_killed_build(tmp_path, caplog):
    proc = writer_process(tmp_path)
    run = EnterInThread(tmp_path, caplog)
    assert run.waiting.wait(30), "the run did not notice the writer"
    assert not run.entered.is_set(), "entered while a writer still held the folder"
    time.sleep(0.3)  # the lock polls every 0.05 s meanwhile; it says so once
    finish(proc)
    run.join()
    run.lock.release()
    assert run.messages == [f"waiting for the writers of an earlier build of {tmp_path} to "
                            "finish their last commit"]


def test_lock_files_in_a_new_nested_folder(tmp_path):
    folder = tmp_path / "a" / "b" / "idx"
    old = os.umask(0o022)
    try:
        with RunLock(folder):
            assert (folder / RUN_LOCK).read_text() == f"{os.getpid()}\n"
        os.close(hold_writer_lock(tmp_path))  # a consumer that comes first makes it
    finally:
        os.umask(old)
    for path in (folder / RUN_LOCK, folder / WRITERS_LOCK, tmp_path / WRITERS_LOCK):
        assert path.stat().st_mode & 0o777 == 0o644, path


@pytest.mark.parametrize("content, shown", [(b"", "?"), (b"\xff12\n", "\ufffd12")])
def test_a_holder_that_wrote_no_pid_is_still_named(tmp_path, content, shown):
    fd = os.open(tmp_path / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, content)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(IndexBusy) as err:
            RunLock(tmp_path).__enter__()
    finally:
        os.close(fd)
    assert str(err.value) == (f"another build (pid {shown}) is writing {tmp_path}; wait for it to end, "
                              "or stop it and run again (the index resumes)")


def test_release_is_idempotent(tmp_path):
    lock = RunLock(tmp_path)
    lock.release()  # never entered
    with lock:
        lock.release()
    lock.release()
    with RunLock(tmp_path):
        pass


def test_writer_killed_releases_at_once(tmp_path, caplog):
    proc = writer_process(tmp_path)
    proc.kill()
    proc.wait()
    caplog.set_level(logging.INFO, logger="embedingest")
    with RunLock(tmp_path, writers_timeout=5):
        pass
    assert "waiting for the writers" not in caplog.text  # taken at the first try


def test_the_writers_lock_is_shared_and_the_run_lock_exclusive(tmp_path):
    """Consumers take the writers lock shared: one consumer's lock must not keep another
    from its own (each would wait for the other's last commit), but it must keep a new
    run out. flock locks belong to an open file, so two opens in one process conflict
    as two processes do."""
    fd = hold_writer_lock(tmp_path)
    other = os.open(tmp_path / WRITERS_LOCK, os.O_RDWR)
    try:
        fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a second consumer: admitted
        fcntl.flock(other, fcntl.LOCK_UN)
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a run: kept out
    finally:
        os.close(other)
        os.close(fd)
    with RunLock(tmp_path):
        run = os.open(tmp_path / RUN_LOCK, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(run, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(run)


def test_writers_that_never_finish_give_a_clear_error(tmp_path):
    proc = writer_process(tmp_path)
    try:
        with pytest.raises(IndexBusy, match=r"fuser .*\.writers\.lock"):
            RunLock(tmp_path, writers_timeout=0.3).__enter__()
    finally:
        finish(proc)
    with RunLock(tmp_path):  # the failed attempt left the run lock free
        pass


def test_writers_share_the_lock_and_the_run_waits_for_the_last(tmp_path, caplog):
    first, second = writer_process(tmp_path), writer_process(tmp_path)  # both hold it at once
    run = EnterInThread(tmp_path, caplog)
    assert run.waiting.wait(30)
    finish(first)
    assert not run.entered.wait(0.5), "entered while the second writer still held the folder"
    finish(second)
    run.join()
    run.lock.release()


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
        with pytest.raises(ConfigError) as err:
            RunLock(folder).__enter__()
        what = {"symlink": "a symbolic link", "hardlink": "a file with other hard links",
                "fifo": "not a regular file"}[kind]  # the message says which, so the user knows why
        assert str(err.value) == (f"{str(folder / name)!r} is {what}, not a lock file embedingest made; "
                                  "it is not opened for writing: delete it and run again")
    assert victim.read_text() == "not yours"


def test_a_forked_child_does_not_keep_the_run_lock(tmp_path):
    """A loader worker forked while the run lock is held shared its open file, and with it
    the lock: a worker that outlived its run kept the next run of the folder out (a
    segment call right after one whose weights failed was refused). Children close it."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()

    def work():  # runs after the fork's hooks, as a worker's code does
        started.set()
        time.sleep(30)

    with RunLock(tmp_path, job="segment run", writers=False):
        child = ctx.Process(target=work)
        child.start()
        assert started.wait(30)
    try:
        with RunLock(tmp_path, job="segment run", writers=False):
            pass
    finally:
        child.kill()
        child.join()

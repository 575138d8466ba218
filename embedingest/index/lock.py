"""One run at a time per index folder (and per segment output folder), and none before
the last run's writers are gone.

Two ``flock`` files in the index folder:

* ``.run.lock``: held exclusively by the process that plans and runs a build. A second
  build of the same folder fails at once, naming the pid that holds it.
* ``.writers.lock``: held shared by every consumer process that writes shards. When a
  build's main process is killed, its consumers still close their sinks, and the last
  shard commit can land a moment later. A new run takes this lock exclusively (then
  drops it) before it reads what the folder holds, so it waits for those commits
  instead of planning around a shard that is still being written.

The kernel drops ``flock`` locks when a process dies, so a killed run never leaves a
stale lock behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import ConfigError, EmbedingestError

log = logging.getLogger("embedingest")

RUN_LOCK = ".run.lock"
WRITERS_LOCK = ".writers.lock"


class IndexBusy(EmbedingestError, RuntimeError):
    """Another build is using the index folder, or its writers did not finish in time."""


def open_lock_file(path: Path, sole: bool = False) -> int:
    """Open (or create) the lock file ``path``; refuse a symbolic link there (never followed)
    or anything but a regular file, and with ``sole`` (the run lock, whose content is
    rewritten with the holder's pid) a file that has other hard links."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        fd = None
    st = os.fstat(fd) if fd is not None else None
    if st is None or not stat.S_ISREG(st.st_mode) or (sole and st.st_nlink != 1):
        if fd is not None:
            os.close(fd)
        kind = ("a symbolic link" if st is None else "not a regular file"
                if not stat.S_ISREG(st.st_mode) else "a file with other hard links")
        raise ConfigError(f"{str(path)!r} is {kind}, not a lock file embedingest made; it is not "
                          "opened for writing: delete it and run again")
    return fd


@contextlib.contextmanager
def no_build_running(folder: str | os.PathLike, what: str) -> Iterator[None]:
    """While the block runs, no build of ``folder`` runs: IndexBusy at once when one is
    running (``what`` would read it half-updated), and a build that starts meanwhile is
    refused (the run lock is held shared, opened read-only: a reader may lack write
    access to the index). A folder no build has run in has no lock file: nothing to hold."""
    path = Path(folder) / RUN_LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise IndexBusy(f"a build (pid {holder}) is writing {folder}: what {what} would read now is "
                            f"half of its update; run {what} again once it has finished") from None
        yield
    finally:
        os.close(fd)


# The run locks this process holds. A forked child (a loader worker, a header reader)
# would share each lock's open file, and with it the lock, until it exits: one that
# outlived its run kept the next run of the same folder out. Children close them.
_HELD: set[int] = set()


def _close_inherited() -> None:
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)


class RunLock:
    """Context manager: exclusive use of ``folder`` for one build (see the module doc), or
    for another ``job`` writing an output folder (segment's masks): ``writers`` False
    leaves out the wait for a killed run's writers, which only a build's consumers announce."""

    def __init__(self, folder: str | os.PathLike, writers_timeout: float = 120.0, *, job: str = "build",
                 resumes: str = "the index resumes", writers: bool = True):
        self.folder = Path(folder)
        self.writers_timeout = writers_timeout
        self.job, self.resumes, self.writers = job, resumes, writers
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = open_lock_file(self.folder / RUN_LOCK, sole=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            who = f"pid {holder}" + (", this process: another call still under way" if holder == str(os.getpid()) else "")
            raise IndexBusy(f"another {self.job} ({who}) is writing {self.folder}; wait for it "
                            f"to end, or stop it and run again ({self.resumes})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        _HELD.add(fd)
        if not self.writers:
            return self
        try:
            self._wait_for_writers()
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            _HELD.discard(self._fd)
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None

    def _wait_for_writers(self) -> None:
        fd = open_lock_file(self.folder / WRITERS_LOCK)
        try:
            deadline, said = time.monotonic() + self.writers_timeout, False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise IndexBusy(
                            f"writer processes of an earlier build still hold {self.folder} after "
                            f"{self.writers_timeout:.0f} s; find them with `fuser "
                            f"{self.folder / WRITERS_LOCK}`, stop them, and run again") from None
                    if not said:
                        log.info("waiting for the writers of an earlier build of %s to finish "
                                 "their last commit", self.folder)
                        said = True
                    time.sleep(0.05)
        finally:
            os.close(fd)


def hold_writer_lock(folder: str | os.PathLike) -> int:
    """Take ``folder``'s writers lock shared, for the life of this (consumer) process;
    returns the descriptor, which must stay open."""
    fd = open_lock_file(Path(folder) / WRITERS_LOCK)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd

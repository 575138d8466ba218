"""Writing the files the tool owns: each one whole or not at all, and only inside its folder.

Every output file (FAISS shards and sidecars, ``trained.faiss``, ``manifest.json``,
``skipped.jsonl``, masks, logits, overlays) is written to a hidden temporary name
(``.<name>.tmp-<pid>``), checked to hold exactly the bytes that were meant (a short
write, or a write error a library only printed, never reaches the final name), fsynced
and ``os.replace``d. The temporary file is created afresh with ``O_NOFOLLOW``, and
``os.replace`` swaps a symbolic link at the final name for the file instead of writing
through it, so a link planted in an output folder is never followed for writing.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import ConfigError

# faiss asks for this many bytes at most per call of the Python writer: peak memory stays
# the index itself plus this, where faiss.serialize_index held a second full copy.
_FAISS_CHUNK = 1 << 20


RUN_ID = re.compile(r"[A-Za-z0-9_]+")
"""What a run id may hold (:func:`new_run_id` makes one): it goes into file names."""


def new_run_id() -> str:
    """A run id unique across runs (time + randomness): it names a run's shards, so a
    resumed run never reuses those of the run it resumes, and its entries in skip reports."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "_" + secrets.token_hex(3)


# Bytes of one file name, and of a whole path, on Linux's file systems (ext4, XFS, btrfs,
# tmpfs): a name made from an input's name (segment's masks) can pass them.
NAME_MAX = 255
PATH_MAX = 4096
# The most bytes a temporary name adds to its file's (".", ".tmp-" and a pid of 7 digits).
_TMP_EXTRA = 13


def tmp_path(path: Path) -> Path:
    """The temporary name used while writing ``path``; one garbage rule covers them all.
    Where the prefix and suffix would take the name past :data:`NAME_MAX`, it keeps the
    name's start and a digest of the whole, so any name that fits can be written."""
    suffix = f".tmp-{os.getpid()}"
    name = f".{path.name}{suffix}"
    if len(os.fsencode(name)) > NAME_MAX:
        digest = hashlib.sha256(os.fsencode(path.name)).hexdigest()[:16]
        head = path.name
        while len(os.fsencode(f".{head}~{digest}{suffix}")) > NAME_MAX:
            head = head[:-1]
        name = f".{head}~{digest}{suffix}"
    return path.with_name(name)


def too_long(path: str | os.PathLike) -> str | None:
    """Why no file can be made at ``path``: its name over :data:`NAME_MAX` bytes, or the
    whole path (or that of its temporary name, written first) over :data:`PATH_MAX`, as a
    skip reason; None where it fits."""
    whole = os.fsencode(path)
    name_length = len(whole) - whole.rfind(b"/") - 1
    if name_length <= NAME_MAX and len(whole) + _TMP_EXTRA < PATH_MAX:
        return None  # the usual case, decided without building the temporary name
    name = os.path.basename(whole)
    if len(name) > NAME_MAX:
        return (f"name too long: its output {os.fsdecode(name)!r} would be {len(name)} bytes, over the "
                f"{NAME_MAX} a file name may have; rename the input")
    longest = max(len(whole), len(os.fsencode(tmp_path(Path(os.fsdecode(whole))))))
    if longest >= PATH_MAX:
        return (f"name too long: its output path would be {longest} bytes, over the {PATH_MAX - 1} a "
                f"path may have; give a shorter --out or a shallower input folder")
    return None


@contextlib.contextmanager
def native_path(path: str | os.PathLike) -> Iterator[str]:
    """``path`` as a name faiss and Arrow can open, for the block: itself where it is
    valid text. Their Python bindings take a path as UTF-8 text, which a folder named
    in another encoding has no form in (Python holds its bytes as surrogates); then, on
    Linux, the file is opened here and named by ``/proc/self/fd/N`` (what they open or
    map there is that file, and stays theirs after the block)."""
    name = os.fspath(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        if not os.path.isdir("/proc/self/fd"):
            raise
    else:
        yield name
        return
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def json_bytes(obj, indent: int | None = 2) -> bytes:
    """``obj`` as JSON in UTF-8, with a final newline. A lone surrogate (in a path whose
    name is not UTF-8, as Python holds it) has no UTF-8 form: it is written as its
    ``\\u`` escape, which JSON readers read back as the same character; all other text
    stays as it is (the skip report writes its lines the same way)."""
    return (json.dumps(obj, indent=indent, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")


# What tmp_path makes: ".<name>.tmp-<pid>", or ".<head>~<digest>.tmp-<pid>" for a long name.
_TMP_NAME = re.compile(r"\.(?P<name>.+?)(?P<digest>~[0-9a-f]{16})?\.tmp-[0-9]+")


def is_tmp_name(name: str, of: Callable[[str], bool] | None = None) -> bool:
    """Whether ``name`` is a temporary name :func:`tmp_path` makes (``of``: of a file for
    whose name ``of(name)`` holds; a shortened name's digest is taken as such): a user's
    ``.draft.tmp-3.txt`` or ``.mine.tmp-2`` beside the outputs is not one to delete."""
    match = _TMP_NAME.fullmatch(name)
    return match is not None and (of is None or match["digest"] is not None or of(match["name"]))


def fsync_dir(folder: Path) -> None:
    """Make the renames in ``folder`` durable, so their order survives a power cut."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def refuse_link(path: Path, what: str = "") -> None:
    """ConfigError when ``path`` is a symbolic link: nothing in an output or index folder
    is followed for writing."""
    if os.path.islink(path):
        raise ConfigError(f"{str(path)!r}{what} is a symbolic link; embedingest never writes "
                          "through links in its folders: remove the link (or use another folder)")


def ensure_folder(root: Path, folder: Path) -> None:
    """Make ``folder`` (``root`` or below it, ``root`` included), refusing a symbolic link in
    any part of it below ``root``, so whatever is written there lands inside ``root``."""
    rel = folder.relative_to(root)
    root.mkdir(parents=True, exist_ok=True)
    here = root
    for part in rel.parts:
        if part in ("", ".", ".."):
            raise ConfigError(f"{str(folder)!r} is not a plain path below {str(root)!r}")
        here = here / part
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):  # another consumer made it just now
                os.mkdir(here)
            st = os.lstat(here)
        if stat.S_ISLNK(st.st_mode):
            refuse_link(here, f" (inside {str(root)!r})")
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory, where an output folder goes",
                                     str(here))


def through_link(root: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Whether a part of ``path`` below ``root`` is a symbolic link (or leaves ``root``)."""
    here = Path(root)
    for part in Path(path).relative_to(root).parts:
        if part == "..":
            return True
        here = here / part
        if os.path.islink(here):
            return True
    return False


def _create(tmp: Path) -> BinaryIO:
    """A new file at ``tmp``: a stale one of a dead process with this pid, or a link planted
    there, is removed (not followed) first."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "wb")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, *, sync_dir: bool = False) -> Iterator[BinaryIO]:
    """Yield a new binary file at the temporary name of ``path``. On a clean exit it is
    flushed, fsynced, checked to hold every byte written to it, and renamed to ``path``
    (then the folder is fsynced too with ``sync_dir``); on an error it is deleted."""
    path = Path(path)
    tmp = tmp_path(path)
    try:
        with _create(tmp) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
            meant, on_disk = fh.tell(), os.fstat(fh.fileno()).st_size
            if on_disk != meant:
                raise OSError(errno.EIO, f"{on_disk} bytes on disk after writing {meant}", str(tmp))
        os.replace(tmp, path)
        if sync_dir:
            fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, sync_dir: bool = False) -> None:
    """Write ``data`` to ``path`` through :func:`atomic_file`."""
    with atomic_file(path, sync_dir=sync_dir) as fh:
        fh.write(data)


def write_streamed(path: str | os.PathLike, produce: Callable[[Callable[[bytes], None]], None],
                   *, sync_dir: bool = False) -> None:
    """Write what ``produce(write)`` hands to ``write`` to ``path`` through
    :func:`atomic_file`. ``write`` never raises into ``produce`` (a C++ library calling
    it could not pass the error on cleanly): the first write error is raised here
    once ``produce`` returns, and the file is not committed."""
    with atomic_file(path, sync_dir=sync_dir) as fh, _SyncAhead(fh) as ahead:
        failed: list[BaseException] = []

        def write(chunk: bytes) -> None:
            if not failed:
                try:
                    fh.write(chunk)
                    ahead.wrote(len(chunk))
                except BaseException as exc:
                    failed.append(exc)

        produce(write)
        if failed:
            raise failed[0]


SYNC_AHEAD_BYTES = 64 << 20
"""A streamed file is handed to the disk every this many bytes while it is written."""


class _SyncAhead:
    """Background ``fdatasync`` of a file being written, one at a time, each after another
    :data:`SYNC_AHEAD_BYTES`: the disk writes the file while the rest is produced, so the
    final fsync of :func:`atomic_file` waits for the last part only (a large file's
    writeback otherwise starts at that fsync). A failed sync is raised by the next write
    or on leaving; the kernel reports a write-back error once per open file, so it
    must not be dropped here."""

    def __init__(self, fh: BinaryIO):
        self.fh, self.since = fh, 0
        self.running = None
        self.pool = None

    def __enter__(self) -> _SyncAhead:
        return self

    def wrote(self, n: int) -> None:
        self.since += n
        if self.since < SYNC_AHEAD_BYTES or (self.running is not None and not self.running.done()):
            return
        if self.running is not None:
            self.running.result()
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedingest-sync")
        self.fh.flush()
        self.since = 0
        self.running = self.pool.submit(os.fdatasync, self.fh.fileno())

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.running is not None and exc[0] is None:
            self.running.result()


def write_faiss_index(index, path: str | os.PathLike, *, sync_dir: bool = True) -> None:
    """Write a faiss index to ``path`` with Python file writes, so a write error raises.
    (faiss's own file writer only prints an error of its final flush, and the short
    file would be renamed into place.) faiss streams the bytes through a callback in
    chunks, so no second copy of the index is held."""
    import faiss

    def produce(write: Callable[[bytes], None]) -> None:
        faiss.write_index(index, faiss.PyCallbackIOWriter(write, _FAISS_CHUNK))

    write_streamed(path, produce, sync_dir=sync_dir)

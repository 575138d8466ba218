"""Find the input files of a run: one file, or a folder read recursively.

Walking is lazy (a corpus of millions of files is never listed in memory by this
function), sorted within each folder so runs are reproducible, safe against symlink
loops, and every folder or file that cannot be read is reported instead of crashing.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path

from ..errors import ConfigError
from .names import has_extension

OnSkip = Callable[[str, str], None]


def _noop(path: str, reason: str) -> None:
    pass


class NotRegularFile(OSError):
    """A path that names a pipe, socket or device where a file was expected; ``str()``
    is the skip reason (``not a regular file: a named pipe (FIFO)``)."""

    def __str__(self) -> str:
        return f"not a regular file: {self.strerror}"


class OutsideInput(OSError):
    """A listed file that was, when opened, outside the input folder: replaced by a link
    out of it after the walk (which skips such links) listed it. ``str()`` is the skip
    reason, the walk's own for a link out of the folder."""

    def __str__(self) -> str:
        return outside_reason(self.filename)


def outside_reason(target: str) -> str:
    """The skip reason of an input that leads out of the input folder, to ``target``."""
    return f"symbolic link out of the input folder: to {target}, not read (--follow-outside-links reads it)"


# The folder (a real path) every file opened by open_regular must lie in, or None.
_WITHIN: ContextVar[str | None] = ContextVar("embedingest_reads_within", default=None)


@contextlib.contextmanager
def reads_within(folder: str | None):
    """In the block, :func:`open_regular` refuses (:class:`OutsideInput`) a file that is
    outside ``folder`` (a real path) once opened, judged by what was opened, not by the
    path: the walk skips links out of the input folder, but a file it listed may be swapped
    for one before a worker reads it. None: no check (``--follow-outside-links``)."""
    token = _WITHIN.set(folder)
    try:
        yield
    finally:
        _WITHIN.reset(token)


def input_folder(root: str | os.PathLike | None, outside_links: bool = False) -> str | None:
    """The folder the files of a walk of ``root`` must lie in (its real path), for
    :func:`reads_within`; None for one file named as the input, an object store's URL,
    or with ``outside_links``."""
    if root is None or outside_links or not os.path.isdir(root):
        return None
    return os.path.realpath(root)


def is_within(real_path: str, folder: str) -> bool:
    """Whether ``real_path`` is ``folder`` or below it (both real paths)."""
    return real_path == folder or real_path.startswith(os.path.join(folder, ""))


def _opened_path(fd: int, path) -> str:
    """The real path of what ``fd`` opened (Linux names it in /proc; elsewhere the
    path resolved now, a moment after the open)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)


_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a non-regular file of ``st_mode`` is, in words."""
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike, follow_links: bool = True):
    """Open ``path`` for reading in binary, without ever blocking: a path that names a
    pipe, socket or device raises :class:`NotRegularFile` (a folder
    :class:`IsADirectoryError`) instead of opening it; so does a symbolic link unless
    ``follow_links`` (a file of an output folder is never read through one).

    A file listed as regular may be replaced by a named pipe before it is read, and
    opening a pipe waits for a writer, for ever; ``O_NONBLOCK`` makes the open return at
    once, ``fstat`` on what was opened says what it is, and the flag is cleared again
    for a regular file. Inside :func:`reads_within`, a file outside its folder once opened
    raises :class:`OutsideInput`.
    """
    try:
        fh = open(path, "rb", opener=_open_nonblocking if follow_links else _open_nonblocking_nofollow)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket (or a device with no driver) cannot be opened
            raise NotRegularFile(errno.ENXIO, "a socket or a device", str(path)) from None
        if exc.errno == errno.ELOOP and not follow_links and os.path.islink(path):
            raise NotRegularFile(errno.ELOOP, "a symbolic link", str(path)) from None
        raise
    try:
        mode = os.fstat(fh.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, file_kind(mode), str(path))
        within = _WITHIN.get()
        if within is not None:
            real = _opened_path(fh.fileno(), path)
            if not is_within(real, within):
                raise OutsideInput(errno.EXDEV, "outside the input folder", real)
        os.set_blocking(fh.fileno(), True)
        return fh
    except BaseException:
        fh.close()
        raise


def open_input(path: str | os.PathLike):
    """Open an input for binary reading: a local path with :func:`open_regular`, an
    fsspec URL (``s3://...``) with :func:`~.remote.open_remote`."""
    from .remote import is_remote, open_remote

    return open_remote(path) if is_remote(path) else open_regular(path)


def file_sha256(path: str | os.PathLike, limit: int | None = None) -> str:
    """The sha256 of an input's bytes (opened with :func:`open_input`: a file turned into
    a pipe cannot hang the hashing), read a megabyte at a time; of its first ``limit``
    bytes only, when given (the bytes a file read in parts is read to)."""
    h = hashlib.sha256()
    left = -1 if limit is None else limit
    with open_input(path) as fh:
        while left:
            block = fh.read(1 << 20 if left < 0 else min(1 << 20, left))
            if not block:
                break
            h.update(block)
            left = left - len(block) if left > 0 else left
    return h.hexdigest()


def _open_nonblocking(path, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0), 0o666)


def _open_nonblocking_nofollow(path, flags: int) -> int:
    return _open_nonblocking(path, flags | os.O_NOFOLLOW)


def os_error_reason(exc: OSError) -> str:
    """The skip reason of a file that could not be opened or read."""
    if isinstance(exc, (NotRegularFile, OutsideInput)):
        return str(exc)
    return f"unreadable: {exc.strerror or exc}"


def refuse_output_as_input(out: str | os.PathLike, inputs: str | os.PathLike, folder: str,
                           outputs: str) -> None:
    """Refuse an output folder that is the input folder itself: :func:`walk_files`
    leaves an output folder inside the input out (``exclude``), but not the whole input."""
    if Path(out).resolve() == Path(inputs).resolve():
        raise ConfigError(f"out={str(out)!r} is the {folder}: {outputs} would be read as "
                          "inputs next time; use another folder, or a subfolder of it")


def refuse_report_in_out(out: str | os.PathLike, reports: dict[str, str | os.PathLike | None]) -> None:
    """ConfigError for a run's report file (``{"--trace": path, ...}``) below its output
    folder: a trace named as a mask, or ``labels.json``, replaced that output for good,
    and any other file there is one the folder's owner did not write."""
    folder = os.path.realpath(out)
    for option, path in reports.items():
        real = None if path is None else os.path.realpath(path)
        if real is not None and real != folder and is_within(real, folder):
            raise ConfigError(f"{option} {os.fspath(path)!r} is inside the output folder {os.fspath(out)!r}, "
                              "whose files the run writes and reads back; write it elsewhere (beside the folder)")


def walk_files(root: str | os.PathLike, extensions: set[str] | None = None,
               on_skip: OnSkip = _noop, on_other: Callable[[str], None] | None = None,
               exclude: str | os.PathLike | None = None, outside_links: bool = False,
               not_input: Callable[[str], str | None] | None = None,
               on_unlisted: Callable[[str], None] | None = None) -> Iterator[Path]:
    """:func:`walk_paths`, each path as a :class:`~pathlib.Path`."""
    for path in walk_paths(root, extensions, on_skip, on_other, exclude, outside_links, not_input,
                           on_unlisted):
        yield Path(path)


def walk_paths(root: str | os.PathLike, extensions: set[str] | None = None,
               on_skip: OnSkip = _noop, on_other: Callable[[str], None] | None = None,
               exclude: str | os.PathLike | None = None, outside_links: bool = False,
               not_input: Callable[[str], str | None] | None = None,
               on_unlisted: Callable[[str], None] | None = None) -> Iterator[str]:
    """Yield the files under ``root`` whose suffix (lower case, with the dot; see
    :func:`has_extension`) is in ``extensions``; ``root`` itself when it is a file
    (whatever its suffix). Paths are strings (``root`` joined with the names below it):
    a corpus of millions of files pays no object per file beyond that.

    Hidden files and folders (name starting with '.') are passed over (each told to
    ``on_other``, a folder not entered). Symbolic links
    are followed, but a folder is entered once only, so a link loop ends; a link to a file
    or folder outside ``root`` is skipped (``on_skip``) unless ``outside_links``: a link
    planted in a corpus must not pull other files of the machine into an index that is
    then searched or served. Folders that
    cannot be listed, broken links, and pipes, sockets or devices (or links to them)
    with a wanted suffix go to ``on_skip(path, reason)``; other files with another suffix to ``on_other(path)``.
    The folder ``exclude`` (a job's output inside its input) is not entered, under
    whatever path it is reached; nor a folder below ``root`` for which ``not_input(path)``
    gives a reason (a job's output of another run, say), which goes to ``on_skip``.
    A folder (``root`` too) that exists but cannot be listed now (permissions, an I/O
    error) also goes to ``on_unlisted(path)``: its files are unknown, not gone, and a
    caller that remembers them keeps them.
    """
    root = os.fspath(root)
    if os.path.isfile(root):
        yield root
        return
    if not os.path.isdir(root):
        try:
            kind = f"is {file_kind(os.stat(root).st_mode)}, not a file or folder"
        except OSError:
            kind = "does not exist (or is a broken link)"
        raise FileNotFoundError(f"input path {root!r} {kind}")
    seen: set[tuple[int, int]] = set()
    inside = input_folder(root, outside_links)
    try:
        st = os.stat(exclude) if exclude is not None else None
        excluded = (st.st_dev, st.st_ino) if st else None
    except OSError:  # not made yet: nothing of it to read
        excluded = None
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            st = os.stat(folder)
        except OSError as exc:
            on_skip(folder, f"cannot stat folder: {exc.strerror or exc}")
            _unlisted(folder, exc, on_unlisted)
            continue
        key = (st.st_dev, st.st_ino)
        if key == excluded:
            continue
        if key in seen:
            on_skip(folder, _seen_reason(folder))
            continue
        seen.add(key)
        reason = not_input(folder) if not_input is not None and folder != root else None
        if reason is not None:
            on_skip(folder, reason)
            continue
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            on_skip(folder, f"cannot list folder: {exc.strerror or exc}")
            _unlisted(folder, exc, on_unlisted)
            continue
        subdirs = []
        for entry in entries:
            if entry.name.startswith("."):
                if on_other is not None:
                    on_other(entry.path)
                continue
            if inside is not None and entry.is_symlink():
                reason = _link_out_of(entry, inside, extensions)
                if reason is not None:
                    on_skip(entry.path, reason)
                    continue
            try:
                if entry.is_dir():
                    subdirs.append(entry.path)
                    continue
                is_file = entry.is_file()
            except OSError as exc:
                on_skip(entry.path, f"cannot stat: {exc.strerror or exc}")
                continue
            wanted = extensions is None or has_extension(entry.name, extensions)
            if not is_file:
                reason = _not_a_file(entry)
                if reason is not None and (wanted or not reason.startswith("not a regular file")):
                    on_skip(entry.path, reason)
                continue
            if wanted:
                yield entry.path
            elif on_other is not None:
                on_other(entry.path)
        stack.extend(reversed(subdirs))


def _unlisted(folder: str, exc: OSError, on_unlisted: Callable[[str], None] | None) -> None:
    """Name ``folder`` to ``on_unlisted`` unless ``exc`` says it is gone (deleted, or
    replaced by a file, since its parent was listed)."""
    if on_unlisted is not None and exc.errno not in (errno.ENOENT, errno.ENOTDIR):
        on_unlisted(folder)


def _seen_reason(folder: str) -> str:
    """Why a folder reached again is not read again: a link inside the folder it names (a
    loop), or another path to a folder read already (a link to it)."""
    here, there = os.path.realpath(os.path.dirname(folder)), os.path.realpath(folder)
    if is_within(here, there):
        return "symlink loop: a link to a folder that holds it"
    return f"already read: a symbolic link to a folder read before, as {there!r}; read once"


def _link_out_of(entry: os.DirEntry, inside: str, extensions: set[str] | None) -> str | None:
    """Why a symbolic link is not followed: it resolves outside the folder ``inside`` (a
    real path) and names a folder or a file with a wanted suffix; None otherwise."""
    target = os.path.realpath(entry.path)
    if is_within(target, inside):
        return None
    if not os.path.isdir(target) and extensions is not None and not has_extension(entry.name, extensions):
        return None
    return outside_reason(target)


def _not_a_file(entry: os.DirEntry) -> str | None:
    """Why an entry that is neither a folder nor a regular file is no input (None when it
    vanished meanwhile). Reading a pipe would wait forever, a device may never end."""
    try:
        mode = os.stat(entry.path).st_mode  # through a link, to what it names
    except FileNotFoundError:
        return "broken or looping symbolic link" if entry.is_symlink() else None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "broken or looping symbolic link"
        return f"cannot stat: {exc.strerror or exc}"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):  # replaced meanwhile: not worth a guess
        return None
    link = "a symbolic link to " if entry.is_symlink() else ""
    return f"not a regular file: {link}{file_kind(mode)}"

"""The mark an ``--overwrite`` run keeps in its output folder, local or in object storage,
from the moment the weights are read until it redid every image: while it is there, the
folder may hold masks of the settings before that run, which a resume would keep as done."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ...errors import ConfigError
from ...outfiles import atomic_write_bytes
from ...sources.remote import is_remote, url_fs

OVERWRITING = ".overwrite-unfinished"


def _object(out: str):
    """(fsspec filesystem, the mark's path) of an output URL."""
    fs, root = url_fs(out)
    return fs, f"{root}/{OVERWRITING}"


def _found(out: str) -> str | None:
    """What has the mark's name in ``out``: ``"mark"`` (a file, an object), ``"folder"``
    (a folder, or objects below the name), ``"link"``, ``"special file"`` (a pipe, a
    socket, a device), or None."""
    if is_remote(out):
        fs, path = _object(out)
        fs.invalidate_cache(path.rsplit("/", 1)[0])  # a listing of this process is no answer
        fs.invalidate_cache(path)
        if fs.isdir(path):
            return "folder"
        return "mark" if fs.isfile(path) else None
    try:
        mode = os.lstat(Path(out) / OVERWRITING).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return "mark"
    if stat.S_ISDIR(mode):
        return "folder"
    return "link" if stat.S_ISLNK(mode) else "special file"


def refuse_unfinished(out: str, overwrite: bool = False) -> None:
    """ConfigError where an --overwrite run into ``out`` left its mark (killed, stopped,
    failed) and this run is no ``overwrite``; and for any run where something else has the
    mark's name (a folder, objects below the name, a link, a pipe: not the job's, so never
    removed, opened or followed here), since no run could then keep or clear the mark."""
    found = _found(out)
    if found not in (None, "mark"):
        what = ("a prefix with objects below it, not the mark (an object)" if is_remote(out)
                else f"a {found}, not the mark (a file)")
        raise ConfigError(f"{str(out).rstrip('/')}/{OVERWRITING} is {what} that segment --overwrite keeps "
                          "there while it redoes the images: move or delete it, then run again")
    if found == "mark" and not overwrite:
        raise ConfigError(f"a segment --overwrite run into {str(out)!r} stopped before it redid every image, "
                          "so masks made with the settings before it may remain beside its own: run it "
                          "again with --overwrite")


def set_mark(out: str) -> None:
    """Mark ``out`` as being overwritten (one PUT where it is a URL)."""
    data = f"{os.getpid()}\n".encode()
    if is_remote(out):
        fs, path = _object(out)
        fs.pipe_file(path, data)
    else:
        atomic_write_bytes(Path(out) / OVERWRITING, data)


def clear_mark(out: str) -> None:
    """Every image redone: the folder is whole again."""
    if is_remote(out):
        fs, path = _object(out)
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass
    else:
        (Path(out) / OVERWRITING).unlink(missing_ok=True)

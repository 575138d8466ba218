"""The mark an ``--overwrite`` run keeps in its output folder, local or in object storage,
from the moment the weights are read until it redid every image: while it is there, the
folder may hold masks of the settings before that run, which a resume would keep as done."""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import ConfigError
from ...outfiles import atomic_write_bytes
from ...sources.remote import is_remote, url_fs

OVERWRITING = ".overwrite-unfinished"


def _object(out: str):
    """(fsspec filesystem, the mark's path) of an output URL."""
    fs, root = url_fs(out)
    return fs, f"{root}/{OVERWRITING}"


def refuse_unfinished(out: str) -> None:
    """ConfigError where an --overwrite run into ``out`` left its mark (killed, stopped, failed)."""
    if is_remote(out):
        fs, path = _object(out)
        fs.invalidate_cache(path.rsplit("/", 1)[0])  # a listing of this process is no answer
        unfinished = fs.exists(path)
    else:
        unfinished = os.path.lexists(Path(out) / OVERWRITING)
    if unfinished:
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

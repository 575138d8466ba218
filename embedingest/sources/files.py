"""Find the input files of a run: one file, or a folder read recursively.

Walking is lazy (a corpus of millions of files is never listed in memory by this
function), sorted within each folder so runs are reproducible, safe against symlink
loops, and every folder or file that cannot be read is reported instead of crashing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import ConfigError

OnSkip = Callable[[str, str], None]


def _noop(path: str, reason: str) -> None:
    pass


def refuse_output_as_input(out: str | os.PathLike, inputs: str | os.PathLike, folder: str,
                           outputs: str) -> None:
    """Refuse an output folder that is the input folder itself: :func:`walk_files`
    leaves an output folder inside the input out (``exclude``), but not the whole input."""
    if Path(out).resolve() == Path(inputs).resolve():
        raise ConfigError(f"out={str(out)!r} is the {folder}: {outputs} would be read as "
                          "inputs next time; use another folder, or a subfolder of it")


def has_extension(name: str, extensions: set[str]) -> bool:
    """Whether ``name`` ends in one of ``extensions`` (lower case, with the dot), which
    may be double, like ``.jsonl.gz``."""
    suffixes = [s.lower() for s in Path(name).suffixes]
    return bool(suffixes) and (suffixes[-1] in extensions or "".join(suffixes[-2:]) in extensions)


def walk_files(root: str | os.PathLike, extensions: set[str] | None = None,
               on_skip: OnSkip = _noop, on_other: Callable[[str], None] | None = None,
               exclude: str | os.PathLike | None = None) -> Iterator[Path]:
    """Yield the files under ``root`` whose suffix (lower case, with the dot; see
    :func:`has_extension`) is in ``extensions``; ``root`` itself when it is a file
    (whatever its suffix).

    Hidden files and folders (name starting with '.') are passed over. Symbolic links
    are followed, but a folder is entered once only, so a link loop ends. Folders that
    cannot be listed, broken links, and pipes, sockets or devices with a wanted suffix
    go to ``on_skip(path, reason)``; other files with another suffix to ``on_other(path)``.
    The folder ``exclude`` (a job's output inside its input) is not entered, under
    whatever path it is reached.
    """
    root = Path(root)
    if root.is_file():
        yield root
        return
    if not root.is_dir():
        raise FileNotFoundError(f"input path {str(root)!r} does not exist or is not a file or folder")
    seen: set[tuple[int, int]] = set()
    try:
        st = os.stat(exclude) if exclude is not None else None
        excluded = (st.st_dev, st.st_ino) if st else None
    except OSError:  # not made yet: nothing of it to read
        excluded = None
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            st = folder.stat()
        except OSError as exc:
            on_skip(str(folder), f"cannot stat folder: {exc.strerror or exc}")
            continue
        key = (st.st_dev, st.st_ino)
        if key == excluded:
            continue
        if key in seen:
            on_skip(str(folder), "symlink loop: folder already visited")
            continue
        seen.add(key)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            on_skip(str(folder), f"cannot list folder: {exc.strerror or exc}")
            continue
        subdirs = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_dir():
                    subdirs.append(Path(entry.path))
                    continue
                is_file = entry.is_file()
            except OSError as exc:
                on_skip(entry.path, f"cannot stat: {exc.strerror or exc}")
                continue
            wanted = extensions is None or has_extension(entry.name, extensions)
            if not is_file:
                if entry.is_symlink():
                    on_skip(entry.path, "broken or looping symbolic link")
                elif wanted:  # reading a pipe would wait forever
                    on_skip(entry.path, "not a regular file (a pipe, socket or device)")
                continue
            if wanted:
                yield Path(entry.path)
            elif on_other is not None:
                on_other(entry.path)
        stack.extend(reversed(subdirs))

"""What a file's name says about it, for local files and objects in storage alike."""

from __future__ import annotations

from pathlib import PurePosixPath


def has_extension(name: str, extensions: set[str]) -> bool:
    """Whether ``name`` ends in one of ``extensions`` (lower case, with the dot), which
    may be double, like ``.jsonl.gz``."""
    suffixes = [s.lower() for s in PurePosixPath(name).suffixes]
    return bool(suffixes) and (suffixes[-1] in extensions or "".join(suffixes[-2:]) in extensions)

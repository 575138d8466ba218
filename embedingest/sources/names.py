"""What a file's name says about it, for local files and objects in storage alike."""

from __future__ import annotations



def has_extension(name: str, extensions: set[str]) -> bool:
    """Whether ``name`` ends in one of ``extensions`` (lower case, with the dot), which
    may be double, like ``.jsonl.gz``. The suffixes are ``PurePosixPath(name).suffixes``,
    found with string operations: a corpus's walk asks this of every file."""
    name = name.rpartition("/")[2]
    if name.endswith("."):
        return False
    parts = name.lstrip(".").lower().split(".")
    if len(parts) < 2:
        return False
    return "." + parts[-1] in extensions or (len(parts) > 2 and f".{parts[-2]}.{parts[-1]}" in extensions)

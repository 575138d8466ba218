"""What a file's name says about it, for local files and objects in storage alike, and
its form as text."""

from __future__ import annotations

import re


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


def name_as_text(name: str) -> str:
    """``name`` as valid text, one to one: the bytes of a name that is not UTF-8 (which
    Python holds as surrogates) as ``\\xNN`` escapes, a backslash twice (so a name holding
    a literal ``\\xe9`` keeps a text of its own). Every other name (valid UTF-8, no
    backslash) is its own text. For the stores that take only valid text: the index's
    keys, Parquet columns."""
    escaped = name.replace("\\", "\\\\")
    return escaped.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


_ESCAPE = re.compile(r"\\(\\|x[0-9a-f]{2})")


def text_as_name(text: str) -> str:
    """The name that :func:`name_as_text` writes as ``text`` (its inverse): ``\\xNN`` back
    to the byte it stands for, a doubled backslash back to one; for opening the file an
    index's key names (joined as it is, a key holding an escape named another file)."""
    raw, at = bytearray(), 0
    for m in _ESCAPE.finditer(text):
        raw += text[at:m.start()].encode("utf-8", "surrogateescape")
        raw += b"\\" if m.group(1) == "\\" else bytes([int(m.group(1)[1:], 16)])
        at = m.end()
    raw += text[at:].encode("utf-8", "surrogateescape")
    return raw.decode("utf-8", "surrogateescape")

"""A file's extension from its name, against pathlib's own suffixes."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedingest.sources.names import has_extension

EXTENSIONS = {".txt", ".md", ".jsonl", ".jsonl.gz", ".gz", ".parquet"}


def by_pathlib(name: str, extensions: set[str]) -> bool:
    suffixes = [s.lower() for s in PurePosixPath(name).suffixes]
    return bool(suffixes) and (suffixes[-1] in extensions or "".join(suffixes[-2:]) in extensions)


@pytest.mark.parametrize("name, expected", [
    ("a.txt", True), ("A.TXT", True), ("notes.Md", True), ("a.jsonl.gz", True), ("a.JSONL.GZ", True),
    ("x.y.jsonl.gz", True), ("a.tar.gz", True),  # .gz alone is wanted
    ("a.txt.bak", False), ("a.", False), ("a.txt.", False), ("noext", False), ("txt", False),
    (".txt", False), ("..txt", False), (".hidden.md", True), ("a..txt", True), ("a. txt", False),
    ("dir/a.md", True), ("a.json", False),
])
def test_extensions(name, expected):
    assert has_extension(name, EXTENSIONS) is expected
    assert by_pathlib(name, EXTENSIONS) is expected


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet="ab.TXtjsonlgzmd -", max_size=14))
def test_the_same_answer_as_pathlib_s_suffixes(name):
    assert has_extension(name, EXTENSIONS) == by_pathlib(name, EXTENSIONS)

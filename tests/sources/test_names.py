"""A file's extension from its name, against pathlib's own suffixes; a name as text and back."""

from __future__ import annotations

import os
from pathlib import PurePosixPath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedingest.sources.names import has_extension, name_as_text, text_as_name

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


@given(st.binary(max_size=40).filter(lambda b: b"/" not in b and b"\0" not in b))
@settings(max_examples=500)
def test_text_as_name_gives_back_every_name(raw):
    name = os.fsdecode(raw)
    text = name_as_text(name)
    text.encode("utf-8")  # valid text, whatever the bytes (a surrogate would raise)
    assert text_as_name(text) == name


@pytest.mark.parametrize("raw, text", [(b"caf\xe9.txt", "caf\\xe9.txt"), (b"caf\\xe9.txt", "caf\\\\xe9.txt"),
                                       (b"back\\slash.txt", "back\\\\slash.txt"), (b"plain.txt", "plain.txt")])
def test_a_name_and_a_literal_escape_stay_two_names(raw, text):
    """A file named with the byte 0xe9 and one named with the four characters \\xe9 have
    texts of their own, and each text gives back its own name."""
    assert name_as_text(os.fsdecode(raw)) == text
    assert os.fsencode(text_as_name(text)) == raw

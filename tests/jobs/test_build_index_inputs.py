"""build-index end to end on the inputs that were once lost or merged without a word:
duplicate record ids, file names that differ only as bytes vs escapes, NUL characters."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedingest import build_index, open_index
from embedingest.errors import ConfigError
from embedingest.index.store import IndexStore
from embedingest.jobs.build_index import unit_key

FAST = dict(num_workers=0, num_consumers=1, batch_size=8)
TEXTS = ["Strong coffee keeps the night shift awake.", "Green tea is brewed at eighty degrees.",
         "Glaciers carve deep valleys into the mountains."]


@pytest.mark.parametrize("records, rid, first, second", [
    ([("same", TEXTS[0]), ("same", TEXTS[1]), {"id": "same", "text": TEXTS[2]}], "same", 0, 1),
    ([("x", TEXTS[0]), ("same", TEXTS[1]), {"id": "same", "text": TEXTS[2]}], "same", 1, 2),
    ([(1, TEXTS[0]), ("1", TEXTS[1])], "1", 0, 1),
    ([{"text": TEXTS[0]}, {"id": 0, "text": TEXTS[1]}], "0", 0, 1),  # a position is an id too
])
def test_duplicate_record_ids_are_an_error_before_anything_is_written(tmp_path, records, rid,
                                                                       first, second):
    out = tmp_path / "mem"
    with pytest.raises(ConfigError) as err:
        build_index(iter(records), out=str(out), **FAST)
    assert f"record id {rid!r} is given twice, by records {first} and {second}" in str(err.value)
    assert not out.exists()


def test_records_without_ids_are_numbered_by_position_and_all_kept(tmp_path):
    out = tmp_path / "mem"
    records = [(None, TEXTS[0]), {"id": None, "text": TEXTS[1]}, {"text": TEXTS[2]}]
    s = build_index(records, out=str(out), **FAST)
    assert (s["exit_code"], s["units_indexed"], s["chunks"]) == (0, 3, 3)
    hits = open_index(out).search(TEXTS, k=1)
    assert [(h[0].record_id, h[0].text) for h in hits] == [("0", TEXTS[0]), ("1", TEXTS[1]),
                                                           ("2", TEXTS[2])]


@pytest.mark.parametrize("name, key", [
    ("notes/café.txt", "notes/café.txt"),  # an ordinary name is its own key
    ("a b/东京 (1).md", "a b/东京 (1).md"),
    ("caf\udce9.txt", "caf\\xe9.txt"),  # byte 0xE9, not UTF-8
    ("caf\\xe9.txt", "caf\\\\xe9.txt"),  # a literal backslash
    ("a\\\udcff", "a\\\\\\xff"),
])
def test_unit_key(name, key):
    assert unit_key(name) == key


def _name_bytes(key: str) -> bytes:
    """The file name a key was made from: the inverse of unit_key, so it is injective."""
    out, i = bytearray(), 0
    while i < len(key):
        if key.startswith("\\\\", i):
            out += b"\\"
            i += 2
        elif key.startswith("\\x", i):
            out.append(int(key[i + 2:i + 4], 16))
            i += 4
        else:
            out += key[i].encode("utf-8")
            i += 1
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=12).map(lambda b: b.replace(b"\0", b"")))
def test_unit_key_is_injective(name):
    assert _name_bytes(unit_key(os.fsdecode(name))) == name


def test_a_byte_name_and_its_escaped_spelling_are_two_files(tmp_path):
    """``caf<0xE9>.txt`` and a file literally named ``caf\\xe9.txt``: once indexed as one."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    try:
        Path(os.fsdecode(bytes(corpus) + b"/caf\xe9.txt")).write_text(TEXTS[0])
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    (corpus / "caf\\xe9.txt").write_text(TEXTS[1])
    out = tmp_path / "idx"
    s = build_index(corpus, out=str(out), **FAST)
    assert (s["exit_code"], s["units_seen"], s["units_indexed"], s["chunks"]) == (0, 2, 2, 2)
    with IndexStore(out) as store:
        assert sorted(store.units()) == ["caf\\\\xe9.txt", "caf\\xe9.txt"]
    hits = open_index(out).search(TEXTS[:2], k=1)
    assert [(h[0].source, h[0].text) for h in hits] == [("caf\\xe9.txt", TEXTS[0]),
                                                        ("caf\\\\xe9.txt", TEXTS[1])]
    assert build_index(corpus, out=str(out), **FAST)["units_unchanged"] == 2


def test_a_nul_character_is_stored_as_the_replacement_character(tmp_path):
    """``alpha\\0beta gamma`` was stored as ``alpha`` (the store cuts text at NUL) while
    its span said 16 characters: NUL is read as U+FFFD, so the stored text is the span of
    the text as read, and the tokens (BERT drops both characters) are the same."""
    text = "alpha\u0000beta gamma"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    sources = {"r.jsonl": "jsonl " + text, "big.txt": "x " * 5000 + text}  # past the 8 KiB check
    (corpus / "r.jsonl").write_text(json.dumps({"id": "n\u0000l", "text": sources["r.jsonl"]}))
    (corpus / "big.txt").write_text(sources["big.txt"])
    for name, corpus_or_records in [("mem", [("m\u0000", text)]), ("files", corpus)]:
        out = tmp_path / name
        s = build_index(corpus_or_records, out=str(out), **FAST)
        assert s["exit_code"] == 0 and s["skipped"] == 0
        hits = open_index(out).search([text], k=s["vectors_total"])[0]
        assert len(hits) == s["vectors_total"]
        with_nul = 0
        for hit in hits:
            source = text if name == "mem" else sources[hit.source]
            span = source[hit.char_start:hit.char_end]
            assert hit.text == span.replace("\u0000", "\ufffd")
            with_nul += "\u0000" in span
        assert with_nul == (1 if name == "mem" else 2)
        ids = {h.record_id for h in hits}
        assert ids == ({"m\ufffd"} if name == "mem" else {"n\ufffdl", ""})

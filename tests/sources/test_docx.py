"""sources/docx.py: a Word document's body as text, and every way a .docx can be bad as a
reason (zip bombs, entity bombs and external entities included)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings, strategies as st

from docx_fixtures import W, document, make_docx, para, table
from embedingest.sources.docx import MAX_BODY_BYTES, DocxSkip, docx_text
from embedingest.sources.text import iter_records


def test_paragraphs_tables_and_tabs_in_reading_order():
    body = document(para("Bread is ", "baked.") + table([["flour", "500 g"], ["water", "350 g"]])
                    + para("rest", "\t", "one hour"))
    assert docx_text(make_docx(body)) == "Bread is baked.\nflour\t500 g\nwater\t350 g\nrest\tone hour"


def test_deleted_changes_field_codes_and_a_text_box_s_fallback_copy_are_not_read():
    body = document(
        "<w:p><w:del><w:r><w:delText>struck out</w:delText></w:r></w:del>"
        "<w:ins><w:r><w:t>inserted</w:t></w:r></w:ins>"
        "<w:r><w:instrText> PAGE </w:instrText></w:r></w:p>"
        "<w:p><w:r><mc:AlternateContent><mc:Choice><w:t>in a box</w:t></mc:Choice>"
        "<mc:Fallback><w:t>in a box</w:t></mc:Fallback></mc:AlternateContent></w:r></w:p>")
    assert docx_text(make_docx(body)) == "inserted\nin a box"


def test_moved_text_is_read_at_its_new_place_only():
    """The old place of moved text (w:moveFrom) keeps its runs' w:t: it was read too,
    'P12 moved toMOVEDFROM'; a deletion whose runs hold w:t is not read either."""
    body = document(
        "<w:p><w:r><w:t>P12 </w:t></w:r><w:moveTo><w:r><w:t>moved to</w:t></w:r></w:moveTo>"
        "<w:moveFrom><w:r><w:t>MOVEDFROM</w:t></w:r></w:moveFrom></w:p>"
        "<w:p><w:r><w:rPr><w:del/></w:rPr><w:t>kept</w:t></w:r><w:del><w:r><w:t>gone</w:t></w:r></w:del></w:p>")
    assert docx_text(make_docx(body)) == "P12 moved to\nkept"


def test_a_docx_is_one_record_through_iter_records(tmp_path):
    (tmp_path / "a.docx").write_bytes(make_docx(document(para("alpha beta"))))
    skips: list = []
    assert list(iter_records(tmp_path / "a.docx", on_skip=lambda *a: skips.append(a))) == [("", "alpha beta")]
    assert skips == []


def _lying_size(data: bytes, size: int) -> bytes:
    """The body's uncompressed size in the central directory replaced by ``size``."""
    at = data.rfind(b"PK\x01\x02", 0, data.rfind(b"word/document.xml"))
    out = bytearray(data)
    struct.pack_into("<I", out, at + 24, size)
    return bytes(out)


LAUGHS = ('<?xml version="1.0"?><!DOCTYPE w:document [<!ENTITY a "' + "a" * 1000 + '">'
          + "".join(f'<!ENTITY {c} "' + f"&{p};" * 10 + '">' for p, c in zip("abcdefg", "bcdefgh"))
          + f']><w:document xmlns:w="{W}"><w:body><w:p><w:r><w:t>&h;</w:t></w:r></w:p></w:body></w:document>')
XXE = ('<?xml version="1.0"?><!DOCTYPE w:document [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
       f'<w:document xmlns:w="{W}"><w:body><w:p><w:r><w:t>&x;</w:t></w:r></w:p></w:body></w:document>')


@pytest.mark.parametrize("data, reason", [
    (b"PK\x03\x04 not a zip", "docx: not a readable zip (File is not a zip file)"),
    (make_docx("<x/>", name="word/other.xml"), "docx: no word/document.xml in it: not a Word document"),
    (make_docx("<w:document"), "docx: its text part is not well-formed XML"),
    (make_docx(document(para(""))), "empty: no text in the document's body"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(600), "encrypted: a password-protected (or old binary .doc)"),
    (make_docx(document(para(" " * (MAX_BODY_BYTES + 1)))),
     f"too-large: its text part unpacks to {MAX_BODY_BYTES + 1 + len(document(para('')))} bytes"),
    (_lying_size(make_docx(document(para("x" * 100_000))), 100), "docx: its text part is damaged (Bad CRC-32"),
    (make_docx(LAUGHS), "docx: its text part is not well-formed XML (limit on input amplification factor"),
    (make_docx(XXE), "docx: its text part is not well-formed XML (undefined entity &x;"),
])
def test_a_bad_docx_is_skipped_whole_with_its_reason(data, reason):
    with pytest.raises(DocxSkip) as skip:
        docx_text(data)
    assert str(skip.value).startswith(reason), str(skip.value)


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 600))
def test_random_and_mutated_bytes_are_text_or_a_reason(junk, at):
    base = make_docx(document(para("some text") + table([["a", "b"]])))
    for data in (junk, base[:at] + junk + base[at + len(junk):]):
        try:
            assert isinstance(docx_text(data), str)
        except DocxSkip as skip:
            assert str(skip).split(":")[0] in ("docx", "encrypted", "empty", "too-large")

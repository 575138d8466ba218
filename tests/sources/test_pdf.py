"""sources/pdf.py: a PDF's pages as records, and every way a PDF can be bad as a reason."""

from __future__ import annotations

import io
import zlib

import pytest
from hypothesis import given, settings, strategies as st
from pypdf import PdfReader, PdfWriter
from pypdf.generic import NameObject, NumberObject, StreamObject

from embedingest.sources.pdf import PdfSkip, page_text, pdf_pages
from pdf_fixtures import make_pdf


def _read(data: bytes) -> tuple[list, list]:
    skips: list = []
    return list(pdf_pages(data, lambda n, reason: skips.append((n, reason)))), skips


def test_each_page_with_text_is_a_record_named_by_its_page():
    pages, skips = _read(make_pdf(["Bread is baked (in an oven)\nat 220 degrees", None, "A third page"]))
    assert pages == [("page-1", "Bread is baked (in an oven)\nat 220 degrees"), ("page-3", "A third page")]
    assert skips == []


def test_the_text_agrees_with_pypdf_itself():
    data = make_pdf(["alpha beta", "gamma\ndelta", "epsilon"])
    reference = [p.extract_text() for p in PdfReader(io.BytesIO(data)).pages]
    assert [text for _, text in _read(data)[0]] == [page_text(t) for t in reference]


@pytest.mark.parametrize("data, reason", [
    (b"", "pdf: pypdf cannot read it (EmptyFileError"),
    (b"%PDF-1.4\nnot a pdf at all", "pdf: pypdf cannot read it"),
    (make_pdf(["cut short"])[:200], "pdf: pypdf cannot read it"),
    (make_pdf([None, None]), "empty: no text on any of its 2 page(s); a scanned PDF needs OCR first"),
    (make_pdf(["locked"], user_password="secret", owner_password="owner"),
     "encrypted: the PDF needs a password to open; save a copy without one to index it"),
])
def test_a_bad_pdf_is_skipped_whole_with_its_reason(data, reason):
    with pytest.raises(PdfSkip) as skip:
        _read(data)
    assert str(skip.value).startswith(reason)


def test_a_pdf_locked_for_editing_only_is_read():
    """Most 'protected' PDFs have an owner password and an empty user password: readable."""
    assert _read(make_pdf(["open to read"], user_password="", owner_password="owner")) == (
        [("page-1", "open to read")], [])


def _with_page_contents(data: bytes, page: int, payload: bytes) -> bytes:
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(data)))
    stream = StreamObject()
    stream._data = payload
    stream[NameObject("/Filter")] = NameObject("/FlateDecode")
    stream[NameObject("/Length")] = NumberObject(len(payload))
    writer.pages[page][NameObject("/Contents")] = writer._add_object(stream)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def test_a_decompression_bomb_skips_its_page_and_the_others_are_read():
    bomb = zlib.compress(b"\0" * 200_000_000, 9)  # 194 KB for 200 MB
    data = _with_page_contents(make_pdf(["good page one", "bomb", "good page three"]), 1, bomb)
    pages, skips = _read(data)
    assert pages == [("page-1", "good page one"), ("page-3", "good page three")]
    assert [n for n, _ in skips] == [2]
    assert skips[0][1].startswith("pdf: page 2: pypdf cannot read its text (LimitReachedError")


def test_a_cyclic_page_tree_is_named():
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(make_pdf(["a", "b"]))))
    pages = writer._root_object["/Pages"]
    pages["/Kids"].append(writer._root_object.raw_get("/Pages"))
    pages[NameObject("/Count")] = NumberObject(3)
    out = io.BytesIO()
    writer.write(out)
    with pytest.raises(PdfSkip, match=r"^pdf: its page tree cannot be read \(PdfReadError: Detected cyclic"):
        _read(out.getvalue())


def test_page_text_drops_broken_characters_and_extra_space():
    assert page_text("  a\ud800b \t c\n\n\n\nd  \n") == "a\ufffdb c\n\nd"


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 2000))
def test_random_and_mutated_bytes_are_records_or_reasons(junk, at):
    """Whatever the bytes, the reader gives pages or a reason, never another error."""
    base = make_pdf(["some text here", "more text"])
    for data in (junk, base[:at] + junk + base[at + len(junk):]):
        try:
            pages, skips = _read(data)
        except PdfSkip as skip:
            assert str(skip).split(":")[0] in ("pdf", "encrypted", "empty")
            continue
        assert all(rid.startswith("page-") and text for rid, text in pages)
        assert all(reason.split(":")[0] in ("pdf", "too-large") for _, reason in skips)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.none(), st.sampled_from(["alpha", "beta gamma", "delta\nepsilon"])), min_size=1,
                max_size=12), st.integers(1, 5))
def test_the_parts_pages_together_are_the_whole_files(pages, parts):
    """A PDF read in parts (a page range each): their pages, in part order, are the pages
    read whole; no part says the file is empty (another part may have the text)."""
    data = make_pdf(pages)
    got = []
    for p in range(parts):
        skips: list = []
        got += list(pdf_pages(data, lambda n, reason: skips.append(n), part=(p, parts)))
        assert skips == []
    if any(pages):
        assert got == _read(data)[0]
    else:
        assert got == []
        with pytest.raises(PdfSkip, match="empty: no text on any of its"):
            _read(data)


def test_a_bad_page_is_told_by_the_part_that_holds_it():
    data = _with_page_contents(make_pdf(["one", "two", "three", "four"]), 2, zlib.compress(b"\0" * 200_000_000, 9))
    told = {}
    for p in range(2):
        skips: list = []
        list(pdf_pages(data, lambda n, reason: skips.append(n), part=(p, 2)))
        told[p] = skips
    whole = _read(data)[1]
    assert [n for n, _ in whole] == told[1] == [3] and told[0] == []

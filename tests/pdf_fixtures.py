"""PDFs made here, with pypdf alone: pages of Helvetica text, blank pages, password-locked
and damaged copies, for the PDF reader's tests."""

from __future__ import annotations

import io

from pypdf import PdfWriter
from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject


def _escaped(line: str) -> bytes:
    return line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)").encode("latin-1")


def make_pdf(pages: list[str | None], user_password: str | None = None, owner_password: str | None = None) -> bytes:
    """A PDF of ``pages``: each a text of lines set in Helvetica, or None for a page with
    no text (a scan's, for the reader)."""
    writer = PdfWriter()
    font = writer._add_object(DictionaryObject({
        NameObject("/Type"): NameObject("/Font"), NameObject("/Subtype"): NameObject("/Type1"),
        NameObject("/BaseFont"): NameObject("/Helvetica")}))
    for text in pages:
        page = writer.add_blank_page(612, 792)
        if text is None:
            continue
        page[NameObject("/Resources")] = DictionaryObject(
            {NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})})
        ops = b"BT /F1 11 Tf 14 TL 72 740 Td " + b" ".join(
            b"(" + _escaped(line) + b") Tj T*" for line in text.split("\n")) + b" ET"
        stream = DecodedStreamObject()
        stream.set_data(ops)
        page[NameObject("/Contents")] = writer._add_object(stream)
    if user_password is not None:
        writer.encrypt(user_password=user_password, owner_password=owner_password, algorithm="RC4-128")
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()

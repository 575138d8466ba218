"""Word documents (.docx) made here with zipfile: paragraphs, tables, tracked changes,
text boxes, and damaged or hostile copies, for the .docx reader's tests."""

from __future__ import annotations

import io
import zipfile
from xml.sax.saxutils import escape

W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
MC = "http://schemas.openxmlformats.org/markup-compatibility/2006"
CONTENT_TYPES = ('<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/'
                 'package/2006/content-types"><Default Extension="xml" ContentType="application/xml"/></Types>')


def para(*runs: str) -> str:
    """A paragraph of runs; a run "\\t" is a tab."""
    return "<w:p>" + "".join("<w:r><w:tab/></w:r>" if r == "\t" else f"<w:r><w:t xml:space=\"preserve\">"
                             f"{escape(r)}</w:t></w:r>" for r in runs) + "</w:p>"


def table(rows: list[list[str]]) -> str:
    return "<w:tbl>" + "".join("<w:tr>" + "".join(f"<w:tc>{para(cell)}</w:tc>" for cell in row) + "</w:tr>"
                               for row in rows) + "</w:tbl>"


def document(body: str) -> str:
    return (f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:document xmlns:w="{W}" '
            f'xmlns:mc="{MC}"><w:body>{body}</w:body></w:document>')


def make_docx(body_xml: str | bytes, name: str = "word/document.xml") -> bytes:
    """A .docx whose ``name`` part (the body by default) is ``body_xml``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", CONTENT_TYPES)
        z.writestr(name, body_xml)
    return buf.getvalue()

"""Text out of a Word document (.docx): its body's paragraphs and tables, in order.

A .docx is a zip of XML parts; the body is ``word/document.xml``. It is streamed through
the standard library's XML parser (which resolves no external entity and, with expat
2.4 and later, refuses entity-expansion bombs), keeping only text: runs (``w:t``), tabs
and breaks, a line a paragraph, a tab between table cells. Deleted tracked changes
(``w:del``, ``w:delText``), the old place of moved text (``w:moveFrom``) and field codes
(``w:instrText``) are not text a reader sees, so they are left out. The part's declared size bounds what is decompressed (zipfile stops there
and a zip bomb's lie fails its CRC), so a small file cannot unpack into gigabytes.

A leaf: :mod:`.text` owns the reasons' wording for the file and calls this.
"""

from __future__ import annotations

import io
import lzma
import re
import zipfile
import zlib
from xml.etree import ElementTree

MAX_DOCX_BYTES = 2**28  # the file, read whole
MAX_BODY_BYTES = 2**28  # word/document.xml once decompressed
BODY = "word/document.xml"
_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"  # a password-protected .docx is an OLE file
_BLANK_LINES = re.compile(r"\n\s*\n\s*")


# What zipfile raises on a damaged archive or member (OSError: bz2's too; NotImplementedError:
# a method or version it does not know, which damage reads as).
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, lzma.LZMAError, NotImplementedError,
               RuntimeError, ValueError, EOFError, OSError)


class DocxSkip(Exception):
    """The whole file is skipped; the message is the skip reason."""


def _body(data: bytes) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    if data.startswith(_OLE_MAGIC):
        raise DocxSkip("encrypted: a password-protected (or old binary .doc) Word file; save a copy "
                       "without a password as .docx to index it")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        info = archive.getinfo(BODY)
    except KeyError:
        raise DocxSkip(f"docx: no {BODY} in it: not a Word document") from None
    except _ZIP_ERRORS as exc:
        raise DocxSkip(f"docx: not a readable zip ({exc}); the file is damaged or not a .docx") from None
    if info.file_size > MAX_BODY_BYTES:
        raise DocxSkip(f"too-large: its text part unpacks to {info.file_size} bytes, more than {MAX_BODY_BYTES}; "
                       "split the document")
    return archive, info


# What each closing tag adds: a run's text is taken from w:t alone (w:delText, deleted
# text, and w:instrText, field codes, are other tags and so left out).
_ENDS = {_W + "tab": "\t", _W + "br": "\n", _W + "cr": "\n", _W + "p": "\n", _W + "tc": "\t", _W + "tr": "\n"}
_CLEARED = {_W + "p", _W + "tbl", _W + "body"}
_FALLBACK = "{http://schemas.openxmlformats.org/markup-compatibility/2006}Fallback"
# Text no reader sees: a text box's copy for older readers (mc:Fallback, beside its
# mc:Choice), a tracked deletion (w:del) and the old place of moved text (w:moveFrom,
# whose runs keep w:t: its new place, w:moveTo, is read).
_UNSEEN = {_FALLBACK, _W + "del", _W + "moveFrom"}


def docx_text(data: bytes) -> str:
    """The document's text. Raises :class:`DocxSkip` with the reason where there is none
    to take."""
    archive, info = _body(data)
    pieces: list[str] = []
    unseen = 0  # depth inside _UNSEEN elements
    try:
        with archive, archive.open(info) as body:
            for event, el in ElementTree.iterparse(body, events=("start", "end")):
                if el.tag in _UNSEEN:
                    unseen += 1 if event == "start" else -1
                if event == "start" or unseen:
                    continue
                if el.tag == _W + "t":
                    pieces.append(el.text or "")
                elif el.tag in _ENDS:
                    pieces.append(_ENDS[el.tag])
                if el.tag in _CLEARED:
                    el.clear()  # what is taken of it is in pieces: memory stays a paragraph's
    except ElementTree.ParseError as exc:
        raise DocxSkip(f"docx: its text part is not well-formed XML ({exc})") from None
    except _ZIP_ERRORS as exc:
        raise DocxSkip(f"docx: its text part is damaged ({exc})") from None
    text = "".join(pieces).replace("\n\t", "\t").replace("\t\n", "\n")  # a table row: cells, then a line
    text = _BLANK_LINES.sub("\n\n", text).strip()
    if not text:
        raise DocxSkip("empty: no text in the document's body")
    return text

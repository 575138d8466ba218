"""Text out of a PDF, a page at a time, with pypdf.

Each page is a record with id ``page-N`` (N from 1, as a reader numbers pages), so a
search hit names the page it came from; a page without text (blank, a figure) is no
record. A PDF is parsed by a library that reads whatever its bytes say, so everything it
raises on a damaged or hostile file is a reason, never an error of the run: the file's
(``pdf``, ``encrypted``, ``empty`` for a scan without a text layer) or one page's.
pypdf bounds what one stream may decompress to, and the file is bounded here
(:data:`MAX_PDF_BYTES`), as are a page's characters (:data:`MAX_PAGE_CHARS`).

A leaf: :mod:`.text` owns the reasons' wording for the file and calls this.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from collections.abc import Callable, Iterator

MAX_PDF_BYTES = 2**28  # the whole file is parsed, and its objects kept while it is read
MAX_PAGE_CHARS = 2**26  # as a JSON line or a CSV field
NEEDS_OCR = "a scanned PDF needs OCR first"
_SURROGATES = re.compile("[\ud800-\udfff]")
_SPACES = re.compile(r"[ \t\r\f\v]+")
_BLANK_LINES = re.compile(r"\n\s*\n\s*")


class PdfSkip(Exception):
    """The whole file is skipped; the message is the skip reason."""


@contextlib.contextmanager
def _quiet_pypdf() -> Iterator[None]:
    """pypdf logs and warns on every repair it makes to a damaged file (an xref off by
    some bytes, a missing object): the page's text, or the skip reason, says what counts."""
    log = logging.getLogger("pypdf")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _problem(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().rstrip(":")[:300]


def _reader(data: bytes):
    from pypdf import PdfReader

    try:
        reader = PdfReader(io.BytesIO(data))
        encrypted = reader.is_encrypted
    except Exception as exc:
        raise PdfSkip(f"pdf: pypdf cannot read it ({_problem(exc)}); the file is damaged or not a PDF") from None
    if encrypted:
        try:
            opened = reader.decrypt("")
        except Exception as exc:
            raise PdfSkip(f"encrypted: the PDF cannot be decrypted here ({_problem(exc)})") from None
        if not opened:
            raise PdfSkip("encrypted: the PDF needs a password to open; save a copy without one to index it")
    return reader


def page_text(text: str) -> str:
    """A page's text as the chunker takes it: lone surrogates (from a broken font map) as
    U+FFFD, runs of spaces as one, blank lines as one."""
    text = _SURROGATES.sub("\ufffd", text)
    return _BLANK_LINES.sub("\n\n", _SPACES.sub(" ", text)).strip()


def _extract(reader, n: int) -> str:
    with _quiet_pypdf():
        return reader.pages[n - 1].extract_text()


def pdf_pages(data: bytes, on_page_skip: Callable[[int, str], None],
              part: tuple[int, int] | None = None) -> Iterator[tuple[str, str]]:
    """``(f"page-{n}", text)`` for each page of the PDF ``data`` with text. A page pypdf
    fails on, or of more than :data:`MAX_PAGE_CHARS`, goes to ``on_page_skip(n, reason)``
    and the others are read. Raises :class:`PdfSkip` for the whole file. (pypdf is kept
    quiet only while it works, not while the caller holds a page.)

    ``part``: ``(p, parts)``, the pages of the ``p``-th ``parts``-th only (a large PDF read
    by several workers, see :mod:`.file_parts`); a part with no text is no skip, since
    the file as a whole may have text in another (the reader of the parts says so)."""
    with _quiet_pypdf():
        reader = _reader(data)
        try:
            pages = len(reader.pages)
        except Exception as exc:
            raise PdfSkip(f"pdf: its page tree cannot be read ({_problem(exc)}); the file is damaged") from None
    if not pages:
        raise PdfSkip("empty: the PDF has no pages")
    p, parts = part or (0, 1)
    found = failed = 0
    for n in range(pages * p // parts + 1, pages * (p + 1) // parts + 1):
        try:
            text = _extract(reader, n)
        except Exception as exc:
            failed += 1
            on_page_skip(n, f"pdf: page {n}: pypdf cannot read its text ({_problem(exc)})")
            continue
        if len(text) > MAX_PAGE_CHARS:
            failed += 1
            on_page_skip(n, f"too-large: page {n}: more than {MAX_PAGE_CHARS} characters on one page")
            continue
        text = page_text(text)
        if text:
            found += 1
            yield f"page-{n}", text
    if not found and not failed and part is None:
        raise PdfSkip(f"empty: no text on any of its {pages} page(s); {NEEDS_OCR}")

"""Read text records out of one file, whatever its format.

:func:`iter_records` streams ``(record_id, text)`` pairs so a corpus of any size passes
through bounded memory: JSON lines, CSV and Parquet are read a record at a time, a plain
text, Markdown or reST file a block at a time when ``stream_above`` asks for it; an HTML
page or a .json document is parsed whole, and so bounded in size (``too-large``).

Nothing a file contains stops a run: every problem goes to ``on_skip(where, reason)``.
``where`` is the path for a whole-file problem, and ``"<path>:<location>"`` (``line 12``,
``row 7``, ``item 3``) for a record problem, which skips that record only. ``reason``
starts with a stable keyword (the part before the first colon, what
:meth:`embedingest.report.SkipReport.by_reason` counts):

==============  ===============================================================
``unreadable``  the file cannot be opened or read (permission, I/O error, a folder)
``not a regular file``  a named pipe, socket or device (one that replaced a file
                after it was listed too): never opened for reading, which could wait
                for ever
``binary``      a NUL byte in the first 8 KiB: not text (UTF-16 or UTF-32 without a BOM too)
``empty``       no bytes, only whitespace, no records, a record with empty text, or a
                PDF without a text layer (a scan)
``decode``      bytes that are neither UTF-8 nor cp1252 (or a broken UTF-16 file)
``json``        malformed JSON, nested too deeply, or not an object where one is due
``field``       the text field is missing, null or not a string
``unicode``     the text or id holds a lone surrogate (a broken ``\\ud800``-style
                JSON escape), which neither tokenizers nor the metadata store take
``csv``         the csv module gave up on a row (a quote that does not close its field)
``parquet``     pyarrow cannot read the file
``pdf``         pypdf cannot read the file (damaged, not a PDF), or one page's text
``docx``        a .docx that is no readable zip, has no body, or whose body is not XML
``encrypted``   a PDF that needs a password to open, a password-protected .docx
``format``      a suffix that is not in :data:`TEXT_EXTENSIONS`
``decompress``  a ``.gz``/``.bz2``/``.xz``/``.zst`` file that is corrupt or cut short (for the
                streamed formats: the rest of it, with the records before kept)
``too-large``   once decompressed: an HTML page over 16 MiB, a .json document over
                256 MiB, a PDF or .docx (or its body unpacked) over 256 MiB, a text file
                read whole over 1 GiB; a JSON line, a CSV line or field, a Parquet text
                or a PDF page over 64 Mi characters (that record only; for CSV the rest
                of the file)
==============  ===============================================================

Every format but Parquet may also come compressed as ``.gz``, ``.bz2``, ``.xz`` or
``.zst`` (``docs.jsonl.gz``): it is decompressed while it is read, so JSON lines and CSV
still stream.

``path`` may also be an fsspec URL (``s3://bucket/docs.jsonl.zst``, see
:mod:`~embedingest.sources.remote`): the object is read as a local file is, and a
problem reading it is a skip reason as for a local file.

Decoding: UTF-8 (a UTF-8 BOM is dropped; a UTF-16 or UTF-32 BOM selects that). A byte that is
not part of valid UTF-8 is read as cp1252, the usual encoding of legacy Western text,
so a cp1252 file, or a UTF-8 file with a few stray legacy bytes, is read without loss
instead of being skipped. The five bytes cp1252 leaves undefined (0x81 0x8D 0x8F 0x90
0x9D) almost never occur in real legacy text, so meeting one skips the file as
``decode`` (for the streamed formats: the rest of it, with every line before the one
that holds the byte kept, and that line named). A whole document that is not UTF-8 and
that cp1252 turns into another encoding's letters (Cyrillic as words of accented Latin,
``Ïðèâåò``; Central European with symbols inside words, ``Za¿ó³æ``) is skipped as
``decode`` too, rather than stored as nonsense (what is streamed, JSON lines, CSV or a
text file read a block at a time, is not checked so).
An HTML page that is not valid UTF-8 is read in the encoding its ``<meta charset>``
declares when that is not a Western one (Shift_JIS, GB2312, windows-1251, ...).
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import csv
import functools
import gzip
import itertools
import json
import logging
import lzma
import os
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from .file_parts import ByteRange, line_ends_before, part_bounds
from .files import open_input, os_error_reason
from .remote import is_remote, remote_size

OnSkip = Callable[[str, str], None]

WHOLE_TEXT_EXTENSIONS = {".txt", ".md", ".rst"}
HTML_EXTENSIONS = {".html", ".htm"}
JSONL_EXTENSIONS = {".jsonl", ".ndjson"}
CSV_EXTENSIONS = {".csv", ".tsv"}
_PLAIN_EXTENSIONS = (WHOLE_TEXT_EXTENSIONS | HTML_EXTENSIONS | JSONL_EXTENSIONS
                     | CSV_EXTENSIONS | {".json"})


class CorruptStream(ValueError):
    """Compressed data that does not decompress, where the decompressor raises a plain
    ``OSError`` for it (bz2), which would read as the disk's failure."""


class ZstdCorrupt(ValueError):
    """A zstd stream that does not decompress (``zstandard.ZstdError``, named here so the
    module imports without zstandard)."""


class ZstdReader:
    """A zstd stream's decompressed bytes, read a block at a time (several frames one
    after another, as ``zstd -T`` and ``pzstd`` write them, too).

    ``zstandard``'s own readers end quietly at a stream cut short inside a frame, which
    would index a truncated file as whole; here that is an ``EOFError``, as gzip, bz2
    and lzma raise. Input is fed :attr:`FEED` bytes at a time, so one feed makes at
    most 8 MiB (a zstd block of 4 bytes can stand for 128 KiB), however well the data
    compresses: a decompression bomb stays bounded."""

    FEED = 256

    def __init__(self, raw):
        import zstandard  # only where a .zst file is read

        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._errors = zstandard.ZstdError
        self._obj = None  # the frame being decompressed, None between frames
        self._buf, self._pos = b"", 0
        self._eof = False

    def _fill(self) -> None:
        while self._pos == len(self._buf) and not self._eof:
            data = self._raw.read(self.FEED)
            if not data:
                self._eof = True
                if self._obj is not None:
                    raise EOFError("compressed file ended before the end-of-stream marker "
                                   "was reached")
                return
            out = []
            while data:
                if self._obj is None:
                    self._obj = self._dctx.decompressobj()
                try:
                    out.append(self._obj.decompress(data))
                except self._errors as exc:
                    raise ZstdCorrupt(str(exc)) from exc
                data = b""
                if self._obj.eof:
                    data, self._obj = self._obj.unused_data, None
            self._buf, self._pos = b"".join(out), 0

    def read1(self, n: int = -1) -> bytes:
        """At most ``n`` bytes, from one feed's decompressed output (b"" at the end): what
        :class:`_Closing` reads, so the bytes before a cut come out before the cut's
        ``EOFError``."""
        self._fill()
        end = len(self._buf) if n < 0 else min(len(self._buf), self._pos + n)
        out, self._pos = self._buf[self._pos:end], end
        return out

    def read(self, n: int = -1) -> bytes:
        parts = []
        while n != 0:
            self._fill()
            if self._pos == len(self._buf):
                break
            end = len(self._buf) if n < 0 else min(len(self._buf), self._pos + n)
            parts.append(self._buf[self._pos:end])
            if n > 0:
                n -= end - self._pos
            self._pos = end
        return b"".join(parts)

    def close(self) -> None:
        self._buf = b""


COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open,
                ".zst": lambda fh, mode: ZstdReader(fh)}
# Formats compressed in their own way, never given as .gz & co.
_PACKED_EXTENSIONS = frozenset({".parquet", ".pdf", ".docx"})
TEXT_EXTENSIONS = frozenset(_PLAIN_EXTENSIONS | _PACKED_EXTENSIONS
                            | {ext + c for ext in _PLAIN_EXTENSIONS for c in COMPRESSIONS})
# What a corrupt or truncated compressed stream raises (gzip's BadGzipFile is an OSError).
_DECOMPRESS_ERRORS = (EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile, ZstdCorrupt, CorruptStream)
# Size bounds (decompressed): what is read whole must fit memory several times over.
MAX_WHOLE_BYTES = 2**30  # a text file read whole (without stream_above)
MAX_JSON_BYTES = 2**28  # a .json document (parsed whole; JSON lines are streamed)
MAX_HTML_BYTES = 2**24  # an HTML page (its parse tree takes tens of times its size)
MAX_LINE_CHARS = 2**26  # one line of JSON lines or CSV, and one CSV field or Parquet text
STREAM_BLOCK = 2**16  # bytes read at a time when streaming

BINARY_PROBE_BYTES = 8192
PARQUET_BATCH_ROWS = 1024
PARQUET_BUFFER_BYTES = 2**20
# Records of one file whose ids are kept to find an id given again (_FirstIds).
MAX_IDS_CHECKED = 1_000_000

_ERRORS = "embedingest.utf8-cp1252"
log = logging.getLogger("embedingest")
# The BOMs of the encodings of more than one byte a unit, UTF-32's first: its LE BOM begins
# with UTF-16's. Each names the codec that reads the bytes after it.
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"),
              (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))
_HTML_DROP = ("script", "style", "noscript", "template")
_HTML_BLOCKS = ("p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre",
                "blockquote", "section", "article", "header", "footer", "title", "dt",
                "dd", "table", "ul", "ol", "hr", "figcaption", "caption", "nav", "aside",
                "main", "figure", "address", "form", "fieldset", "legend", "details",
                "summary", "dl", "menu", "center", "textarea")
# Elements whose whitespace is their content: kept as written.
_HTML_VERBATIM = ("pre", "textarea")
# Elements set side by side: a space after each keeps the words of neighbours apart
# (``<td>apple</td><td>banana</td>`` is not ``applebanana``).
_HTML_CELLS = ("td", "th", "option", "button", "label")
# Declared encodings read as UTF-8-else-cp1252 anyway, and the supersets browsers use.
# (A page that declares UTF-16 but is not, a common slip, is read as UTF-8, as browsers do.)
_DEFAULT_DECODED = {"utf-8", "ascii", "iso8859-1", "cp1252", "utf-16", "utf-16-le", "utf-16-be",
                    "utf-32", "utf-32-le", "utf-32-be"}
# The end of a page's head, looked for in its first MAX_HTML_HEAD_BYTES.
_HEAD_END = re.compile(rb"</head[\s>]|<body[\s>]", re.IGNORECASE)
MAX_HTML_HEAD_BYTES = 2**20
_HTML_SUPERSETS = {"gb2312": "gb18030", "gbk": "gb18030", "euc_kr": "cp949", "shift_jis": "cp932"}
_SPACES = re.compile(r"[^\S\n]+")
_BLANK_LINES = re.compile(r"\s*\n\s*")

# One CSV field may be a whole document; the default limit (128 KiB) would reject it.
csv.field_size_limit(MAX_LINE_CHARS)


def _utf8_then_cp1252(exc: UnicodeError) -> tuple[str, int]:
    """Codec error handler: read the bytes UTF-8 rejected as cp1252, or give up."""
    if not isinstance(exc, UnicodeDecodeError):
        raise exc
    bad = exc.object[exc.start:exc.end]
    try:
        return bad.decode("cp1252"), exc.end
    except UnicodeDecodeError:
        raise UnicodeDecodeError(
            "utf-8", exc.object, exc.start, exc.end,
            f"bytes {bad.hex(' ')} are neither UTF-8 nor cp1252 (convert the file to UTF-8)") from None


codecs.register_error(_ERRORS, _utf8_then_cp1252)


class _Skip(Exception):
    """A whole-file problem: the message is the reason given to ``on_skip``."""


def _noop(where: str, reason: str) -> None:
    pass


def _wide_bom(head: bytes) -> tuple[str, int] | None:
    """``(codec, BOM length)`` when ``head`` starts with a UTF-32 or UTF-16 BOM."""
    for bom, codec in _WIDE_BOMS:
        if head.startswith(bom):
            return codec, len(bom)
    return None


def _encoding(head: bytes) -> tuple[str, str]:
    """The (encoding, errors) pair for a file that starts with ``head``."""
    wide = _wide_bom(head)
    if wide:
        return wide[0][:6], "strict"  # "utf-32" / "utf-16": the codec drops the BOM itself
    if b"\x00" in head[:BINARY_PROBE_BYTES]:
        raise _Skip(f"binary: NUL byte in the first {BINARY_PROBE_BYTES} bytes (UTF-16 or UTF-32 "
                    f"text without a BOM reads so too: convert it to UTF-8)")
    return "utf-8-sig", _ERRORS


def _decode(data: bytes) -> str:
    if not data:
        raise _Skip("empty: the file has no bytes")
    encoding, errors = _encoding(data[:BINARY_PROBE_BYTES])
    try:
        text = data.decode(encoding, errors)
    except UnicodeDecodeError as exc:
        raise _Skip(f"decode: {exc.reason} (byte offset {exc.start})") from None
    if not text.strip():
        raise _Skip("empty: the file holds only whitespace")
    if errors == _ERRORS and not _is_utf8(data):
        _refuse_other_legacy_text(text)
    return text


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# Read as cp1252, text of another single-byte encoding shows it: Cyrillic (cp1251, KOI8-R)
# as words of accented Latin letters only, Central European (ISO-8859-2) as symbols inside
# words (``Za¿ó³æ``). Western text has a few accented letters a word and no such symbols.
_OTHER_LEGACY_ACCENTED = 0.4  # of the letters: accented Latin (cp1252's high half)
_OTHER_LEGACY_IN_WORD = 0.01  # of the words: a cp1252 symbol between two letters, 3 at least
# (Latin-1's symbols, but those Western words hold: ª º, the soft hyphen, the acute accent
# typed as an apostrophe, Catalan's middle dot in l·l)
_IN_WORD_SYMBOL = re.compile(
    r"(?<=[^\W\d_])[\u00a1-\u00a9\u00ab\u00ac\u00ae-\u00b3\u00b5\u00b6\u00b8\u00b9\u00bb-\u00bf](?=[^\W\d_])")


# Characters of a document the check above looks at, in parts spread over it: the counts
# are shares, which a spread sample keeps, and a document of any size costs what this does.
_OTHER_LEGACY_SAMPLE = 1 << 20
_OTHER_LEGACY_PARTS = 16


def _spread_sample(text: str, size: int = _OTHER_LEGACY_SAMPLE, parts: int = _OTHER_LEGACY_PARTS) -> str:
    """``text`` itself up to ``size`` characters; else ``parts`` pieces of it, from its start
    to its end, ``size`` characters in all (a word cut at a piece's edge counts as two)."""
    if len(text) <= size:
        return text
    step, width = len(text) // parts, size // parts
    return " ".join(text[i * step:i * step + width] for i in range(parts))


def _refuse_other_legacy_text(text: str) -> None:
    """_Skip (``decode``) for text that is not UTF-8 and that cp1252, read in its place,
    turns into another encoding's letters: stored, it would be searched as nonsense.
    Judged on a sample spread over the text (:func:`_spread_sample`): a whole document
    read at once may be any size."""
    text = _spread_sample(text)
    letters = sum(1 for c in text if c.isalpha())
    if letters < 20:
        return
    accented = sum(1 for c in text if "\u00c0" <= c <= "\u00ff" and c.isalpha()) / letters
    in_word = len(_IN_WORD_SYMBOL.findall(text))
    if accented > _OTHER_LEGACY_ACCENTED or in_word >= max(3, _OTHER_LEGACY_IN_WORD * len(text.split())):
        raise _Skip(f"decode: not UTF-8, and read as cp1252 (the Western legacy encoding) it is another "
                    f"encoding's text ({accented:.0%} of its letters accented, {in_word} symbols inside words, "
                    f"e.g. {_sample_word(text)!r}): convert it to UTF-8 from its encoding (iconv -f ENCODING -t UTF-8)")


def _sample_word(text: str) -> str:
    """A word of ``text`` that shows the misreading, cut short."""
    for word in text.split():
        if _IN_WORD_SYMBOL.search(word) or sum(c >= "\u00c0" for c in word) > len(word) // 2 > 0:
            return word[:24]
    return text.split()[0][:24]


def splittable(path: str | Path) -> bool:
    """Whether the file at ``path`` can be read in parts (:mod:`.file_parts`): an
    uncompressed JSON lines, Parquet or PDF file on this machine."""
    if is_remote(path):
        return False
    fmt, compression = text_format(path)
    return compression is None and (fmt in JSONL_EXTENSIONS or fmt in (".parquet", ".pdf"))


def empty_reason(path: str | Path) -> str:
    """The reason for a file read in parts none of which met a record or a problem."""
    if text_format(path)[0] == ".pdf":
        from .pdf import NEEDS_OCR

        return f"empty: no text on any of its pages; {NEEDS_OCR}"
    return "empty: no records"


def text_format(path: str | Path) -> tuple[str, str | None]:
    """``(format suffix, compression suffix or None)``: ``a.jsonl.gz`` -> ``(".jsonl", ".gz")``."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if len(suffixes) >= 2 and suffixes[-1] in COMPRESSIONS:
        return suffixes[-2], suffixes[-1]
    return (suffixes[-1] if suffixes else ""), None


class _Closing:
    """A decompressing reader that also closes the file under it (gzip, bz2, lzma and
    :class:`ZstdReader` leave a file object they were given open)."""

    def __init__(self, outer, inner):
        self._outer, self._inner = outer, inner
        self._cut: EOFError | None = None  # met after bytes a read gives: raised at the next

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes; a stream cut short gives what was decompressed before the cut,
        then raises ``EOFError`` at the next read (a reader's own ``read(n)`` drops the
        bytes it had gathered in that call when it meets the cut)."""
        if self._cut is not None:
            raise self._cut
        step = getattr(self._outer, "read1", None)
        if n < 0 or step is None:
            return self._read(self._outer.read, n)
        out = bytearray()
        while len(out) < n:
            try:
                block = self._read(step, n - len(out))
            except EOFError as exc:
                if not out:
                    raise
                self._cut = exc
                break
            if not block:
                break
            out += block
        return bytes(out)

    @staticmethod
    def _read(read, n: int) -> bytes:
        try:
            return read(n)
        except OSError as exc:
            if exc.errno is None:  # the data's own fault (bz2: "Invalid data stream"), not the disk's
                raise CorruptStream(str(exc)) from exc
            raise

    def close(self) -> None:
        try:
            self._outer.close()
        finally:
            self._inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_raw(path: Path):
    """The file's bytes, decompressed on the fly when its name says so. Opening never
    blocks: a pipe, socket or device raises :class:`NotRegularFile`."""
    fh = open_input(path)
    opener = COMPRESSIONS.get(text_format(path)[1])
    if opener is None:
        return fh
    try:
        return _Closing(opener(fh, "rb"), fh)
    except BaseException:
        fh.close()
        raise


def _read_bytes(path: Path, limit: int, what: str = "") -> bytearray:
    """The file's bytes (decompressed), at most ``limit``; more is ``too-large`` unless
    ``what`` is empty (the caller then sees ``limit + 1`` bytes and decides)."""
    data = bytearray()
    try:
        with _open_raw(path) as fh:
            while len(data) <= limit:  # a block at a time: read(limit) would allocate it all
                block = fh.read(min(2**20, limit + 1 - len(data)))
                if not block:
                    break
                data += block
    except _DECOMPRESS_ERRORS as exc:
        raise _Skip(f"decompress: {exc}") from None
    except OSError as exc:
        raise _Skip(os_error_reason(exc)) from None
    if what and len(data) > limit:
        raise _Skip(f"too-large: more than {limit} bytes in one {what}; split it, or give "
                    "its records as JSON lines")
    return data


class _BadBytes(Exception):
    """Bytes that do not decode, met while streaming; the message is the reason."""


def _stream_codec(head: bytes) -> tuple[str, str, int]:
    """``(codec, errors, BOM length)`` to decode a stream that starts with ``head``,
    after the binary check (the BOM is skipped, so a part can be decoded afresh)."""
    wide = _wide_bom(head)
    if wide:
        return wide[0], "strict", wide[1]
    _encoding(head)
    return "utf-8", _ERRORS, len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0


def _decoded(raw, head: bytes, mid_file: bool = False) -> Iterator[str]:
    """The text of ``raw`` (whose first bytes, ``head``, were read already) a block at a
    time. Bytes that do not decode raise :class:`_BadBytes`, after everything before them
    was yielded (a text decoder would drop the whole block they are in). ``mid_file``:
    ``raw`` starts inside a UTF-8 file (a part, see :mod:`.file_parts`), so ``head`` is
    not the file's start and says nothing of its encoding."""
    codec, errors, bom = ("utf-8", _ERRORS, 0) if mid_file else _stream_codec(head)
    decoder = codecs.getincrementaldecoder(codec)(errors)
    block = head[bom:]
    while True:
        final = not block
        try:
            text = decoder.decode(block, final)
        except UnicodeDecodeError as exc:
            good = exc.object[:exc.start].decode(codec, errors)
            if good:
                yield good
            raise _BadBytes(exc.reason) from None
        if text:
            yield text
        if final:
            return
        block = raw.read(STREAM_BLOCK)


def _check_compressed(path: Path) -> None:
    """Decompress a local compressed file once, keeping nothing, before its lines are
    read: gzip checks its CRC (bz2 and xz their blocks') only after handing out the data,
    so a corrupt file would be indexed up to the check, its damaged records with it, and
    reported as a cut. A corrupt one is skipped whole; one cut short keeps the records
    before the cut, as reading it finds them. (Decompressing costs far less than
    tokenizing what it gives; an object in storage is not read twice.)"""
    if text_format(path)[1] is None or is_remote(path):
        return
    try:
        with _open_raw(path) as fh:
            while fh.read(2**20):
                pass
    except EOFError:
        return
    except _DECOMPRESS_ERRORS as exc:
        raise _Skip(f"decompress: {exc}; the data is corrupt, so none of the file's records "
                    f"are read") from None
    except OSError as exc:
        raise _Skip(os_error_reason(exc)) from None


def _opened(path: Path):
    """``(raw, head)``: the file open for streaming, and its first bytes, after the
    empty and binary checks."""
    try:
        raw = _open_raw(path)
    except OSError as exc:
        raise _Skip(os_error_reason(exc)) from None
    try:
        head = raw.read(BINARY_PROBE_BYTES)
        if not head:
            raise _Skip("empty: the file has no bytes")
        _encoding(head)
    except BaseException:
        raw.close()
        raise
    return raw, head


_EOL = re.compile(r"\r\n|\r|\n")


def _opened_part(path: Path, part: tuple[int, int, int]):
    """``(raw, head, lines before, the part's last byte)`` of part ``(p, parts, size)``
    of the file at ``path`` (see :mod:`.file_parts`), or None when that part has nothing
    to read: an empty range, or a file that only part 0 reads, whole (empty, binary, or
    UTF-16). Only part 0 raises :class:`_Skip` for the file as a whole."""
    p, parts, size = part
    try:
        fh = open_input(path)
    except OSError as exc:
        if p == 0:
            raise _Skip(os_error_reason(exc)) from None
        return None
    try:
        fd = fh.fileno()
        size = min(size, os.fstat(fd).st_size)
        file_head = os.pread(fd, BINARY_PROBE_BYTES, 0)
        try:
            _encoding(file_head)
            whole = not file_head or _wide_bom(file_head) is not None
        except _Skip:  # binary
            whole = True
        if whole:
            fh.close()
            return (*_opened(path), 0, None) if p == 0 else None
        start, stop = part_bounds(fd, p, parts, size)
        if start >= stop:
            fh.close()
            return None
        before = line_ends_before(fd, start)
    except OSError as exc:
        fh.close()
        if p == 0:
            raise _Skip(os_error_reason(exc)) from None
        return None
    raw = ByteRange(fh, start, stop)
    return raw, raw.read(BINARY_PROBE_BYTES), before, stop


def _lines(path: Path, translate: bool, part: tuple[int, int, int] | None = None,
           numbered: list | None = None) -> Iterator[str | _Skip]:
    """The lines of the file at ``path``, each with its line end (``\\n`` for every kind
    when ``translate``, else as written, as csv wants it). A line of more than
    :data:`MAX_LINE_CHARS` characters comes as a ``too-large`` :class:`_Skip` instead,
    never held whole. Bytes that do not decode end the file with a ``decode`` skip that
    names their line; every line before it is yielded. With ``part`` (``(p, parts,
    size)``) only that part's lines, and ``numbered[0]`` is set to the number of lines
    before them, before the first is yielded."""
    stop = None
    if part is None:
        _check_compressed(path)
        (raw, head), n = _opened(path), 0
    else:
        opened = _opened_part(path, part)
        if opened is None:
            return
        raw, head, n, stop = opened
    if numbered is not None:
        numbered[0] = n
    parts: list[str] = []
    size = 0
    long = carry = False
    with raw:
        try:
            for text in _decoded(raw, head, mid_file=stop is not None and part[0] > 0):
                if carry:  # a \r at the end of the block before: is it a \r\n?
                    text, carry = "\r" + text, False
                if text.endswith("\r"):
                    text, carry = text[:-1], True
                pos = 0
                for m in _EOL.finditer(text):
                    n += 1
                    if long or size + m.start() - pos > MAX_LINE_CHARS:
                        yield _Skip(f"too-large: line {n}: more than {MAX_LINE_CHARS} "
                                    "characters on one line; split the record")
                    else:
                        parts.append(text[pos:m.start()])
                        parts.append("\n" if translate else m.group())
                        yield "".join(parts)
                    parts, size, long = [], 0, False
                    pos = m.end()
                if pos < len(text) and not long:
                    parts.append(text[pos:])
                    size += len(text) - pos
                    if size > MAX_LINE_CHARS:
                        parts, size, long = [], 0, True
        except _BadBytes as exc:
            rest = "the rest of the file" if stop is None else f"the rest of its part (to byte {stop})"
            raise _Skip(f"decode: line {n + 1}: {exc}; {rest} is skipped") from None
    if carry:
        parts.append("\n" if translate else "\r")
    if long:
        yield _Skip(f"too-large: line {n + 1}: more than {MAX_LINE_CHARS} characters on one "
                    "line; split the record")
    elif parts:
        yield "".join(parts)


class TextStream:
    """The text of a whole-text file too large to hold at once (see ``stream_above`` of
    :func:`iter_records`): iterating it reads and decodes the file again, a block at a
    time, as ``str`` parts. The file was decoded once before (a file that does not decode
    is skipped whole); a problem met on the way all the same (the file changed, a read
    error) goes to ``on_skip`` and ends the text there; what came before it is kept. NUL characters are not checked past the first
    :data:`BINARY_PROBE_BYTES` bytes."""

    __slots__ = ("path", "on_skip")

    def __init__(self, path: Path, on_skip: OnSkip):
        self.path, self.on_skip = path, on_skip

    def __iter__(self) -> Iterator[str]:
        where, n = str(self.path), 0
        try:
            raw, head = _opened(self.path)
            with raw:
                for part in _decoded(raw, head):
                    n += len(part)
                    yield part
            return
        except _Skip as skip:
            reason = str(skip)
        except _BadBytes as exc:
            reason = f"decode: {exc} after character {n}"
        except _DECOMPRESS_ERRORS as exc:
            reason = f"decompress: {exc} after character {n}"
        except OSError as exc:
            reason = os_error_reason(exc)
        self.on_skip(where, f"{reason}; the rest of the file is skipped")


def _given_id(value):
    """A record's id field as given, None for none: null, or text without a visible
    character (``""``, what exports write for a missing value), which would name no
    record (a hit shows it as the whole file's) and repeat as a duplicate."""
    if isinstance(value, str) and not value.strip():
        return None
    return value


def _record_id(value, default: str) -> str:
    """A record's id as text, whatever its type: bytes as UTF-8 (other bytes as ``\\xNN``),
    numbers, dates and times as ``str`` gives them, true and false, lists and objects as
    JSON (Python would say ``True``, which no input file spells)."""
    if value is None:
        return default
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "backslashreplace")
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    return str(value)


class _FirstIds:
    """The ids the good records of one file gave so far. A later record with one of them
    is skipped and reported: a search hit names its record by id and its span is in that
    record's text, so two texts under one id would leave the hit pointing into either.
    The ids of the first :data:`MAX_IDS_CHECKED` records are kept, while the file is read
    (about 100 bytes each); a file with more records has its later ids checked against
    those only, and says so once in the log."""

    def __init__(self, path):
        self._seen: set[str] = set()
        self._made: set[str] = set()  # ids made by position for records that had none
        self._path = path
        self._full = False

    def repeated(self, record_id: str, loc: str, made: bool = False) -> str | None:
        """The skip reason if ``record_id`` was given before in this file, else None
        (and it is given now). ``made``: the record had no id, and this one was made from
        its position (``line-3``): a record's own id may be the same text."""
        if record_id in self._seen:
            shown = record_id if len(record_id) <= 200 else record_id[:200] + "..."
            if made:
                return (f"duplicate: {loc}: the record has no id, and the one made from its position, "
                        f"{shown!r}, is the id of an earlier record of this file; give it an id")
            if record_id in self._made:
                return (f"duplicate: {loc}: the id {shown!r} was made from the position of an earlier "
                        f"record of this file that had none; give that record an id, or this one another")
            return (f"duplicate: {loc}: the id {shown!r} is that of an earlier record of "
                    f"this file; only the first is indexed")
        if len(self._seen) < MAX_IDS_CHECKED:
            self._seen.add(record_id)
            if made:
                self._made.add(record_id)
        elif not self._full:
            self._full = True
            log.warning("%s: more than %d records; the ids of later records are checked "
                        "against those of the first %d only", self._path, MAX_IDS_CHECKED,
                        MAX_IDS_CHECKED)
        return None


def field_names(keys) -> str:
    """Names of a record's fields (or columns) as a reason lists them: the first ten, quoted."""
    names = list(keys)
    if not names:
        return "none"
    more = f", ... ({len(names)} in all)" if len(names) > 10 else ""
    return ", ".join(repr(_shown(k)) for k in names[:10]) + more


def _shown(name, most: int = 100):
    """A name as a reason shows it: a text over ``most`` characters cut, with its length
    (a header whose quote never closes is one name of the whole file)."""
    if isinstance(name, str) and len(name) > most:
        return f"{name[:most]}... ({len(name)} characters)"
    return name


def _text_of(obj, text_field: str, loc: str) -> str:
    """The text of one record object, or raise :class:`_Skip` with the record's reason."""
    if not isinstance(obj, dict):
        raise _Skip(f"json: {loc}: expected a JSON object, got {type(obj).__name__}")
    if text_field not in obj:
        raise _Skip(f"field: {loc}: no {text_field!r} field (fields: {field_names(obj)}); "
                    f"choose the text field with --text-field (text_field= in the library)")
    text = obj[text_field]
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        raise _Skip(f"field: {loc}: {text_field!r} is {kind}, expected a string")
    if not text.strip():
        raise _Skip(f"empty: {loc}: {text_field!r} is empty")
    return text


def _objects(objs, text_field: str, id_field: str, kind: str, path: str,
             on_skip: OnSkip) -> Iterator[tuple[str, str]]:
    """Turn ``(number, object_or_skip)`` pairs into records, reporting the bad ones."""
    ids = _FirstIds(path)
    for n, obj in objs:
        loc = f"{kind} {n}"
        try:
            if isinstance(obj, _Skip):
                raise obj
            text = _text_of(obj, text_field, loc)
            given = _given_id(obj.get(id_field))
            record_id = _record_id(given, f"{kind}-{n}")
            for value, what in ((text, repr(text_field)), (record_id, f"id {id_field!r}")):
                problem = lone_surrogate(value)
                if problem:
                    raise _Skip(f"unicode: {loc}: {what} holds {problem}")
            repeated = ids.repeated(record_id, loc, made=given is None)
            if repeated:
                raise _Skip(repeated)
        except _Skip as skip:
            on_skip(f"{path}:{loc}", str(skip))
            continue
        yield record_id, text


def arrow_as_list(values) -> list:
    """``values`` as a list: a pyarrow Array or ChunkedArray (of texts, of records) by its
    ``to_pylist()`` (iterated, it gives pyarrow scalars, which are no ``str``), anything
    else iterated."""
    if type(values).__module__.startswith("pyarrow") and hasattr(values, "to_pylist") and not hasattr(
            values, "schema"):
        return values.to_pylist()
    return list(values)


def lone_surrogate(value: str, fix: str = "a broken escape; fix the record") -> str | None:
    """What is wrong with ``value`` if it holds a lone surrogate, else None (``fix`` says
    what to do). Only JSON escapes, bytes that are not UTF-8 decoded with
    ``surrogateescape`` (a command line's arguments) or Python callers make them; one
    fails a tokenizer's whole batch call."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate (U+{ord(value[exc.start]):04X} at character {exc.start}), {fix}"
    return None


def _parse_line(line: str, n: int):
    """The JSON value of line ``n``, or the :class:`_Skip` that says why there is none. A
    byte-order mark at the line's start is dropped: files joined with ``cat`` keep each
    one's mark at the start of its first line."""
    try:
        return json.loads(line[1:] if line.startswith("\ufeff") else line)
    except json.JSONDecodeError as exc:
        return _Skip(f"json: line {n}, column {exc.colno}: {exc.msg}")
    except ValueError as exc:
        return _Skip(f"json: line {n}: {exc}")
    except RecursionError:
        return _Skip(f"json: line {n}: nested too deeply")


def _json_lines(lines, text_field, id_field, path, on_skip, first: list | None = None):
    """The records of ``lines``; ``first[0]``, read when the first line comes, is the
    number of lines before them (a part of a file, see :func:`_lines`)."""
    def numbered():
        for k, line in enumerate(lines, 1):
            n = k + (first[0] if first else 0)
            if isinstance(line, _Skip) or line.strip():
                yield n, line if isinstance(line, _Skip) else _parse_line(line, n)

    return _objects(numbered(), text_field, id_field, "line", path, on_skip)


def _read_whole_text(path: Path, text_field, id_field, on_skip, stream_above=None):
    """One record; a file of more than ``stream_above`` bytes as a :class:`TextStream`."""
    if stream_above is None:
        yield "", _decode(_read_bytes(path, MAX_WHOLE_BYTES, "document"))
        return
    data = _read_bytes(path, stream_above)
    if len(data) <= stream_above:
        yield "", _decode(data)
        return
    _encoding(data[:BINARY_PROBE_BYTES])
    del data
    _check_decodes(path)
    yield "", TextStream(path, on_skip)


def _check_decodes(path: Path) -> None:
    """Decode the whole file once, keeping nothing, before it is streamed: a file with
    bytes that do not decode (or cut short) is skipped whole, as a small one is, instead
    of being indexed up to them. Tokenizing costs a thousand times more than this pass."""
    raw, head = _opened(path)
    n = 0
    with raw:
        try:
            for part in _decoded(raw, head):
                n += len(part)
        except _BadBytes as exc:
            raise _Skip(f"decode: {exc} (after character {n})") from None
        except _DECOMPRESS_ERRORS as exc:
            raise _Skip(f"decompress: {exc}") from None


def _html_head(data: bytes) -> bytes:
    """Where a page's ``<meta charset>`` is looked for: its head, which inline styles,
    scripts or a comment banner can make long (a parser meets the declaration there and
    switches, as browsers do), or its first 4 KiB when no end of a head is found."""
    end = _HEAD_END.search(data, 0, MAX_HTML_HEAD_BYTES)
    return data[:max(end.start() if end else 0, 4096)]


def _decode_html(data: bytes) -> str:
    """A page in the encoding its ``<meta charset>`` (or XML prolog) declares, such as
    Shift_JIS, GB2312 or windows-1251, which read as UTF-8-else-cp1252 would be
    mojibake. Bytes that are valid UTF-8 are UTF-8 whatever the page says (legacy text
    almost never is, mislabelled pages often are); Western and undeclared pages, and
    pages that do not decode as declared, are read as any text file."""
    from bs4.dammit import EncodingDetector

    declared = EncodingDetector.find_declared_encoding(_html_head(data), is_html=True,
                                                       search_entire_document=True)
    try:
        codec = codecs.lookup(declared).name if declared else None
    except LookupError:
        codec = None
    codec = _HTML_SUPERSETS.get(codec, codec)
    if codec and codec not in _DEFAULT_DECODED and b"\x00" not in data[:BINARY_PROBE_BYTES]:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            try:
                return data.decode(codec)
            except UnicodeDecodeError:
                pass
    return _decode(data)


def _html_pieces(soup) -> Iterator[tuple[str, bool]]:
    """``(text, verbatim)`` of the page's visible strings in reading order, a line after
    each of :data:`_HTML_BLOCKS` and a space after each of :data:`_HTML_CELLS`; verbatim
    inside :data:`_HTML_VERBATIM`. The tree is walked with a stack of its own and never
    changed: bs4's ``append`` walks down to an element's last descendant, so marking
    the blocks of 20,000 nested ``<div>`` took 22 s, 200,000 hours."""
    from bs4.element import CData, NavigableString, Tag

    stack = [(iter(soup.contents), "", False)]
    while stack:
        nodes, end, verbatim = stack[-1]
        node = next(nodes, None)
        if node is None:
            stack.pop()
            if end:
                yield end, verbatim
        elif isinstance(node, Tag):
            if node.name not in _HTML_DROP:
                end = "\n" if node.name in _HTML_BLOCKS else " " if node.name in _HTML_CELLS else ""
                stack.append((iter(node.contents), end, verbatim or node.name in _HTML_VERBATIM))
        elif type(node) in (NavigableString, CData):  # not comments, doctypes, ruby notes
            yield str(node), verbatim


def _visible_text(soup) -> str:
    """The page's text, its runs of spaces and blank lines made one, but for the text of
    :data:`_HTML_VERBATIM` elements (code, poems, aligned tables), whose spaces and lines
    are the page's content, kept as written."""
    runs = itertools.groupby(_html_pieces(soup), key=lambda piece: piece[1])
    text = "".join(_verbatim_or_folded("".join(t for t, _ in run), kept) for kept, run in runs)
    return text.strip()


def _verbatim_or_folded(text: str, verbatim: bool) -> str:
    return text if verbatim else _BLANK_LINES.sub("\n", _SPACES.sub(" ", text))


def _read_html(path: Path, text_field, id_field, on_skip):
    from bs4 import BeautifulSoup

    page = bytes(_read_bytes(path, MAX_HTML_BYTES, "HTML page"))
    text = _visible_text(BeautifulSoup(_decode_html(page), "html.parser"))
    if not text:
        raise _Skip("empty: no visible text in the HTML")
    yield "", text


def _packed_file(path: Path, limit: int, what: str) -> bytes:
    """The whole file for a parser of packed bytes (PDF, Word), at most ``limit``."""
    data = bytes(_read_bytes(path, limit, what))
    if not data:
        raise _Skip("empty: the file has no bytes")
    return data


def _read_pdf(path: Path, text_field, id_field, on_skip, part=None):
    """A record a page with text, id ``page-N`` (:mod:`.pdf`). With ``part`` (``(p, parts,
    size)``, see :mod:`.file_parts`) the pages of part ``p`` only: every part parses the
    file, and what is wrong with it as a whole is part 0's to say."""
    from .pdf import MAX_PDF_BYTES, PdfSkip, pdf_pages

    first = part is None or part[0] == 0
    try:
        data = _packed_file(path, MAX_PDF_BYTES, "PDF")
    except (_Skip, OSError):
        if first:
            raise
        return
    try:
        yield from pdf_pages(data, lambda n, reason: on_skip(f"{path}:page {n}", reason),
                             part=None if part is None else part[:2])
    except PdfSkip as skip:
        if first:
            raise _Skip(str(skip)) from None


def _read_docx(path: Path, text_field, id_field, on_skip):
    """One record: the body's text (:mod:`.docx`)."""
    from .docx import MAX_DOCX_BYTES, DocxSkip, docx_text

    data = _packed_file(path, MAX_DOCX_BYTES, "Word document")
    try:
        yield "", docx_text(data)
    except DocxSkip as skip:
        raise _Skip(str(skip)) from None


def _split_lines(text: str) -> Iterator[str]:
    """The lines of ``text``, cut where the JSON lines reader cuts them (``\n``, ``\r\n``,
    a lone ``\r``) and nowhere else: ``str.splitlines`` also cuts at U+2028 and other
    characters a JSON string may hold raw."""
    pos = 0
    for m in _EOL.finditer(text):
        yield text[pos:m.start()]
        pos = m.end()
    yield text[pos:]


def _read_json(path: Path, text_field, id_field, on_skip):
    """A JSON array of objects, one object, or (when the whole is not one JSON value
    and its first line is) JSON lines."""
    text = _decode(_read_bytes(path, MAX_JSON_BYTES, "JSON document"))
    try:
        doc = json.loads(text)
    except RecursionError:
        raise _Skip("json: nested too deeply") from None
    except json.JSONDecodeError as exc:
        first = next(line for line in _split_lines(text) if line.strip())
        if not isinstance(_parse_line(first, 1), _Skip):
            yield from _json_lines(_split_lines(text), text_field, id_field, path, on_skip)
            return
        raise _Skip(f"json: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except ValueError as exc:
        raise _Skip(f"json: {exc}") from None
    if isinstance(doc, dict):
        yield from _objects([(1, doc)], text_field, id_field, "item", path, on_skip)
    elif isinstance(doc, list):
        yield from _objects(enumerate(doc, 1), text_field, id_field, "item", path, on_skip)
    else:
        raise _Skip(f"json: the document is a {type(doc).__name__}, "
                    f"expected an object or an array of objects")


def _read_jsonl(path: Path, text_field, id_field, on_skip, part=None):
    before = [0]
    yield from _json_lines(_lines(path, translate=True, part=part, numbered=before),
                           text_field, id_field, path, on_skip, first=before)


class _CsvLines:
    """A CSV file's lines for the csv module, counting them: after a row the module gave up
    on, its own ``line_num`` does not say where that was. Lines looked at ahead
    (:meth:`ahead`, to choose the delimiter) are handed out, and counted, in their turn."""

    def __init__(self, path: Path):
        self.lines = _lines(path, translate=False)
        self.count = 0
        self._ahead: list[str] = []  # lines looked at ahead, from self._next on
        self._next = 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if self._next < len(self._ahead):
            line, self._next = self._ahead[self._next], self._next + 1
            if self._next == len(self._ahead):
                self._ahead, self._next = [], 0
        else:
            line = self._read()
        self.count += 1
        return line

    def _read(self) -> str:
        line = next(self.lines)
        if isinstance(line, _Skip):
            raise _Skip(f"{line}; the rest of the file is skipped")
        return line

    def ahead(self, limit: int) -> Iterator[str]:
        """The coming lines, none consumed: the first, then more while they hold at most
        ``limit`` characters in all (a quote that never closes would read the whole file)."""
        size = 0
        for k in itertools.count(self._next):
            if k == len(self._ahead):
                try:
                    self._ahead.append(self._read())
                except StopIteration:
                    return
            size += len(self._ahead[k])
            if k > self._next and size > limit:
                return
            yield self._ahead[k]

    def close(self) -> None:
        self.lines.close()


# The delimiters a CSV file may use, the extension's own first: spreadsheets in locales
# whose decimal mark is a comma write ';'.
_DELIMITERS = {",": "a comma", "\t": "a tab", ";": "a semicolon", "|": "a vertical bar"}
# What a header record may span, past its first line, while its delimiter is chosen.
MAX_HEADER_CHARS = 2**20


def _dialect(lines: _CsvLines, candidates: tuple[str, ...], text_field: str) -> tuple[str, bool]:
    """``(delimiter, skipinitialspace)``: the first of ``candidates`` that splits the
    header record into a ``text_field`` column (``id;text;lang``), else the first that
    does so once the spaces after each delimiter are dropped (``id, text``); with none,
    the first that parses the header, so the skip names its columns. The header is
    parsed whole each time: a quoted name that spans lines (a wrapped heading) does not
    hide the delimiter after it."""
    parsed = []
    for spaced in (False, True):
        for candidate in candidates:
            try:
                header = next(csv.reader(lines.ahead(MAX_HEADER_CHARS), delimiter=candidate,
                                         skipinitialspace=spaced, strict=True), [])
            except csv.Error:
                continue
            if text_field in header:
                return candidate, spaced
            parsed.append(candidate)
    return (parsed[0] if parsed else candidates[0]), False


_SEP_LINE = re.compile(r"sep=([^\"\r\n])[^\S\r\n]*\r?\n?", re.IGNORECASE)


def _preamble(lines: _CsvLines) -> str | None:
    """Read the lines before the header: blank ones (an export's leading empty lines),
    and the ``sep=;`` line Excel writes and reads to name the delimiter, which is
    returned (None when there is none)."""
    while True:
        line = next(lines.ahead(0), None)
        if line is None or line.strip():
            break
        next(lines)
    sep = _SEP_LINE.fullmatch(line) if line is not None else None
    if sep is None:
        return None
    next(lines)
    return sep.group(1)


def _read_csv(path: Path, text_field, id_field, on_skip):
    """Rows as records, each checked: a row the csv module gives up on (a quote that does
    not close its field), or with more values than the header has columns (an unquoted
    delimiter in the text), is skipped alone with its line; a header naming the text or
    id column twice skips the file (other columns, unread, may repeat: a spreadsheet's
    unnamed trailing columns are all named ''). A field over the size bound skips the
    rest of the file (where it ends is not known)."""
    lines = _CsvLines(path)
    with contextlib.closing(lines):
        named = _preamble(lines)
        default = "\t" if text_format(path)[0] == ".tsv" else ","
        candidates = (named,) if named else (default, *(d for d in _DELIMITERS if d != default))
        delimiter, spaced = _dialect(lines, candidates, text_field)
        reader = csv.DictReader(lines, delimiter=delimiter, skipinitialspace=spaced, strict=True)
        try:
            columns = reader.fieldnames
        except csv.Error as exc:
            raise _Skip(f"csv: the header row (line {lines.count}): {exc}") from None
        if not columns:
            raise _Skip("empty: no header row")
        if text_field not in columns:
            raise _Skip(f"field: no {text_field!r} column (columns: {field_names(columns)}); "
                        f"choose the text column with --text-field (text_field= in the library)")
        twice = [c for c in dict.fromkeys((text_field, id_field)) if columns.count(c) > 1]
        if twice:
            raise _Skip(f"field: the header names {field_names(twice)} more than once; rename the "
                        f"columns so each is named once")
        ids, rows, n = _FirstIds(path), iter(reader), 0
        while True:
            n += 1
            loc, start = f"row {n}", lines.count + 1
            try:
                row = next(rows)
            except StopIteration:
                return
            except csv.Error as exc:
                if str(exc).startswith("field larger than field limit"):
                    raise _Skip(f"too-large: {loc} (line {lines.count}): a field of more than "
                                f"{MAX_LINE_CHARS} characters; the rest of the file is skipped") from None
                # a quote that does not close its field takes the lines after it in: say which
                where = (f"line {lines.count}" if lines.count <= start else
                         f"lines {start}-{lines.count}, read as one row: a quote opened there does not "
                         f"close its field")
                on_skip(f"{path}:{loc}", f"csv: {loc} ({where}): {exc}; quote the field "
                                         f"(a quote inside one doubled) or remove the stray quote")
                continue
            where = f"{loc} (line {lines.count})"
            text = row.get(text_field)
            if None in row:
                on_skip(f"{path}:{loc}", f"field: {where}: {len(columns) + len(row[None])} values for "
                                         f"{len(columns)} columns; quote a value that holds "
                                         f"{_DELIMITERS.get(delimiter, repr(delimiter))}")
            elif text is None:
                on_skip(f"{path}:{loc}", f"field: {where}: the row has no {text_field!r} value")
            elif not text.strip():
                on_skip(f"{path}:{loc}", f"empty: {where}: {text_field!r} is empty")
            else:
                given = _given_id(row.get(id_field))
                record_id = _record_id(given, f"row-{n}")
                repeated = ids.repeated(record_id, where, made=given is None)
                if repeated:
                    on_skip(f"{path}:{loc}", repeated)
                else:
                    yield record_id, text


def _is_text_type(kind) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(kind):  # a column of few distinct strings, stored once each
        kind = kind.value_type
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or getattr(pa.types, "is_string_view", lambda t: False)(kind))


def _id_values(column) -> list:
    """The values of an id column of any type, for :func:`_record_id`: dates, times and
    decimals as Arrow writes them as text (``2024-01-02 03:04:05.000000``)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if pa.types.is_temporal(column.type) or pa.types.is_decimal(column.type):
        try:
            return pc.cast(column, pa.string()).to_pylist()
        except pa.ArrowException:
            pass
    return column.to_pylist()


def _read_parquet(path: Path, text_field, id_field, on_skip, part=None):
    """The rows of a Parquet file; with ``part`` (``(p, parts, size)``) its ``p``-th
    ``parts``-th of the rows only, numbered as in the whole file (only the row groups that
    hold them are read). Only part 0 reports what is wrong with the file as a whole."""
    try:
        yield from _parquet_rows(path, text_field, id_field, on_skip, part)
    except _Skip:
        if part is None or part[0] == 0:
            raise


_TOO_LARGE = object()  # a Parquet text over the bound, in place of its value


def _bounded_texts(column) -> list:
    """A batch's text column as Python strings, a text over :data:`MAX_LINE_CHARS`
    characters as :data:`_TOO_LARGE`: the lengths are taken in Arrow, so such a text
    (a few KB compressed can hold a gigabyte) is never copied into a Python string."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(column.type):
        lengths = pc.take(pc.utf8_length(column.dictionary), column.indices)
    else:
        lengths = pc.utf8_length(column)
    over = pc.greater(lengths, MAX_LINE_CHARS)
    if not pc.any(over).as_py():
        return column.to_pylist()
    big = over.to_pylist()
    small = iter(column.take(pa.array([i for i, b in enumerate(big) if not b], pa.int64())).to_pylist())
    return [_TOO_LARGE if b else next(small) for b in big]


def _parquet_rows(path: Path, text_field, id_field, on_skip, part):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        fh = open_input(path)
    except OSError as exc:
        raise _Skip(os_error_reason(exc)) from None
    with fh:
        try:
            if (remote_size(fh) if is_remote(path) else os.fstat(fh.fileno()).st_size) == 0:
                raise _Skip("empty: the file has no bytes")
            # A local file's column chunks are read through a 1 MiB buffer, a page at a
            # time: unbuffered, a row group's whole text column is held while it is read
            # (a pandas-written file is often one group), in every part that reads it.
            pf = pq.ParquetFile(fh) if is_remote(path) else pq.ParquetFile(
                fh, buffer_size=PARQUET_BUFFER_BYTES, pre_buffer=False)
        except OSError as exc:
            raise _Skip(f"parquet: {exc}") from None
        except pa.ArrowException as exc:
            raise _Skip(f"parquet: {exc}") from None
        schema = pf.schema_arrow
        if text_field not in schema.names:
            raise _Skip(f"field: no {text_field!r} column (columns: {field_names(schema.names)}); "
                        f"choose the text column with --text-field (text_field= in the library)")
        kind = schema.field(text_field).type
        if not _is_text_type(kind):
            raise _Skip(f"field: column {text_field!r} is {kind}, expected a string column")
        columns = [text_field] + ([id_field] if id_field in schema.names and id_field != text_field
                                  else [])
        n = 0
        first_ids = _FirstIds(path)
        try:
            for n, batch in _parquet_batches(pf, columns, part):
                texts = _bounded_texts(batch.column(text_field))
                ids = (_id_values(batch.column(id_field)) if id_field in batch.schema.names
                       else [None] * len(texts))
                for text, rid in zip(texts, ids):
                    n += 1
                    loc = f"row {n}"
                    if text is None:
                        on_skip(f"{path}:{loc}", f"field: {loc}: {text_field!r} is null")
                    elif text is _TOO_LARGE:
                        on_skip(f"{path}:{loc}", f"too-large: {loc}: {text_field!r} holds more "
                                                 f"than {MAX_LINE_CHARS} characters")
                    elif not text.strip():
                        on_skip(f"{path}:{loc}", f"empty: {loc}: {text_field!r} is empty")
                    else:
                        rid = _given_id(rid)
                        record_id = _record_id(rid, f"row-{n}")
                        repeated = first_ids.repeated(record_id, loc, made=rid is None)
                        if repeated:
                            on_skip(f"{path}:{loc}", repeated)
                        else:
                            yield record_id, text
        except (OSError, pa.ArrowException) as exc:
            if part is None:
                raise _Skip(f"parquet: row {n + 1}: {exc}; the rest of the file is skipped") from None
            # a problem inside this part's rows, told by the part (whole-file problems are
            # told by part 0 only, see _read_parquet)
            on_skip(str(path), f"parquet: row {n + 1}: {exc}; the rest of its part's rows "
                               f"are skipped")


def _parquet_batches(pf, columns, part):
    """``(rows before it, record batch)`` of the file's row groups (those of ``part``)."""
    before = 0
    if part is None:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            yield before, batch
            before += batch.num_rows
        return
    p, parts, _ = part
    total = pf.metadata.num_rows
    lo, hi = total * p // parts, total * (p + 1) // parts
    for g in range(pf.metadata.num_row_groups):
        rows = pf.metadata.row_group(g).num_rows
        if before < hi and before + rows > lo:  # the group holds rows of the part
            at = before
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[g], columns=columns):
                start, stop = max(lo - at, 0), min(hi - at, batch.num_rows)
                if start < stop:
                    yield at + start, batch.slice(start, stop - start)
                at += batch.num_rows
                if at >= hi:
                    break
        before += rows


_READERS = {
    **{ext: _read_whole_text for ext in WHOLE_TEXT_EXTENSIONS},
    **{ext: _read_html for ext in HTML_EXTENSIONS},
    **{ext: _read_jsonl for ext in JSONL_EXTENSIONS},
    **{ext: _read_csv for ext in CSV_EXTENSIONS},
    ".json": _read_json,
    ".parquet": _read_parquet,
    ".pdf": _read_pdf,
    ".docx": _read_docx,
}


def iter_records(path: str | Path, *, text_field: str = "text", id_field: str = "id",
                 on_skip: OnSkip = _noop, stream_above: int | None = None,
                 part: tuple[int, int, int] | None = None
                 ) -> Iterator[tuple[str, str | TextStream]]:
    """Yield ``(record_id, text)`` for every good record of the file at ``path``.

    Plain text, Markdown, reStructuredText, HTML and Word (.docx) files are one record with id ``""``;
    a PDF is a record a page with text, id ``page-N``;
    with ``stream_above``, a plain text, Markdown or reStructuredText file of more than
    that many bytes (decompressed) comes as a :class:`TextStream` instead of a string, to
    be read a block at a time, so its size is not bounded by memory.
    Records of JSON, JSON lines, CSV/TSV and Parquet take their text from ``text_field``
    and their id from ``id_field``; a record without an id (or with one of whitespace
    only) gets ``line-N`` (JSON lines),
    ``row-N`` (CSV, Parquet; N counts data rows from 1) or ``item-N`` (JSON array).
    Problems go to ``on_skip`` (see the module docstring) instead of being raised.

    ``part``: ``(p, parts, size)``, only the records of part ``p`` of ``parts`` of the
    file, planned at ``size`` bytes (see :mod:`.file_parts`; a file that cannot be read
    in parts is part 0's, whole). The file is then not said to be empty: its parts'
    reader adds up what they saw.
    """
    path = path if is_remote(path) else Path(path)
    fmt, compression = text_format(path)
    reader = _READERS.get(fmt) if compression is None or fmt in _PLAIN_EXTENSIONS else None
    if part is not None and part[1] > 1:
        if splittable(path):
            reader = functools.partial(reader, part=part)
        elif part[0] > 0:
            return
    if reader is None:
        suffix = fmt + (compression or "")
        on_skip(str(path), f"format: suffix {suffix!r} is not a text format; known: "
                           f"{', '.join(sorted(_PLAIN_EXTENSIONS | _PACKED_EXTENSIONS))}, "
                           f"and all but {', '.join(sorted(_PACKED_EXTENSIONS))} compressed as {', '.join(COMPRESSIONS)}")
        return
    produced = skipped = 0

    def count_skip(where: str, reason: str) -> None:
        nonlocal skipped
        skipped += 1
        on_skip(where, reason)

    if stream_above is not None and reader is _read_whole_text:
        reader = functools.partial(reader, stream_above=stream_above)
    try:
        for record in reader(path, text_field, id_field, count_skip):
            produced += 1
            yield record
    except _Skip as skip:
        on_skip(str(path), str(skip))
        return
    except _DECOMPRESS_ERRORS as exc:
        on_skip(str(path), f"decompress: {exc}; the rest of the file is skipped")
        return
    except UnicodeDecodeError as exc:
        on_skip(str(path), f"decode: {exc.reason}; the rest of the file is skipped")
        return
    except UnicodeError as exc:
        on_skip(str(path), f"decode: {exc}; the rest of the file is skipped")
        return
    except OSError as exc:
        on_skip(str(path), os_error_reason(exc))
        return
    if produced == 0 and skipped == 0 and part is None:
        on_skip(str(path), "empty: no records")


"""One large JSON lines, Parquet or PDF file read by several loader workers, a part each.

A file is one unit, and a unit went to one loader worker: a corpus given as one large
``corpus.jsonl`` or ``train.parquet`` was tokenized on one core while the GPU waited.
Such a file is now cut into parts (:func:`part_count`), one per worker:

* a JSON lines file into byte ranges cut at line starts: a line belongs to the part its
  first byte is in, and a part learns its first line's number by counting the line ends
  before it (JSON cannot hold a raw line end inside a value, so a line end is always
  between records);
* a Parquet file by rows: part ``p`` takes the ``p``-th ``parts``-th of them, and reads
  only the row groups that hold them (a file written in one row group, as pandas and
  pyarrow write up to a million rows, can be read in parts too);
* a PDF by pages: each part parses the file and takes the ``p``-th ``parts``-th of its
  pages (their text is most of the work), in parts of at least :data:`PDF_PART_BYTES`.

Which files can be (``sources.text.splittable``): an uncompressed JSON lines, Parquet or
PDF file on this machine; a file in UTF-16 (seen at its start) is read whole by part 0. Part 0 hashes the file and reports what is wrong
with it as a whole (empty, binary, no text column); the other parts say nothing of it.
The parts are cut from the size the file had when they were planned, and read to it, and
part 0 hashes those bytes: lines appended meanwhile are left to the next run, which sees
the file changed.
"""

from __future__ import annotations

import os

# Cut a file in parts of at least this many bytes: smaller parts would cost their
# workers more in opening and counting lines than they save.
PART_BYTES = 4 * 2**20
# A PDF's bytes hold far more work: pypdf takes milliseconds a page to find its text, and
# a page is a few kilobytes, so a part of this many (a hundred pages or so) pays its
# parse of the file (the cross-reference table and the page tree) many times over.
PDF_PART_BYTES = 2**18
# At most this many parts a file (chunk numbers stay within the id's 31 bits anyway).
MAX_PARTS = 64
_BLOCK = 2**20


def part_count(size: int, workers: int, share: int, pdf: bool = False) -> int:
    """How many parts a splittable file of ``size`` bytes is read in by
    ``workers`` workers, when each should get about ``share`` bytes of such files (their
    sum over the workers): none smaller than :data:`PART_BYTES` (a ``pdf``:
    :data:`PDF_PART_BYTES`), so many large files are read whole, a worker each, and one
    large file by every worker."""
    if workers < 2:
        return 1
    return max(1, min(workers, MAX_PARTS, size // max(PDF_PART_BYTES if pdf else PART_BYTES, share)))


def line_start(fd: int, pos: int, size: int) -> int:
    """The first line start at or after byte ``pos`` of the file ``fd`` of ``size`` bytes.
    A line ends at ``\\n``, ``\\r\\n`` or a lone ``\\r``, as the JSON lines reader reads
    them, so a ``\\r\\n`` is never cut in two."""
    if pos <= 0:
        return 0
    if pos >= size:
        return size
    at = pos - 1
    while at < size:
        block = os.pread(fd, min(_BLOCK, size - at), at)
        if not block:
            return size
        cr, lf = block.find(b"\r"), block.find(b"\n")
        found = [i for i in (cr, lf) if i >= 0]
        if not found:
            at += len(block)
            continue
        i = min(found)
        end = at + i + 1
        if block[i] == 0x0D:  # "\r": a "\r\n" ends one byte later
            after = block[i + 1:i + 2] or os.pread(fd, 1, end)
            if after == b"\n":
                end += 1
        return min(end, size)
    return size


def part_bounds(fd: int, p: int, parts: int, size: int) -> tuple[int, int]:
    """The bytes ``[start, stop)`` of part ``p`` of ``parts`` of a JSON lines file of
    ``size`` bytes: about a ``parts``-th of it, cut at line starts. Part 0 starts at 0
    (so it alone reads a byte-order mark), the last ends at ``size``."""
    def bound(k: int) -> int:
        if k <= 0:
            return 0
        if k >= parts:
            return size
        return line_start(fd, max(1, size * k // parts), size)

    return bound(p), bound(p + 1)


def line_ends_before(fd: int, stop: int) -> int:
    """How many line ends (``\\n``, ``\\r\\n``, a lone ``\\r``) the bytes before ``stop``
    hold, ``stop`` being a line start: the number of the line that starts there, less 1."""
    n, at, cr_last = 0, 0, False
    while at < stop:
        block = os.pread(fd, min(_BLOCK, stop - at), at)
        if not block:
            break
        n += block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n")
        if cr_last and block[:1] == b"\n":
            n -= 1
        cr_last = block[-1:] == b"\r"
        at += len(block)
    return n


class ByteRange:
    """Bytes ``start`` to ``stop`` of an open file, read as a stream (``read(n)``) without
    moving its offset; closing closes the file."""

    def __init__(self, fh, start: int, stop: int):
        self._fh, self._fd = fh, fh.fileno()
        self._at, self._stop = start, stop

    def read(self, n: int = -1) -> bytes:
        left = self._stop - self._at
        n = left if n < 0 else min(n, left)
        if n <= 0:
            return b""
        data = os.pread(self._fd, n, self._at)
        self._at += len(data)
        return data

    def close(self) -> None:
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

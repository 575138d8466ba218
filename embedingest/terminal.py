"""Text from a corpus shown on a terminal, with its control characters as escapes.

File names, record ids and chunk texts come from the data, which anyone may have
written. Printed as they are, a control character could move the cursor, retitle or
clear the terminal, or forge a line of the log (a file name holding a newline and
``WARNING ...``), and Unicode's bidirectional controls could show a name or a text in
another order than it has. JSON output needs none of this: it escapes them itself.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys

# C0 and C1 controls and DEL as \xNN; the bidirectional embeddings, overrides and
# isolates as \uNNNN.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def printable(text: str) -> str:
    """``text`` with every control character written as its escape (a newline as ``\\x0a``)."""
    return text.translate(_ESCAPES)


def _escaped_in_shell(c: str) -> bool:
    return 0xDC80 <= ord(c) <= 0xDCFF or ord(c) in _ESCAPES


def shell_quote(arg: str) -> str:
    """``arg`` quoted for a command a user pastes into bash (or zsh, ksh), naming the same
    bytes: ``shlex.quote`` where that does, bash's ``$'...'`` quoting where ``arg`` holds
    a byte of a name that is not UTF-8 (a lone surrogate, as ``os.fsdecode`` reads it:
    shlex kept it, and printed it is no byte of the name) or a control character (which
    would move the cursor or end the line). Such bytes are written as ``\\xHH``."""
    if not any(map(_escaped_in_shell, arg)):
        return shlex.quote(arg)
    out = []
    for c in arg:
        if _escaped_in_shell(c):
            out += (f"\\x{b:02x}" for b in os.fsencode(c))
        else:
            out.append("\\" + c if c in "\\'" else c)
    return "$'" + "".join(out) + "'"


class PrintableFormatter(logging.Formatter):
    """Log lines whose message is :func:`printable`: one record is one line, whatever
    names it holds. A traceback after it keeps its own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


def counted(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun for it, singular for one: '1 file', '2 files'."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def rate(per_second: float) -> str:
    """A rate for a summary line: whole numbers from 10 up ('37,812'), two significant
    digits below ('3.4', '0.046'), so a slow run on a CPU never reads as '0 docs/s'."""
    if per_second >= 10 or per_second == 0:
        return f"{per_second:,.0f}"
    return f"{per_second:.2g}"


def log_to_stderr(level: int) -> None:
    """The program's logging: ``level`` and up to standard error, one escaped line per
    record (as :func:`logging.basicConfig`, nothing changes if logging is set up already)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])

"""embedingest.terminal: what the corpus controls is escaped before a terminal shows it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from embedingest.terminal import PrintableFormatter, counted, printable, rate, shell_quote

CONTROLS = {*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)}


def test_controls_and_bidirectional_marks_become_escapes_and_the_rest_stays():
    text = "a\x1b[31mred\nWARNING forged\x07\x7f\x9b é ✓ 日本 \u202ereversed\u2066x\u2069\t"
    assert printable(text) == ("a\\x1b[31mred\\x0aWARNING forged\\x07\\x7f\\x9b é ✓ 日本 "
                               "\\u202ereversed\\u2066x\\u2069\\x09")


@given(st.text())
def test_nothing_the_terminal_acts_on_is_left_and_other_text_is_unchanged(text):
    shown = printable(text)
    assert not any(ord(c) in CONTROLS for c in shown)
    if not any(ord(c) in CONTROLS for c in text):
        assert shown == text
    assert len(shown) >= len(text)


def test_a_log_record_is_one_line_and_its_traceback_keeps_its_lines():
    formatter = PrintableFormatter("%(levelname)s %(name)s: %(message)s")
    record = logging.LogRecord("embedingest", logging.WARNING, __file__, 1,
                               "skipped %s: %s", ("a\nWARNING forged.txt", "empty"), None)
    assert formatter.format(record) == "WARNING embedingest: skipped a\\x0aWARNING forged.txt: empty"
    try:
        raise ValueError("line one\nline two")
    except ValueError:
        record = logging.LogRecord("embedingest", logging.ERROR, __file__, 1, "failed\x1b[2J", (),
                                   sys.exc_info())
    lines = formatter.format(record).splitlines()
    assert lines[0] == "ERROR embedingest: failed\\x1b[2J"
    assert lines[1] == "Traceback (most recent call last):" and lines[-2:] == ["ValueError: line one", "line two"]


def test_a_count_of_one_takes_the_singular_and_any_other_the_plural():
    assert [counted(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]
    assert counted(1, "entry", "entries") == "1 entry" and counted(3, "entry", "entries") == "3 entries"


def test_a_rate_keeps_two_digits_below_ten_so_a_slow_run_is_not_zero():
    """Before: 13 documents in 284.8 s were '0 docs/s'."""
    assert [rate(x) for x in (37812.4, 10.4, 9.96, 3.42, 0.0456, 13 / 284.8, 0)] == [
        "37,812", "10", "10", "3.4", "0.046", "0.046", "0"]


def test_shell_quote_names_the_same_bytes_in_bash():
    """A name that is not UTF-8 (lone surrogates, as os.fsdecode reads it) or holds a
    control character is quoted $'...' with its bytes; others as shlex quotes them."""
    assert shell_quote("a b") == "'a b'" and shell_quote("IVF4,Flat") == "IVF4,Flat"
    assert shell_quote(os.fsdecode(b"bad\xff.txt")) == "$'bad\\xff.txt'"
    for name in (b"bad\xff.txt", b"it's \\ \xfe\x1b[31m\n", "é\u202e\x85".encode() + b"\x80", b"plain name"):
        got = subprocess.run(["bash", "-c", f"printf %s {shell_quote(os.fsdecode(name))}"], capture_output=True,
                             check=True).stdout
        assert got == name

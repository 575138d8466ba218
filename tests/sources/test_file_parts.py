"""A large JSON lines or Parquet file read in parts: the parts' records together are the
whole file's, each once, with the same ids, line numbers and problems."""

from __future__ import annotations

import codecs
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedingest.sources import file_parts
from embedingest.sources.file_parts import line_ends_before, line_start, part_bounds, part_count
from embedingest.sources.text import iter_records, splittable

ENDS = ["\n", "\r\n", "\r"]


def read(path, parts=None):
    """(records, skips) of the whole file, or of its ``parts`` parts together."""
    skips: list = []
    if parts is None:
        recs = list(iter_records(path, on_skip=lambda w, r: skips.append((w, r))))
        return recs, [s for s in skips if s[1] != "empty: no records"]
    size = os.path.getsize(path)
    recs = [r for p in range(parts)
            for r in iter_records(path, on_skip=lambda w, r: skips.append((w, r)), part=(p, parts, size))]
    return recs, skips


line = st.one_of(
    st.just(""), st.just("   "), st.just("{broken"), st.just('{"body": "no text"}'),
    st.builds(lambda t, ascii_: json.dumps({"text": t or "x"}, ensure_ascii=ascii_),
              st.text(st.characters(blacklist_categories=("Cs",)), max_size=30), st.booleans()),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.tuples(line, st.sampled_from(ENDS)), max_size=14),
       bom=st.booleans(), cut_end=st.booleans(), parts=st.integers(2, 9))
def test_parts_together_are_the_whole_file(tmp_path, lines, bom, cut_end, parts):
    data = (codecs.BOM_UTF8 if bom else b"") + "".join(a + e for a, e in lines).encode()
    if cut_end:
        data = data.rstrip(b"\r\n")
    path = tmp_path / "a.jsonl"
    path.write_bytes(data)
    whole, whole_skips = read(path)
    got, got_skips = read(path, parts)
    assert sorted(got) == sorted(whole)
    assert len(got) == len(whole)
    assert sorted(got_skips) == sorted(whole_skips)


def line_starts(data: bytes) -> list[int]:
    """Every line start of ``data``, as the JSON lines reader cuts lines."""
    return [0] + [m.end() for m in re.finditer(rb"\r\n|\r|\n", data)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.lists(st.sampled_from([b"a", b"\xc3\xa9", b"\n", b"\r", b"\r\n", b" "]), max_size=40).map(b"".join),
       pos=st.integers(0, 45))
def test_line_start_and_line_numbers(tmp_path, data, pos):
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        starts = line_starts(data)
        want = min([s for s in starts if s >= pos and s <= len(data)] + [len(data)])
        got = line_start(fd, pos, len(data))
        assert got == want
        assert line_ends_before(fd, got) == len([s for s in starts[1:] if s <= got])
    finally:
        os.close(fd)


def test_bounds_cover_the_file_once_at_line_starts(tmp_path):
    data = b"".join(b"x" * (i % 7) + [b"\n", b"\r\n", b"\r"][i % 3] for i in range(200))
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for parts in (2, 3, 7, 64):
            bounds = [part_bounds(fd, p, parts, len(data)) for p in range(parts)]
            assert bounds[0][0] == 0 and bounds[-1][1] == len(data)
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert all(b[0] in line_starts(data) for b in bounds)
    finally:
        os.close(fd)


def test_bad_bytes_skip_the_rest_of_their_part_only(tmp_path):
    rows = [json.dumps({"id": f"r{i}", "text": f"record {i}"}) for i in range(400)]
    data = "\n".join(rows).encode() + b"\n"
    bad_at = data.index(b'"r300"')
    data = data[:bad_at] + b"\x81" + data[bad_at + 1:]  # neither UTF-8 nor cp1252
    path = tmp_path / "a.jsonl"
    path.write_bytes(data)
    whole, whole_skips = read(path)
    got, got_skips = read(path, 4)
    fd = os.open(path, os.O_RDONLY)
    try:
        stop = next(b for a, b in (part_bounds(fd, p, 4, len(data)) for p in range(4)) if a <= bad_at < b)
    finally:
        os.close(fd)
    starts = [sum(len(r) + 1 for r in rows[:i]) for i in range(400)]
    lost = {f"r{i}" for i in range(300, 400) if starts[i] < stop}
    assert 0 < len(lost) < 100 and stop < len(data)
    assert [r for r, _ in whole] == [f"r{i}" for i in range(300)]
    assert {r for r, _ in got} == {f"r{i}" for i in range(400)} - lost
    assert whole_skips[0][1].startswith("decode: line 301:") and "rest of the file" in whole_skips[0][1]
    (skip,) = got_skips
    assert skip[1].startswith("decode: line 301:")
    assert skip[1].endswith(f"; the rest of its part (to byte {stop}) is skipped")


def test_a_file_only_part_0_can_read_is_read_whole_by_it(tmp_path):
    text = "".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(50))
    utf16 = tmp_path / "u.jsonl"
    utf16.write_bytes(text.encode("utf-16"))
    gz = tmp_path / "g.jsonl.gz"
    import gzip
    gz.write_bytes(gzip.compress(text.encode()))
    for path in (utf16, gz):
        size = os.path.getsize(path)
        per_part = [list(iter_records(path, part=(p, 3, size))) for p in range(3)]
        assert [len(r) for r in per_part] == [50, 0, 0]


def test_whole_file_problems_are_told_once(tmp_path):
    empty, binary = tmp_path / "e.jsonl", tmp_path / "b.jsonl"
    empty.write_bytes(b"")
    binary.write_bytes(b"\x00\x01" * 5000 + b"\n" * 100)
    for path, reason in ((empty, "empty: the file has no bytes"), (binary, "binary:")):
        skips: list = []
        for p in range(4):
            assert list(iter_records(path, on_skip=lambda w, r: skips.append(r),
                                     part=(p, 4, os.path.getsize(path)))) == []
        assert len(skips) == 1 and skips[0].startswith(reason)


@pytest.mark.parametrize("group_rows", [700, 5000, 1])
def test_parquet_parts_are_ranges_of_its_rows(tmp_path, group_rows):
    """Whatever its row groups (many, one as pandas writes, one row each), a Parquet
    file's parts together are the whole file, each about an equal share of its rows."""
    path = tmp_path / "t.parquet"
    n = 5000 if group_rows > 1 else 300
    texts = [f"text {i}" if i % 7 else None for i in range(n)]
    ids = [f"id{i}" if i % 3 else None for i in range(n)]
    pq.write_table(pa.table({"text": texts, "id": ids}), path, row_group_size=group_rows)
    whole, whole_skips = read(path)
    assert ("row-4", "text 3") in whole and ("id4", "text 4") in whole
    for parts in (2, 3, 8, 20):
        got, got_skips = read(path, parts)
        assert sorted(got) == sorted(whole) and sorted(got_skips) == sorted(whole_skips)
        sizes = [len(list(iter_records(path, part=(p, parts, 1)))) for p in range(parts)]
        assert max(sizes) - min(sizes) <= n // parts // 5 + 2
    skips: list = []
    for p in range(3):
        list(iter_records(path, text_field="nope", on_skip=lambda w, r: skips.append(r), part=(p, 3, 1)))
    assert len(skips) == 1 and skips[0].startswith("field: no 'nope' column")


@pytest.mark.parametrize("sizes, workers, want", [
    ([600 * 2**20], 14, [14]),  # one large file: every worker
    ([60 * 2**20], 14, [14]),
    ([20 * 2**20], 14, [5]),  # parts of at least PART_BYTES
    ([3 * 2**20], 14, [1]),
    ([100 * 2**20] * 14, 14, [1] * 14),  # as many large files as workers: a file each
    ([800 * 2**20, 8 * 2**20], 4, [3, 1]),
    ([600 * 2**20], 1, [1]),
])
def test_part_count(sizes, workers, want):
    share = sum(sizes) // workers
    assert [part_count(s, workers, share) for s in sizes] == want
    assert file_parts.MAX_PARTS >= 14


def test_what_can_be_split():
    assert splittable("/d/a.jsonl") and splittable("/d/B.NDJSON")
    assert splittable("/d/t.parquet")
    for name in ("/d/a.jsonl.gz", "/d/a.csv", "/d/a.txt", "/d/a.json", "s3://b/a.jsonl"):
        assert not splittable(name)


PARQUET_MEMORY_PROBE = r"""
import os, sys
import pyarrow.parquet
from embedingest.sources.text import iter_records

def peak_kb():  # this process's own peak (getrusage's would count the parent's at the fork)
    with open("/proc/self/status") as fh:
        return int(next(line for line in fh if line.startswith("VmHWM")).split()[1])

path = sys.argv[1]
before = peak_kb()
n = sum(1 for _ in iter_records(path, part=(3, 4, os.path.getsize(path))))
print(n, (peak_kb() - before) >> 10)
"""


def test_a_parquet_part_does_not_hold_its_row_group_whole(tmp_path):
    """Each part reads a row group's pages through a small buffer: a part of a file of
    one 130 MB row group (as pandas writes) grows its process by far less than the group;
    unbuffered, every worker reading a part held the whole group."""
    import subprocess
    import sys

    import random

    rng = random.Random(0)
    texts = [" ".join("%x" % rng.getrandbits(40) for _ in range(300)) for _ in range(40000)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "one-group.parquet", compression="none")
    script = tmp_path / "probe.py"
    script.write_text(PARQUET_MEMORY_PROBE)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "one-group.parquet")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    n, grew_mb = map(int, out.stdout.split())
    assert n == 10000
    assert grew_mb < 100, grew_mb  # unbuffered: 161 MB on a 2-core development machine

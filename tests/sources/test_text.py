"""iter_records on every format, and on every kind of bad input it must report, not raise."""

from __future__ import annotations

import codecs
import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedingest.sources.text import TEXT_EXTENSIONS, iter_records
from fault_helpers import unblock_later


def read(path: Path, **kw) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    skipped: list[tuple[str, str]] = []
    records = list(iter_records(path, on_skip=lambda w, r: skipped.append((w, r)), **kw))
    return records, skipped


def write(tmp_path: Path, name: str, data: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def keywords(skipped) -> list[str]:
    return [reason.split(":")[0] for _, reason in skipped]


PLAIN = {".txt", ".md", ".rst", ".html", ".htm", ".jsonl", ".ndjson", ".json", ".csv", ".tsv"}


def test_extensions():
    assert TEXT_EXTENSIONS == PLAIN | {".parquet", ".pdf", ".docx"} | {e + c for e in PLAIN
                                                      for c in (".gz", ".bz2", ".xz", ".zst")}


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_compressed_files_read_like_plain_ones(tmp_path, suffix):
    import bz2
    import gzip
    import lzma

    import zstandard

    compress = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
                ".zst": zstandard.ZstdCompressor().compress}[suffix]
    lines = "\n".join(json.dumps({"id": f"r{i}", "text": f"record {i} é"}) for i in range(3))
    jsonl = write(tmp_path, "docs.JSONL" + suffix, compress(lines.encode()))
    tsv = write(tmp_path, "t.tsv" + suffix, compress("id\ttext\nx\tcell\n".encode()))
    txt = write(tmp_path, "n.txt" + suffix, compress("café notes".encode("cp1252")))
    assert read(jsonl) == ([(f"r{i}", f"record {i} é") for i in range(3)], [])
    assert read(tsv) == ([("x", "cell")], []) and read(txt) == ([("", "café notes")], [])


def test_corrupt_or_cut_compressed_files(tmp_path):
    import gzip

    rng = np.random.default_rng(0)
    lines = "\n".join(json.dumps({"text": rng.bytes(100).hex()}) for _ in range(2000)).encode()
    cut = write(tmp_path, "cut.jsonl.gz", gzip.compress(lines)[:100_000])
    records, skipped = read(cut)
    assert 0 < len(records) < 2000  # the records before the cut are kept
    assert keywords(skipped) == ["decompress"] and "rest of the file" in skipped[0][1]
    assert keywords(read(write(tmp_path, "bad.txt.gz", b"not gzip at all"))[1]) == ["decompress"]
    assert keywords(read(write(tmp_path, "bad.json.xz", b"\xfd7zXZ\x00garbage"))[1]) == ["decompress"]
    # bz2 raises a plain OSError for bad data: still the data's fault, not an unreadable disk
    for name in ("bad.txt.bz2", "bad.jsonl.bz2"):
        assert read(write(tmp_path, name, b"BZh9 not bzip2 at all")) == (
            [], [(str(tmp_path / name), "decompress: Invalid data stream" + (
                "; the data is corrupt, so none of the file's records are read" if "jsonl" in name else ""))])


@pytest.mark.parametrize("name, cut", [("a.jsonl.gz", 4), ("a.csv.gz", 100), ("a.jsonl.xz", 30)])
def test_a_stream_cut_short_keeps_every_record_decompressed_before_the_cut(tmp_path, name, cut):
    """A reader's read(n) dropped what it had decompressed in that call when it met the
    cut: a gzip missing only its trailer (every byte of data there) kept none of its 100
    records, a CSV cut 100 bytes short 700 of 1,980."""
    import gzip
    import lzma

    n = 100 if "jsonl" in name else 2000
    data = ("".join(json.dumps({"id": str(i), "text": f"row {i}"}) + "\n" for i in range(n)) if "jsonl" in name
            else "id,text\n" + "".join(f"{i},row {i}\n" for i in range(n))).encode()
    packed = (gzip.compress if name.endswith(".gz") else lzma.compress)(data)[:-cut]
    whole = zlib_prefix(packed) if name.endswith(".gz") else lzma.LZMADecompressor().decompress(packed)
    kept = whole[:whole.rfind(b"\n") + 1].count(b"\n") - (0 if "jsonl" in name else 1)
    records, skipped = read(write(tmp_path, name, packed))
    assert len(records) == kept and kept >= n - 25
    assert records == [(str(i), f"row {i}") for i in range(kept)]
    assert keywords(skipped) == ["decompress"]


def zlib_prefix(packed: bytes) -> bytes:
    """All that zlib can decompress of a gzip stream cut short."""
    import zlib

    return zlib.decompressobj(wbits=31).decompress(packed)


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
def test_a_corrupt_compressed_stream_indexes_none_of_its_records(tmp_path, suffix):
    """Two bytes flipped mid-file: the decompressor checks its CRC only after handing out
    the damaged data, so its records (and broken lines after them) were indexed and
    reported, then the file ended as if cut. Now the file is checked first and skipped
    whole; a file cut short still keeps the records before the cut."""
    import bz2
    import gzip
    import lzma

    compress = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[suffix]
    lines = "".join(json.dumps({"id": f"r{i}", "text": f"date elder mango fig rec{i} " * 5}) + "\n"
                    for i in range(400)).encode()
    data = bytearray(compress(lines))
    for at in (len(data) // 2, len(data) // 2 + 7):
        data[at] ^= 0x5A
    path = write(tmp_path, "docs.jsonl" + suffix, bytes(data))
    records, skipped = read(path)
    assert records == [] and len(skipped) == 1 and skipped[0][0] == str(path)
    assert skipped[0][1].startswith("decompress: ")
    assert skipped[0][1].endswith("; the data is corrupt, so none of the file's records are read")
    cut = write(tmp_path, "cut.jsonl" + suffix, compress(lines)[: len(data) * 3 // 4])
    records, skipped = read(cut)
    # (bz2 gives nothing of a block before its end: these 68 KB are one block)
    assert 0 < len(records) < 400 or (suffix == ".bz2" and not records)
    assert keywords(skipped) == ["decompress"]
    assert records == [(f"r{i}", f"date elder mango fig rec{i} " * 5) for i in range(len(records))]
    assert keywords(read(write(tmp_path, "a.parquet.gz", gzip.compress(b"x")))[1]) == ["format"]


def test_zstd_frames_cut_short_corrupt_or_many(tmp_path):
    """zstandard's own readers end quietly where a stream is cut inside a frame; the
    reader says ``decompress`` as for gzip, keeping the records before the cut, and
    reads every frame of a multi-frame file (``zstd -T``, ``pzstd``)."""
    import zstandard

    rng = np.random.default_rng(0)
    lines = "\n".join(json.dumps({"text": rng.bytes(100).hex()}) for _ in range(2000)).encode()
    whole = zstandard.ZstdCompressor().compress(lines)
    records, skipped = read(write(tmp_path, "cut.jsonl.zst", whole[:len(whole) // 2]))
    assert 0 < len(records) < 2000 and keywords(skipped) == ["decompress"]
    assert "rest of the file" in skipped[0][1]
    assert keywords(read(write(tmp_path, "bad.txt.zst", b"not zstd at all"))[1]) == ["decompress"]
    assert keywords(read(write(tmp_path, "cut.txt.zst", whole[:-1]))[1]) == ["decompress"]
    halves = lines[:len(lines) // 2], lines[len(lines) // 2:]
    frames = b"".join(zstandard.ZstdCompressor().compress(h) for h in halves)
    records, skipped = read(write(tmp_path, "two.jsonl.zst", frames))
    assert skipped == [] and [t for _, t in records] == [json.loads(x)["text"] for x in lines.splitlines()]


def test_a_zstd_bomb_is_read_a_bounded_block_at_a_time():
    """However well a stream compresses, one step of the reader holds at most 8 MiB."""
    import zstandard

    from embedingest.sources.text import ZstdReader

    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 * 2**20))
    reader, total, most = ZstdReader(io.BytesIO(bomb)), 0, 0
    while block := reader.read(2**16):
        total += len(block)
        most = max(most, len(reader._buf))
    assert total == 64 * 2**20 and most <= 8 * 2**20


@pytest.mark.parametrize("name", ["a.txt", "a.md", "a.rst", "A.TXT"])
def test_whole_file_is_one_record(tmp_path, name):
    text = "# Title\n\nSome *text*, with ünïcödé.\n"
    assert read(write(tmp_path, name, text)) == ([("", text)], [])


def test_utf8_bom_is_dropped(tmp_path):
    path = write(tmp_path, "a.txt", b"\xef\xbb\xbfhello")
    assert read(path) == ([("", "hello")], [])


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"])
def test_utf16_and_utf32_with_a_bom_read_whole_and_streamed(tmp_path, codec):
    """UTF-32 LE's BOM begins with UTF-16 LE's: each byte order of both reads its text,
    whole (a text file), streamed (JSON lines) and as a large text file a block at a time."""
    bom = {"utf-16-be": codecs.BOM_UTF16_BE, "utf-32-le": codecs.BOM_UTF32_LE,
           "utf-32-be": codecs.BOM_UTF32_BE}.get(codec, b"")
    path = write(tmp_path, "a.txt", bom + "héllo wörld \U0001F600".encode(codec))
    assert read(path) == ([("", "héllo wörld \U0001F600")], [])
    lines = "".join(json.dumps({"id": str(i), "text": f"líne {i}"}) + "\n" for i in range(3))
    assert read(write(tmp_path, "a.jsonl", bom + lines.encode(codec))) == (
        [(str(i), f"líne {i}") for i in range(3)], [])
    big = "naïve words\n" * 10_000
    (_, stream), = iter_records(write(tmp_path, "big.md", bom + big.encode(codec)), stream_above=2**12)
    assert "".join(stream) == big


def test_wide_text_without_a_bom_is_binary_and_says_how_to_read_it(tmp_path):
    path = write(tmp_path, "a.txt", "plain words".encode("utf-16-le"))
    assert read(path) == ([], [(str(path), "binary: NUL byte in the first 8192 bytes (UTF-16 or UTF-32 "
                                           "text without a BOM reads so too: convert it to UTF-8)")])


def test_cp1252_fallback(tmp_path):
    path = write(tmp_path, "a.txt", "café – “quoted” €5".encode("cp1252"))
    assert read(path) == ([("", "café – “quoted” €5")], [])


WESTERN = ["Le café est très chaud, et la crème brûlée était délicieuse à Noël. Où est l’hôtel? Don’t.",
           "Die Größe der Straße ist für Fußgänger über 5 m² groß; Bäume blühen. Schöne Grüße.",
           "¿Qué pasó? ¡Olé! El niño comió piña en la mañana; España — año 2020 – «hola» nº 5.",
           "La paral·lela és col·lectiva i il·lustrada; intel·ligència i cel·la a la vila.",
           "Þetta er íslenskur texti með ð og þ og æ, og ö á öllum stöðum í þessum setningum."]


@pytest.mark.parametrize("text", WESTERN)
def test_western_legacy_text_is_read_as_cp1252(tmp_path, text):
    path = write(tmp_path, "a.txt", text.encode("cp1252"))
    assert read(path) == ([("", text)], [])


@pytest.mark.parametrize("text, codec, sample", [
    ("Привет мир, это тестовый документ о погоде и реках. Москва стоит на реке.", "cp1251", "Ïðèâåò"),
    ("Привет мир, это тестовый документ о погоде и реках. Москва стоит на реке.", "koi8-r", "ðÒÉ×ÅÔ"),
    ("Zażółć gęślą jaźń. Pchnąć w tę łódź jeża lub ośm skrzyń fig. Źdźbło trawy.", "iso-8859-2", "Za¿ó³æ"),
    ("Καλημέρα κόσμε, αυτό είναι ένα έγγραφο για τον καιρό και τα ποτάμια.", "cp1253", "ÊáëçìÝñá"),
])
def test_text_of_another_legacy_encoding_is_skipped_not_stored_as_nonsense(tmp_path, text, codec, sample):
    """Before: read as cp1252 without a word (``Ïðèâåò ìèð``, ``Za¿ó³æ gê¶l±``), stored and
    searched as nonsense."""
    path = write(tmp_path, "a.txt", text.encode(codec))
    records, skipped = read(path)
    assert records == [] and keywords(skipped) == ["decode"]
    assert skipped[0][1].startswith("decode: not UTF-8, and read as cp1252 (the Western legacy encoding) it is "
                                    "another encoding's text (")
    assert f"e.g. '{sample}'" in skipped[0][1] and skipped[0][1].endswith(
        "convert it to UTF-8 from its encoding (iconv -f ENCODING -t UTF-8)")


def test_the_legacy_encoding_check_looks_at_a_bounded_sample_spread_over_a_long_text(tmp_path):
    """A document read whole may be any size: the check judges a sample of a fixed size from
    its start to its end, and still tells a long text of another encoding from a Western one."""
    from embedingest.sources.text import _OTHER_LEGACY_SAMPLE, _spread_sample

    text = "".join(f"{i:07d} " for i in range(400_000))  # 3.2 M characters, each place known
    sample = _spread_sample(text)
    assert len(sample) <= _OTHER_LEGACY_SAMPLE + 16 and sample.startswith("0000000 ")
    assert any(f"{i:07d}" in sample for i in range(375_000, 400_000)), "the end is looked at"
    assert any(f"{i:07d}" in sample for i in range(190_000, 210_000)), "and the middle"
    assert _spread_sample("short text") == "short text"
    russian = "Привет мир, это тестовый документ о погоде и реках. Москва стоит на реке. " * 40_000
    records, skipped = read(write(tmp_path, "ru.txt", russian.encode("cp1251")))
    assert records == [] and keywords(skipped) == ["decode"]
    french = "Le café où l'élève étudie près de la forêt, à côté du lycée. " * 50_000
    assert read(write(tmp_path, "fr.txt", french.encode("cp1252")))[0] == [("", french)]


def test_mixed_utf8_and_stray_cp1252_byte(tmp_path):
    path = write(tmp_path, "a.txt", "naïve ".encode() + b"caf\xe9")
    assert read(path) == ([("", "naïve café")], [])


@pytest.mark.parametrize("data, keyword", [
    (b"", "empty"),
    (b"  \n\t ", "empty"),
    (b"PK\x03\x04\x00\x00binary", "binary"),
    (b"text then \x81 undefined in cp1252", "decode"),
])
def test_bad_whole_files(tmp_path, data, keyword):
    path = write(tmp_path, "a.txt", data)
    records, skipped = read(path)
    assert records == []
    assert skipped == [(str(path), skipped[0][1])]
    assert keywords(skipped) == [keyword]


@pytest.mark.parametrize("name", ["a.jsonl", "a.csv", "a.json", "a.html", "a.parquet"])
def test_empty_file_any_format(tmp_path, name):
    assert keywords(read(write(tmp_path, name, b""))[1]) == ["empty"]


def test_binary_jsonl(tmp_path):
    path = write(tmp_path, "a.jsonl", b'{"text": "a"}\n\x00\x01\x02')
    assert read(path) == ([], [(str(path), "binary: NUL byte in the first 8192 bytes (UTF-16 or UTF-32 "
                                           "text without a BOM reads so too: convert it to UTF-8)")])


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_permission_denied(tmp_path):
    path = write(tmp_path, "a.txt", "secret")
    path.chmod(0)
    try:
        records, skipped = read(path)
    finally:
        path.chmod(0o644)
    assert records == [] and keywords(skipped) == ["unreadable"]


def test_permission_error_is_unreadable(tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    txt, jsonl = write(tmp_path, "a.txt", "x"), write(tmp_path, "a.jsonl", '{"text": "x"}')
    monkeypatch.setattr(Path, "read_bytes", denied)
    monkeypatch.setattr("builtins.open", denied)
    for path in (txt, jsonl):
        assert read(path) == ([], [(str(path), "unreadable: Permission denied")])


def test_missing_file_and_folder(tmp_path):
    (tmp_path / "dir.txt").mkdir()
    for path in (tmp_path / "missing.jsonl", tmp_path / "dir.txt"):
        records, skipped = read(path)
        assert records == [] and keywords(skipped) == ["unreadable"]
        assert skipped[0][0] == str(path)


def test_unknown_suffix(tmp_path):
    records, skipped = read(write(tmp_path, "a.pptx", "x"))
    assert records == [] and keywords(skipped) == ["format"]


def test_jsonl_records_and_record_problems(tmp_path):
    lines = [
        json.dumps({"id": "a", "text": "first"}),
        "{not json",
        "",
        json.dumps({"other": "x"}),
        json.dumps({"text": 5}),
        json.dumps({"text": None}),
        json.dumps({"text": "   "}),
        json.dumps([1, 2]),
        "[" * 100_000,
        json.dumps({"text": "no id"}),
        json.dumps({"id": 7, "text": "int id"}),
    ]
    path = write(tmp_path, "a.jsonl", "\n".join(lines) + "\n")
    records, skipped = read(path)
    assert records == [("a", "first"), ("line-10", "no id"), ("7", "int id")]
    assert [(w, r.split(":")[0]) for w, r in skipped] == [
        (f"{path}:line 2", "json"),
        (f"{path}:line 4", "field"),
        (f"{path}:line 5", "field"),
        (f"{path}:line 6", "field"),
        (f"{path}:line 7", "empty"),
        (f"{path}:line 8", "json"),
        (f"{path}:line 9", "json"),
    ]
    assert skipped[0][1] == "json: line 2, column 2: Expecting property name enclosed in double quotes"
    assert "'text'" in skipped[1][1] and "'other'" in skipped[1][1]
    assert "nested too deeply" in skipped[6][1]


def test_a_record_without_the_text_field_names_the_cli_option(tmp_path):
    """A JSON record without the text field told a command-line user to pass
    ``text_field=``, a library argument; CSV and Parquet named ``--text-field``."""
    path = write(tmp_path, "a.json", json.dumps({"data": [{"text": "nested"}]}))
    assert read(path) == ([], [(f"{path}:item 1", "field: item 1: no 'text' field (fields: 'data'); choose "
                                                  "the text field with --text-field (text_field= in the library)")])


def test_json_lines_joined_with_cat_keep_the_records_after_each_byte_order_mark(tmp_path):
    """``cat a.jsonl b.jsonl`` of files saved with a BOM puts the mark at the start of a
    line inside the file: that record was skipped, ``json: line 2: Unexpected UTF-8 BOM
    (decode using utf-8-sig)``, advice no user of the command can follow. The mark is
    dropped at any line's start, in a file read whole or in parts."""
    bom = "\ufeff"
    path = write(tmp_path, "all.jsonl", f'{bom}{{"id": "a", "text": "one"}}\n{bom}{{"id": "b", "text": "two"}}\r\n'
                                        f'{bom}{{"id": "c", "text": "three"}}\n')
    expected = [("a", "one"), ("b", "two"), ("c", "three")]
    assert read(path) == (expected, [])
    size = path.stat().st_size
    parts = [read(path, part=(p, 3, size)) for p in range(3)]
    assert [r for records, _ in parts for r in records] == expected and all(s == [] for _, s in parts)


def test_lone_surrogates_skip_their_record_only(tmp_path):
    """A broken \\ud83d-style escape once failed the tokenizer's batch call, which
    skipped every later record of the file."""
    lines = ['{"id": "a", "text": "half an emoji \\ud83d here"}',
             '{"id": "b\\udc00", "text": "bad id"}',
             '{"id": "c", "text": "whole emoji \\ud83d\\ude00 kept"}']
    path = write(tmp_path, "s.jsonl", "\n".join(lines) + "\n")
    records, skipped = read(path)
    assert records == [("c", "whole emoji \U0001F600 kept")]
    assert [(w, r.split(":")[0]) for w, r in skipped] == [
        (f"{path}:line 1", "unicode"), (f"{path}:line 2", "unicode")]
    assert "U+D83D at character 14" in skipped[0][1] and "'id'" in skipped[1][1]


def test_custom_fields_ndjson(tmp_path):
    path = write(tmp_path, "a.ndjson", '{"body": "b1", "key": "k1"}\r\n{"body": "b2"}\r\n')
    assert read(path, text_field="body", id_field="key") == (
        [("k1", "b1"), ("line-2", "b2")], [])


def test_jsonl_with_only_blank_lines(tmp_path):
    path = write(tmp_path, "a.jsonl", "\n\n  \n")
    assert keywords(read(path)[1]) == ["empty"]


def test_json_array_object_and_lines(tmp_path):
    array = write(tmp_path, "array.json", json.dumps(
        [{"text": "x", "id": "i1"}, {"text": "y"}, "not an object", {"title": "z"}]))
    records, skipped = read(array)
    assert records == [("i1", "x"), ("item-2", "y")]
    assert skipped == [(f"{array}:item 3", skipped[0][1]), (f"{array}:item 4", skipped[1][1])]
    assert keywords(skipped) == ["json", "field"]

    one = write(tmp_path, "one.json", json.dumps({"text": "only", "id": "o"}, indent=2))
    assert read(one) == ([("o", "only")], [])

    lines = write(tmp_path, "lines.json", '{"text": "l1"}\n{"text": "l2"}\n{broken\n')
    records, skipped = read(lines)
    assert records == [("line-1", "l1"), ("line-2", "l2")]
    assert skipped == [(f"{lines}:line 3", skipped[0][1])] and keywords(skipped) == ["json"]


def test_json_lines_in_a_json_file_are_cut_where_the_lines_reader_cuts_them(tmp_path):
    """A ``.json`` file of JSON lines was split with ``str.splitlines``, which also cuts at
    U+2028 (scraped text holds it raw, valid in a JSON string): its first record read as
    two lines and the whole file was skipped (``json: line 2: Extra data``). Lines that
    end in a lone ``\\r`` were one line, every record lost under one ``json`` skip. Both
    are now cut as a ``.jsonl`` file is."""
    separator = write(tmp_path, "a.json", '{"id": "a", "text": "one\u2028two"}\n{"id": "b", "text": "three"}\n')
    assert read(separator) == ([("a", "one\u2028two"), ("b", "three")], [])
    old_mac = write(tmp_path, "b.json", '{"id": "a", "text": "one"}\r{"id": "b", "text": "two"}\r\r{"x": 1}\r')
    assert read(old_mac) == ([("a", "one"), ("b", "two")], [
        (f"{old_mac}:line 4", "field: line 4: no 'text' field (fields: 'x'); choose the text field with "
                              "--text-field (text_field= in the library)")])


@pytest.mark.parametrize("data", ['{\n  "text": oops\n}', "42", "[" * 100_000])
def test_bad_json_document(tmp_path, data):
    path = write(tmp_path, "a.json", data)
    records, skipped = read(path)
    assert records == [] and skipped[0][0] == str(path) and keywords(skipped) == ["json"]


def test_csv_and_tsv(tmp_path):
    csv_path = write(tmp_path, "a.csv", 'id,text\n1,"multi\nline, with comma"\n2,\n3\n,no id\n')
    records, skipped = read(csv_path)
    assert records == [("1", "multi\nline, with comma"), ("row-4", "no id")]
    assert skipped == [(f"{csv_path}:row 2", skipped[0][1]), (f"{csv_path}:row 3", skipped[1][1])]
    assert keywords(skipped) == ["empty", "field"]

    tsv_path = write(tmp_path, "a.tsv", "text\tid\nhello, world\tx\n")
    assert read(tsv_path) == ([("x", "hello, world")], [])


def test_csv_rows_that_do_not_parse_are_skipped_alone_never_merged(tmp_path):
    """An unquoted comma (more values than columns), a stray quote, and a quote that never
    closes: each such row is reported with its line, and the rows around it are read as
    the csv module reads them alone (none is cut, merged into another or dropped unseen)."""
    path = write(tmp_path, "a.csv", 'id,text\n1,hello, world\n2,"quoted, ok"\n3,"stray" quote\n'
                                    '4,"multi\nline"\n5,"never closed\n6,swallowed\n')
    records, skipped = read(path)
    assert records == [("2", "quoted, ok"), ("4", "multi\nline")]
    assert skipped == [
        (f"{path}:row 1", "field: row 1 (line 2): 3 values for 2 columns; quote a value that holds a comma"),
        (f"{path}:row 3", "csv: row 3 (line 4): ',' expected after '\"'; quote the field (a quote inside "
                          "one doubled) or remove the stray quote"),
        (f"{path}:row 5", "csv: row 5 (lines 7-8, read as one row: a quote opened there does not close its "
                          "field): unexpected end of data; quote the field (a quote inside one doubled) or "
                          "remove the stray quote")]
    tsv = write(tmp_path, "a.tsv", 'id\ttext\n1\t"To be" is a line\n2\tplain\n3\ta\tb\n4\t"has\ttab"\n')
    records, skipped = read(tsv)
    assert records == [("2", "plain"), ("4", "has\ttab")]
    assert keywords(skipped) == ["csv", "field"] and skipped[1][1].endswith("quote a value that holds a tab")


@pytest.mark.parametrize("sep, name", [(";", "a semicolon"), ("|", "a vertical bar"), ("\t", "a tab")])
def test_a_csv_with_another_delimiter_is_read_when_its_header_names_the_text_column(tmp_path, sep, name):
    """Spreadsheets in locales whose decimal mark is a comma write ``;``: such a file was
    skipped whole ("no 'text' column (columns: 'id;text;lang')"). The delimiter is now the
    one that splits the header into a text column; the comma stays the first choice."""
    path = write(tmp_path, "a.csv", f'id{sep}text{sep}lang\n1{sep}Bonjour, le monde{sep}fr\n'
                                    f'2{sep}"quoted {sep} inside"{sep}de\n3{sep}too{sep}many{sep}values\n')
    records, skipped = read(path)
    assert records == [("1", "Bonjour, le monde"), ("2", f"quoted {sep} inside")]
    assert skipped == [(f"{path}:row 3", f"field: row 3 (line 4): 4 values for 3 columns; quote a value "
                                         f"that holds {name}")]
    comma_first = write(tmp_path, "b.csv", "id,text;note\n1,a;b\n")  # the comma splits it into 'text;note'
    assert read(comma_first)[0] == []
    both = write(tmp_path, "c.csv", "id,text,x;y\n1,kept as comma,z\n")
    assert read(both)[0] == [("1", "kept as comma")]


@pytest.mark.parametrize("id_name, header", [("id", 'id;"note\n(wrapped)";text'),
                                             ("id\r\n(key)", '"id\r\n(key)";note;"text"')])
def test_a_csv_header_that_spans_lines_is_split_at_its_own_delimiter(tmp_path, id_name, header):
    """A quoted header name holding a line break (a spreadsheet's wrapped heading): the
    delimiter was chosen from the header's first line alone, so this ``;`` file was read
    at commas and skipped whole (``csv: the header row (line 2): ',' expected after '"'``).
    It is now chosen from the whole header record; the rows keep their line numbers."""
    path = write(tmp_path, "a.csv", header + '\n1;n;Bonjour, le monde\n2;n;a;b\n3;"multi\nline";plain\n')
    records, skipped = read(path, id_field=id_name)
    assert records == [("1", "Bonjour, le monde"), ("3", "plain")]
    assert skipped == [(f"{path}:row 2", "field: row 2 (line 4): 4 values for 3 columns; quote a value "
                                         "that holds a semicolon")]


def test_a_csv_header_without_the_text_column_is_named_split_at_a_delimiter_that_parses_it(tmp_path):
    """No delimiter gives a text column: the skip names the columns as the first delimiter
    that parses the header reads them, not the comma's parse error."""
    path = write(tmp_path, "a.csv", '"body\ntext";"id"\n"hello; world";1\n')
    assert read(path) == ([], [(str(path), "field: no 'text' column (columns: 'body\\ntext', 'id'); "
                                           "choose the text column with --text-field (text_field= in the library)")])
    assert read(path, text_field="body\ntext") == ([("1", "hello; world")], [])


def test_a_csv_s_blank_lines_and_excel_sep_line_before_the_header_are_read_past(tmp_path):
    """Blank lines before the header made the file 'empty: no header row', and the
    ``sep=;`` line Excel writes (and reads) to name the delimiter was taken for the
    header: both files were skipped whole. Both are now read past, the delimiter taken
    from ``sep=``; rows keep the file's line numbers."""
    blank = write(tmp_path, "a.csv", "\r\n  \nid,text\n1,after blank lines\n2,a,b\n")
    assert read(blank) == ([("1", "after blank lines")], [
        (f"{blank}:row 2", "field: row 2 (line 5): 3 values for 2 columns; quote a value that holds a comma")])
    hint = write(tmp_path, "b.csv", "\ufeffsep=|\r\nid|text\r\n1|pipe, hint; kept\r\n2|x|y\r\n")
    assert read(hint) == ([("1", "pipe, hint; kept")], [
        (f"{hint}:row 2", "field: row 2 (line 4): 3 values for 2 columns; quote a value that holds a vertical bar")])
    colon = write(tmp_path, "c.csv", "SEP=:\nid:text\n1:colon\n2:a:b\n")
    assert read(colon) == ([("1", "colon")], [
        (f"{colon}:row 2", "field: row 2 (line 4): 3 values for 2 columns; quote a value that holds ':'")])
    only = write(tmp_path, "d.csv", "sep=;\n\n")
    assert read(only) == ([], [(str(only), "empty: no header row")])


def test_a_csv_written_with_a_space_after_each_delimiter_is_read(tmp_path):
    """``id, text`` (a space after each comma, as people and some tools write CSV) has no
    'text' column, only ' text': the file was skipped whole, and given ``--text-field
    ' text'`` its quoted values (``2, "a, b"``) were rows the csv module gave up on.
    When no delimiter gives the text column as written, the spaces after delimiters are
    dropped, from the header and the rows alike."""
    path = write(tmp_path, "a.csv", 'id, text\n1, hello\n2, "a, b"\n3, x, y\n')
    assert read(path) == ([("1", "hello"), ("2", "a, b")], [
        (f"{path}:row 3", "field: row 3 (line 4): 3 values for 2 columns; quote a value that holds a comma")])
    semi = write(tmp_path, "b.csv", "id; text\n1; Bonjour, le monde\n")
    assert read(semi) == ([("1", "Bonjour, le monde")], [])
    as_written = write(tmp_path, "c.csv", "id,text\n1,  kept as written\n")
    assert read(as_written) == ([("1", "  kept as written")], [])


def test_a_csv_header_whose_quote_never_closes_is_read_once_and_named_short(tmp_path):
    """A header ``"text,id`` whose quote never closes is one column name of the whole
    file: the skip reason held it whole (a megabyte on one line of skipped.jsonl); the
    lines looked at ahead to choose the delimiter (a million short ones) are handed
    out in linear time."""
    path = write(tmp_path, "a.csv", '"text,id\n' + "\n" * 1_000_000 + 'x"\n1,a\n')
    started = time.monotonic()
    records, skipped = read(path)
    assert time.monotonic() - started < 20
    assert records == [] and skipped == [(str(path), "field: no 'text' column (columns: 'text,id" + "\\n" * 93
                                          + "... (1000009 characters)'); choose the text column with "
                                          "--text-field (text_field= in the library)")]


def test_a_csv_header_naming_a_column_twice_skips_the_file(tmp_path):
    path = write(tmp_path, "a.csv", "text,text,id\nfirst,second,a\n")
    assert read(path) == ([], [(str(path), "field: the header names 'text' more than once; rename the "
                                           "columns so each is named once")])
    ids = write(tmp_path, "b.csv", "id,text,id\n1,first,2\n")
    assert read(ids) == ([], [(str(ids), "field: the header names 'id' more than once; rename the "
                                         "columns so each is named once")])


def test_a_csv_whose_other_columns_repeat_a_name_is_read(tmp_path):
    """A spreadsheet saved as CSV names its empty trailing columns '' (``id,text,,``), and
    a sheet may repeat a heading (``note,note``): the whole file was skipped, "the header
    names '' more than once", though neither column is read. Only the text and id
    columns must be named once."""
    path = write(tmp_path, "a.csv", "id,text,,\n1,first kangaroo,,\n2,second,x,y\n")
    assert read(path) == ([("1", "first kangaroo"), ("2", "second")], [])
    notes = write(tmp_path, "b.csv", "note,note,text\na,b,hello\n")
    assert read(notes) == ([("row-1", "hello")], [])


def test_csv_without_text_column(tmp_path):
    path = write(tmp_path, "a.csv", "a,b\n1,2\n")
    records, skipped = read(path)
    assert records == [] and keywords(skipped) == ["field"] and "'a', 'b'" in skipped[0][1]


def test_csv_field_larger_than_default_limit(tmp_path):
    text = "y" * 1_000_000
    assert read(write(tmp_path, "a.csv", f"text\n{text}\n")) == ([("row-1", text)], [])


def test_html_visible_text(tmp_path):
    html = ("<html><head><title>Title</title><style>p {color: red}</style>"
            "<script>var hidden = 1;</script></head><body><!-- a comment -->"
            "<p>Hello <b>bold</b>world</p><div>two<br>three</div>"
            "<noscript>no js</noscript></body></html>")
    records, skipped = read(write(tmp_path, "a.html", html))
    assert skipped == []
    assert records == [("", "Title\nHello boldworld\ntwo\nthree")]


def test_html_pre_and_textarea_keep_their_spaces_and_lines(tmp_path):
    """Code in ``<pre>`` lost its indentation and blank lines (``def foo():\\nreturn 1``),
    as the runs of spaces of the rest of the page are made one. Their text is now kept
    as written; the rest of the page is read as before."""
    html = ("<p>Example   code:</p><pre>def  foo():\n    return   1\n\n\n    # end</pre>"
            "<textarea>  a\n\n  b</textarea><p>after   it</p>")
    assert read(write(tmp_path, "c.html", html)) == (
        [("", "Example code:\ndef  foo():\n    return   1\n\n\n    # end\n  a\n\n  b\nafter it")], [])


def test_html_of_deeply_nested_tags_is_read_in_time_linear_in_its_size(tmp_path):
    """Unclosed or deeply nested tags (a generator's bug, a hostile page): each block was
    marked by appending a line to it, which bs4 does by walking down to its last
    descendant, so 20,000 nested ``<div>`` took 22 s and 200,000 (1.2 MB) hours, a
    worker held all that time. The tree is now walked once (under a second for 50,000,
    which took over two minutes before)."""
    n = 50_000
    page = write(tmp_path, "deep.html", "<div>" * n + "<p>deep <b>text</b></p>" + "</div>" * n + "<pre> a  b</pre>")
    started = time.monotonic()
    assert read(page) == ([("", "deep text\n a  b")], [])
    assert time.monotonic() - started < 20


def test_html_table_cells_and_controls_keep_their_words_apart(tmp_path):
    """Cells of a row, options and buttons sit side by side with no whitespace between
    them in the page: they were read as one word (``applebanana``, ``redgreen``), which
    the model reads as other words. Each is now followed by a space, and the block
    elements that were missing (``main``, ``figure``, ``summary``, ...) by a line."""
    html = ("<table><tr><th>Name</th><th>City</th></tr><tr><td>apple</td><td>banana</td></tr></table>"
            "<select><option>red</option><option>green</option></select><button>OK</button>"
            "<button>Cancel</button><main>top</main><figure>pic</figure><details><summary>more"
            "</summary>hidden</details><p>in<b>line</b> stays</p>")
    assert read(write(tmp_path, "t.html", html)) == (
        [("", "Name City\napple banana\nred green OK Cancel top\npic\nmore\nhidden\ninline stays")], [])


@pytest.mark.parametrize("charset,text", [
    ("Shift_JIS", "東京の天気は晴れです"), ("gb2312", "北京今天天气很好"),
    ("windows-1251", "Погода в Москве хорошая"), ("euc-kr", "서울 날씨가 좋습니다"),
])
def test_html_in_its_declared_encoding(tmp_path, charset, text):
    page = f'<html><head><meta charset="{charset}"><title>t</title></head><body><p>{text}</p></body></html>'
    path = write(tmp_path, "p.html", page.encode(charset))
    records, skipped = read(path)
    assert skipped == [] and text in records[0][1]


@pytest.mark.parametrize("charset, text, before", [
    ("windows-1251", "Погода в Москве хорошая", "<style>" + "p{color:red}" * 400 + "</style>"),
    ("shift_jis", "東京の天気は晴れです", "<!-- " + "banner " * 700 + "-->"),
])
def test_an_html_charset_declared_late_in_the_head_is_read(tmp_path, charset, text, before):
    """A ``<meta charset>`` after a long inline style or comment banner (past 2 KiB) was
    not seen: a windows-1251 page was indexed as cp1252 mojibake (``Ïîãîäà``) without
    a word, a Shift_JIS one skipped as ``decode``. The whole head is looked at now."""
    page = (f'<html><head>{before}<meta http-equiv="Content-Type" content="text/html; '
            f'charset={charset}"></head><body><p>{text}</p></body></html>')
    assert read(write(tmp_path, "p.html", page.encode(charset))) == ([("", text)], [])


def test_html_declarations_browsers_override(tmp_path):
    latin = write(tmp_path, "l.html", '<meta charset="iso-8859-1"><p>“quoted” café</p>'.encode("cp1252"))
    slip = write(tmp_path, "u.html", '<meta charset="utf-16"><p>plain café</p>'.encode("utf-8"))
    wrong = write(tmp_path, "w.html", '<meta charset="shift_jis"><p>naïve café</p>'.encode("utf-8"))
    assert "“quoted” café" in read(latin)[0][0][1]
    assert "plain café" in read(slip)[0][0][1]
    assert "naïve café" in read(wrong)[0][0][1]  # valid UTF-8 wins over a wrong label


def test_html_without_visible_text(tmp_path):
    path = write(tmp_path, "a.htm", "<html><script>x()</script></html>")
    assert read(path) == ([], [(str(path), "empty: no visible text in the HTML")])


def test_parquet(tmp_path):
    path = tmp_path / "a.parquet"
    table = pa.table({"id": [1, 2, 3, None, 5], "text": ["a", None, " ", "d", "e"]})
    pq.write_table(table, path, row_group_size=2)
    records, skipped = read(path)
    assert records == [("1", "a"), ("row-4", "d"), ("5", "e")]
    assert [w for w, _ in skipped] == [f"{path}:row 2", f"{path}:row 3"]
    assert keywords(skipped) == ["field", "empty"]


@pytest.mark.parametrize("dictionary", [False, True])
def test_a_parquet_text_over_the_bound_is_skipped_without_a_python_copy(tmp_path, monkeypatch, dictionary):
    """The bound counts characters (a 4-byte emoji is one), and a text over it never
    becomes a Python string: a few KB of Parquet can hold a gigabyte of text."""
    from embedingest.sources import text as text_mod

    monkeypatch.setattr(text_mod, "MAX_LINE_CHARS", 100)
    texts = pa.array(["ok", "\U0001F600" * 100, "y" * 101, "after", None])
    texts = texts.dictionary_encode() if dictionary else texts
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c", "d", "e"], "text": texts}), path)
    records, skipped = read(path)
    assert records == [("a", "ok"), ("b", "\U0001F600" * 100), ("d", "after")]
    assert skipped == [(f"{path}:row 3", "too-large: row 3: 'text' holds more than 100 characters"),
                       (f"{path}:row 5", "field: row 5: 'text' is null")]
    # 30 million characters: Arrow holds them (its own allocator); Python never copies them
    import tracemalloc

    huge = tmp_path / "huge.parquet"
    pq.write_table(pa.table({"text": ["before", "z" * 30_000_000]}), huge, compression="zstd")
    tracemalloc.start()
    try:
        records, skipped = read(huge)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert records == [("row-1", "before")] and keywords(skipped) == ["too-large"]
    assert peak < 5_000_000


def test_parquet_bad_schema_and_corrupt(tmp_path):
    numbers = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    assert keywords(read(numbers)[1]) == ["field"]
    no_text = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["x"]}), no_text)
    assert keywords(read(no_text)[1]) == ["field"]
    assert read(no_text, text_field="body") == ([("row-1", "x")], [])
    corrupt = write(tmp_path, "c.parquet", b"PAR1 not really")
    assert keywords(read(corrupt)[1]) == ["parquet"]


@pytest.mark.parametrize("name", ["big.jsonl", "big.txt", "big.csv"])
def test_50mb_single_line_is_linear(tmp_path, name):
    text = "word " * 10_000_000
    data = {"big.jsonl": json.dumps({"text": text}), "big.txt": text,
            "big.csv": "text\n" + text}[name]
    path = write(tmp_path, name, data)
    start = time.perf_counter()
    records, skipped = read(path)
    assert time.perf_counter() - start < 20
    assert skipped == [] and len(records) == 1 and records[0][1] == text


def _jsonl_lines(n: int, width: int = 0) -> list[bytes]:
    return [json.dumps({"id": i, "text": f"record {i} " + "w" * width}).encode() for i in range(1, n + 1)]


@pytest.mark.parametrize("width", [0, 1000])  # the bad line in the first block, or a later one
def test_undecodable_line_keeps_every_line_before_it(tmp_path, width):
    """Line 100 holds a byte that is neither UTF-8 nor cp1252: lines 1-99 are kept (a text
    decoder once dropped the whole block around it: lines 67-99, unreported)."""
    lines = _jsonl_lines(150, width)
    lines[99] = lines[99].replace(b"record", b"rec\x81ord")
    path = write(tmp_path, "a.jsonl", b"\n".join(lines) + b"\n")
    records, skipped = read(path)
    assert [r for r, _ in records] == [str(i) for i in range(1, 100)]
    assert skipped == [(str(path), "decode: line 100: bytes 81 are neither UTF-8 nor cp1252 (convert the file to UTF-8); "
                                   "the rest of the file is skipped")]


def test_undecodable_row_keeps_every_row_before_it(tmp_path):
    rows = [f'{i},"row {i} {"x" * 900}"'.encode() for i in range(1, 121)]
    rows[89] = rows[89] + b"\x9d"
    path = write(tmp_path, "a.csv", b"id,text\r\n" + b"\r\n".join(rows) + b"\r\n")
    records, skipped = read(path)
    assert [r for r, _ in records] == [str(i) for i in range(1, 90)]
    assert keywords(skipped) == ["decode"] and skipped[0][1].startswith("decode: line 91: ")


def test_undecodable_utf16_keeps_every_line_before_it(tmp_path):
    good = b"".join(line.decode().encode("utf-16-le") + "\n".encode("utf-16-le")
                    for line in _jsonl_lines(200, 500))
    path = write(tmp_path, "a.jsonl", codecs.BOM_UTF16_LE + good + "\ud800".encode("utf-16-le", "surrogatepass")
                 + "oops\n".encode("utf-16-le"))
    records, skipped = read(path)
    assert len(records) == 200 and records[-1][1].startswith("record 200 ")
    assert keywords(skipped) == ["decode"] and "line 201" in skipped[0][1]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_line_ends_across_blocks_as_a_text_file_reads_them(tmp_path, newline):
    """Lines of every length around the block size, so a \\r\\n falls on a block edge."""
    from embedingest.sources import text as text_mod

    lines, size = [], 0
    for i in range(400):
        line = json.dumps({"id": i, "text": "é" * (i % 7) + "v" * (text_mod.STREAM_BLOCK // 97 + i % 13)})
        lines.append(line)
    data = newline.join(line.encode() for line in lines) + newline
    path = write(tmp_path, "a.jsonl", data)
    want = [(str(i), json.loads(line)["text"]) for i, line in enumerate(lines)]
    assert read(path) == (want, [])
    csv_data = b"id,text" + newline + newline.join(f'{i},"a{newline.decode()}b {i}"'.encode()
                                                    for i in range(3000)) + newline
    reference = io.TextIOWrapper(io.BytesIO(csv_data), newline="")
    import csv as csv_mod

    expected = [(row["id"], row["text"]) for row in csv_mod.DictReader(reference)]
    assert read(write(tmp_path, "a.csv", csv_data)) == (expected, [])


def test_a_line_longer_than_the_bound_is_skipped_alone(tmp_path, monkeypatch):
    from embedingest.sources import text as text_mod

    monkeypatch.setattr(text_mod, "MAX_LINE_CHARS", 1000)
    lines = [json.dumps({"id": "a", "text": "short"}), json.dumps({"id": "b", "text": "x" * 300_000}),
             json.dumps({"id": "c", "text": "after"})]
    path = write(tmp_path, "a.jsonl", "\n".join(lines))
    records, skipped = read(path)
    assert records == [("a", "short"), ("c", "after")]
    assert skipped == [(f"{path}:line 2", "too-large: line 2: more than 1000 characters on one "
                                          "line; split the record")]
    csv_path = write(tmp_path, "a.csv", "text\nshort\n" + "y" * 5000 + "\nafter\n")
    records, skipped = read(csv_path)
    assert records == [("row-1", "short")] and keywords(skipped) == ["too-large"]
    assert "line 3" in skipped[0][1] and "rest of the file" in skipped[0][1]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
@pytest.mark.parametrize("name", ["a.txt", "a.jsonl", "a.csv", "a.json", "a.html", "a.parquet",
                                  "a.txt.gz", "a.jsonl.xz"])
def test_a_pipe_is_reported_at_once(tmp_path, name):
    """A file that became a named pipe after it was listed: opening it used to wait for a
    writer, for ever."""
    path = tmp_path / name
    os.mkfifo(path)
    unblock_later(path)
    start = time.monotonic()
    records, skipped = read(path)
    assert time.monotonic() - start < 5
    assert records == [] and skipped == [(str(path), "not a regular file: a named pipe (FIFO)")]


def test_a_device_is_not_read(tmp_path):
    link = tmp_path / "zero.txt"
    link.symlink_to("/dev/zero")
    assert read(link) == ([], [(str(link), "not a regular file: a character device")])


def test_parquet_dictionary_text_and_ids_of_any_type(tmp_path):
    """A dictionary-encoded text column was refused; a binary or timestamp id column
    refused the whole file."""
    import datetime

    texts = pa.array(["alpha", "beta", "alpha", "gamma"]).dictionary_encode()
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": texts, "id": pa.array([b"k1", b"caf\xe9", None, b"k4"])}), path)
    assert read(path) == ([("k1", "alpha"), ("caf\\xe9", "beta"), ("row-3", "alpha"),
                           ("k4", "gamma")], [])
    assert pa.types.is_dictionary(pq.read_schema(path).field("text").type)

    when = [datetime.datetime(2024, 1, 2, 3, 4, 5), datetime.datetime(2024, 1, 2, 3, 4, 6)]
    for kind, ids in [
        (pa.timestamp("ns"), ["2024-01-02 03:04:05.000000000", "2024-01-02 03:04:06.000000000"]),
        (pa.timestamp("us", tz="UTC"), ["2024-01-02 03:04:05.000000Z", "2024-01-02 03:04:06.000000Z"]),
        (pa.date32(), ["2024-01-02", "2024-01-03"]),
    ]:
        stamped = tmp_path / "t.parquet"
        values = [(w + datetime.timedelta(days=i)).date() for i, w in enumerate(when)] if kind == pa.date32() else when
        pq.write_table(pa.table({"id": pa.array(values, kind), "text": ["one", "two"]}), stamped)
        assert read(stamped) == (list(zip(ids, ["one", "two"])), []), kind
    nested = tmp_path / "n.parquet"
    pq.write_table(pa.table({"id": [[1, 2], None], "text": pa.array(["x", "y"], pa.large_string())}), nested)
    assert read(nested) == ([("[1,2]", "x"), ("row-2", "y")], [])
    flags = tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": [True, False], "text": ["x", "y"]}), flags)
    assert read(flags) == ([("true", "x"), ("false", "y")], [])  # as the file spells them, not Python's True
    lines = write(tmp_path, "b.jsonl", b'{"id": true, "text": "x"}\n{"id": [false, 1.5], "text": "y"}\n')
    assert read(lines) == ([("true", "x"), ("[false,1.5]", "y")], [])


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_a_large_text_file_streams_and_is_skipped_whole_when_it_does_not_decode(tmp_path, suffix):
    """Past ``stream_above`` a text file comes as a TextStream, read a block at a time;
    bytes that do not decode at its end skip it whole (as a small file), not after
    everything before them was indexed."""
    import gzip

    from embedingest.sources.text import TextStream

    text = "naïve words and more words\n" * 40_000
    pack = gzip.compress if suffix else (lambda b: b)
    good = write(tmp_path, "big.txt" + suffix, pack(b"\xef\xbb\xbf" + text.encode()))
    skipped = []
    (rid, stream), = iter_records(good, on_skip=lambda w, r: skipped.append((w, r)),
                                  stream_above=2**16)
    assert rid == "" and isinstance(stream, TextStream) and "".join(stream) == text
    assert skipped == []
    bad = write(tmp_path, "bad.txt" + suffix, pack(text.encode() + b"\x81 tail"))
    records, skipped = read(bad, stream_above=2**16)
    assert records == [] and keywords(skipped) == ["decode"]
    assert f"after character {len(text)}" in skipped[0][1]
    utf16 = write(tmp_path, "u.md" + suffix, pack(text.encode("utf-16")))
    (_, stream), = iter_records(utf16, stream_above=2**16)
    assert "".join(stream) == text
    # changed after that check: the stream keeps what came before, and says where it ended
    ended = []
    assert "".join(TextStream(bad, lambda w, r: ended.append((w, r)))) == text
    assert ended == [(str(bad), f"decode: bytes 81 are neither UTF-8 nor cp1252 (convert the file to UTF-8) after character "
                                f"{len(text)}; the rest of the file is skipped")]


def test_a_record_id_given_again_in_a_file_is_skipped_and_reported_where(tmp_path):
    """A hit names its record by id and its span is in that record's text: a later record
    of the same file with an id given before (explicitly, or an id that is another
    record's default) is skipped with its place, in every format with ids; other files
    may reuse the id."""
    dup = "the id {!r} is that of an earlier record of this file; only the first is indexed"
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"id": "r1", "text": "one"}, {"id": "r2", "text": "two"}, {"id": "r1", "text": "again"},
        {"id": "r3", "text": ""}, {"id": "r3", "text": "three"}, {"text": "no id"},
        {"id": "line-6", "text": "another's default"}]) + "\n", encoding="utf-8")
    assert read(jsonl) == ([("r1", "one"), ("r2", "two"), ("r3", "three"), ("line-6", "no id")], [
        (f"{jsonl}:line 3", "duplicate: line 3: " + dup.format("r1")),
        (f"{jsonl}:line 4", "empty: line 4: 'text' is empty"),
        (f"{jsonl}:line 7", "duplicate: line 7: the id 'line-6' was made from the position of an earlier "
                            "record of this file that had none; give that record an id, or this one another")])
    made_second = tmp_path / "made.jsonl"  # an id given first, then a record without one that makes it
    made_second.write_text('{"id": "line-2", "text": "a"}\n{"id": null, "text": "b"}\n', encoding="utf-8")
    assert read(made_second) == ([("line-2", "a")], [
        (f"{made_second}:line 2", "duplicate: line 2: the record has no id, and the one made from its "
                                  "position, 'line-2', is the id of an earlier record of this file; give it an id")])
    items = tmp_path / "b.json"
    items.write_text(json.dumps([{"id": 7, "text": "a"}, {"id": "7", "text": "b"}]), encoding="utf-8")
    assert read(items) == ([("7", "a")], [(f"{items}:item 2", "duplicate: item 2: " + dup.format("7"))])
    rows = tmp_path / "c.csv"
    rows.write_text("id,text\nk,one\nk,two\n", encoding="utf-8")
    assert read(rows) == ([("k", "one")], [(f"{rows}:row 2", "duplicate: row 2 (line 3): " + dup.format("k"))])
    table = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": [5, 6, 5], "text": ["x", "y", "z"]}), table)
    assert read(table) == ([("5", "x"), ("6", "y")], [(f"{table}:row 3", "duplicate: row 3: " + dup.format("5"))])
    other = tmp_path / "e.jsonl"
    other.write_text(json.dumps({"id": "r1", "text": "one elsewhere"}) + "\n", encoding="utf-8")
    assert read(other) == ([("r1", "one elsewhere")], [])
    long_id = "x" * 300
    again = tmp_path / "f.jsonl"
    again.write_text(json.dumps({"id": long_id, "text": "a"}) + "\n" + json.dumps({"id": long_id, "text": "b"}) + "\n",
                     encoding="utf-8")
    assert read(again)[1] == [(f"{again}:line 2", "duplicate: line 2: " + dup.format("x" * 200 + "..."))]


def test_an_empty_or_blank_id_is_no_id_in_every_format(tmp_path):
    """Exports write a missing id as ``""``: every record after the first with it was
    skipped as a duplicate of it, and the first was indexed under the id ``""``, a
    whole file's (a hit named the file, not the record). An id of whitespace only is now
    no id, in every format: the record's position names it."""
    jsonl = write(tmp_path, "a.jsonl", '{"id": "", "text": "one"}\n{"id": "", "text": "two"}\n'
                                       '{"id": " \\t", "text": "three"}\n{"id": "k", "text": "four"}\n')
    assert read(jsonl) == ([("line-1", "one"), ("line-2", "two"), ("line-3", "three"), ("k", "four")], [])
    items = write(tmp_path, "b.json", json.dumps([{"id": "", "text": "a"}, {"id": "  ", "text": "b"}]))
    assert read(items) == ([("item-1", "a"), ("item-2", "b")], [])
    rows = write(tmp_path, "c.csv", 'id,text\n,a\n" ",b\n')
    assert read(rows) == ([("row-1", "a"), ("row-2", "b")], [])
    table = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ["", " ", "z"], "text": ["x", "y", "w"]}), table)
    assert read(table) == ([("row-1", "x"), ("row-2", "y"), ("z", "w")], [])


def test_past_the_ids_kept_a_file_s_later_ids_are_checked_against_the_first_ones_and_the_log_says_so(
        tmp_path, monkeypatch, caplog):
    """The ids of a file's first MAX_IDS_CHECKED records are kept (memory stays bounded
    whatever the file's size): a later repeat of one of them is still skipped, a repeat of
    a later id is not found, and the log says once which file that is."""
    from embedingest.sources import text as text_module

    monkeypatch.setattr(text_module, "MAX_IDS_CHECKED", 3)
    path = tmp_path / "big.jsonl"
    exactly = tmp_path / "three.jsonl"
    exactly.write_text("".join(json.dumps({"id": i, "text": "t"}) + "\n" for i in "abc"), encoding="utf-8")
    with caplog.at_level("WARNING", logger="embedingest"):
        assert len(read(exactly)[0]) == 3
    assert not caplog.records
    ids = ["a", "b", "c", "d", "a", "d", "e"]
    path.write_text("".join(json.dumps({"id": i, "text": f"text {n}"}) + "\n" for n, i in enumerate(ids)),
                    encoding="utf-8")
    with caplog.at_level("WARNING", logger="embedingest"):
        records, skipped = read(path)
    assert [rid for rid, _ in records] == ["a", "b", "c", "d", "d", "e"]
    assert [w for w, _ in skipped] == [f"{path}:line 5"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: more than 3 records; the ids of later records are checked against those of the first 3 only"]


def test_a_pdf_read_in_parts_gives_its_pages_once_and_its_problems_once(tmp_path):
    """A PDF is splittable: its parts' pages in order are the whole file's, and what is
    wrong with the file as a whole (damaged, locked, too large) is told by part 0 only."""
    from pdf_fixtures import make_pdf

    from embedingest.sources.text import splittable

    path = write(tmp_path, "book.pdf", make_pdf([f"Chapter {i} of the river." if i % 3 else None
                                                 for i in range(10)]))
    assert splittable(path) and not splittable(tmp_path / "book.pdf.gz")
    size = path.stat().st_size
    whole = read(path)
    parts = [read(path, part=(p, 3, size)) for p in range(3)]
    assert [r for records, _ in parts for r in records] == whole[0] and len(whole[0]) == 6
    assert all(s == [] for _, s in parts)
    damaged = write(tmp_path, "cut.pdf", make_pdf(["cut short"])[:200])
    locked = write(tmp_path, "locked.pdf", make_pdf(["x"], user_password="secret", owner_password="o"))
    for bad in (damaged, locked):
        told = [read(bad, part=(p, 3, 1000)) for p in range(3)]
        assert told[0][0] == [] and [r.split(":")[0] for _, r in told[0][1]] == [read(bad)[1][0][1].split(":")[0]]
        assert told[1] == told[2] == ([], [])

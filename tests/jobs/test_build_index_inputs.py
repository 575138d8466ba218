"""build-index end to end on the inputs that were once lost or merged without a word:
duplicate record ids (in memory and in a file), file names that differ only as bytes vs escapes, NUL characters."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedingest import build_index, open_index
from embedingest.errors import ConfigError
from embedingest.index.shard_store import ShardStore
from embedingest.jobs.build_index import unit_key

FAST = dict(num_workers=0, num_consumers=1, batch_size=8)
TEXTS = ["Strong coffee keeps the night shift awake.", "Green tea is brewed at eighty degrees.",
         "Glaciers carve deep valleys into the mountains."]


@pytest.mark.parametrize("records, rid, first, second", [
    ([("same", TEXTS[0]), ("same", TEXTS[1]), {"id": "same", "text": TEXTS[2]}], "same", 0, 1),
    ([("x", TEXTS[0]), ("same", TEXTS[1]), {"id": "same", "text": TEXTS[2]}], "same", 1, 2),
    ([(1, TEXTS[0]), ("1", TEXTS[1])], "1", 0, 1),
    ([{"text": TEXTS[0]}, {"id": 0, "text": TEXTS[1]}], "0", 0, 1),  # a position is an id too
])
def test_duplicate_record_ids_are_an_error_before_anything_is_written(tmp_path, records, rid,
                                                                       first, second):
    out = tmp_path / "mem"
    with pytest.raises(ConfigError) as err:
        build_index(iter(records), out=str(out), **FAST)
    assert f"record id {rid!r} is given twice, by records {first} and {second}" in str(err.value)
    assert not out.exists()


def test_records_without_ids_are_numbered_by_position_and_all_kept(tmp_path):
    out = tmp_path / "mem"
    records = [(None, TEXTS[0]), {"id": None, "text": TEXTS[1]}, {"text": TEXTS[2]}]
    s = build_index(records, out=str(out), **FAST)
    assert (s["exit_code"], s["units_indexed"], s["chunks"]) == (0, 3, 3)
    hits = open_index(out).search(TEXTS, k=1)
    assert [(h[0].record_id, h[0].text) for h in hits] == [("0", TEXTS[0]), ("1", TEXTS[1]),
                                                           ("2", TEXTS[2])]


def test_a_record_id_given_again_in_a_file_is_reported_and_its_first_record_kept(tmp_path):
    """A JSON lines file whose third record repeats the first one's id: the first is
    indexed and found under that id, the repeat is in the report with its line (before,
    both were indexed under one id, each hit's span pointing into either text)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [{"id": "a", "text": TEXTS[0]}, {"id": "b", "text": TEXTS[1]}, {"id": "a", "text": TEXTS[2]}]
    (corpus / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    s = build_index(str(corpus), out=str(tmp_path / "ix"), **FAST)
    assert (s["exit_code"], s["chunks"], s["skipped_by_reason"]) == (3, 2, {"duplicate": 1})
    report = [json.loads(line) for line in (tmp_path / "ix" / "skipped.jsonl").read_text().splitlines()]
    assert [(r["path"], r["reason"]) for r in report] == [
        (f"{corpus / 'r.jsonl'}:line 3", "duplicate: line 3: the id 'a' is that of an earlier record "
                                         "of this file; only the first is indexed")]
    hits = open_index(tmp_path / "ix").search(TEXTS, k=3)
    assert {(h.record_id, h.text) for h in hits[2]} == {("a", TEXTS[0]), ("b", TEXTS[1])}


@pytest.mark.parametrize("name, key", [
    ("notes/café.txt", "notes/café.txt"),  # an ordinary name is its own key
    ("a b/东京 (1).md", "a b/东京 (1).md"),
    ("caf\udce9.txt", "caf\\xe9.txt"),  # byte 0xE9, not UTF-8
    ("caf\\xe9.txt", "caf\\\\xe9.txt"),  # a literal backslash
    ("a\\\udcff", "a\\\\\\xff"),
])
def test_unit_key(name, key):
    assert unit_key(name) == key


def _name_bytes(key: str) -> bytes:
    """The file name a key was made from: the inverse of unit_key, so it is injective."""
    out, i = bytearray(), 0
    while i < len(key):
        if key.startswith("\\\\", i):
            out += b"\\"
            i += 2
        elif key.startswith("\\x", i):
            out.append(int(key[i + 2:i + 4], 16))
            i += 4
        else:
            out += key[i].encode("utf-8")
            i += 1
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=12).map(lambda b: b.replace(b"\0", b"")))
def test_unit_key_is_injective(name):
    assert _name_bytes(unit_key(os.fsdecode(name))) == name


def test_a_byte_name_and_its_escaped_spelling_are_two_files(tmp_path):
    """``caf<0xE9>.txt`` and a file literally named ``caf\\xe9.txt``: once indexed as one."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    try:
        Path(os.fsdecode(bytes(corpus) + b"/caf\xe9.txt")).write_text(TEXTS[0])
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    (corpus / "caf\\xe9.txt").write_text(TEXTS[1])
    out = tmp_path / "idx"
    s = build_index(corpus, out=str(out), **FAST)
    assert (s["exit_code"], s["units_seen"], s["units_indexed"], s["chunks"]) == (0, 2, 2, 2)
    with ShardStore(out) as store:
        assert sorted(store.units()) == ["caf\\\\xe9.txt", "caf\\xe9.txt"]
    hits = open_index(out).search(TEXTS[:2], k=1)
    assert [(h[0].source, h[0].text) for h in hits] == [("caf\\xe9.txt", TEXTS[0]),
                                                        ("caf\\\\xe9.txt", TEXTS[1])]
    assert build_index(corpus, out=str(out), **FAST)["units_unchanged"] == 2


def test_a_nul_character_is_stored_as_the_replacement_character(tmp_path):
    """``alpha\\0beta gamma`` was stored as ``alpha`` (the store cuts text at NUL) while
    its span said 16 characters: NUL is read as U+FFFD, so the stored text is the span of
    the text as read, and the tokens (BERT drops both characters) are the same."""
    text = "alpha\u0000beta gamma"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    sources = {"r.jsonl": "jsonl " + text, "big.txt": "x " * 5000 + text}  # past the 8 KiB check
    (corpus / "r.jsonl").write_text(json.dumps({"id": "n\u0000l", "text": sources["r.jsonl"]}))
    (corpus / "big.txt").write_text(sources["big.txt"])
    for name, corpus_or_records in [("mem", [("m\u0000", text)]), ("files", corpus)]:
        out = tmp_path / name
        s = build_index(corpus_or_records, out=str(out), **FAST)
        assert s["exit_code"] == 0 and s["skipped"] == 0
        hits = open_index(out).search([text], k=s["vectors_total"])[0]
        assert len(hits) == s["vectors_total"]
        with_nul = 0
        for hit in hits:
            source = text if name == "mem" else sources[hit.source]
            span = source[hit.char_start:hit.char_end]
            assert hit.text == span.replace("\u0000", "\ufffd")
            with_nul += "\u0000" in span
        assert with_nul == (1 if name == "mem" else 2)
        ids = {h.record_id for h in hits}
        assert ids == ({"m\ufffd"} if name == "mem" else {"n\ufffdl", ""})


_PEAK = ("import resource, subprocess, sys\n"
         "rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
         "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")


def _cli_peak_rss(args: list[str]) -> tuple[int, int]:
    """``(exit code, peak RSS in bytes of the largest process of the run)``: the CLI in a
    process of its own, whose waited-for descendants (DataLoader workers and consumers
    included) are all its children's rusage."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-m", "embedingest", *args],
                         capture_output=True, text=True, env=env, timeout=600, check=True)
    rc, kib = out.stdout.split()
    return int(rc), int(kib) * 1024


@pytest.mark.slow
def test_decompression_bombs_build_in_bounded_memory_and_rebuild(tmp_path):
    """The issue's compressed files, smaller (the bound does not depend on their size:
    tests/sources/test_text_dataset.py shows it): a .txt.gz of ``a\\x01\\x01\\x01\\x01\\x01``
    repeated and one of ``aaaa...`` once made 25 MB chunks, 4 GB peaks and then
    ``sqlite3.DataError: string or blob too big``, in every later build too. They are
    past STREAM_ABOVE, so they are read a block at a time: every chunk holds at most
    8,192 characters, the largest process needs no more than for an ordinary file, and
    the next build finds everything unchanged."""
    import gzip

    from embedingest.index.shard_store import ShardStore

    base, corpus = tmp_path / "base", tmp_path / "corpus"
    for folder in (base, corpus):
        folder.mkdir()
        (folder / "note.txt").write_text(" ".join(TEXTS * 20))
    with gzip.open(corpus / "bomb.txt.gz", "wb", compresslevel=9) as fh:
        for _ in range(16):
            fh.write(b"a\x01\x01\x01\x01\x01" * 2**16)
    with gzip.open(corpus / "aaaa.txt.gz", "wb", compresslevel=9) as fh:
        fh.write(b"a" * 8 * 2**20)
    assert (corpus / "bomb.txt.gz").stat().st_size < 2**16
    args = ["--device", "cpu", "--num-workers", "1", "--num-consumers", "1"]
    rc, base_peak = _cli_peak_rss(["build-index", str(base), "--out", str(tmp_path / "i0"), *args])
    assert rc == 0
    out = tmp_path / "idx"
    rc, peak = _cli_peak_rss(["build-index", str(corpus), "--out", str(out), *args])
    assert rc == 0
    assert peak < base_peak + 256 * 2**20, (peak, base_peak)  # read whole: about +350 MiB
    with ShardStore(out) as store:
        units = store.units()
        ids = [int(i) for s in store.shards() for i in s.ids()]
        rows = store.chunks(ids)
    assert {k: u.status for k, u in units.items()} == dict.fromkeys(
        ["aaaa.txt.gz", "bomb.txt.gz", "note.txt"], "done")
    assert len(rows) == len(ids) == sum(u.n_chunks for u in units.values())
    assert units["aaaa.txt.gz"].n_chunks == 8 * 2**20 // 8192
    assert units["bomb.txt.gz"].n_chunks == 6 * 2**20 // 8192
    assert max(len(r.text) for r in rows.values()) <= 8192
    assert all(len(r.text) == r.char_end - r.char_start for r in rows.values())
    again = build_index(corpus, out=str(out), num_workers=0, num_consumers=1)
    assert (again["exit_code"], again["units_unchanged"], again["chunks"]) == (0, 3, 0)


def _readme_library_snippet() -> str:
    """The README's first Python block that calls build_index, as a user would copy it."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    return next(b for b in blocks if "build_index(" in b and "open_index" in b)


def _run_script(tmp_path: Path, code: str):
    import subprocess
    import sys

    (tmp_path / "corpus").mkdir(exist_ok=True)
    for i, text in enumerate(TEXTS):
        (tmp_path / "corpus" / f"d{i}.txt").write_text(text)
    (tmp_path / "snippet.py").write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.mark.slow
def test_the_readme_library_snippet_runs_as_a_script(tmp_path):
    """Saved as a script and run, the snippet once failed with ConsumerDied: the spawned
    consumers imported the unguarded script and started the build again."""
    snippet = _readme_library_snippet()
    assert 'if __name__ == "__main__":' in snippet
    run = _run_script(tmp_path, snippet)
    assert run.returncode == 0, run.stderr[-3000:]
    hits = run.stdout.splitlines()
    assert len(hits) == len(TEXTS) and hits[0].startswith("1 ")
    assert {line.split()[2] for line in hits} == {f"d{i}.txt" for i in range(len(TEXTS))}
    assert (tmp_path / "indexes" / "mem" / "manifest.json").is_file()


@pytest.mark.slow
def test_an_unguarded_script_builds_as_the_guarded_one(tmp_path):
    """build_index's consumers run a package's sink and start without importing the script
    (engine.lean_spawn): the snippet without its guard builds the same index, where its
    consumers once imported it and stopped the run with ConsumerDied."""
    import textwrap

    lines = _readme_library_snippet().splitlines(keepends=True)
    guard = next(i for i, line in enumerate(lines) if line.startswith("if __name__"))
    unguarded = "".join(lines[:guard]) + textwrap.dedent("".join(lines[guard + 1:]))
    run = _run_script(tmp_path, unguarded)
    assert run.returncode == 0, run.stderr[-3000:]
    hits = run.stdout.splitlines()
    assert len(hits) == len(TEXTS) and hits[0].startswith("1 ")
    assert {line.split()[2] for line in hits} == {f"d{i}.txt" for i in range(len(TEXTS))}


def test_a_corpus_inside_the_index_s_own_folders_is_refused_before_any_work(tmp_path):
    """``build-index p7/shards --out p7`` read the shard files it had written as documents:
    4, 8, 12, 16 vectors on four runs, every hit more than once. A corpus that is, or is
    inside, a folder the index writes (shards/, .overwritten/) is refused, naming both,
    before anything is written; a folder of the user's inside the index folder is a
    corpus as any other."""
    from embedingest.jobs.build_index.plan import refuse_corpus_in_index

    out = tmp_path / "p7"
    for corpus in (out / "shards", out / "shards" / "sub", out / ".overwritten" / "shards"):
        corpus.mkdir(parents=True, exist_ok=True)
        (corpus / "a.txt").write_text(TEXTS[0])
    cases = [(out / "shards", "is", "shards"), (out / "shards" / "sub", "is inside", "shards"),
             (out / "shards" / "a.txt", "is inside", "shards"),
             (out / ".overwritten" / "shards", "is inside", ".overwritten")]
    for corpus, where, folder in cases:
        with pytest.raises(ConfigError) as err:
            build_index(str(corpus), out=str(out), **FAST)
        assert str(err.value) == (
            f"corpus {str(corpus)!r} {where} {str(out / folder)!r}, a folder the index {str(out)!r} writes: its "
            "shard files would be read as documents on every run; move the documents to a folder of their "
            "own, or give another --out")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        ".overwritten", ".overwritten/shards", ".overwritten/shards/a.txt", "shards", "shards/a.txt", "shards/sub",
        "shards/sub/a.txt"]
    (out / "docs").mkdir()
    refuse_corpus_in_index(out / "docs", out)  # no error


def test_an_index_s_own_file_as_its_corpus_and_an_out_in_another_index_s_shards_are_refused(tmp_path):
    """``build-index s/manifest.json --out s`` made the manifest the index's only document
    and removed every unit it held; ``--out s/shards/sub`` made an index inside another's
    shards folder. Both are refused before anything is written."""
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXTS[0])
    out = tmp_path / "s"
    assert build_index(str(corpus), out=str(out), **FAST)["units_indexed"] == 1
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    for own in ("manifest.json", "skipped.jsonl"):
        (out / own).touch()
        with pytest.raises(ConfigError) as err:
            build_index(str(out / own), out=str(out), **FAST)
        assert str(err.value) == (
            f"corpus {str(out / own)!r} is a file of the index {str(out)!r} itself: read as the corpus, it would "
            "be the index's only document, and every unit the index holds would be removed; give the "
            "documents' folder or file as the corpus")
    inner = out / "shards" / "sub"
    with pytest.raises(ConfigError) as err:
        build_index(str(corpus), out=str(inner), **FAST)
    assert str(err.value) == (f"--out {str(inner)!r} is inside {str(out / 'shards')!r}, the shards folder of the "
                              f"index {str(out)!r}, whose builds delete what they did not write there: give an "
                              "--out outside it")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    assert len(open_index(out)) == 1

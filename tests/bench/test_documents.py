"""The long-document benchmark (``bench text --corpus documents``): its windows are the
chunker's, its memory sampler sees a child's pages, and the command writes every row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from embedingest.bench import documents, floor
from embedingest.cli import main
from embedingest.stages.chunker import Chunker
from embedingest.stages.tokenizer import load_tokenizer

DOCS = [
    ("The engine copies each batch's outputs into pinned host buffers on its own stream, and "
     "consumer processes write them out while the GPU runs the next batches. ") * 40,
    "Short note: FAISS shards hold the vectors; a Parquet table holds each chunk's source and span.\n" * 25,
    "ünïcödé, CJK 東京都 and emoji \U0001F600 in a document that is cut into several windows. " * 30,
]


def test_windows_are_the_chunkers_chunks(tmp_path):
    """The forward-alone row must run the chunks build-index makes: the same ids, and texts
    that are the chunks' spans."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(DOCS):
        (folder / f"d{i}.txt").write_text(text, encoding="utf-8")
    tokenizer = load_tokenizer(None)
    windows, texts = documents.chunk_windows(folder, tokenizer, 64, 8)
    chunker = Chunker(tokenizer, 64, 8)
    expected = [c for text in DOCS for c in chunker.chunk(text)]
    assert [list(c.input_ids) for c in expected] == windows
    assert [text[c.char_start:c.char_end] for text in DOCS for c in chunker.chunk(text)] == texts
    assert len(windows) > 3 * len(DOCS)  # long enough to give several windows each


def test_the_floor_reads_back_the_batches_it_was_given(tmp_path):
    """The floor's process must run exactly the forward alone's batches: ids and masks read
    back from its file equal :func:`documents.sorted_batches`'s."""
    windows = [[101, *range(1000, 1000 + n), 102] for n in (0, 3, 17, 40, 5, 1)]
    batches = documents.sorted_batches(windows, 4)
    floor.save_batches(tmp_path / "b.npz", batches)
    back = list(floor.load_batches(tmp_path / "b.npz"))
    assert len(back) == len(batches) == 2
    for (ids, mask), (ids2, mask2) in zip(batches, back):
        assert ids2.dtype == ids.dtype and mask2.dtype == mask.dtype
        assert ids2.equal(ids) and mask2.equal(mask)


def test_memory_of_the_process_tree_counts_a_child(tmp_path):
    """The child's share is the tree's PSS less the test process's own, read back to back:
    the test process's own PSS drifts (file pages reclaimed under memory pressure), so a
    before-and-after difference of the whole tree would measure that drift too."""
    code = ("import sys, time; x = bytearray(256 * 2**20); x[::4096] = b'\\1' * len(x[::4096]); "
            "print('ready', flush=True); time.sleep(60)")
    me = os.getpid()
    alone = documents._tree_pss(me) - documents._pss(me)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        own_child = documents._pss(child.pid)
        with_child = documents._tree_pss(me) - documents._pss(me)
    finally:
        child.kill()
        child.wait()
    assert 200 * 2**20 <= own_child <= 400 * 2**20  # its 256 MB (less any reclaimed), its interpreter
    assert with_child - alone >= own_child - 16 * 2**20


@pytest.mark.slow
def test_bench_text_documents_on_the_cpu_writes_its_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "build_corpus", lambda size: DOCS)
    path = tmp_path / "bench.json"
    t0 = time.perf_counter()
    r = CliRunner().invoke(main, ["bench", "text", "--corpus", "documents", "--mb", "0.1", "--device", "cpu",
                                  "--st-sample", "30", "--batch-size", "16", "--json", str(path),
                                  "--num-workers", "1", "--num-consumers", "1",
                                  "--trace", str(tmp_path / "trace.json")])
    assert r.exit_code == 0, r.output
    assert "| loop | chunks/s | x bound | x sentence-transformers |" in r.stdout
    data = json.loads(path.read_text())
    rows = {row["kind"]: row for row in data["rows"]}
    assert set(rows) == {"engine", "floor", "bound", "reference"}
    engine, floor, bound, st = rows["engine"], rows["floor"], rows["bound"], rows["reference"]
    assert engine["chunks"] == bound["chunks"] > 3 * len(DOCS)  # build-index made the same chunks
    # the floor ran the same chunks in a process of its own, paying for its interpreter and torch
    assert floor["chunks"] == bound["chunks"] and floor["vs_bound"] < 1.0
    assert "embedingest.bench.floor" in floor["command"] and "vectors_mb" not in floor
    assert st["chunks"] == min(30, bound["chunks"]) and bound["vs_bound"] == 1.0 and st["vs_st"] == 1.0
    assert engine["vectors_mb"] == engine["chunks"] * 384 * 4 / 2**20
    assert 50 < engine["peak_pss_mb"] < 8192  # the command's processes were sampled
    assert 0 < engine["startup"]["to_first_batch_s"] < engine["seconds"] <= time.perf_counter() - t0
    assert engine["startup"]["after_return_s"] > 0  # the command's exit, not counted
    assert data["documents"]["documents"] == len(DOCS) and data["config"]["device"] == "cpu"
    (summary,) = data["build_index_summaries"]
    assert summary["device"] == "cpu" and summary["vectors_total"] == engine["chunks"]
    # the build-index options given reach the command (they were dropped for documents)
    assert summary["engine"]["num_consumers"] == 1 and "--num-workers 1" in engine["command"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert sum(e.get("cat") == "consumer" for e in trace["traceEvents"]) == summary["engine"]["batches"]


def test_startup_counts_the_time_before_the_call_on_the_command_s_clock():
    """With the call's start on the clock the command was started on, the time before
    the call is exact and the exit after it is left out; without it, the old estimate."""
    summary = {"seconds": 10.0, "started": 102.5, "phases": {"import_s": 1.0, "plan_s": 0.5,
                                                              "load_model_s": 1.0, "encode_s": 7.0},
               "timing": {"start_s": 0.1, "first_batch_s": 0.2, "first_forward_s": 0.3}}
    exact = documents.startup(13.0, summary, t0=100.0)
    assert exact["before_call_s"] == 2.5 and exact["after_return_s"] == 0.5
    assert exact["to_first_batch_s"] == 2.5 + 1.0 + 0.5 + 1.0 + 0.1 + 0.2
    rough = documents.startup(13.0, summary)
    assert rough["before_call_s"] == 3.0 and rough["after_return_s"] is None

"""Faults of the input side through the real CLI: Ctrl-C in the middle of a full CPU
batch, and a file that turns into a named pipe after the run planned it."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from fault_helpers import WORDS, check_index_files, stop_bound, wait_for


def _long_corpus(root: Path, n: int = 12) -> Path:
    """Files long enough that every chunk is full (256 tokens) and every batch too."""
    rng = random.Random(0)
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"d{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(8000)))
    return root


@pytest.mark.slow
def test_ctrl_c_during_a_full_cpu_batch_exits_130_within_5_s(cli, tmp_path):
    """The default CPU batch (256 chunks of 256 tokens) takes seconds to encode. Ctrl-C
    while it is encoded once took 6.6 s: the DataLoader worker took the Ctrl-C too, left
    its loop and waited at exit to flush its queue, so the loader's shutdown waited its
    5 s for it; and the interpreter's last garbage collection (torch, transformers) took
    seconds more on a loaded machine. The worker now leaves Ctrl-C to the main process,
    and the command exits without that collection."""
    bound = stop_bound("embedingest.jobs.build_index")  # 5 s, more on a machine slower now
    corpus = _long_corpus(tmp_path / "corpus")
    out = tmp_path / "idx"
    run = cli("build-index", corpus, "--out", out, "--device", "cpu", "--num-workers", "1",
              "--num-consumers", "1", "--json")
    wait_for(lambda: run.consumers() or not run.running(), 180, what="the engine's consumers")
    wait_for(lambda: run.loader_workers() or not run.running(), 60, what="the loader worker")
    time.sleep(3.0)  # the first batch is tokenized and its forward under way
    assert run.running() and not list((out / "segments").glob("seg-*.faiss")), run.describe()
    run.signal_group(signal.SIGINT)
    t0 = time.monotonic()
    rc = run.wait(60)
    took = time.monotonic() - t0
    assert rc == 130, run.describe()
    assert took < bound, f"the run took {took:.1f} s to stop (bound {bound:.1f} s)"
    assert "interrupted:" in run.stderr and "Traceback" not in run.stderr, run.describe()
    run.assert_no_leftovers()
    check_index_files(out)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_file_replaced_by_a_pipe_after_planning_is_reported_not_waited_for(tmp_path):
    """Planned as a regular file, then replaced by a named pipe before it is read (or
    hashed): the run once hung until it was killed. It now reports the file as ``not a
    regular file`` and indexes the rest."""
    import subprocess
    import sys

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"d{i}.txt").write_text(" ".join(WORDS[i:i + 12]))
    (corpus / "pipe.jsonl").write_text('{"text": "soon a pipe"}\n')  # a pipe before the plan lists it
    (corpus / "later.txt").write_text("soon a pipe as well")
    out = tmp_path / "idx"
    script = f"""
import os
from embedingest.jobs import build_index as job

plan_units = job.plan_units

def plan_then_swap(store, candidates, report, *within):
    def swapped():
        for cand in candidates:
            if cand["key"] == "pipe.jsonl":  # listed as a file, a pipe before anything reads it
                os.unlink(cand["path"]); os.mkfifo(cand["path"])
            yield cand
    plan = plan_units(store, swapped(), report, *within)
    later = {str(corpus / "later.txt")!r}
    os.unlink(later); os.mkfifo(later)  # planned, then a pipe before it is read
    return plan

job.plan_units = plan_then_swap
summary = job.build_index({str(corpus)!r}, out={str(out)!r}, num_workers=0, num_consumers=1)
print(summary["exit_code"], summary["units_indexed"], summary["chunks"])
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["3", "5", "3"]  # the pipes are units with no chunks
    report = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert sorted((Path(r["path"]).name, r["reason"]) for r in report) == [
        ("later.txt", "not a regular file: a named pipe (FIFO)"),
        ("pipe.jsonl", "not a regular file: a named pipe (FIFO)")]

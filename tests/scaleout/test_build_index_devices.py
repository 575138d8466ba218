"""build-index --devices on two CPU processes: the same index as one process, one manifest."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from corpus_fixtures import TOPICS as ALL_TOPICS
from corpus_fixtures import chunk_rows, vectors_by_id

from embedingest import build_index, open_index
from embedingest.cli import main
from embedingest.index.shard_store import ShardStore

TOPICS = ALL_TOPICS[:8]
FAST = {"num_workers": 0, "num_consumers": 2, "batch_size": 8, "chunk_tokens": 48, "overlap": 8}


def make_corpus(root: Path) -> Path:
    """Files of very different sizes, so a split by count would be unbalanced."""
    root.mkdir(parents=True)
    with open(root / "big.jsonl", "w") as fh:
        for i in range(12):
            text = " ".join(TOPICS[i % 8:] + TOPICS[:i % 8])
            fh.write(json.dumps({"id": f"b{i}", "text": text}) + "\n")
    for i, text in enumerate(TOPICS):
        (root / f"small{i}.md").write_text(text)
    (root / "empty.txt").write_text("   \n")
    return root


def test_two_cpu_devices_build_the_single_process_index(tmp_path, no_leaks):
    corpus = make_corpus(tmp_path / "corpus")
    one, two = tmp_path / "one", tmp_path / "two"
    s1 = build_index(corpus, out=str(one), **FAST)
    s2 = build_index(corpus, out=str(two), devices="cpu,cpu", **FAST)

    for key in ("units_seen", "units_indexed", "docs", "chunks", "vectors_total", "skipped",
                "skipped_by_reason", "exit_code"):
        assert s2[key] == s1[key], key
    assert s1["chunks"] > 30 and s1["skipped"] == 1 and s1["exit_code"] == 3
    assert s2["device"] == "cpu,cpu"
    per_device = s2["engine"]["per_device"]
    assert len(per_device) == 2 and all(d["batches"] > 0 for d in per_device)
    assert s2["engine"]["batches"] == sum(d["batches"] for d in per_device)

    v1, v2 = vectors_by_id(one), vectors_by_id(two)
    assert sorted(v1) == sorted(v2)
    diff = max(float(np.abs(v1[i] - v2[i]).max()) for i in v1)
    assert diff <= 1e-5, diff
    assert chunk_rows(one, v1) == chunk_rows(two, v2)
    with ShardStore(one) as store:
        units_one = {k: (u.unit_no, u.n_chunks, u.status) for k, u in store.units().items()}
    with ShardStore(two) as store:
        units_two = {k: (u.unit_no, u.n_chunks, u.status) for k, u in store.units().items()}
        listed = [(s.name, s.count) for s in store.shards()]
    assert units_two == units_one

    manifest = json.loads((two / "manifest.json").read_text())
    assert [(s["name"], s["count"]) for s in manifest["segments"]] == listed
    runs = {re.match(r"shard-(.+)-w\d+-\d+", name).group(1) for name, _ in listed}
    assert len(runs) == 2 and {r[-3:] for r in runs} == {"_d0", "_d1"}
    assert json.loads((one / "manifest.json").read_text())["corpus"] == manifest["corpus"]

    with open_index(two) as index:
        for text, hits in zip(TOPICS, index.search(TOPICS, k=2)):
            assert hits[0].text == text and hits[0].source.startswith("small")

    # the CLI resumes with the same option: only the changed file is redone
    (corpus / "small3.md").write_text("Quantum computers use qubits that can be in superposition.")
    result = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(two), "--devices",
                                       "cpu,cpu", "--num-workers", "0", "--batch-size", "8",
                                       "--chunk-tokens", "48", "--overlap", "8", "--json"])
    assert result.exit_code == 3, result.output  # empty.txt is read (and reported) again
    again = json.loads(result.output[result.output.index("{"):])
    assert again["units_indexed"] == 2 and again["units_unchanged"] == s1["units_seen"] - 2
    assert again["vectors_total"] == s1["vectors_total"] and again["device"] == "cpu,cpu"
    with open_index(two) as index:
        (hits,) = index.search(["qubits and superposition"], k=1)
        assert hits[0].source == "small3.md"


def test_ctrl_c_stops_all_devices_and_the_same_command_resumes(tmp_path, no_leaks):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in range(12):
        with open(corpus / f"part{f:02d}.jsonl", "w") as fh:
            for r in range(8):
                text = f"{TOPICS[(f + r) % 8]} ({f}, {r})"
                fh.write(json.dumps({"id": f"{f}-{r}", "text": text}) + "\n")
    out = tmp_path / "idx"
    cmd = [sys.executable, "-m", "embedingest", "build-index", str(corpus), "--out", str(out),
           "--devices", "cpu,cpu", "--num-workers", "0", "--batch-size", "4",
           "--commit-every", "4", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not list((out / "shards").glob("*.commit.json")):
        assert time.monotonic() < deadline, "no segment was written"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "run the same command again to resume" in err
    manifest = json.loads((out / "manifest.json").read_text())
    with ShardStore(out) as store:
        assert [s["name"] for s in manifest["segments"]] == [s.name for s in store.shards()]

    s = build_index(corpus, out=str(out), devices="cpu,cpu", num_workers=0, batch_size=4)
    assert s["units_indexed"] + s["units_unchanged"] == 12 and s["exit_code"] == 0
    with ShardStore(out) as store:
        assert store.reconcile() == set()
        units = store.units()
        assert all(u.status == "done" for u in units.values())
        ids = np.concatenate([seg.ids() for seg in store.shards()])
    assert len(ids) == len(set(ids.tolist())) == sum(u.n_chunks for u in units.values()) == 96
    assert len(chunk_rows(out, ids.tolist())) == 96


FORKED_BUILD = """
import json, sys
import embedingest.jobs.build_index.devices as md
md.start_method = lambda devices: "fork"
from embedingest import build_index
s = build_index(sys.argv[1], out=sys.argv[2], devices="cpu,cpu", **json.loads(sys.argv[3]))
print(json.dumps([d["timing"]["start_method"] for d in s["engine"]["per_device"]]))
"""


def test_forked_device_processes_build_the_same_index(tmp_path, no_leaks):
    """The fork path GPUs take, run on two CPU processes from a fresh interpreter (no
    CPU thread pool started before the fork)."""
    corpus = make_corpus(tmp_path / "corpus")
    one, two = tmp_path / "one", tmp_path / "two"
    build_index(corpus, out=str(one), **FAST)
    run = subprocess.run([sys.executable, "-c", FORKED_BUILD, str(corpus), str(two), json.dumps(FAST)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == ["fork", "fork"]
    v1, v2 = vectors_by_id(one), vectors_by_id(two)
    assert sorted(v1) == sorted(v2) and len(v1) > 30
    assert max(float(np.abs(v1[i] - v2[i]).max()) for i in v1) <= 1e-5
    assert chunk_rows(one, v1) == chunk_rows(two, v2)


@pytest.mark.needs_cuda
def test_gpu_processes_are_forked_and_build_the_one_gpu_index(tmp_path, no_leaks):
    """Two processes on GPU 0 (named twice, so one GPU is enough): forked, since this
    process never touched CUDA for them, and the same vectors as one GPU."""
    corpus = make_corpus(tmp_path / "corpus")
    one, two = tmp_path / "one", tmp_path / "two"
    code = ("import json, sys; from embedingest import build_index; "
            "s = build_index(sys.argv[1], out=sys.argv[2], devices=sys.argv[3], **json.loads(sys.argv[4])); "
            "print(json.dumps([d['timing']['start_method'] for d in s['engine'].get('per_device', [])]))")
    for out, devices in ((one, "0"), (two, "0,0")):
        run = subprocess.run([sys.executable, "-c", code, str(corpus), str(out), devices, json.dumps(FAST)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == ["fork", "fork"]
    v1, v2 = vectors_by_id(one), vectors_by_id(two)
    assert sorted(v1) == sorted(v2) and len(v1) > 30
    assert max(float(np.abs(v1[i] - v2[i]).max()) for i in v1) <= 2e-3  # fp16, other batches


def test_a_bad_model_on_two_devices_is_one_clear_error(tmp_path):
    """Both children fail the same way; the user reads the error once, with no traceback
    of the child that was stopped while reporting it."""
    corpus = make_corpus(tmp_path / "corpus")
    cmd = [sys.executable, "-m", "embedingest", "build-index", str(corpus), "--out", str(tmp_path / "i"),
           "--devices", "cpu,cpu", "--model", str(tmp_path / "nope")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.count("does not exist or is not a folder") == 1, run.stderr


def test_an_index_that_needs_training_is_trained_by_the_first_device(tmp_path, no_leaks):
    """IVF: the first device process trains on the same first chunks one process would,
    so the trained index is byte for byte the same, and every vector lands in it."""
    corpus = make_corpus(tmp_path / "corpus")
    one, two = tmp_path / "one", tmp_path / "two"
    options = dict(FAST, index="IVF4,Flat", train_size=20)
    s1 = build_index(corpus, out=str(one), **options)
    s2 = build_index(corpus, out=str(two), devices="cpu,cpu", **options)
    assert s2["vectors_total"] == s1["vectors_total"] > 30
    assert (two / "trained.faiss").read_bytes() == (one / "trained.faiss").read_bytes()
    v1, v2 = vectors_by_id(one), vectors_by_id(two)
    assert sorted(v1) == sorted(v2)
    assert max(float(np.abs(v1[i] - v2[i]).max()) for i in v1) <= 1e-5
    with open_index(two) as index:
        (hits,) = index.search([TOPICS[1]], k=1)
        assert hits[0].text == TOPICS[1]

"""build-index's plan numbers units as every path (one process, several devices, Ray)
does: new units in the corpus's order above every number ever given, a unit with the
same content keeps its number (unchanged, or left half done), a changed one gets a
fresh number."""

import hashlib

import numpy as np
from shard_fixtures import DIM, batches, meta_of, unit_vectors

from embedingest.index.shard_store import ShardStore
from embedingest.index.store import Manifest
from embedingest.jobs.build_index.plan import apply_plan, plan_units
from embedingest.report import SkipReport
from embedingest.sinks.shard_writer import ShardWriterFactory


def write_units(folder, units, chunks, run_id):
    """Every chunk of ``units`` committed, each unit marked finished."""
    sink = ShardWriterFactory(str(folder), DIM, run_id=run_id)(0)
    for b, (part, done) in enumerate(batches(units, chunks)):
        ids = np.array([r["id"] for r in part], dtype=np.int64)
        sink(meta_of(b, part, done), {"emb": unit_vectors(len(ids), seed=b), "ids": ids})
    sink.close()


def records(**texts):
    return [{"key": f"record:{k}", "size": len(t), "mtime_ns": None,
             "sha256": hashlib.sha256(t.encode()).hexdigest(), "text": t, "record_id": k}
            for k, t in texts.items()]


def test_units_are_numbered_in_order_and_a_changed_one_gets_a_fresh_number(tmp_path):
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(Manifest(model={"name": "m", "path": "/nowhere"}, dim=DIM))
    plan = plan_units(store, records(a="x", b="y", c="z"), SkipReport())
    assert apply_plan(store, plan) == (0, {"record:a": 1, "record:b": 2, "record:c": 3})
    write_units(tmp_path / "ix", [1, 2], 5, "r1")  # a and b done; c left pending
    write_units(tmp_path / "ix", [40], 3, "r0")  # a stray's vectors: no row names 40

    plan = plan_units(store, records(d="new", b="changed", a="x", c="z"), SkipReport())
    assert [c["key"] for c in plan.todo] == ["record:d", "record:b", "record:c"]
    assert (plan.unchanged, plan.renumbered, sorted(plan.replaced)) == (1, [2], [2, 3, 40])
    removed, nos = apply_plan(store, plan)
    assert removed == 5 + 3  # b's old vectors and the stray's
    assert nos == {"record:d": 41, "record:b": 42, "record:c": 3}  # above the stray's 40
    assert {k: u.unit_no for k, u in store.units().items()} == {
        "record:a": 1, "record:b": 42, "record:c": 3, "record:d": 41}
    plan = plan_units(store, records(d="new", b="changed", a="x", c="z"), SkipReport())
    assert apply_plan(store, plan)[1] == {"record:d": 41, "record:b": 42, "record:c": 3}  # a rerun: the same


def test_files_are_hashed_in_parallel_in_the_corpus_order_and_a_failed_read_is_reported(
        tmp_path, monkeypatch):
    """Large files are hashed by a thread pool, the others by the planning thread; the plan
    keeps the corpus's order, each digest is its own file's, and a file whose read fails
    is reported (stage hash) and left out."""
    import threading
    import time

    from embedingest.jobs.build_index import plan as plan_module

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    monkeypatch.setattr(plan_module, "HASH_APART", 200)  # "large": the files from doc015 on
    texts = {f"doc{i:03d}.txt": f"document {i} " * (i + 1) for i in range(40)}
    for name, text in texts.items():
        (corpus / name).write_text(text)
    threads, real = set(), plan_module._sha256

    def sha256(path):
        threads.add(threading.get_ident())
        time.sleep(0.01)  # long enough that the pool's threads all take files
        if path.endswith("doc017.txt"):
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(plan_module, "_sha256", sha256)
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(Manifest(model={"name": "m", "path": "/nowhere"}, dim=DIM))
    report = SkipReport()
    plan = plan_units(store, plan_module.file_candidates(corpus, report, tmp_path / "ix"), report)
    names = [c["path"].rsplit("/", 1)[1] for c in plan.todo]
    assert names == [n for n in sorted(texts) if n != "doc017.txt"]
    for cand in plan.todo:
        name = cand["path"].rsplit("/", 1)[1]
        assert cand["sha256"] == hashlib.sha256(texts[name].encode()).hexdigest()
    assert [(e["stage"], e["reason"].split(":")[0]) for e in report.entries] == [("hash", "unreadable")]
    assert report.entries[0]["path"].endswith("doc017.txt")
    assert len(threads) > 2 and threading.get_ident() in threads

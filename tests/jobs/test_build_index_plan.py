"""build-index's plan numbers units as every path (one process, several devices, Ray)
does: new units in the corpus's order above every number ever given, a unit with the
same content keeps its number (unchanged, or left half done), a changed one gets a
fresh number."""

import hashlib
import os

import numpy as np
from shard_fixtures import DIM, batches, meta_of, unit_vectors, write_manifest

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


def test_files_whose_stamp_moved_are_hashed_in_parallel_in_the_corpus_order_and_a_failed_read_is_reported(
        tmp_path, monkeypatch):
    """Files known to the index whose size or mtime moved are hashed to compare with their
    rows: large files by a thread pool, the others by the planning thread; the plan keeps
    the corpus's order, each digest is its own file's, and a file whose read fails is
    reported (stage hash) and left out."""
    import threading
    import time

    from embedingest.jobs.build_index import plan as plan_module

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    monkeypatch.setattr(plan_module, "HASH_APART", 200)  # "large": the files from doc015 on
    texts = {f"doc{i:03d}.txt": f"document {i} " * (i + 1) for i in range(40)}
    for name, text in texts.items():
        (corpus / name).write_text(text)
    threads, real = set(), plan_module.file_sha256

    def sha256(path):
        threads.add(threading.get_ident())
        time.sleep(0.01)  # long enough that the pool's threads all take files
        if path.endswith("doc017.txt"):
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(plan_module, "file_sha256", sha256)
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(Manifest(model={"name": "m", "path": "/nowhere"}, dim=DIM))
    store.upsert_units([{"key": name, "size": len(text), "mtime_ns": 1, "sha256": "0" * 64,
                         "status": "pending", "n_chunks": 0} for name, text in texts.items()])
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
    assert len(plan.renumbered) == 39  # every content differs from the rows' (zeros)


def test_new_files_are_not_read_by_the_plan(tmp_path, monkeypatch):
    """A file the index never saw goes to the todo list unhashed (its loader worker hashes
    it), so the plan costs a stat per file; an unreadable new file is left to the worker."""
    from embedingest.jobs.build_index import plan as plan_module

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"d{i}.txt").write_text(f"text {i}")
    (corpus / "d2.txt").chmod(0)
    read = []
    monkeypatch.setattr(plan_module, "file_sha256", lambda path: read.append(path) or "0" * 64)
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(Manifest(model={"name": "m", "path": "/nowhere"}, dim=DIM))
    report = SkipReport()
    plan = plan_units(store, plan_module.file_candidates(corpus, report, tmp_path / "ix"), report)
    assert read == [] and report.entries == []
    assert [(c["key"], c["sha256"]) for c in plan.todo] == [(f"d{i}.txt", None) for i in range(5)]
    assert apply_plan(store, plan)[1] == {f"d{i}.txt": i + 1 for i in range(5)}
    assert [u.sha256 for u in store.units().values()] == [None] * 5


def test_a_half_done_file_without_a_hash_keeps_its_number_while_its_stamp_is_the_same(tmp_path):
    """A unit whose run stopped before its worker hashed it has no hash to compare: the
    same size and mtime keep its number (the ids a clean run gives); a moved stamp gives
    it a fresh one. Neither is read by the plan."""
    from embedingest.jobs.build_index import plan as plan_module

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a.txt", "b.txt"):
        (corpus / name).write_text(f"text of {name}")
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(Manifest(model={"name": "m", "path": "/nowhere"}, dim=DIM))
    report = SkipReport()
    plan = plan_units(store, plan_module.file_candidates(corpus, report, tmp_path / "ix"), report)
    assert apply_plan(store, plan)[1] == {"a.txt": 1, "b.txt": 2}  # then the run is killed
    (corpus / "b.txt").write_text("b changed, longer")
    plan = plan_units(store, plan_module.file_candidates(corpus, report, tmp_path / "ix"), report)
    assert [(c["key"], c["sha256"]) for c in plan.todo] == [("a.txt", None), ("b.txt", None)]
    assert (sorted(plan.replaced), plan.renumbered) == ([1, 2], [2])
    assert apply_plan(store, plan)[1] == {"a.txt": 1, "b.txt": 3}


def test_a_finished_unit_takes_its_hash_from_the_shard_that_finished_it(tmp_path):
    """The loader's hash of a file travels with the unit's finishing into the shard's
    commit record; the store reads it back, and a moved stamp over the same bytes is then
    unchanged (compared by that hash), over other bytes renumbered."""
    from embedingest.jobs.build_index import plan as plan_module

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("alpha")
    (corpus / "b.txt").write_text("beta")
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(Manifest(model={"name": "m", "path": "/nowhere"}, dim=DIM))
    report = SkipReport()
    plan = plan_units(store, plan_module.file_candidates(corpus, report, tmp_path / "ix"), report)
    nos = apply_plan(store, plan)[1]
    sha = {k: hashlib.sha256((corpus / k).read_bytes()).hexdigest() for k in nos}
    sink = ShardWriterFactory(str(tmp_path / "ix"), DIM, run_id="r1")(0)
    for b, (part, done) in enumerate(batches([nos["a.txt"], nos["b.txt"]], 2)):
        ids = np.array([r["id"] for r in part], dtype=np.int64)
        meta = meta_of(b, part, done)
        meta.unit_hashes = tuple((u, sha["a.txt" if u == nos["a.txt"] else "b.txt"]) for u, _ in done)
        sink(meta, {"emb": unit_vectors(len(ids), seed=b), "ids": ids})
    sink.close()
    assert {k: (u.sha256, u.status) for k, u in store.units().items()} == {
        k: (sha[k], "done") for k in nos}
    import os
    for name, text in (("a.txt", "alpha"), ("b.txt", "BETA!")):
        (corpus / name).write_text(text)
        os.utime(corpus / name, ns=(1, 1))
    plan = plan_units(store, plan_module.file_candidates(corpus, report, tmp_path / "ix"), report)
    assert (plan.unchanged, [c["key"] for c in plan.todo], plan.renumbered) == (1, ["b.txt"], [nos["b.txt"]])
    store.sync_status()
    rows = store.db.execute("SELECT key, sha256 FROM units ORDER BY key").fetchall()
    assert rows == [("a.txt", sha["a.txt"]), ("b.txt", sha["b.txt"])]


def test_a_known_file_swapped_for_a_link_out_of_the_corpus_is_reported_not_hashed(tmp_path):
    """A file whose stamp moved is hashed by the plan to compare with its row: one swapped
    for a link out of the corpus after the listing (a writer racing the run) is reported
    with the listing's reason, and no hash of the outside file goes into the index."""
    import os

    from embedingest.jobs.build_index import plan as plan_module
    from embedingest.sources.files import input_folder

    corpus, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    corpus.mkdir()
    elsewhere.mkdir()
    (corpus / "a.txt").write_text("own text")
    (corpus / "b.txt").write_text("listed, then swapped")
    (elsewhere / "secret.txt").write_text("a secret of the machine")
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(Manifest(model={"name": "m", "path": "/nowhere"}, dim=DIM))
    store.upsert_units([{"key": name, "size": 1, "mtime_ns": 1, "sha256": "0" * 64,
                         "status": "pending", "n_chunks": 0} for name in ("a.txt", "b.txt")])
    report = SkipReport()
    listed = list(plan_module.file_candidates(corpus, report, tmp_path / "ix"))
    (corpus / "b.txt").unlink()
    (corpus / "b.txt").symlink_to(elsewhere / "secret.txt")
    plan = plan_units(store, listed, report, input_folder(corpus))
    assert [(c["key"], c["sha256"]) for c in plan.todo] == [
        ("a.txt", hashlib.sha256(b"own text").hexdigest())]
    assert [(e["path"], e["stage"], e["reason"]) for e in report.entries] == [(
        str(corpus / "b.txt"), "hash",
        f"symbolic link out of the input folder: to {os.path.realpath(elsewhere / 'secret.txt')}, "
        "not read (--follow-outside-links reads it)")]


def test_an_index_folder_inside_the_corpus_is_reported_not_read(tmp_path):
    """Another index kept inside the corpus (not this run's --out): its shards' Parquet
    rows and its JSON records would be indexed as documents. Its folder is passed over
    with a reason; a folder that only has a manifest.json of its own is read."""
    from embedingest.jobs.build_index.plan import file_candidates

    corpus = tmp_path / "corpus"
    (corpus / "old-index" / "shards").mkdir(parents=True)
    (corpus / "old-index" / "manifest.json").write_text('{"format": 2, "model": {"name": "m"}, "dim": 8}')
    (corpus / "old-index" / "shards" / "shard-r-w0-00000.parquet").write_bytes(b"PAR1")
    (corpus / "app").mkdir()
    (corpus / "app" / "manifest.json").write_text('{"name": "an app"}')
    (corpus / "doc.txt").write_text("a document")
    report = SkipReport()
    keys = [c["key"] for c in file_candidates(corpus, report, tmp_path / "ix")]
    assert sorted(keys) == ["app/manifest.json", "doc.txt"]
    assert [(e["path"], e["reason"]) for e in report.entries] == [(
        str(corpus / "old-index"), "index: an embedingest index, not documents (its corpus is what to "
                                   "index); move it out of the corpus folder")]


def test_texts_alone_are_records_and_a_corpus_that_is_no_iterable_of_records_is_refused():
    """A list of texts was all skipped ('expected (id, text) or a dict', exit 3); a dict or
    a DataFrame iterated over its keys or column names; an int raised a TypeError."""
    import pytest

    from embedingest.config import IndexConfig
    from embedingest.errors import ConfigError
    from embedingest.jobs.build_index.plan import record_candidates

    report = SkipReport()
    got = record_candidates(["first text", ("k", "keyed text"), "third text"], IndexConfig(), report)
    assert [(c["record_id"], c["text"]) for c in got] == [("0", "first text"), ("k", "keyed text"),
                                                          ("2", "third text")]
    assert report.entries == []
    # a dict without the text field is named as such, with its fields (it was "'text' is not a string")
    got = record_candidates([{"id": "x", "body": "hello"}, {"id": "y", "text": None}, {"id": "z", "body": "b"}],
                            IndexConfig(), report)
    assert got == [] and [(e["path"], e["reason"]) for e in report.entries] == [
        ("record x", "field: no 'text' field (fields: 'id', 'body'); choose the text field with text_field="),
        ("record y", "field: 'text' is not a string"),
        ("record z", "field: no 'text' field (fields: 'id', 'body'); choose the text field with text_field=")]
    got = record_candidates([{"id": "x", "body": "hello"}], IndexConfig(text_field="body"), SkipReport())
    assert [(c["record_id"], c["text"]) for c in got] == [("x", "hello")]
    import pyarrow as pa  # pyarrow strings were pyarrow scalars: every one skipped as "expected ... a text"

    for texts in (pa.array(["alpha beta", "gamma"]), pa.chunked_array([["alpha beta"], ["gamma"]])):
        report = SkipReport()
        got = record_candidates(texts, IndexConfig(), report)
        assert [(c["record_id"], c["text"]) for c in got] == [("0", "alpha beta"), ("1", "gamma")]
        assert report.entries == []

    class Frame:  # what a DataFrame shows of itself
        columns = ["id", "text"]

        def to_dict(self, orient):
            return []

        def __iter__(self):
            return iter(self.columns)

    for corpus, hint in [({"a": "text"}, "; for a dict of id to text, give its .items()"),
                         (Frame(), "; for a DataFrame, give df.to_dict('records') (its columns named text and id)"),
                         (b"bytes", ""), (7, ""), (None, "")]:
        with pytest.raises(ConfigError) as err:
            record_candidates(corpus, IndexConfig(), SkipReport())
        assert str(err.value) == (f"corpus of type {type(corpus).__name__}: give a folder, a file, a URL, or an "
                                  f"iterable of records ((id, text) pairs, dicts, or texts){hint}")


def test_files_under_a_folder_that_cannot_be_listed_keep_their_vectors(tmp_path, monkeypatch):
    """A folder of the corpus that cannot be listed on a re-run (its permissions changed,
    an I/O error of a network file system) was taken for a folder of no files: every
    vector of the files under it was removed, and all of them encoded again once it could
    be read. Such files are kept as they were (counted unchanged) and the folder is
    reported; a folder that is gone is gone, and a corpus folder that cannot be listed
    keeps the whole index."""
    import embedingest.sources.files as files
    from embedingest import build_index
    from test_build_index import FAST, all_ids

    corpus = tmp_path / "corpus"
    texts = {"a.txt": "Owls hunt at night over the meadow.", "locked/b.txt": "Foxes dig dens in the sand.",
             "locked/deep/c.md": "Badgers sleep through the day underground.",
             "gone/d.txt": "Herons wade in the shallow river."}
    for rel, text in texts.items():
        (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
        (corpus / rel).write_text(text)
    out = tmp_path / "idx"
    assert build_index(corpus, out=str(out), **FAST)["vectors_total"] == 4
    ids = set(all_ids(out).tolist())
    real = os.scandir
    locked = {str(corpus / "locked")}
    monkeypatch.setattr(files.os, "scandir",
                        lambda path: (_ for _ in ()).throw(PermissionError(13, "Permission denied", path))
                        if os.fspath(path) in locked else real(path))
    (corpus / "gone" / "d.txt").unlink()
    (corpus / "gone").rmdir()
    s = build_index(corpus, out=str(out), **FAST)
    assert (s["units_unchanged"], s["units_removed"], s["vectors_removed"], s["vectors_total"]) == (3, 1, 1, 3)
    assert s["skipped_by_reason"] == {"cannot list folder": 1} and s["exit_code"] == 3
    with ShardStore(out) as store:
        assert sorted(store.units()) == ["a.txt", "locked/b.txt", "locked/deep/c.md"]
    kept = set(all_ids(out).tolist())
    assert len(kept) == 3 and kept < ids
    locked.add(str(corpus))  # the corpus folder itself: nothing is taken for deleted
    s = build_index(corpus, out=str(out), **FAST)
    assert (s["units_unchanged"], s["units_removed"], s["vectors_total"]) == (3, 0, 3)
    locked.clear()
    s = build_index(corpus, out=str(out), **FAST)
    assert (s["units_unchanged"], s["units_indexed"], s["chunks"], s["exit_code"]) == (3, 0, 0, 0)
    assert set(all_ids(out).tolist()) == kept


def test_a_dataset_folder_with_a_manifest_and_shards_of_its_own_is_read(tmp_path):
    """A user's dataset inside the corpus with its own manifest.json and shards/ was passed
    over whole as an embedingest index, its documents with it. An index is told by its
    manifest (a model and a width) or, where that is damaged, by the index files beside
    it; the manifest is never read through a link or from a pipe."""
    from embedingest.jobs.build_index.plan import file_candidates

    corpus = tmp_path / "corpus"
    (corpus / "data" / "shards").mkdir(parents=True)
    (corpus / "data" / "docs").mkdir()
    (corpus / "data" / "manifest.json").write_text('{"name": "my dataset", "version": 1}')
    (corpus / "data" / "shards" / "part-0.jsonl").write_text('{"id": "a", "text": "about zebras"}\n')
    (corpus / "data" / "docs" / "k.txt").write_text("important doc about kangaroos")
    damaged = corpus / "damaged-index"  # a manifest cut short, its units beside it
    (damaged / "shards").mkdir(parents=True)
    (damaged / "manifest.json").write_text('{"format": 2, "mod')
    (damaged / "units.sqlite").write_bytes(b"")
    (damaged / "shards" / "notes.txt").write_text("an index's file")
    piped = corpus / "piped"  # a pipe where the manifest is: read would wait for ever
    (piped / "shards").mkdir(parents=True)
    os.mkfifo(piped / "manifest.json")
    (piped / "p.txt").write_text("beside a pipe")
    linked = corpus / "linked"  # a link to an index's manifest: not followed, no index files here
    (linked / "shards").mkdir(parents=True)
    (tmp_path / "real.json").write_text('{"model": {"name": "m"}, "dim": 8}')
    (linked / "manifest.json").symlink_to(tmp_path / "real.json")
    (linked / "l.txt").write_text("beside a link")
    write_manifest(corpus / "real-index")  # an index's manifest, no shards yet: still an index
    (corpus / "real-index" / "r.txt").write_text("inside an index")
    report = SkipReport()
    keys = sorted(c["key"] for c in file_candidates(corpus, report, tmp_path / "ix"))
    assert keys == ["data/docs/k.txt", "data/manifest.json", "data/shards/part-0.jsonl", "linked/l.txt",
                    "piped/p.txt"]
    assert [(e["path"], e["reason"]) for e in report.entries] == [
        (str(damaged), "index: an embedingest index, not documents (its corpus is what to index); move it out "
                       "of the corpus folder"),
        (str(linked / "manifest.json"), "symbolic link out of the input folder: to "
                                        f"{tmp_path / 'real.json'}, not read (--follow-outside-links reads it)"),
        (str(piped / "manifest.json"), "not a regular file: a named pipe (FIFO)"),
        (str(corpus / "real-index"), "index: an embedingest index, not documents (its corpus is what to index); "
                                     "move it out of the corpus folder")]


def test_an_export_folder_inside_the_corpus_is_reported_not_read_and_a_spark_output_is(tmp_path):
    """``export --to`` inside the corpus: the next build read the export's Parquet rows as
    documents (every hit twice). A folder holding what export writes (``_SUCCESS`` and
    Parquet files all named as shards) is passed over with a reason; a Spark job's output
    (``_SUCCESS`` and ``part-*.parquet``), or an export folder the user added Parquet
    files of their own to, is read."""
    from shard_fixtures import build_shards

    from embedingest.index.export import export_index
    from embedingest.jobs.build_index.plan import file_candidates

    corpus = tmp_path / "corpus"
    build_shards(tmp_path / "ix", n_units=2, chunks=3, workers=1)
    export_index(tmp_path / "ix", corpus / "exported")
    (corpus / "spark").mkdir()
    (corpus / "spark" / "_SUCCESS").write_bytes(b"")
    (corpus / "spark" / "part-00000-1f2e.snappy.parquet").write_bytes(b"PAR1")
    export_index(tmp_path / "ix", corpus / "mixed")
    (corpus / "mixed" / "mine.parquet").write_bytes(b"PAR1")
    report = SkipReport()
    keys = sorted(c["key"] for c in file_candidates(corpus, report, tmp_path / "out"))
    shard = next((corpus / "mixed").glob("shard-*.parquet")).name
    assert keys == ["mixed/mine.parquet", f"mixed/{shard}", "spark/part-00000-1f2e.snappy.parquet"]
    assert [(e["path"], e["reason"]) for e in report.entries] == [(
        str(corpus / "exported"), "export: an embedingest export (_SUCCESS and Parquet files named as shards), "
                                  "not documents (its index's corpus is what to index); move it out of the "
                                  "corpus folder")]


def _rewrite_keeping_stamp(path, text: str) -> None:
    """Write ``text`` (as long as what ``path`` holds) and set its mtime back, as ``cp -p``,
    ``rsync -a`` or ``touch -r`` leave a file; wait until its ctime moved (a coarse clock
    can give two writes one tick)."""
    import time

    before = os.stat(path)
    assert len(text.encode()) == before.st_size
    while os.stat(path).st_ctime_ns == before.st_ctime_ns:
        time.sleep(0.005)
        path.write_text(text)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def _indexed_corpus(tmp_path, texts: dict):
    """A corpus of ``texts``, planned into an index whose units are finished, each row
    with its file's hash (as a finished run leaves them)."""
    from embedingest.jobs.build_index.plan import file_candidates

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in texts.items():
        (corpus / name).write_text(text)
    store = ShardStore(tmp_path / "ix")
    store.create_or_open(Manifest(model={"name": "m", "path": "/nowhere"}, dim=DIM))
    nos = apply_plan(store, plan_units(store, file_candidates(corpus, SkipReport(), tmp_path / "ix"),
                                       SkipReport()))[1]
    write_units(tmp_path / "ix", sorted(nos.values()), 2, "r1")
    store.upsert_units([{"key": k, "sha256": hashlib.sha256(t.encode()).hexdigest()} for k, t in texts.items()])
    return corpus, store


def test_a_rewrite_that_keeps_size_and_mtime_is_redone_and_a_chmod_is_only_hashed(tmp_path):
    """A file rewritten with another text of its size, its mtime set back, was counted
    unchanged for good (search showed the old text). Its inode change time moved, so it
    is hashed and, its content changed, indexed again under a fresh number; a chmod (or
    a hard link) moves the ctime alone: the hash is the row's, the unit stays, and its
    row takes the new ctime, so the next run hashes nothing."""
    from embedingest.jobs.build_index.plan import file_candidates

    corpus, store = _indexed_corpus(tmp_path, {"a.txt": "the cat sat on the mat", "b.txt": "owls hunt at night"})
    plan = plan_units(store, file_candidates(corpus, SkipReport(), tmp_path / "ix"), SkipReport())
    assert (plan.todo, plan.unchanged) == ([], 2)
    _rewrite_keeping_stamp(corpus / "a.txt", "the dog sat on the rug")
    mode = 0o600
    while os.stat(corpus / "b.txt").st_ctime_ns == store.units()["b.txt"].ctime_ns:  # one clock tick
        os.chmod(corpus / "b.txt", mode)
        mode ^= 0o040
    time_of_b = os.stat(corpus / "b.txt").st_ctime_ns
    plan = plan_units(store, file_candidates(corpus, SkipReport(), tmp_path / "ix"), SkipReport())
    assert [(c["key"], c["sha256"]) for c in plan.todo] == [
        ("a.txt", hashlib.sha256(b"the dog sat on the rug").hexdigest())]
    assert (plan.unchanged, plan.replaced, plan.renumbered) == (1, [1], [1])
    assert store.units()["b.txt"].ctime_ns == time_of_b
    apply_plan(store, plan)
    assert store.units()["a.txt"].ctime_ns == os.stat(corpus / "a.txt").st_ctime_ns


def test_a_units_row_made_before_ctimes_were_kept_is_judged_as_then_and_given_one(tmp_path, monkeypatch):
    """An index whose units.sqlite has no ctime_ns column (an older embedingest's) is read
    as it was (a reader sees ctime None), its rows judged by size and mtime: an unchanged
    file is not hashed. The writer adds the column, the plan stores each file's ctime, and
    from then on a same-size, same-mtime rewrite is caught."""
    import sqlite3

    from embedingest.jobs.build_index import plan as plan_module

    corpus, store = _indexed_corpus(tmp_path, {"a.txt": "the cat sat on the mat", "b.txt": "owls hunt at night"})
    store.close()
    with sqlite3.connect(tmp_path / "ix" / "units.sqlite") as db:
        db.execute("ALTER TABLE units DROP COLUMN ctime_ns")  # the table as an older version made it
    with ShardStore(tmp_path / "ix", read_only=True) as reader:
        assert {k: (u.unit_no, u.ctime_ns, u.status) for k, u in reader.units().items()} == {
            "a.txt": (1, None, "done"), "b.txt": (2, None, "done")}
    store = ShardStore(tmp_path / "ix")
    hashed = []
    monkeypatch.setattr(plan_module, "file_sha256", lambda path: hashed.append(path) or "0" * 64)
    plan = plan_units(store, plan_module.file_candidates(corpus, SkipReport(), tmp_path / "ix"), SkipReport())
    assert (plan.todo, plan.unchanged, hashed) == ([], 2, [])
    assert {k: u.ctime_ns for k, u in store.units().items()} == {
        name: os.stat(corpus / name).st_ctime_ns for name in ("a.txt", "b.txt")}
    monkeypatch.undo()
    _rewrite_keeping_stamp(corpus / "b.txt", "owls fish at night")
    plan = plan_units(store, plan_module.file_candidates(corpus, SkipReport(), tmp_path / "ix"), SkipReport())
    assert [(c["key"], c["sha256"]) for c in plan.todo] == [
        ("b.txt", hashlib.sha256(b"owls fish at night").hexdigest())]


def test_a_file_is_recorded_as_itself_and_an_index_recording_its_folder_is_its_own_while_it_holds_it_alone(
        tmp_path, monkeypatch):
    """The corpus recorded: a folder's real path, a file's (by the name given: its unit
    key), a URL; none for records. A folder recorded stands for a file in it only where
    the index holds that file alone (an index written before a file was recorded as
    itself); a file recorded never stands for its folder."""
    from embedingest.jobs.build_index.plan import corpus_path, same_corpus

    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.txt").write_text("x")
    (tmp_path / "link").symlink_to(folder)
    monkeypatch.chdir(folder)
    real = str(folder.resolve())
    file = os.path.join(real, "a.txt")
    assert corpus_path(str(folder), False) == corpus_path(".", False) == real
    assert corpus_path(str(tmp_path / "link"), False) == real
    assert corpus_path("a.txt", False) == corpus_path(str(tmp_path / "link" / "a.txt"), False) == file
    assert (corpus_path("s3://b/p/", False), corpus_path([("1", "x")], True)) == ("s3://b/p", None)
    assert same_corpus(file, file, list) and same_corpus(None, file, list) and same_corpus(real, None, list)
    assert same_corpus(real, file, lambda: ["a.txt"]) and same_corpus(real, file, list)
    assert not same_corpus(real, file, lambda: ["a.txt", "b.txt"])
    assert not same_corpus(file, real, lambda: ["a.txt"])
    assert not same_corpus(str(tmp_path), file, lambda: ["a.txt"])

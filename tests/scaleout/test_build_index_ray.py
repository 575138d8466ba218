"""build_index_ray on a local two-CPU Ray cluster: the same ids, vectors and chunk rows as
build_index on the same records (two actors, several blocks, batches that cut records
apart), and the same incremental behaviour: unchanged records keep their ids, changed ones
get fresh ones, a stopped run finished gives the ids of a clean one."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from model_fixtures import copy_model
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)
from test_build_index_devices import TOPICS, chunk_rows, vectors_by_id

from embedingest import build_index, open_index
from embedingest.index.shard_store import ShardStore

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
SETTINGS = {"num_consumers": 1, "batch_size": 8, "chunk_tokens": 32, "overlap": 8}


def records():
    """Long records (several chunks each), short ones, and one with no tokens."""
    recs = [{"id": f"long{i}", "text": " ".join(TOPICS[i:] + TOPICS[:i])} for i in range(4)]
    recs += [{"id": f"s{i}", "text": t} for i, t in enumerate(TOPICS)]
    recs.append({"id": "z87", "text": "Tides rise twice a day."})  # its id's digest ends in a zero byte
    recs.append({"id": "blank", "text": "  "})
    return recs


KEEP_IDLE_WORKERS = {"num_workers_soft_limit": 8, "idle_worker_killing_time_threshold_ms": 3_600_000}
"""Ray's ``_system_config`` for the tests' instances: the worker that ran a first pass (and
imported torch with this package) is kept while the actors run, so the next build's
first pass reuses it instead of paying that import again; by default Ray kills idle
workers beyond one per CPU after a second."""


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'embedingest[ray]')")
    # address="local": a new instance of its own, never the cluster another test (or a
    # parallel test worker) started and recorded in Ray's temp folder for bare ray.init()s
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _system_config=KEEP_IDLE_WORKERS)
    yield ray
    ray.shutdown()


def content(out) -> dict:
    """The index's content by vector id: each chunk's vector and row, each id checked
    against its unit's key and chunk number."""
    vectors = vectors_by_id(out)  # asserts each id is stored once
    rows = chunk_rows(out, vectors)
    assert sorted(rows) == sorted(vectors)
    with ShardStore(out) as store:
        units = {u.unit_no: u.key for u in store.units().values()}
    for i, row in rows.items():
        source, record_id, chunk_no = row[:3]
        assert units[i >> 32] == source == f"record:{record_id}" and i & 0xFFFFFFFF == chunk_no
    return {i: (vectors[i], rows[i]) for i in vectors}


def assert_same_index(a, b):
    """The same ids, each with the same vector and row, and the same units."""
    ca, cb = content(a), content(b)
    assert sorted(ca) == sorted(cb)
    assert ca, "an empty index proves nothing"
    diff = max(float(np.abs(ca[k][0] - cb[k][0]).max()) for k in ca)
    assert diff <= 1e-5, diff
    assert {k: v[1] for k, v in ca.items()} == {k: v[1] for k, v in cb.items()}
    assert complete_units(a) == complete_units(b)


def unit_numbers(out) -> dict:
    """{key: unit number} of every unit row."""
    with ShardStore(out) as store:
        return {k: u.unit_no for k, u in store.units().items()}


def complete_units(out) -> dict:
    """{key: (n_chunks, sha256)} of the units the shards hold complete."""
    with ShardStore(out) as store:
        assert not store.reconcile()
        return {k: (u.unit_no, u.n_chunks, u.sha256) for k, u in store.units().items()
                if u.status == "done"}


@pytest.fixture
def driver_reads(monkeypatch, ray_cluster):
    """Every batch a Ray Dataset hands to this (the driver's) process, as (columns, rows):
    iter_batches, iter_rows, take and the rest all go through DataIterator._iter_batches."""
    from ray.data.iterator import DataIterator

    seen = []
    inner = DataIterator._iter_batches

    def counted(self, *args, **kwargs):
        for batch in inner(self, *args, **kwargs):
            columns = batch.column_names if hasattr(batch, "column_names") else list(batch)
            rows = batch.num_rows if hasattr(batch, "num_rows") else len(next(iter(batch.values())))
            seen.append((tuple(columns), rows))
            yield batch

    monkeypatch.setattr(DataIterator, "_iter_batches", counted)
    return seen


def texts_read(reads) -> int:
    """Rows holding a record's text that the driver read (the actors' and the first
    pass's rows hold none)."""
    return sum(rows for columns, rows in reads if "text" in columns)


def blocks(ray, recs, n=5):
    """``recs`` as a dataset of ``n`` blocks (batches of 4 records cut across them)."""
    return ray.data.from_items(recs, override_num_blocks=n)


@pytest.mark.timeout(900)  # six builds, each Ray one two passes over the dataset, on a loaded host
def test_ray_build_equals_single_process_build_and_resumes(tmp_path, ray_cluster, driver_reads):
    from embedingest import build_index_ray

    ray = ray_cluster
    recs = records()
    one, two = tmp_path / "one", tmp_path / "two"
    s1 = build_index(recs, out=str(one), num_workers=0, **SETTINGS)
    s2 = build_index_ray(blocks(ray, recs), two, concurrency=2, records_per_call=4, **SETTINGS)
    for key in ("units_seen", "units_indexed", "docs", "chunks", "vectors_total", "skipped",
                "skipped_by_reason", "exit_code"):
        assert s2[key] == s1[key], key
    assert s1["chunks"] > len(recs) and s2["units_incomplete"] == 0 and s2["duplicate_ids"] == 0
    assert_same_index(one, two)  # the same ids: unit numbers 1..n in the records' order
    assert unit_numbers(two) == {f"record:{r['id']}": n for n, r in enumerate(recs, 1)}
    manifest = json.loads((two / "manifest.json").read_text())
    assert sum(s["count"] for s in manifest["segments"]) == s1["vectors_total"]
    pids = {seg["name"].split("_ray")[1].split("_")[0] for seg in manifest["segments"]}
    assert len(pids) == 2  # both actors wrote shards
    assert manifest["dtype"] == "fp32"
    assert json.loads((one / "manifest.json").read_text())["corpus"] == manifest["corpus"]
    with open_index(two) as index:
        (hits,) = index.search([TOPICS[5]], k=1)
        assert hits[0].text == TOPICS[5] and hits[0].record_id == "s5"
    assert texts_read(driver_reads) == 0  # the driver read no text: the first pass's rows,
    assert sum(rows for _, rows in driver_reads) == 2 * len(recs) + 1  # the actors', the blank's skip

    # unchanged: nothing is encoded, nothing removed, the shards with vectors stay as they are
    driver_reads.clear()
    s3 = build_index_ray(blocks(ray, recs, 3), two, concurrency=2, records_per_call=4, **SETTINGS)
    assert (s3["units_indexed"], s3["chunks"], s3["units_removed"], s3["vectors_removed"]) == (1, 0, 0, 0)
    assert s3["units_unchanged"] == len(recs) - 1  # the blank one is read every run, as build_index does
    after = json.loads((two / "manifest.json").read_text())["segments"]
    before = {seg["name"] for seg in manifest["segments"]}  # no actor wrote a vector; a shard
    assert all(seg["name"] in before or seg["name"].startswith("shard-rm") for seg in after)
    assert sum(seg["count"] for seg in after) == s1["vectors_total"]  # holding the blank's mark is rewritten
    assert texts_read(driver_reads) == 0 and sum(r for _, r in driver_reads) == len(recs) + 2
    build_index(recs, out=str(one), num_workers=0, **SETTINGS)
    assert_same_index(one, two)

    # change one record, delete one, add one: both paths do the same work and give the same ids
    before = unit_numbers(two)
    changed = recs[5]
    changed["text"] = "Quantum computers use qubits that can be in superposition."
    del recs[7]
    recs.insert(2, {"id": "new", "text": "Arctic terns migrate from pole to pole every year."})
    s1 = build_index(recs, out=str(one), num_workers=0, **SETTINGS)
    s2 = build_index_ray(blocks(ray, recs, 4), two, concurrency=2, records_per_call=3, **SETTINGS)
    for key in ("units_seen", "units_indexed", "units_removed", "units_unchanged", "skipped",
                "chunks", "vectors_removed", "vectors_total"):
        assert s2[key] == s1[key], key
    assert s2["units_indexed"] == 3  # the changed, the new and the blank one (read every run)
    assert s2["units_removed"] == 1 and s2["units_unchanged"] == len(recs) - 3
    assert_same_index(one, two)
    now = unit_numbers(two)
    fresh = max(before.values())
    assert fresh == len(recs)  # no run spent a number on an unchanged record
    assert now["record:new"] == fresh + 1 and now["record:s1"] == fresh + 2  # in order
    assert {k: v for k, v in now.items() if v <= fresh} == {
        k: v for k, v in before.items() if k in now and k != "record:s1"}
    with open_index(two) as index:
        (hits,) = index.search([changed["text"]], k=1)
        assert hits[0].text == changed["text"] and hits[0].record_id == "s1"
        assert hits[0].id >> 32 == fresh + 2
    assert texts_read(driver_reads) == 0


def test_duplicate_ids_are_reported_and_indexed_by_no_occurrence(tmp_path, ray_cluster):
    """An id given twice is found once every record was seen: each occurrence is in the
    skip report, and no unit of it stays (whether new, changed or unchanged)."""
    from embedingest import build_index_ray
    from embedingest.report import REPORT_NAME

    ray = ray_cluster
    out = tmp_path / "a"
    recs = [{"id": 1, "text": "a b"}, {"id": 2, "text": "c d"}, {"id": 1, "text": "e f"},
            {"id": 3, "text": "g h"}]
    s = build_index_ray(ray.data.from_items(recs), out, records_per_call=2, **SETTINGS)
    assert (s["duplicate_ids"], s["units_seen"], s["units_indexed"], s["skipped"]) == (1, 2, 2, 2)
    assert s["skipped_by_reason"] == {"duplicate": 2} and s["exit_code"] != 0
    reported = [json.loads(line) for line in (out / REPORT_NAME).read_text().splitlines()]
    assert [r["path"] for r in reported] == ["record 1", "record 1"]
    assert "occurs 2 times" in reported[0]["reason"]
    assert sorted(complete_units(out)) == ["record:2", "record:3"]
    assert {row[1] for _, row in content(out).values()} == {"2", "3"}
    # now 1 is unique, 2 is given twice (once unchanged, once changed), 3 went away
    recs = [{"id": 1, "text": "a b"}, {"id": 2, "text": "c d"}, {"id": 2, "text": "x y"}]
    s = build_index_ray(ray.data.from_items(recs), out, records_per_call=1, concurrency=2, **SETTINGS)
    assert (s["duplicate_ids"], s["units_seen"], s["units_indexed"], s["units_unchanged"]) == (1, 1, 1, 0)
    assert s["units_removed"] == 1 and s["skipped_by_reason"] == {"duplicate": 2}
    assert sorted(complete_units(out)) == ["record:1"]
    with ShardStore(out) as store:
        assert sorted(store.units()) == ["record:1"]
    assert unit_numbers(out) == {"record:1": 3}  # fresh: 1 and 2 were given before
    one = tmp_path / "one"
    build_index([recs[0]], out=str(one), num_workers=0, **SETTINGS)
    (a,), (b,) = content(one).values(), content(out).values()  # its one chunk, under unit 1 there
    assert np.abs(a[0] - b[0]).max() <= 1e-5 and a[1] == b[1]


def test_concurrency_is_an_actor_pool_without_ray_s_deprecation_warning(tmp_path, ray_cluster):
    """``concurrency`` reaches Ray as ``compute=ActorPoolStrategy``: its ``map_batches(concurrency=)``
    warns on every call that it is deprecated."""
    from embedingest import build_index_ray
    from embedingest.errors import ConfigError
    from embedingest.jobs.build_index.ray import actor_pool

    pool = actor_pool(3)
    assert (pool.min_size, pool.max_size) == (3, 3)
    pool = actor_pool((1, 4))
    assert (pool.min_size, pool.max_size) == (1, 4)
    assert actor_pool((1, 4, 2)).initial_size == 2
    with pytest.raises(ConfigError, match=r"concurrency=\(1,\)"):
        actor_pool((1,))
    ray = ray_cluster
    recs = [{"id": i, "text": f"note {i} about {TOPICS[i % len(TOPICS)]}"} for i in range(6)]
    said = []
    heard = logging.Handler(logging.WARNING)
    heard.emit = lambda record: said.append(record.getMessage())
    ray_data_log = logging.getLogger("ray.data")  # Ray's own handlers; it does not propagate
    ray_data_log.addHandler(heard)
    try:
        s = build_index_ray(ray.data.from_items(recs), tmp_path / "idx", concurrency=(1, 2),
                            records_per_call=3, **SETTINGS)
    finally:
        ray_data_log.removeHandler(heard)
    assert s["units_indexed"] == 6
    assert not [m for m in said if "concurrency" in m], said


def test_missing_columns_are_errors(tmp_path, ray_cluster):
    from embedingest import build_index_ray
    from embedingest.errors import ConfigError

    no_id = ray_cluster.data.from_items([{"body": "a b"}])
    with pytest.raises(ConfigError, match="no column 'id'.*columns are body"):
        build_index_ray(no_id, tmp_path / "b", text_field="body")


def test_an_overwrite_that_fails_leaves_the_index_as_it_was(tmp_path, ray_cluster):
    """As build_index: the old index waits in .overwritten/ and comes back when the
    rebuild fails (here: a factory its few chunks cannot train)."""
    from embedingest import build_index_ray
    from embedingest.errors import ConfigError

    out = tmp_path / "ix"
    build_index_ray(blocks(ray_cluster, records()), out, **SETTINGS)
    before = content(out)
    with pytest.raises(ConfigError, match=r"cannot train 'IVF64,Flat'"):
        build_index_ray(blocks(ray_cluster, records()), out, overwrite=True, index="IVF64,Flat", **SETTINGS)
    after = content(out)
    assert after.keys() == before.keys() and not (out / ".overwritten").exists()
    assert all(np.array_equal(after[i][0], before[i][0]) and after[i][1] == before[i][1] for i in before)
    assert json.loads((out / "manifest.json").read_text())["factory"] == "Flat"


def test_import_without_ray_says_how_to_install():
    code = "import sys; sys.modules['ray'] = None; import embedingest.jobs.build_index.ray"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          env=os.environ)  # PYTHONPATH: the checkout (tests/conftest.py)
    assert proc.returncode == 1
    assert "pip install 'embedingest[ray]'" in proc.stderr


def as_batch(recs) -> dict:
    return {"id": np.array([r["id"] for r in recs], dtype=object),
            "text": np.array([r["text"] for r in recs], dtype=object)}


def abandon(plan) -> None:
    """What a driver killed before ``finish`` leaves: the unit rows the plan wrote, the
    actors' shards, no manifest naming them."""
    plan.store.close()


def test_plan_and_embed_batches_called_directly(tmp_path, ray_cluster):
    """The three steps by hand, as a pipeline of one's own would run them: the plan
    numbers the records as build_index does and writes their unit rows, EmbedBatches
    (called here, not by Ray) embeds the records the plan assigned into shards and
    returns one row per record, finish() writes what build_index writes."""
    from embedingest.jobs.build_index.ray import RESULT_SCHEMA, EmbedBatches, plan_ray_index

    ray = ray_cluster
    recs = records()
    one, two = tmp_path / "one", tmp_path / "two"
    plan = plan_ray_index(ray.data.from_items(recs), two, **SETTINGS)
    assert plan.dtype == "fp32" and len(ray.get(plan.assigned).digests) == len(recs)
    assert plan.counts == {"units_seen": len(recs), "units_indexed": 0, "units_unchanged": 0,
                           "units_removed": 0, "vectors_removed": 0, "docs": 0, "chunks": 0,
                           "duplicate_ids": 0, "units_incomplete": 0}
    # the unit rows are written first, numbered in the records' order
    assert unit_numbers(two) == {f"record:{r['id']}": n for n, r in enumerate(recs, 1)}
    kwargs = plan.actor_kwargs()
    assert kwargs["config"]["batch_size"] == SETTINGS["batch_size"] and kwargs["out"] == str(two)
    actor = EmbedBatches(**kwargs)
    assert actor.device == "cpu"
    tables = [actor(as_batch(part)) for part in (recs[5:], recs[:5])]  # any order, any batch
    assert all(t.schema == RESULT_SCHEMA for t in tables)
    rows = [r for t in tables for r in t.to_pylist()]
    skipped = [(r["skip_where"], r["skip_reason"].split(":")[0]) for r in rows if r["status"] == "skipped"]
    assert skipped == [("record:blank:blank", "empty")]  # as build_index reports it
    rows = sorted((r for r in rows if r["status"] != "skipped"), key=lambda r: r["unit_no"])
    assert [r["status"] for r in rows] == ["indexed"] * len(recs)
    assert [(r["record_id"], r["unit_no"]) for r in rows] == [(r["id"], n) for n, r in enumerate(recs, 1)]
    nos = {r["record_id"]: r["unit_no"] for r in rows}
    with ShardStore(two) as store:  # the rows are in the shards the actor committed
        ids = [int(i) for s in store.shards() for i in s.ids()]
        chunks = store.chunks(ids)
    for rec, row in zip(recs, rows):
        mine = sorted((c for c in chunks.values() if c.unit_no == nos[rec["id"]]), key=lambda c: c.chunk_no)
        assert row["n_chunks"] == len(mine)
        assert [c.chunk_no for c in mine] == list(range(len(mine)))
        assert all(rec["text"][c.char_start:c.char_end] == c.text and c.record_id == rec["id"] for c in mine)
    assert rows[-1]["n_chunks"] == 0 and rows[0]["n_chunks"] > 1  # blank, long0
    assert actor.calls == 2  # one engine (and one run id) per call
    s2 = plan.finish(ray.data.from_arrow(tables))
    s1 = build_index(recs, out=str(one), num_workers=0, **SETTINGS)
    for key in ("units_seen", "units_indexed", "docs", "chunks", "vectors_total", "skipped", "exit_code"):
        assert s2[key] == s1[key], key
    assert s2["units_incomplete"] == 0
    assert_same_index(one, two)

    # the next run's actors pass what the index holds without work; a record whose text
    # is not the one planned is reported, not embedded
    changed = [dict(r) for r in recs]
    changed[5]["text"] = "Quantum computers use qubits."
    plan = plan_ray_index(ray.data.from_items(changed), two, **SETTINGS)
    actor = EmbedBatches(**plan.actor_kwargs())
    table = actor(as_batch(recs[4:6]))
    assert table.column("status").to_pylist() == ["skipped"]
    assert table.column("skip_reason")[0].as_py().startswith("changed: its text is not the one")
    table = actor(as_batch(changed[4:6]))
    assert table.column("status").to_pylist() == ["indexed"]
    assert table.column("unit_no").to_pylist() == [len(recs) + 1]  # a number never given before
    abandon(plan)


def test_a_run_stopped_anywhere_is_finished_by_running_again(tmp_path, ray_cluster):
    """A driver killed before finish() (unit rows and some shards committed), then a
    finish() whose results fail half-way, then an actor call retried (its units twice):
    the next run keeps what is whole and gives the index, ids included, of a clean build."""
    from embedingest import build_index_ray
    from embedingest.jobs.build_index.ray import EmbedBatches, plan_ray_index

    ray = ray_cluster
    recs = records()
    one, two = tmp_path / "one", tmp_path / "two"
    s1 = build_index(recs, out=str(one), num_workers=0, **SETTINGS)
    plan = plan_ray_index(blocks(ray, recs), two, **SETTINGS)
    EmbedBatches(**plan.actor_kwargs())(as_batch(recs[:6]))
    abandon(plan)

    plan = plan_ray_index(blocks(ray, recs), two, **SETTINGS)
    assert plan.counts["units_unchanged"] == 6 and plan.counts["vectors_removed"] == 0
    assert len(ray.get(plan.assigned).digests) == len(recs) - 6
    actor = EmbedBatches(**plan.actor_kwargs())
    tables = [actor(as_batch(recs[6:9])), actor(as_batch(recs[9:]))]

    def fail_on_the_second(table):
        if "s5" in table.column("record_id").to_pylist():
            raise ValueError("the driver's stream broke")
        return table

    results = ray.data.from_arrow(tables).map_batches(fail_on_the_second, batch_format="pyarrow",
                                                      batch_size=None, max_retries=0)
    with pytest.raises(Exception, match="the driver's stream broke"):
        plan.finish(results)

    recs[3]["text"] = "Quantum computers use qubits that can be in superposition."
    s1 = build_index(recs, out=str(one), num_workers=0, **SETTINGS)  # the same history, one process
    plan = plan_ray_index(blocks(ray, recs), two, **SETTINGS)
    assert plan.counts["units_unchanged"] == len(recs) - 2  # all but the changed and the blank one
    actor = EmbedBatches(**plan.actor_kwargs())
    tables = [actor(as_batch(recs[3:4])), actor(as_batch(recs[3:4]))]  # a call retried
    s2 = plan.finish(ray.data.from_arrow(tables))
    assert s2["units_incomplete"] == 1  # its chunks twice: removed, redone by the next run
    # ... and said: not counted as indexed, reported, and the run's status is not success
    assert (s2["units_indexed"], s2["chunks"], s2["docs"]) == (0, 0, 0)
    assert s2["exit_code"] == 3 and s2["skipped_by_reason"] == {"incomplete": 1}
    entries = [json.loads(line) for line in (two / "skipped.jsonl").read_text().splitlines()]
    last = [e for e in entries if e["reason"].startswith("incomplete")]
    assert [e["path"] for e in last] == [f"record {recs[3]['id']}"]
    assert "run again to index it" in last[0]["reason"]

    s2 = build_index_ray(blocks(ray, recs), two, records_per_call=4, **SETTINGS)
    assert s2["units_incomplete"] == 0 and s2["vectors_total"] == s1["vectors_total"]
    assert_same_index(one, two)


@pytest.mark.slow
def test_records_in_a_bucket_build_the_index_of_the_same_records(tmp_path, ray_cluster, s3, s3_endpoint):
    """The Ray path's inputs in object storage: JSON lines (plain, .gz and .zst) in a
    bucket, listed as build-index lists a prefix and read by Ray Data, give the index
    build_index makes of the same records."""
    import gzip

    import pyarrow.fs as pafs
    import zstandard

    from embedingest import build_index_ray
    from embedingest.sources.remote import walk_remote

    recs = records()
    lines = [json.dumps(r).encode() for r in recs]
    s3.put("ray/a.jsonl", b"\n".join(lines[:4]))
    s3.put("ray/b.jsonl.gz", gzip.compress(b"\n".join(lines[4:8])))
    s3.put("ray/c/d.jsonl.zst", zstandard.ZstdCompressor().compress(b"\n".join(lines[8:])))
    urls = [obj.url for obj in walk_remote(s3.url("ray"), {".jsonl", ".jsonl.gz", ".jsonl.zst"})]
    assert [u.rsplit("/", 1)[-1] for u in urls] == ["a.jsonl", "b.jsonl.gz", "d.jsonl.zst"]
    # The cluster's workers started before this test's environment: the store is named
    # to them in the filesystem handed over.
    host = s3_endpoint.removeprefix("http://")
    fs = pafs.S3FileSystem(endpoint_override=host, scheme="http", access_key="testing",
                           secret_key="testing", region="us-east-1")
    dataset = ray_cluster.data.read_json([u.removeprefix("s3://") for u in urls], filesystem=fs)
    one, two = tmp_path / "one", tmp_path / "two"
    s1 = build_index(recs, out=str(one), num_workers=0, **SETTINGS)
    # one actor: the read tasks need the cluster's other CPU
    s2 = build_index_ray(dataset, two, concurrency=1, records_per_call=4, **SETTINGS)
    for key in ("units_seen", "units_indexed", "chunks", "vectors_total", "skipped"):
        assert s2[key] == s1[key], key
    assert_same_index(one, two)


@pytest.mark.slow
def test_ray_build_uses_the_document_prompt_and_records_both(tmp_path, ray_cluster):
    """build_index_ray honours the model's prompts as build_index does."""
    from embedingest import build_index_ray

    recs = [{"id": f"r{i}", "text": f"Record {i} tells of rivers, bread and whales, part {i}."}
            for i in range(6)]
    settings = {"num_consumers": 1, "batch_size": 4, "search_k": 4}
    model = copy_model(tmp_path / "e5-like", prompts={"query": "query: ", "passage": "passage: "})
    one, two = tmp_path / "one", tmp_path / "two"
    build_index(recs, out=str(one), model=str(model), num_workers=0, **settings)
    build_index_ray(ray_cluster.data.from_items(recs), two, model=str(model), concurrency=1, **settings)
    m1, m2 = (json.loads((f / "manifest.json").read_text()) for f in (one, two))
    assert m1["prompts"] == m2["prompts"] == {"document": "passage: ", "query": "query: "}
    assert m2["search"] == {"k": 4}
    va, vb = vectors_by_id(one), vectors_by_id(two)
    assert sorted(va) == sorted(vb) and max(float(np.abs(va[i] - vb[i]).max()) for i in va) <= 1e-5

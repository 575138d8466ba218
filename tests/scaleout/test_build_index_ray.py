"""build_index_ray on a local two-CPU Ray cluster: the same ids, vectors and chunk rows as
build_index on the same records, and the same incremental behaviour."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)
from test_build_index_devices import TOPICS, chunk_rows, vectors_by_id

from embedingest import build_index, open_index

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")
SETTINGS = {"num_consumers": 1, "batch_size": 8, "chunk_tokens": 32, "overlap": 8}


def records():
    """Long records (several chunks each), short ones, and one with no tokens."""
    recs = [{"id": f"long{i}", "text": " ".join(TOPICS[i:] + TOPICS[:i])} for i in range(4)]
    recs += [{"id": f"s{i}", "text": t} for i, t in enumerate(TOPICS)]
    recs.append({"id": "blank", "text": "  "})
    return recs


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'embedingest[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def assert_same_index(a, b):
    va, vb = vectors_by_id(a), vectors_by_id(b)
    assert sorted(va) == sorted(vb)
    diff = max(float(np.abs(va[i] - vb[i]).max()) for i in va)
    assert diff <= 1e-5, diff
    assert chunk_rows(a, va) == chunk_rows(b, vb)


def test_ray_build_equals_single_process_build_and_resumes(tmp_path, ray_cluster):
    from embedingest import build_index_ray

    ray = ray_cluster
    recs = records()
    one, two = tmp_path / "one", tmp_path / "two"
    s1 = build_index(recs, out=str(one), num_workers=0, **SETTINGS)
    s2 = build_index_ray(ray.data.from_items(recs), two, concurrency=2, records_per_call=4,
                         **SETTINGS)
    for key in ("units_seen", "units_indexed", "docs", "chunks", "vectors_total", "skipped",
                "skipped_by_reason", "exit_code"):
        assert s2[key] == s1[key], key
    assert s1["chunks"] > len(recs) and s2["units_incomplete"] == 0
    assert_same_index(one, two)
    manifest = json.loads((two / "manifest.json").read_text())
    assert sum(s["count"] for s in manifest["segments"]) == s1["vectors_total"]
    assert len(manifest["segments"]) >= 2 and manifest["dtype"] == "fp32"
    assert json.loads((one / "manifest.json").read_text())["corpus"] == manifest["corpus"]
    with open_index(two) as index:
        (hits,) = index.search([TOPICS[5]], k=1)
        assert hits[0].text == TOPICS[5] and hits[0].record_id == "s5"

    # change one record, delete one, add one: both paths do the same work
    recs[5]["text"] = "Quantum computers use qubits that can be in superposition."
    del recs[7]
    recs.append({"id": "new", "text": "Arctic terns migrate from pole to pole every year."})
    s1 = build_index(recs, out=str(one), num_workers=0, **SETTINGS)
    s2 = build_index_ray(ray.data.from_items(recs), two, concurrency=2, records_per_call=4,
                         **SETTINGS)
    for key in ("units_indexed", "units_removed", "units_unchanged", "skipped", "chunks"):
        assert s2[key] == s1[key], key
    assert s2["units_indexed"] == 3  # the changed, the new and the blank one (read every run)
    assert s2["units_removed"] == 1 and s2["units_unchanged"] == len(recs) - 3
    assert_same_index(one, two)


def test_duplicate_ids_and_missing_columns_are_errors(tmp_path, ray_cluster):
    from embedingest.errors import ConfigError
    from embedingest import build_index_ray

    ray = ray_cluster
    dup = ray.data.from_items([{"id": 1, "text": "a b"}, {"id": 1, "text": "c d"}])
    with pytest.raises(ConfigError, match="record id '1' occurs more than once"):
        build_index_ray(dup, tmp_path / "a")
    no_id = ray.data.from_items([{"body": "a b"}])
    with pytest.raises(ConfigError, match="no column 'id'.*columns are body"):
        build_index_ray(no_id, tmp_path / "b", text_field="body")


def test_import_without_ray_says_how_to_install():
    code = "import sys; sys.modules['ray'] = None; import embedingest.jobs.build_index.ray"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          env=os.environ)  # PYTHONPATH: the checkout (tests/conftest.py)
    assert proc.returncode == 1
    assert "pip install 'embedingest[ray]'" in proc.stderr


def test_plan_and_embed_batches_called_directly(tmp_path, ray_cluster):
    """The three steps by hand, as a pipeline of one's own would run them: the plan
    marks every record with text pending, EmbedBatches (called here, not by Ray) embeds
    only pending records into shards and returns one row per record, finish() writes
    what build_index writes."""
    from embedingest.jobs.build_index.ray import RESULT_SCHEMA, EmbedBatches, plan_ray_index

    ray = ray_cluster
    recs = records()
    plan = plan_ray_index(ray.data.from_items(recs), tmp_path / "two", **SETTINGS)
    assert plan.pending == len(recs) and plan.dtype == "fp32"  # the blank one too: read every run
    assert plan.counts == {"units_seen": len(recs), "units_indexed": 0, "units_unchanged": 0,
                           "units_removed": 0, "vectors_removed": 0, "docs": 0, "chunks": 0}
    kwargs = plan.actor_kwargs()
    assert kwargs["config"]["batch_size"] == SETTINGS["batch_size"] and kwargs["out"] == str(tmp_path / "two")
    actor = EmbedBatches(**kwargs)
    assert actor.device == "cpu"
    first, rest = recs[:5], recs[5:]
    tables = []
    for part in (first, rest):
        batch = {"id": np.array([r["id"] for r in part], dtype=object),
                 "text": np.array([r["text"] for r in part], dtype=object)}
        table = actor(batch)
        assert table.schema == RESULT_SCHEMA
        tables.append(table)
    from embedingest.index.shard_store import ShardStore

    rows = [r for t in tables for r in t.to_pylist()]
    with ShardStore(tmp_path / "two") as store:  # the rows are in the shards the actor committed
        nos = {key[len("record:"):]: u.unit_no for key, u in store.units().items()}
        ids = [int(i) for s in store.shards() for i in s.ids()]
        chunks = store.chunks(ids)
    embedded = {r["unit_no"]: r for r in rows if r["unit_no"] >= 0}
    assert set(embedded) == set(nos.values())
    for rec in recs:
        mine = sorted((c for c in chunks.values() if c.unit_no == nos[rec["id"]]), key=lambda c: c.chunk_no)
        assert embedded[nos[rec["id"]]]["n_chunks"] == len(mine)
        assert [c.chunk_no for c in mine] == list(range(len(mine)))
        assert all(rec["text"][c.char_start:c.char_end] == c.text and c.record_id == rec["id"] for c in mine)
    assert embedded[nos["blank"]]["n_chunks"] == 0 and embedded[nos["long0"]]["n_chunks"] > 1
    assert actor.calls == 2  # one engine (and one run id) per call
    # a record that is not pending passes without work
    assert actor({"id": np.array(["nope"], dtype=object), "text": np.array(["x"], dtype=object)}).num_rows == 0
    s2 = plan.finish(ray.data.from_arrow(tables))
    s1 = build_index(recs, out=str(tmp_path / "one"), num_workers=0, **SETTINGS)
    for key in ("units_indexed", "docs", "chunks", "vectors_total", "skipped", "exit_code"):
        assert s2[key] == s1[key], key
    assert s2["units_incomplete"] == 0
    assert_same_index(tmp_path / "one", tmp_path / "two")


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

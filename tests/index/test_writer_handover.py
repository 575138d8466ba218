"""When MetadataWriter hands rows to its thread, and what close() does by default: cases
that mutation testing found untested (docs/TESTING.md)."""

from __future__ import annotations

import time

import pytest
from test_writer import chunk_rows

from embedingest.index.store import IndexStore, vector_ids
from embedingest.index.writer import MetadataWriter
from embedingest.sources.text_dataset import Chunks


def rows_in_db(store, unit_no, n):
    return len(store.chunks(vector_ids(unit_no, range(n)).tolist()))


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def store(tmp_path):
    s = IndexStore(tmp_path)
    yield s
    s.close()


def test_more_rows_than_max_rows_are_handed_over_at_once(store):
    """Rows count across batches: 4 + 4 + 4 > 10 hands over on the third batch, however
    long ago the last hand-over was (the clock alone would wait an hour here)."""
    (no,) = store.upsert_units([{"key": "a"}]).values()
    meta = MetadataWriter(store, every=3600, max_rows=10)
    texts = [f"t{i}" for i in range(12)]
    meta.add({"chunks": Chunks(chunk_rows(no, texts[:4])), "units_done": []})
    meta.add({"chunks": Chunks(chunk_rows(no, texts[:8])[4:]), "units_done": []})
    assert meta.n_rows == 8 and meta._thread is None  # 8 rows: nothing handed over yet
    meta.add({"chunks": Chunks(chunk_rows(no, texts)[8:]), "units_done": []})
    assert meta.n_rows == 0 and meta.rows == []  # handed over
    wait_until(lambda: rows_in_db(store, no, 12) == 12)
    meta.close()


def test_exactly_max_rows_waits_for_more_or_for_the_clock(store):
    (no,) = store.upsert_units([{"key": "a"}]).values()
    meta = MetadataWriter(store, every=3600, max_rows=10)
    meta.add({"chunks": Chunks(chunk_rows(no, [f"t{i}" for i in range(10)])), "units_done": []})
    assert meta.n_rows == 10 and meta._thread is None
    meta.close()
    assert rows_in_db(store, no, 10) == 10


def test_the_clock_hands_over_without_many_rows(store):
    (no,) = store.upsert_units([{"key": "a"}]).values()
    meta = MetadataWriter(store, every=0.05, max_rows=1000)
    meta.add({"chunks": Chunks(chunk_rows(no, ["x"])), "units_done": []})
    time.sleep(0.1)  # more than `every`: the next add hands both over
    meta.add({"chunks": Chunks(chunk_rows(no, ["x", "y"])[1:]), "units_done": [(no, 2)]})
    assert meta.rows == [] and meta._thread is not None
    wait_until(lambda: store.units()["a"].status == "done")
    meta.close()


def test_close_writes_what_was_added_and_raises_a_write_error(store, monkeypatch):
    (no,) = store.upsert_units([{"key": "a"}]).values()
    meta = MetadataWriter(store, every=3600)
    meta.add({"chunks": Chunks(chunk_rows(no, ["a", "b"])), "units_done": [(no, 2)]})
    assert meta.blocked_s == 0.0 and meta.write_s == 0.0
    meta.close()  # flushes by default
    assert rows_in_db(store, no, 2) == 2 and store.units()["a"].n_chunks == 2
    assert meta._thread is None and 0.0 <= meta.blocked_s < 1.0 and 0.0 < meta.write_s < 30

    def broken(rows, db):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "insert_chunk_json", broken)
    meta = MetadataWriter(store, every=3600)
    meta.add({"chunks": Chunks(chunk_rows(no, ["c"])), "units_done": []})
    with pytest.raises(OSError, match="No space left"):
        meta.close()
    assert meta._thread is None
    meta = MetadataWriter(store, every=3600)
    meta.add({"chunks": Chunks(chunk_rows(no, ["c"])), "units_done": []})
    meta.close(raise_errors=False)  # cleaning up after another failure: dropped
    assert meta._thread is None


def test_a_chunk_field_of_another_type_is_named(store):
    meta = MetadataWriter(store)
    bad = [{"unit_no": 1, "chunk_no": 0, "record_id": {"a set"}, "char_start": 0, "char_end": 1,
            "text": "x", "first": True}]
    with pytest.raises(TypeError, match=r"chunk field \{'a set'\} \(set\) is not a string or number"):
        meta.add({"chunks": bad, "units_done": []})
    meta.close(flush=False)


def test_time_blocked_and_writing_add_up_over_hand_overs(store, monkeypatch):
    """A slow disk (each write 0.05 s) behind a queue of one: the writes' times and the
    waits of ``add`` are sums over every hand-over, not the last one's. A loaded
    machine only makes both larger."""
    (no,) = store.upsert_units([{"key": "a"}]).values()
    insert = store.insert_chunk_json

    def slow_insert(rows, db):
        time.sleep(0.05)
        return insert(rows, db)

    monkeypatch.setattr(store, "insert_chunk_json", slow_insert)
    meta = MetadataWriter(store, every=0, depth=1)
    for i in range(6):
        meta.add({"chunks": Chunks(chunk_rows(no, [f"t{j}" for j in range(i + 1)])[i:]), "units_done": []})
    assert meta._thread.name == "embedingest-metadata" and meta._thread.daemon
    t0 = time.perf_counter()
    meta.close()
    elapsed = time.perf_counter() - t0
    assert rows_in_db(store, no, 6) == 6
    assert 0.25 <= meta.write_s < 30  # six writes of 0.05 s
    assert 0.08 <= meta.blocked_s < 30 + elapsed  # several adds waited for a write each

import threading
import time

import numpy as np

from embedingest.index.store import MAX_UNIT_NO, IndexStore, vector_ids
from embedingest.index.writer import MetadataWriter
from embedingest.sources.text_dataset import Chunks


def chunk_rows(unit_no, texts, record_id="r"):
    return [(unit_no << 32 | i, unit_no, record_id, i, 10 * i, 10 * i + len(t), t, i == 0)
            for i, t in enumerate(texts)]


def test_rows_arrive_exactly_and_units_are_marked_done(tmp_path):
    store = IndexStore(tmp_path)
    nos = store.upsert_units([{"key": "a"}, {"key": "b"}])
    texts = ["plain", 'quotes " and \\ backslash', "new\nline\ttab", "ünïcødé 文字 🙂", ""]
    odd = Chunks(chunk_rows(nos["a"], texts, record_id=None))
    assert odd.n_docs == 1 and len(odd) == 5 and list(odd)[3]["text"] == texts[3]
    with MetadataWriter(store) as meta:
        meta.add({"chunks": odd, "units_done": [(nos["a"], 5)]})
        meta.add({"chunks": Chunks([]), "units_done": [(nos["b"], 0)]})
    got = store.chunks(vector_ids(nos["a"], range(5)).tolist())
    assert [got[i].text for i in sorted(got)] == texts
    assert [(c.record_id, c.chunk_no, c.char_start, c.char_end) for c in got.values()][2] == (None, 2, 20, 32)
    units = store.units()
    assert (units["a"].status, units["a"].n_chunks, units["b"].status, units["b"].n_chunks) == \
        ("done", 5, "done", 0)


def test_a_redone_unit_replaces_its_rows_and_ids_use_all_64_bits(tmp_path):
    store = IndexStore(tmp_path)
    with MetadataWriter(store) as meta:
        meta.add({"chunks": Chunks(chunk_rows(MAX_UNIT_NO, ["old", "old"])), "units_done": []})
        meta.add({"chunks": Chunks(chunk_rows(MAX_UNIT_NO, ["new"])), "units_done": []})
    top = vector_ids(MAX_UNIT_NO, [0, 1]).tolist()
    assert top[0] == (2**31 - 1) << 32
    got = store.chunks(top)
    assert got[top[0]].text == "new" and got[top[1]].text == "old"
    store.delete_chunks([MAX_UNIT_NO])
    assert store.chunks(top) == {}


def test_deleting_a_unit_leaves_its_neighbours(tmp_path):
    store = IndexStore(tmp_path)
    with MetadataWriter(store) as meta:
        for unit in (4, 5, 6):
            meta.add({"chunks": Chunks(chunk_rows(unit, ["x", "y"])), "units_done": []})
    store.delete_chunks([5])
    left = store.chunks([int(i) for u in (4, 5, 6) for i in vector_ids(u, [0, 1])])
    assert sorted({i >> 32 for i in left}) == [4, 6] and len(left) == 4


def test_sqlite_without_json_functions_gets_the_same_rows(tmp_path, monkeypatch):
    from embedingest.index import store as store_mod

    monkeypatch.setattr(store_mod, "sqlite_has_json", lambda: False)
    store = IndexStore(tmp_path)
    texts = ["one", "tw\"o", "thrée"]
    with MetadataWriter(store) as meta:
        meta.add({"chunks": Chunks(chunk_rows(9, texts)), "units_done": []})
    got = store.chunks(vector_ids(9, range(3)).tolist())
    assert [got[i].text for i in sorted(got)] == texts


def test_dict_chunks_with_numpy_values(tmp_path):
    """Ray hands rows from Arrow columns: numpy integers, no id."""
    store = IndexStore(tmp_path)
    with MetadataWriter(store) as meta:
        meta.add({"chunks": [{"unit_no": 3, "record_id": "r7", "chunk_no": np.int64(i),
                              "char_start": np.int64(0), "char_end": np.int32(4), "text": "abcd"}
                             for i in range(2)], "units_done": []})
    got = store.chunks(vector_ids(3, [0, 1]).tolist())
    assert [(c.record_id, c.char_end) for c in got.values()] == [("r7", 4), ("r7", 4)]


def test_writer_keeps_up_beside_a_busy_thread(tmp_path):
    """The metadata thread must not need the GIL per row: with rows bound one by one
    (executemany) it wrote ~1,500 rows/s next to a busy Python thread, here 100k rows
    take a few seconds."""
    store = IndexStore(tmp_path)
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(range(1000))

    batches = [Chunks(chunk_rows(u, [f"paragraph {u} {i} " * 20 for i in range(1000)]))
               for u in range(100)]
    spinner = threading.Thread(target=busy)
    spinner.start()
    try:
        t0 = time.perf_counter()
        with MetadataWriter(store, every=0.05) as meta:
            for c in batches:
                meta.add({"chunks": c, "units_done": []})
        seconds = time.perf_counter() - t0
    finally:
        stop.set()
        spinner.join()
    assert store.db.execute("SELECT count(*) FROM chunks").fetchone()[0] == 100_000
    assert seconds < 30, f"100k metadata rows took {seconds:.1f} s beside a busy thread"

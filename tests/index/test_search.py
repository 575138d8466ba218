import json

import numpy as np
import pytest
from index_fixtures import DIM, build_index, build_v1, unit_vectors

from embedingest.errors import ConfigError
from embedingest.index.shard_store import ShardStore
from embedingest.index.search import Hit, open_index, read_shard
from embedingest.index.store import Manifest


class FakeEncoder:
    """Maps each text to a fixed vector, so text search needs no model."""

    def __init__(self, table):
        self.table = table
        self.calls = []

    def encode(self, texts):
        self.calls.append(list(texts))
        return np.stack([self.table[t] for t in texts])


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_search_equals_brute_force_over_all_segments(tmp_path, metric):
    built = build_index(tmp_path, n_units=8, chunks=25, metric=metric, commit_every=30, workers=3)
    queries = unit_vectors(12, seed=5)
    with open_index(built.store.folder) as index:
        assert len(index.shards) > 3 and len(index) == 200
        for k in (1, 10, 200, 500):
            scores, ids = index.search_raw(queries, k)
            want_s, want_i = built.brute_force(queries, min(k, 200), metric)
            np.testing.assert_array_equal(ids, want_i)
            np.testing.assert_allclose(scores, want_s, rtol=1e-4, atol=1e-5)


def test_hits_carry_chunk_metadata(tmp_path):
    built = build_index(tmp_path, n_units=3, chunks=10)
    query = built.emb[13]  # exactly one stored vector
    with open_index(built.store.folder) as index:
        (hits,) = index.search_vectors(query, k=3)
    first = hits[0]
    assert [h.rank for h in hits] == [1, 2, 3] and first.id == built.ids[13]
    unit_no, chunk_no = int(built.ids[13] >> 32), int(built.ids[13] & 0xFFFFFFFF)
    key = next(k for k, v in built.unit_nos.items() if v == unit_no)
    assert first == Hit(1, pytest.approx(1.0, abs=1e-5), int(built.ids[13]), key, f"rec{unit_no}",
                        chunk_no, 10 * chunk_no, 10 * chunk_no + 9, f"text {key} {chunk_no}")
    assert hits[0].score >= hits[1].score >= hits[2].score


def test_text_queries_use_the_encoder(tmp_path):
    built = build_index(tmp_path, n_units=2, chunks=10)
    enc = FakeEncoder({"alpha": built.emb[3], "beta": built.emb[17]})
    with open_index(built.store.folder, encoder=enc) as index:
        assert index.search("alpha", k=1)[0][0].id == built.ids[3]
        both = index.search(["alpha", "beta"], k=2)
        assert [h[0].id for h in both] == [built.ids[3], built.ids[17]]
        assert index.search([]) == []
        with pytest.raises(ConfigError, match=r"query 1 \('  '\) is empty"):
            index.search(["alpha", "  "])
    assert enc.calls == [["alpha"], ["alpha", "beta"]]


@pytest.mark.parametrize("factory,params", [("IVF4,Flat", "nprobe=4"), ("HNSW16", "efSearch=256")])
def test_ivf_and_hnsw_with_search_params_equal_brute_force(tmp_path, factory, params):
    built = build_index(tmp_path, n_units=5, chunks=30, factory=factory, commit_every=70)
    queries = unit_vectors(6, seed=3)
    with open_index(built.store.folder, params=params) as index:
        scores, ids = index.search_raw(queries, 10)
    want_s, want_i = built.brute_force(queries, 10)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_allclose(scores, want_s, rtol=1e-5)


def test_segments_are_memory_mapped_where_faiss_can(tmp_path):
    built = build_index(tmp_path, n_units=2, chunks=10)
    path = built.store.shards()[0].path
    index = read_shard(path, "s0")
    maps = open("/proc/self/maps").read()
    assert str(path) in maps and index.ntotal > 0


def test_empty_index_and_errors(tmp_path):
    store = ShardStore(tmp_path / "empty")
    store.create_or_open(Manifest(model={"name": "m"}, dim=DIM))
    with open_index(store.folder) as index:
        assert index.search_vectors(unit_vectors(3), k=5) == [[], [], []]
        with pytest.raises(ConfigError, match=r"\(n, 16\)"):
            index.search_raw(np.zeros((2, 8)), 5)
        with pytest.raises(ConfigError, match="'m'.*not on this machine"):
            index.search("hello")
    with pytest.raises(ConfigError, match="not an embedingest index"):
        open_index(tmp_path / "missing")


def test_a_format_1_index_is_refused_not_read(tmp_path):
    folder = tmp_path / "old"
    build_v1(folder)
    before = sorted((p.relative_to(folder), p.stat().st_mtime_ns) for p in folder.rglob("*"))
    with pytest.raises(ConfigError) as err:
        open_index(folder)
    assert str(err.value).startswith(
        f"the index at {str(folder)!r} is in format 1 (chunk metadata in metadata.sqlite), which this "
        "embedingest no longer reads. Rebuild it in format 2 with:\n  embedingest build-index CORPUS --out ")
    assert sorted((p.relative_to(folder), p.stat().st_mtime_ns) for p in folder.rglob("*")) == before


def test_search_params_that_do_not_apply(tmp_path):
    built = build_index(tmp_path, n_units=1, chunks=3)
    with pytest.raises(ConfigError, match="'nprobe=4' do not apply.*'Flat'"):
        open_index(built.store.folder, params="nprobe=4")


def test_garbage_and_interrupted_removal_are_invisible_to_search(tmp_path, monkeypatch):
    import embedingest.index.shard_edit as shard_edit

    built = build_index(tmp_path, n_units=3, chunks=20, commit_every=25)
    store, gone = built.store, list(built.unit_nos.values())[1]
    shards = store.shards_dir
    (shards / ".shard-z-w0-00000.parquet.tmp-1").write_bytes(b"partial")
    (shards / "shard-z-w0-00000.faiss").write_bytes(b"never committed")
    monkeypatch.setattr(shard_edit, "delete_shard", lambda shard: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # one replacement committed, its old shard not yet deleted
        store.remove_units([gone])
    monkeypatch.undo()
    queries = unit_vectors(4, seed=9)
    with open_index(store.folder) as index:  # shard by shard: no id twice, every hit has its row
        hits = index.search_vectors(queries, 100)
        assert all(len({h.id for h in row}) == len(row) and all(h.text for h in row) for row in hits)
    store.remove_units([gone])  # what the next build does first
    keep = built.ids >> 32 != gone
    with open_index(store.folder) as index:
        scores, ids = index.search_raw(queries, 100)
    want_s, want_i = built.brute_force(queries, 100, keep=keep)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_allclose(scores, want_s, rtol=1e-5)


def test_text_search_with_the_manifest_model(tmp_path):
    from embedingest.index.shards import BatchMeta, encode_chunks
    from embedingest.sinks.shard_writer import ShardWriterFactory
    from embedingest.stages.encoder import TextEncoder
    encoder = TextEncoder.load(None, "cpu", "fp32")
    texts = ["the cat sat on the mat", "stock markets fell sharply", "a recipe for lemon cake"]
    model = {**encoder.info(), "path": "/built/elsewhere", "dtype": "fp16"}
    store = ShardStore(tmp_path)
    store.create_or_open(Manifest(model=model, dim=encoder.dim, dtype="fp16"))
    nos = store.upsert_units([{"key": "news.txt"}])
    ids = (nos["news.txt"] << 32) + np.arange(3, dtype=np.int64)
    rows = encode_chunks(ids.tolist(), ["news.txt"] * 3, [None] * 3, [0, 1, 2], [0] * 3,
                         [len(t) for t in texts], texts)
    sink = ShardWriterFactory(tmp_path, encoder.dim)(0)
    sink(BatchMeta(0, rows, ((nos["news.txt"], 3),)),
         {"emb": encoder.encode(texts).astype(np.float16), "ids": ids})
    sink.close()
    with open_index(tmp_path) as index:  # fp16 on a GPU, elsewhere: bundled model in fp32
        hits = index.search(["baking a cake", "shares dropped"], k=2)
        assert [h[0].text for h in hits] == [texts[2], texts[1]]
        assert hits[0][0].source == "news.txt" and hits[0][0].score > hits[0][1].score
        for blank in ("\ufffd", "\u0301\u0302", "\u0301 \ufffd"):  # printable, yet the tokenizer drops them
            with pytest.raises(ConfigError) as err:
                index.search(["cake", blank])
            assert str(err.value) == (f"query 1 ({blank!r}) holds nothing the model reads (its tokenizer "
                                      "drops every character); give each query some words")
        assert len(index.search(["\u00e9"], k=1)[0]) == 1  # an accented letter is read
        for unread in ("\U0001f600\U0001f600", "\U0001f600 \u2603"):  # every token [UNK]: arbitrary hits before
            with pytest.raises(ConfigError) as err:
                index.search([unread])
            assert str(err.value) == (f"query 0 ({unread!r}) holds nothing the model reads (its tokenizer "
                                      "knows none of its characters: [UNK] only); give each query some words")
        assert len(index.search(["cake \U0001f600"], k=1)[0]) == 1  # one word it knows is enough
    with open_index(tmp_path, device="cpu:0") as on_cpu0:  # safetensors refused the name: a traceback
        assert [h[0].text for h in on_cpu0.search(["baking a cake"], k=1)] == [texts[2]]
    # a query prompt of all the model's 256 tokens ([CLS] + 254 + [SEP]): every query was cut off
    # whole after it, each got the same hits, exit 0
    with open_index(tmp_path, query_prompt="a " * 254) as crowded:
        with pytest.raises(ConfigError) as err:
            crowded.search(["baking a cake"])
        assert str(err.value) == (
            f"the query prompt {'a ' * 30 + '...'!r} is 256 tokens long (with the model's own), and the model "
            "reads 256: no word of a query would be read, and every query would get the same hits; give a "
            "shorter prompt (--query-prompt, query_prompt=)")
    with open_index(tmp_path, query_prompt="a " * 253) as roomy:  # a token of the query is read
        assert len(roomy.search(["cake"], k=1)[0]) == 1


@pytest.mark.parametrize("given, message", [
    ({"params": 5}, "params=5: give text (e.g. 'nprobe=16'), or None for the index's"),
    ({"query_prompt": 5}, "query_prompt=5: give text (e.g. 'query: '), or None for the index's"),
    ({"device": "tpu"}, "device='tpu' is not a device; use auto, cuda, cuda:N or cpu"),
])
def test_open_index_names_an_argument_of_the_wrong_kind(tmp_path, given, message):
    """Before: AttributeError ('int' object has no attribute 'split') at the first search,
    a TypeError adding the prompt to a query, safetensors' error for a device."""
    with pytest.raises(ConfigError) as err:
        open_index(tmp_path, **given)
    assert str(err.value) == message


def test_open_index_refuses_an_unknown_query_runtime(tmp_path):
    with pytest.raises(ConfigError, match="query runtime 'gpu' is not one of auto, torch, onnx"):
        open_index(tmp_path, query_runtime="gpu")


def test_while_overwrite_rebuilds_readers_are_answered_from_the_index_set_aside(tmp_path):
    """During build-index --overwrite the folder holds the rebuild's first shards (or
    none): search printed [] and serve answered no hits until it finished. Readers now
    open the whole index set aside in .overwritten/, and a server switches back once the
    rebuild is done."""
    from embedingest.index.shard_store import ASIDE_DIR, SetAside, ShardStore, drop_set_aside
    from embedingest.serve.live import LiveIndex

    built = build_index(tmp_path, n_units=3, chunks=10)
    queries = built.emb[:2]
    with open_index(tmp_path) as index:
        want = index.search_raw(queries, 5)
    aside = SetAside(ShardStore(tmp_path))  # as a rebuild does before it writes
    ShardStore(tmp_path).create_or_open(Manifest(model={"name": "m"}, dim=DIM))  # its first, empty state
    live = LiveIndex(open_index(tmp_path), lambda encoder: open_index(tmp_path), check_every=0, folder=tmp_path)
    assert live.current().store.folder == tmp_path / ASIDE_DIR and live.current().ntotal == 30
    np.testing.assert_array_equal(live.current().search_raw(queries, 5)[1], want[1])
    drop_set_aside(tmp_path)  # the rebuild finished (with nothing in it, here)
    assert aside.moved and live.current().store.folder == tmp_path and live.current().ntotal == 0
    assert live.refresh() is live.current()


def test_a_shard_of_another_metric_than_the_manifest_s_is_refused_not_ranked_wrongly(tmp_path):
    """A shard's vectors file swapped for one of the same vectors and ids under L2 (the
    same size: the record's check passes), or the manifest's metric edited. Before: the
    shard's L2 distances were merged as inner products, the farthest chunks ranked first."""
    import faiss

    built = build_index(tmp_path, n_units=3, chunks=10, workers=1)
    folder = built.store.folder
    (path,) = sorted((folder / "shards").glob("*.faiss"))
    index = faiss.read_index(str(path))
    swapped = faiss.IndexIDMap(faiss.IndexFlatL2(DIM))
    swapped.add_with_ids(index.index.reconstruct_n(0, index.ntotal), faiss.vector_to_array(index.id_map))
    size = path.stat().st_size
    faiss.write_index(swapped, str(path))
    assert path.stat().st_size == size
    name = path.name[: -len(".faiss")]
    with pytest.raises(ConfigError) as err:
        open_index(folder)
    assert str(err.value) == (
        f"{str(path)!r} holds vectors compared by metric 'l2', but the manifest says 'ip': their scores cannot "
        "be merged (the hits would be ranked wrongly); the shard is damaged or the manifest was changed: put "
        f"back the manifest's metric, or delete that shard's files (every file named {name}.*) and run the same "
        "build-index command again: the units it held are redone")
    faiss.write_index(index, str(path))
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(dict(manifest, metric="l2")))
    with pytest.raises(ConfigError, match=r"holds vectors compared by metric 'ip', but the manifest says 'l2'"):
        open_index(folder)

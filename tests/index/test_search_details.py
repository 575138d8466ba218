"""open_index and Index: defaults, messages, empty and partial results, the read fallback:
cases that mutation testing found untested (docs/TESTING.md)."""

from __future__ import annotations

import os
from pathlib import Path

import faiss
import numpy as np
import pytest
from index_fixtures import DIM, unit_vectors
from index_fixtures import build_index

import embedingest.index.search as search_mod
from embedingest.errors import ConfigError
from embedingest.index.shard_store import ShardStore
from embedingest.index.lookup import ShardRows
from embedingest.index.search import Index, open_index, read_shard
from embedingest.index.store import IndexStore, Manifest


class FakeEncoder:
    def __init__(self, vectors):
        self.vectors = vectors

    def encode(self, texts):
        return np.stack([self.vectors[int(t)] for t in texts])


def test_read_segment_tries_each_mmap_mode_then_reads_into_memory(tmp_path, monkeypatch):
    built = build_index(tmp_path, n_units=2, chunks=5)
    seg = built.store.shards()[0]
    path, n = seg.path, seg.count
    real = faiss.read_index
    calls = []

    def flaky(name, *flags, refuse=()):
        calls.append(flags)
        if flags and flags[0] in refuse:
            raise RuntimeError("cannot mmap this kind")
        return real(name, *flags)

    first, second = search_mod._MMAP_FLAGS
    monkeypatch.setattr(faiss, "read_index", lambda n, *f: flaky(n, *f, refuse=(first,)))
    assert read_shard(path, "s0").ntotal == n and calls == [(first,), (second,)]
    calls.clear()
    monkeypatch.setattr(faiss, "read_index", lambda n, *f: flaky(n, *f, refuse=(first, second)))
    assert read_shard(path, "s0").ntotal == n and calls == [(first,), (second,), (0,)]  # 0: into memory


def test_defaults_device_and_close(tmp_path):
    built = build_index(tmp_path, n_units=2, chunks=10)
    with open_index(tmp_path) as index:
        assert index.device == "cpu"
    index = open_index(tmp_path, device="cuda:1")  # only kept until a text query loads the encoder
    assert index.device == "cuda:1"
    index.close()
    for closed in (lambda: index.ntotal, lambda: len(index)):  # 0 read as an empty index
        with pytest.raises(ConfigError, match="was closed: open it again with open_index"):
            closed()
    bare = Index(IndexStore(tmp_path), built.store.read_manifest(), [])
    assert (bare.device, bare.query_runtime) == ("cpu", "torch")


def test_k_defaults_to_ten_and_is_passed_on(tmp_path):
    built = build_index(tmp_path, n_units=2, chunks=10)
    q = built.emb[:2]
    with open_index(tmp_path, encoder=FakeEncoder(built.emb)) as index:
        assert index.search_raw(q)[1].shape == (2, 10)
        assert [len(h) for h in index.search_vectors(q)] == [10, 10]
        assert [len(h) for h in index.search(["0", "1"])] == [10, 10]
        assert [len(h) for h in index.search(["0", "1"], k=3)] == [3, 3]


def test_messages_name_the_bad_value(tmp_path):
    build_index(tmp_path, n_units=1, chunks=4)
    with open_index(tmp_path, encoder=FakeEncoder({})) as index:
        with pytest.raises(ConfigError) as err:
            index.search(["ok", " "])
        assert str(err.value) == "query 1 (' ') is empty or not text; give each query some words"
        with pytest.raises(ConfigError) as err:  # control characters only: the tokenizer drops them
            index.search(["\x00\x01\u200b\x7f"])
        assert str(err.value) == ("query 0 ('\\x00\\x01\\u200b\\x7f') is empty or not text; give each query "
                                  "some words")
        with pytest.raises(ConfigError) as err:
            index.search_raw(np.zeros(3, np.float32))
        assert str(err.value) == (f"query vectors of shape (3,), expected (n, {DIM}) for the index "
                                  f"at {str(tmp_path)!r}")
        with pytest.raises(ConfigError) as err:
            index.search_raw(np.zeros((1, DIM), np.float32), k=0)
        assert str(err.value) == "k must be a positive integer, got 0"
        for k in (True, 2.5):  # a bool is an int to Python, not a count here
            with pytest.raises(ConfigError) as err:
                index.search_raw(np.zeros((1, DIM), np.float32), k=k)
            assert str(err.value) == f"k must be a positive integer, got {k!r}"
    with pytest.raises(ConfigError) as err:
        open_index(tmp_path, params="nprobe=4")
    assert str(err.value) == (f"search parameters 'nprobe=4' do not apply to the index at {str(tmp_path)!r} "
                              "(factory 'Flat'): params='nprobe=4': it has no parameter nprobe; it takes no "
                              "search parameters: leave out params")


def test_an_index_with_no_vectors_answers_empty_arrays(tmp_path):
    store = ShardStore(tmp_path)
    store.create_or_open(Manifest(model={"name": "m"}, dim=DIM))
    store.close()
    with open_index(tmp_path) as index:
        scores, ids = index.search_raw(unit_vectors(2), k=5)
        assert (scores.shape, scores.dtype, ids.shape, ids.dtype) == ((2, 0), np.float32, (2, 0), np.int64)
        assert index.search_vectors(unit_vectors(2), k=5) == [[], []]


def test_fewer_hits_than_k(tmp_path):
    """An IVF index probing one list of four finds fewer than k for some queries (faiss
    pads with -1): each query's hits stop there, the others still come. (Vectors without
    rows cannot happen in format 2: a shard commits both or neither.)"""
    built = build_index(tmp_path, n_units=4, chunks=10, factory="IVF4,Flat")
    with open_index(tmp_path, params="nprobe=1") as index:  # its own default probes all four
        hits = index.search_vectors(built.emb[:5], k=40)
    assert all(len(h) < 40 for h in hits) and all(len(h) > 0 for h in hits)
    assert all(h.source is not None for row in hits for h in row)



def test_a_vector_found_without_its_row_is_refused_with_what_to_do(tmp_path, monkeypatch):
    """A shard commits its vectors and rows together, so only a damaged file could do this:
    one row is hidden from the lookup, and a search that finds its vector says what to do."""
    built = build_index(tmp_path, n_units=2, chunks=10)
    victim = int(built.ids[3])
    real = ShardRows.chunks
    monkeypatch.setattr(ShardRows, "chunks",
                        lambda self, ids: {i: c for i, c in real(self, ids).items() if i != victim})
    with open_index(tmp_path) as index:
        assert index.search_vectors(built.emb[4], k=1)[0][0].id == built.ids[4]
        with pytest.raises(ConfigError) as err:
            index.search_vectors(built.emb[3], k=2)
    assert str(err.value) == (
        f"1 of the vectors found have no metadata row in its shard's Parquet file (e.g. id {victim}): "
        "the last build of this index was stopped before it finished (or one is running now); run the "
        "same build-index command again to finish it, then search")


def test_the_manifest_s_query_prompt_goes_before_each_query_unless_the_caller_gives_one(tmp_path):
    built = build_index(tmp_path, n_units=1, chunks=4)
    manifest = built.store.read_manifest()
    manifest.prompts = {"query": "query: ", "document": "passage: "}
    built.store.write_manifest(manifest)
    seen = []

    class Recorder(FakeEncoder):
        def encode(self, texts):
            seen.append(list(texts))
            return np.stack([built.emb[0] for _ in texts])
    for prompt, want in ((None, "query: 1"), ("", "1"), ("find: ", "find: 1")):
        with open_index(tmp_path, encoder=Recorder(None), query_prompt=prompt) as index:
            index.search(["1"], k=1)
        assert seen.pop() == [want]


def test_closing_an_index_closes_its_shards_parquet_files(tmp_path):
    build_index(tmp_path, n_units=2, chunks=10)

    def open_parquet():
        fds = os.listdir("/proc/self/fd")
        return sorted(p for p in (os.path.realpath(f"/proc/self/fd/{fd}") for fd in fds) if p.endswith(".parquet"))
    before = open_parquet()
    index = open_index(tmp_path)
    index.search_vectors(unit_vectors(2), k=3)
    assert len(open_parquet()) > len(before)  # the rows were read from them
    index.close()
    assert open_parquet() == before


class _Loaded:
    """What ``TextEncoder.load`` gives, as ``_load_encoder`` reads it: a name and a dim."""

    def __init__(self, name, dim):
        self.name, self.dim = name, dim

    def info(self):
        return {"name": self.name, "dim": self.dim}


@pytest.fixture
def loads(monkeypatch):
    """``TextEncoder.load``, ``resolve_model`` and ``use_query_runtime`` replaced by
    recorders: ``loads.calls`` says what each was given; ``loads.answer`` is the
    (name, dim) the next load gives; names in ``loads.unresolved`` are not found."""
    from embedingest.stages import encoder as encoder_mod, model_folder, query_runtime

    class Loads:
        calls = []
        answer = ("org/m", DIM)
        unresolved = set()

    def load(model, device, dtype):
        Loads.calls.append(("load", model, device, dtype))
        return _Loaded(*Loads.answer)

    def resolve(name):
        Loads.calls.append(("resolve", name))
        if name in Loads.unresolved:
            raise ConfigError(f"{name} is not in the cache")
        return Path(f"/resolved/{name}"), name

    def use(encoder, runtime, cache_dir, threads):
        Loads.calls.append(("runtime", encoder, runtime, cache_dir, threads))
        return runtime

    monkeypatch.setattr(encoder_mod.TextEncoder, "load", staticmethod(load))
    monkeypatch.setattr(model_folder, "resolve_model", resolve)
    monkeypatch.setattr(query_runtime, "use_query_runtime", use)
    return Loads


def _empty_index(folder, model, dtype="fp32", **kw):
    store = ShardStore(folder)
    store.create_or_open(Manifest(model=model, dim=DIM, dtype=dtype))
    store.close()
    return open_index(folder, **kw)


def test_the_manifest_s_model_is_loaded_from_its_folder_on_the_device_in_its_dtype(tmp_path, loads, monkeypatch):
    """fp16 becomes fp32 on the CPU only; the encoder gets the runtime asked for, with the
    cache folder given, else the default one, and torch's thread count."""
    import torch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr("embedingest.stages.device.resolve_device", lambda device: device)  # cuda:1 here too
    folder = tmp_path / "model"
    folder.mkdir()
    model = {"name": "org/m", "path": str(folder)}
    threads = torch.get_num_threads()
    cases = [("cpu", "fp16", {"query_runtime": "onnx", "cache_dir": str(tmp_path / "c")}, "fp32", "onnx",
              str(tmp_path / "c")),
             ("cuda:1", "fp16", {}, "fp16", "torch", tmp_path / "xdg" / "embedingest"),
             ("cpu", "bf16", {"query_runtime": "auto"}, "bf16", "auto", tmp_path / "xdg" / "embedingest")]
    for n, (device, dtype, kw, loaded_dtype, runtime, cache) in enumerate(cases):
        with _empty_index(tmp_path / f"index{n}", model, dtype, device=device, **kw) as index:
            encoder = index.encoder
            assert index.encoder is encoder and isinstance(encoder, _Loaded)
        assert loads.calls == [("load", str(folder), device, loaded_dtype),
                               ("runtime", encoder, runtime, cache, threads)]
        loads.calls.clear()


def test_a_gpu_torch_does_not_see_is_named_as_the_device_not_as_the_model(tmp_path, loads, monkeypatch):
    """Before: 'the model ... cannot be loaded from ... (device='cuda' asks for a GPU ...): put
    the model back there', though the model was there."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    folder = tmp_path / "model"
    folder.mkdir()
    with _empty_index(tmp_path / "index", {"name": "org/m", "path": str(folder)}, device="cuda") as index:
        with pytest.raises(ConfigError) as err:
            index.search("hello")
    assert str(err.value) == "device='cuda' asks for a GPU but torch sees no CUDA device; use device cpu"
    assert loads.calls == []


def test_a_model_folder_not_on_this_machine_is_found_by_its_name(tmp_path, loads):
    """The bundled model's name or a Hugging Face id (a path missing, or none): the
    folder ``resolve_model`` gives is loaded."""
    from embedingest.stages.model_folder import BUNDLED_NAME

    for n, model in enumerate(({"name": BUNDLED_NAME, "path": str(tmp_path / "gone")},
                               {"name": "org/m"}, {"name": "org/m", "path": ""})):
        loads.answer = (model["name"], DIM)
        with _empty_index(tmp_path / f"index{n}", model) as index:
            assert isinstance(index.encoder, _Loaded)
        assert loads.calls[:2] == [("resolve", model["name"]),
                                   ("load", f"/resolved/{model['name']}", "cpu", "fp32")]
        loads.calls.clear()


def test_a_model_neither_on_this_machine_nor_found_by_its_name_is_refused_with_what_to_do(tmp_path, loads):
    loads.unresolved = {"org/other"}
    for n, model in enumerate(({"name": "../m", "path": "/nowhere"}, {"path": "/nowhere"},
                               {"name": "org/other"})):
        folder = tmp_path / f"index{n}"
        with _empty_index(folder, model) as index, pytest.raises(ConfigError) as err:
            index.search("hello")
        name, path = model.get("name"), model.get("path")
        if name == "org/other":
            assert loads.calls == [("resolve", name)]
            assert str(err.value) == (f"the model of {str(folder)!r} ('org/other') is not on this machine "
                                      "(path None) and not found by its name: org/other is not in the cache")
            assert isinstance(err.value.__cause__, ConfigError)
        else:
            assert loads.calls == []
            assert str(err.value) == (f"the model of {str(folder)!r} ({name!r}) is not on this machine "
                                      f"(path {path!r}): put the model folder there (from Python, pass "
                                      "encoder= or query vectors)")
        loads.calls.clear()


def test_a_model_of_another_name_or_dim_than_the_index_s_is_refused(tmp_path, loads):
    folder = tmp_path / "model"
    folder.mkdir()
    for n, answer in enumerate((("org/other", DIM), ("org/m", DIM + 1))):
        loads.answer = answer
        with _empty_index(tmp_path / f"index{n}", {"name": "org/m", "path": str(folder)}) as index:
            with pytest.raises(ConfigError) as err:
                index.search("hello")
        assert str(err.value) == (f"model at {str(folder)!r} is {answer[0]!r} (dim {answer[1]}), but the "
                                  f"index was built with 'org/m' (dim {DIM}): rebuild with --overwrite or "
                                  "pass encoder=")
        assert [c[0] for c in loads.calls] == ["load"]
        loads.calls.clear()


def test_the_store_of_an_open_index_is_a_reader_that_creates_nothing(tmp_path):
    """``Index.store`` is opened read-only: its units database, when missing, is refused by
    name, never created."""
    from embedingest.index.store import UNITS_NAME

    build_index(tmp_path, n_units=1, chunks=4)
    (tmp_path / UNITS_NAME).unlink()
    before = sorted(p.name for p in tmp_path.iterdir())
    with open_index(tmp_path) as index:
        assert index.store.read_only is True
        with pytest.raises(ConfigError) as err:
            index.store.units()
    assert str(err.value) == (
        f"{str(tmp_path / UNITS_NAME)!r} does not exist: the build of this index was stopped before it "
        "wrote any metadata, or the file was deleted; run the same build-index command again to finish it")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_model_folder_emptied_after_the_build_is_refused_with_a_search_s_advice(tmp_path):
    """The folder is still there but holds no model: the loader's message told a search user
    to pass another folder (a build's advice); it now says what a search can do."""
    import shutil

    from model_fixtures import copy_model

    from embedingest import build_index as build

    model = copy_model(tmp_path / "mm")
    build([("1", "hello world")], out=str(tmp_path / "idx"), model=str(model), num_workers=0, num_consumers=1)
    shutil.rmtree(model)
    model.mkdir()
    with open_index(tmp_path / "idx") as index, pytest.raises(ConfigError) as err:
        index.search("hello")
    assert str(err.value) == (
        f"the model of {str(tmp_path / 'idx')!r} ('mm') cannot be loaded from {str(model)!r}, where the index "
        f"was built with it ({model} is not a model folder: it holds neither modules.json "
        "(sentence-transformers) nor config.json (Hugging Face)): put the model back there (from Python, pass "
        "encoder= or query vectors)")
    assert isinstance(err.value.__cause__, ConfigError)


def test_a_search_under_way_finishes_when_another_thread_closes_the_index(tmp_path):
    """close() freed the shards and rows under a search in another thread: ArrowInvalid
    (closed file) and OSError (posix_madvise) came out of it, besides 'was closed'."""
    import threading

    build_index(tmp_path, n_units=4, chunks=40)
    q = unit_vectors(4, seed=7)
    for trial in range(30):
        index = open_index(tmp_path)
        errors, started = [], threading.Event()

        def loop():
            try:
                while True:
                    started.set()
                    assert len(index.search_vectors(q, 5)) == 4
            except ConfigError as exc:
                errors.append(exc)
            except BaseException as exc:  # anything else is the defect
                errors.append(exc)

        worker = threading.Thread(target=loop)
        worker.start()
        started.wait()
        index.close()
        worker.join(10)
        assert not worker.is_alive()
        [error] = errors
        assert isinstance(error, ConfigError) and "was closed" in str(error), (trial, repr(error))


def test_queries_of_the_wrong_kind_an_index_s_pickle_and_pyarrow_texts(tmp_path):
    """A dict was searched by its keys; a text given to search_raw was numpy's
    ValueError; pickling named a lambda of ShardRows; pyarrow strings were 'not text'."""
    import pickle

    import pyarrow as pa

    built = build_index(tmp_path, n_units=2, chunks=10)
    with open_index(tmp_path, encoder=FakeEncoder(built.emb)) as index:
        with pytest.raises(ConfigError, match=r"^queries is a dict: its keys would be searched; give a list of texts"):
            index.search({"0": "apple"})
        with pytest.raises(ConfigError, match=rf"^query vectors of type str are no numbers .*: give an array of "
                                              rf"shape \(n, {DIM}\); texts go to search\(\)$"):
            index.search_raw("apple")
        with pytest.raises(TypeError, match=rf"^an Index does not pickle .*open_index\({str(tmp_path)!r}\)$"):
            pickle.dumps(index)
        want = [[h.id for h in hits] for hits in index.search(["0", "3"], 4)]
        for texts in (pa.array(["0", "3"]), pa.chunked_array([["0"], ["3"]])):
            assert [[h.id for h in hits] for hits in index.search(texts, 4)] == want


def test_a_forked_child_searches_after_its_parent_did(tmp_path):
    """faiss's OpenMP pool does not survive a fork: a child's first search, after the
    parent's, hung for ever (a multiprocessing.Pool of an ETL job)."""
    import subprocess
    import sys
    import textwrap

    build_index(tmp_path, n_units=2, chunks=10)
    code = textwrap.dedent(f"""
        import multiprocessing as mp
        import numpy as np
        from embedingest.index.search import open_index
        index = open_index({str(tmp_path)!r})
        q = np.ones((1, {DIM}), np.float32) / {DIM} ** 0.5
        here = index.search_raw(q, 3)[1].tolist()
        def work(_):
            return index.search_raw(q, 3)[1].tolist()
        if __name__ == "__main__":
            with mp.get_context("fork").Pool(1) as pool:
                there = pool.map_async(work, [0]).get(timeout=30)[0]
            print(here == there and len(here[0]) == 3)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]

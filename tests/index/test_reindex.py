"""reindex: another faiss factory from the saved embeddings, switched by the manifest."""

import errno
import json
import logging
import os
import shlex
import shutil

import faiss
import numpy as np
import pytest
from click.testing import CliRunner
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)
from shard_fixtures import DIM, build_shards, recommit_file, unit_vectors

import embedingest.index.reindex as reindex_mod
from embedingest.cli import main
from embedingest.errors import ConfigError
from embedingest.index.faiss_factory import faiss_message
from embedingest.index.reindex import reindex
from embedingest.index.search import open_index
from embedingest.index.shards import EMB_SUFFIX, clean_shards, list_shards
from embedingest.outfiles import write_faiss_index


def search_all(folder, generation, queries, k, params=None):
    """Merged top-k over every shard's vectors file of ``generation``."""
    heap = faiss.ResultHeap(len(queries), k, keep_max=True)
    for shard in list_shards(folder / "shards", generation=generation):
        index = faiss.read_index(str(shard.faiss_path(generation)))
        if params:
            faiss.ParameterSpace().set_index_parameters(index, params)
        heap.add_result(*index.search(queries, k))
    heap.finalize()
    return heap.D, heap.I


@pytest.mark.parametrize("factory", ["L2norm,Flat", "L2norm,IVF4,Flat"])
def test_reindex_to_a_factory_faiss_cannot_clone(tmp_path, factory):
    """faiss clones no L2norm transform: reindex ended in 'clone not supported for this type
    of VectorTransform' with a traceback, where build-index takes the factory."""
    folder = tmp_path / "ix"
    built = build_shards(folder, n_units=4, chunks=25, commit_every=60, workers=2)
    assert reindex(folder, factory, train_size=100, search_params="nprobe=4" if "IVF" in factory else None
                   )["vectors"] == 100
    q = unit_vectors(3, seed=9)
    _, ids = search_all(folder, 1, q, 5, "nprobe=4" if "IVF" in factory else None)
    emb16 = built.emb.astype(np.float16).astype(np.float32)
    cosine = q @ (emb16 / np.linalg.norm(emb16, axis=1, keepdims=True)).T  # L2norm: the vectors normalised
    assert np.array_equal(ids, built.ids[np.argsort(-cosine, axis=1)[:, :5]])


def test_reindex_to_ivf_gives_exact_results_with_every_list_probed(tmp_path):
    folder = tmp_path / "ix"
    built = build_shards(folder, n_units=8, chunks=25, commit_every=60, workers=2)
    summary = reindex(folder, "IVF4,Flat", train_size=150, search_params="nprobe=4")
    assert summary == {"index": str(folder), "factory": "IVF4,Flat", "previous_factory": "Flat",
                       "generation": 1, "shards": len(list_shards(folder / "shards", generation=1)), "vectors": 200,
                       "trained": True, "search_params": "nprobe=4"}
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["factory"], manifest["generation"], manifest["search"]) == ("IVF4,Flat", 1,
                                                                                 {"params": "nprobe=4"})
    names = os.listdir(folder / "shards")
    assert not [n for n in names if n.endswith(".faiss") and ".g1." not in n]  # old vectors deleted
    assert "trained.g1.faiss" in os.listdir(folder)
    q = unit_vectors(5, seed=7)
    scores, ids = search_all(folder, 1, q, 10, "nprobe=4")
    emb16 = built.emb.astype(np.float16).astype(np.float32)  # what was saved
    exact = np.argsort(-(q @ emb16.T), axis=1)[:, :10]
    assert np.array_equal(ids, built.ids[exact])
    assert np.allclose(scores, np.take_along_axis(q @ emb16.T, exact, 1), atol=1e-5)
    again = reindex(folder, "Flat", search_params=None)  # nprobe does not apply to Flat: dropped
    assert (again["generation"], again["trained"], again["search_params"]) == (2, False, None)
    assert np.array_equal(search_all(folder, 2, q, 10)[1], built.ids[exact])
    assert not (folder / "trained.g1.faiss").exists()


def test_a_crash_before_the_manifest_leaves_the_old_index_and_no_new_files(tmp_path, monkeypatch):
    """A Ctrl-C before the switch, or a full disk at the second shard: the index is as it
    was, and the next generation's files written so far are gone (they stayed, taking
    the disk, until the next successful run)."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=3, chunks=10, commit_every=20, workers=2)
    before = json.loads((folder / "manifest.json").read_text())
    def files_now():
        return sorted(p.name for p in folder.rglob("*") if p.name != ".run.lock")  # reindex's lock stays
    files = files_now()
    import embedingest.index.store as store_mod

    def crash(self, manifest):
        raise KeyboardInterrupt
    monkeypatch.setattr(store_mod.IndexStore, "write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        reindex(folder, "IVF2,Flat")
    monkeypatch.undo()
    calls = []

    def full_disk(index, path):
        calls.append(path)
        if len(calls) == 3:  # the trained file, one shard, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_faiss_index(index, path)
    monkeypatch.setattr(reindex_mod, "write_faiss_index", full_disk)
    with pytest.raises(OSError, match="No space left"):
        reindex(folder, "IVF2,Flat")
    monkeypatch.undo()
    assert [p.name for p in calls[:2]] == ["trained.g1.faiss", calls[1].name] and calls[1].name.endswith(".g1.faiss")
    assert json.loads((folder / "manifest.json").read_text()) == before
    assert files_now() == files
    list_shards(folder / "shards", generation=0)  # the old vectors are whole
    assert clean_shards(folder / "shards", generation=0) == []
    assert reindex(folder, "IVF2,Flat")["generation"] == 1  # and the next run goes through


def test_a_failure_after_the_switch_keeps_the_new_generation(tmp_path, monkeypatch):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=10, workers=1)

    def fail(*args, **kwargs):
        raise OSError(errno.EIO, "I/O error")
    monkeypatch.setattr(reindex_mod, "clean_shards", fail)
    with pytest.raises(OSError, match="I/O error"):
        reindex(folder, "HNSW8")
    monkeypatch.undo()
    assert json.loads((folder / "manifest.json").read_text())["generation"] == 1
    assert list_shards(folder / "shards", generation=1)  # the files the manifest names are there
    with open_index(folder) as index:
        assert index.ntotal == 20


def test_an_index_without_embeddings_is_refused_with_the_rebuild_command(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=3, workers=1, save_embeddings=False)
    with pytest.raises(ConfigError) as err:
        reindex(folder, "HNSW16")
    shards = [s for s in list_shards(folder / "shards") if s.rows]
    assert str(err.value) == (
        f"the index at {str(folder)!r} kept no embeddings for {len(shards)} of its {len(shards)} shards "
        f"(e.g. {shards[0].name}): it was built without --save-embeddings, so it cannot be reindexed "
        f"without the model; rebuild it with:\n  embedingest build-index /data/corpus --out {folder} "
        "--model test-model --index HNSW16 --save-embeddings --overwrite")


def test_the_rebuild_command_keeps_every_setting_the_index_records(tmp_path):
    """The command suggested for an index without embeddings dropped its chunking, prompts,
    search defaults and record fields: the rebuild cut, embedded and searched otherwise.
    It is run here as printed (shell-split) and the rebuilt manifest compared."""
    corpus, out = tmp_path / "the corpus", tmp_path / "IDX"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Bread rises because yeast ferments sugars in the dough.")
    (corpus / "b.jsonl").write_text("".join(json.dumps({"key": f"k{i}", "body": t}) + "\n" for i, t in
                                            enumerate(["Whales breathe air.", "Magma reaches the surface."])))
    fast = ["--device", "cpu", "--num-workers", "0"]
    built = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(out), "--chunk-tokens", "64",
                                      "--overlap", "8", "--doc-prompt", "passage: ", "--query-prompt",
                                      "query: it's", "--metric", "l2", "--index", "HNSW16", "--search-params",
                                      "efSearch=96", "--search-k", "3", "--text-field", "body", "--id-field",
                                      "key", *fast])
    assert built.exit_code == 0, built.output
    refused = CliRunner().invoke(main, ["reindex", str(out), "--index", "HNSW32"])
    assert refused.exit_code == 1
    command = refused.output.strip().splitlines()[-1].strip()
    assert command == (f"embedingest build-index {shlex.quote(str(corpus))} --out {out} --model "
                       "sentence-transformers/all-MiniLM-L6-v2 --index HNSW32 --metric l2 --chunk-tokens 64 "
                       "--overlap 8 --doc-prompt 'passage: ' --query-prompt 'query: it'\"'\"'s' --search-params "
                       "efSearch=96 --search-k 3 --text-field body --id-field key --save-embeddings --overwrite")
    program, *args = shlex.split(command)
    rebuilt = CliRunner().invoke(main, [*args, *fast])
    assert program == "embedingest" and rebuilt.exit_code == 0, rebuilt.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert {k: manifest[k] for k in ("factory", "metric", "chunking", "prompts", "search", "record_fields")} == {
        "factory": "HNSW32", "metric": "l2", "chunking": {"tokens": 64, "overlap": 8},
        "prompts": {"document": "passage: ", "query": "query: it's"}, "search": {"params": "efSearch=96", "k": 3},
        "record_fields": {"text": "body", "id": "key"}}
    assert reindex(out, "Flat")["vectors"] == 3  # the embeddings are kept now


def test_the_rebuild_command_leaves_out_the_defaults(tmp_path):
    """A plain index's command stays plain: the bundled model declares no prompts, and its
    chunking, search defaults and record fields are those a build takes when given none."""
    corpus, out = tmp_path / "c", tmp_path / "ix"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Bread rises because yeast ferments sugars in the dough.")
    assert CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(out), "--device", "cpu",
                                     "--num-workers", "0"]).exit_code == 0
    with pytest.raises(ConfigError) as err:
        reindex(out, "HNSW32")
    assert str(err.value).splitlines()[-1] == (
        f"  embedingest build-index {corpus} --out {out} --model sentence-transformers/all-MiniLM-L6-v2 "
        "--index HNSW32 --save-embeddings --overwrite")
    # search defaults turned off: a plain build would keep HNSW's efSearch, so '' is given
    with pytest.raises(ConfigError) as err:
        reindex(out, "HNSW32", search_params="")
    assert str(err.value).splitlines()[-1].endswith("--index HNSW32 --search-params '' --save-embeddings --overwrite")


def test_bad_factories_and_parameters_are_config_errors(tmp_path):
    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=3, workers=1)
    with pytest.raises(ConfigError, match="faiss cannot build index factory 'Nope'"):
        reindex(folder, "Nope")
    with pytest.raises(ConfigError) as err:
        reindex(folder, "HNSW8", search_params="nprobe=3")
    assert str(err.value) == (f"search parameters 'nprobe=3' do not apply to the new factory: "
                              f"{faiss_refusal('HNSW8', 'nprobe=3')}; nprobe is for IVF factories, efSearch "
                              "for HNSW")
    with pytest.raises(ConfigError) as err:  # 6 vectors for 16 lists
        reindex(folder, "IVF16,Flat")
    assert str(err.value) == (f"cannot train 'IVF16,Flat' on 6 vectors: {faiss_refusal('IVF16,Flat', n=6)}; "
                              "on 6 vectors use at most 6 lists (IVF6) or at most 2 bits per code (PQ, e.g. PQ16x2), "
                              "or index more vectors first")
    assert json.loads((folder / "manifest.json").read_text())["generation"] == 0


def faiss_refusal(factory, params=None, n=None):
    """faiss's own reason, as faiss_message cuts it (its words vary with its version):
    setting ``params`` on an empty ``factory`` index, or training one on ``n`` vectors."""
    index = faiss.index_factory(DIM, factory, faiss.METRIC_INNER_PRODUCT)
    with pytest.raises(RuntimeError) as err:
        if params:
            faiss.ParameterSpace().set_index_parameters(faiss.IndexIDMap(index), params)
        else:
            index.train(unit_vectors(n))
    return faiss_message(err.value)


def test_training_samples_spread_over_every_shard():
    embs = [np.full((n, 2), i, np.float32) for i, n in enumerate([10, 0, 30, 60])]
    sample = reindex_mod._sample(embs, 50, seed=1)
    assert sample.shape == (50, 2)
    assert set(np.unique(sample[:, 0]).tolist()) == {0, 2, 3}
    assert reindex_mod._sample(embs, 1000, 0).shape == (100, 2)


def test_training_samples_are_distinct_vectors_drawn_with_the_seed():
    """Without replacement (a sample as large as the index is every vector, in order), and
    seeded (the same seed draws the same vectors, another seed others)."""
    embs = [np.arange(60, dtype=np.float16).reshape(30, 2), np.arange(60, 200, dtype=np.float16).reshape(70, 2)]
    assert np.array_equal(reindex_mod._sample(embs, 100, seed=5), np.concatenate(embs))
    one = reindex_mod._sample(embs, 40, seed=1)
    assert len(np.unique(one[:, 0])) == 40
    assert np.array_equal(reindex_mod._sample(embs, 40, seed=1), one)
    assert not np.array_equal(reindex_mod._sample(embs, 40, seed=2), one)


def test_an_index_without_vectors_has_nothing_to_train_on():
    with pytest.raises(ConfigError) as err:
        reindex_mod._sample([np.zeros((0, 2), np.float16)], 10, 0)
    assert str(err.value) == "the index holds no vectors to train on"
    assert np.array_equal(reindex_mod._sample([np.ones((1, 2), np.float16)], 10, 0), [[1, 1]])


def test_stored_search_parameters_stay_where_they_apply_and_go_with_a_warning_elsewhere(tmp_path, caplog):
    """``search_params=None`` keeps the stored ones for another IVF factory and drops them,
    saying so, for HNSW; each reindex logs what it did."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=4, chunks=25, commit_every=60, workers=1)
    first = reindex(folder, "IVF4,Flat", train_size=100, search_params="nprobe=2")
    caplog.set_level(logging.INFO, logger="embedingest")
    caplog.clear()
    again = reindex(folder, "IVF8,Flat", train_size=100)
    assert again["search_params"] == "nprobe=2"
    assert json.loads((folder / "manifest.json").read_text())["search"] == {"params": "nprobe=2"}
    ours = [m for m in caplog.messages if not m.startswith("faiss: ")]  # faiss's: 100 points for 8 lists
    assert ours == [f"reindexed {folder}: IVF4,Flat (generation 1) -> IVF8,Flat (generation 2); "
                    f"{first['shards']} old files deleted"]  # each shard's .g1 vectors
    caplog.clear()
    last = reindex(folder, "HNSW8")
    assert last["search_params"] == "efSearch=64"  # a new HNSW index's, as the IVF one's nprobe went
    assert json.loads((folder / "manifest.json").read_text())["search"] == {"params": "efSearch=64"}
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "the stored search parameters 'nprobe=2' do not apply to the new factory: dropped"),
        (logging.INFO, f"reindexed {folder}: IVF8,Flat (generation 2) -> HNSW8 (generation 3); "
                       f"{last['shards']} old files deleted")]
    # a factory that becomes IVF (HNSW), none given: a new index's nprobe, 16 at most its
    # lists (efSearch, 64); one that was IVF (HNSW) keeps what it had, none included (its
    # builder may have turned them off)
    assert reindex(folder, "IVF32,Flat", train_size=100)["search_params"] == "nprobe=16"
    assert reindex(folder, "IVF4,Flat", train_size=100)["search_params"] == "nprobe=4"  # IVF4's own default
    assert reindex(folder, "HNSW8")["search_params"] == "efSearch=64"
    assert reindex(folder, "HNSW16", search_params="efSearch=32")["search_params"] == "efSearch=32"
    assert reindex(folder, "HNSW8")["search_params"] == "efSearch=32"
    assert reindex(folder, "HNSW8", search_params="")["search_params"] is None
    assert reindex(folder, "HNSW16")["search_params"] is None
    assert reindex(folder, "Flat")["search_params"] is None
    assert reindex(folder, "IVF4,Flat", train_size=100)["search_params"] == "nprobe=4"
    assert reindex(folder, "IVF4,Flat", train_size=100, search_params="")["search_params"] is None
    assert reindex(folder, "IVF8,Flat", train_size=100)["search_params"] is None


def test_the_old_trained_file_goes_and_the_new_one_is_the_shards_own(tmp_path):
    """A build's ``trained.faiss`` (generation 0) is deleted by the reindex that replaces
    it; the new ``trained.g1.faiss`` is the empty index the shards were cloned from (a later
    build adds to it), and the same index reindexed twice is trained alike (seeded)."""
    folder = tmp_path / "ix"
    folder.mkdir()
    template = faiss.index_factory(DIM, "IVF4,Flat", faiss.METRIC_INNER_PRODUCT)
    template.train(unit_vectors(300, seed=5))
    write_faiss_index(template, folder / "trained.faiss")  # where a build keeps it
    build_shards(folder, n_units=4, chunks=25, commit_every=60, workers=1, factory="IVF4,Flat",
                 trained=str(folder / "trained.faiss"))
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    summary = reindex(folder, "IVF2,Flat", train_size=60)
    assert summary["trained"] and not (folder / "trained.faiss").exists()
    trained = faiss.read_index(str(folder / "trained.g1.faiss"))
    assert (type(faiss.downcast_index(trained)).__name__, trained.is_trained, trained.ntotal) == ("IndexIVFFlat",
                                                                                                 True, 0)
    centroids = faiss.extract_index_ivf(trained).quantizer.reconstruct_n()
    indexes = [faiss.read_index(str(s.faiss_path(1))) for s in list_shards(folder / "shards", generation=1)]
    assert indexes and all(np.array_equal(faiss.extract_index_ivf(index).quantizer.reconstruct_n(), centroids)
                           for index in indexes)
    reindex(copy, "IVF2,Flat", train_size=60)
    assert (copy / "trained.g1.faiss").read_bytes() == (folder / "trained.g1.faiss").read_bytes()


def test_the_saved_embeddings_are_mapped_not_read_whole(tmp_path, monkeypatch):
    """An index's embeddings may not fit in memory: each shard's file is memory-mapped."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=25, commit_every=60, workers=1)
    loads = []
    real = np.load

    def spy(path, *args, **kwargs):
        loads.append((os.path.basename(path), kwargs.get("mmap_mode")))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(np, "load", spy)
    reindex(folder, "HNSW8")
    shards = [s.name for s in list_shards(folder / "shards", generation=1) if s.rows]
    assert sorted(loads) == sorted((f"{name}{EMB_SUFFIX}", "r") for name in shards)


def test_an_index_in_object_storage_is_reindexed_as_the_same_index_on_disk(s3, tmp_path):
    """reindex s3://... (twice: the second reads the first's .g1 vectors) and export
    s3://... give what they give on disk; the bucket keeps no old vectors and no lease."""
    import pyarrow.parquet as pq

    from embedingest.index.export import export_index
    from embedingest.index.remote_store import LEASE_NAME
    from embedingest.index.search import open_index
    from embedingest.index.shard_store import ShardStore

    folder = tmp_path / "ix"
    build_shards(folder, n_units=8, chunks=25, commit_every=60, workers=2)
    with ShardStore(folder) as store:
        store.update_shards()
    url = s3.upload(folder, "idx/ix")
    local = tmp_path / "local"
    shutil.copytree(folder, local)
    q = unit_vectors(6, seed=4)

    def hits(where):
        with open_index(where, cache_dir=tmp_path / "cache") as index:
            return [[(h.id, round(h.score, 5), h.text) for h in row] for row in index.search_vectors(q, k=7)]

    for factory, params in (("IVF4,Flat", "nprobe=4"), ("Flat", "")):
        want = reindex(local, factory, train_size=150, search_params=params, seed=3)
        got = reindex(url, factory, train_size=150, search_params=params, seed=3)
        assert got == want | {"index": url}
        if want["trained"]:  # the same 150 of the 200 vectors (train_size and seed passed on)
            assert s3.fs.cat(f"{s3.name}/idx/ix/trained.g1.faiss") == (local / "trained.g1.faiss").read_bytes()
        assert hits(url) == hits(local)
    names = set(s3.fs.ls(f"{s3.name}/idx/ix/shards", refresh=True))
    vectors = sorted(n.rsplit("/", 1)[-1] for n in names if n.endswith(".faiss"))
    assert vectors and all(".g2." in n for n in vectors)  # the older generations' are deleted
    top = {n.rsplit("/", 1)[-1] for n in s3.fs.ls(f"{s3.name}/idx/ix", refresh=True)}
    assert LEASE_NAME not in top and not {n for n in top if n.startswith("trained")}  # Flat: none
    assert json.loads(s3.fs.cat(f"{s3.name}/idx/ix/manifest.json"))["generation"] == 2

    a, b = export_index(local, tmp_path / "a"), export_index(url, tmp_path / "b")
    assert a | {"index": url, "to": "b"} == b | {"to": "b"} and a["embeddings"] and a["rows"] == 200
    for path in sorted((tmp_path / "a").glob("*.parquet")):
        assert pq.read_table(path).equals(pq.read_table(tmp_path / "b" / path.name))
    with pytest.raises(ConfigError, match="export writes a local folder, not 's3://"):
        export_index(local, s3.url("out"))
    from click.testing import CliRunner

    from embedingest.cli import main

    result = CliRunner().invoke(main, ["export", url, "--to", str(tmp_path / "c"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["rows"] == 200
    result = CliRunner().invoke(main, ["reindex", url, "--index", "HNSW8", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["generation"] == 3


def test_reindex_of_a_prefix_without_an_index_says_so(s3, tmp_path):
    s3.put("empty/x.txt", b"x")
    with pytest.raises(ConfigError, match="holds no embedingest index"):
        reindex(s3.url("empty"), "Flat")


def _save_as_committed(shard, array):
    """Write ``array`` as a shard's embeddings and give its record the new size and hash."""
    path = shard.folder / f"{shard.name}{EMB_SUFFIX}"
    np.save(path, array, allow_pickle=True)
    recommit_file(shard, "emb")


@pytest.mark.parametrize("array, problem", [
    (lambda e: e.reshape(-1, DIM // 2), "it holds an array of shape (50, 8) and type float16, not 25 vectors of 16 floats"),
    (lambda e: e[:-1], "it holds an array of shape (24, 16) and type float16, not 25 vectors of 16 floats"),
    (lambda e: e.reshape(-1), "it holds an array of shape (400,) and type float16, not 25 vectors of 16 floats"),
    (lambda e: e.astype(np.int16), "it holds an array of shape (25, 16) and type int16, not 25 vectors of 16 floats"),
])
def test_saved_embeddings_of_another_shape_are_a_damaged_shard_not_a_faiss_assertion(tmp_path, array, problem):
    """Before: an AssertionError traceback from faiss (`assert d == self.d`, 'not same nb of
    vectors as ids'), or integers added as vectors; export and a removal read them as well."""
    from embedingest.index.export import export_index

    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=25, commit_every=60, workers=1)
    (shard,) = list_shards(folder / "shards")
    _save_as_committed(shard, array(np.load(folder / "shards" / f"{shard.name}{EMB_SUFFIX}")))
    before = sorted(os.listdir(folder / "shards"))
    expected = (f"shard {shard.name} in {str(folder / 'shards')!r} is damaged: its emb file "
                f"'{shard.name}{EMB_SUFFIX}' is not its vectors ({problem}); delete that shard's files")
    for call in (lambda: reindex(folder, "HNSW8"), lambda: export_index(folder, tmp_path / "out")):
        with pytest.raises(ConfigError) as err:
            call()
        assert str(err.value).startswith(expected)
    assert sorted(os.listdir(folder / "shards")) == before and not (tmp_path / "out" / "_SUCCESS").exists()


def test_reindex_refuses_embeddings_that_are_not_the_bytes_committed(tmp_path):
    """Zeros over a shard's saved embeddings, at their size: before, reindexed as zero vectors."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=1, chunks=25, commit_every=60, workers=1)
    (shard,) = list_shards(folder / "shards")
    path = folder / "shards" / f"{shard.name}{EMB_SUFFIX}"
    data = path.read_bytes()
    path.write_bytes(data[:128] + bytes(len(data) - 128))
    with pytest.raises(ConfigError, match=rf"^shard {shard.name} in .* is damaged: its emb file "
                                          rf"'{shard.name}\.emb\.npy' does not hold the bytes that were committed"):
        reindex(folder, "HNSW8")
    assert json.loads((folder / "manifest.json").read_text())["generation"] == 0


def test_a_reindex_that_fails_does_not_say_it_dropped_the_search_parameters(tmp_path, caplog):
    """'dropped' was logged before the work, then the reindex failed and kept them."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=2, chunks=10, workers=1)
    reindex(folder, "IVF2,Flat", train_size=20, search_params="nprobe=2")
    caplog.set_level(logging.INFO, logger="embedingest")
    caplog.clear()
    with pytest.raises(ConfigError, match=r"^cannot train 'PQ8x8' on 20 vectors: "):
        reindex(folder, "PQ8x8")
    assert [m for m in caplog.messages if "dropped" in m] == []
    assert json.loads((folder / "manifest.json").read_text())["search"] == {"params": "nprobe=2"}


def test_reindex_to_an_ivfpq_factory_of_the_readme_gives_an_index_that_searches(tmp_path, monkeypatch):
    """IVF-PQ with lists x sub-quantizers x 256 floats of precomputed tables over 64 MiB
    (IVF4096,PQ32 in the README; IVF8192,PQ16 here, 128 MiB): reindex ended well, then
    every search said the shard was damaged and to delete it. k-means over 8192 lists is
    replaced here by random centroids (seconds, not minutes)."""
    folder = tmp_path / "ix"
    built = build_shards(folder, n_units=4, chunks=25, commit_every=60, workers=2)

    def quick_train(index, sample):
        rng = np.random.default_rng(0)
        ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        ivf.quantizer.add(rng.standard_normal((ivf.nlist, DIM)).astype(np.float32))
        ivf.pq.train(np.concatenate([sample, rng.standard_normal((1000, DIM)).astype(np.float32)]))
        ivf.is_trained = index.is_trained = True
    monkeypatch.setattr(reindex_mod, "train", quick_train)
    summary = reindex(folder, "IVF8192,PQ16", train_size=100)
    assert (summary["trained"], summary["search_params"]) == (True, "nprobe=16")
    with open_index(folder) as index:
        hits = index.search_vectors(built.emb[:5], 3)
    assert [h[0].id for h in hits] == built.ids[:5].tolist()  # each vector finds itself first


def test_kept_search_defaults_follow_the_new_lists(tmp_path, caplog):
    """IVF16's automatic nprobe=16 stayed nprobe=16 on IVF4 (more than its 4 lists), and
    IVF8's nprobe=8 stayed 8 on IVF64, where a new IVF64 gets 16: an automatic default is
    the new factory's. A builder's own nprobe is kept, cut to the new lists where over them;
    each change is said in the log."""
    folder = tmp_path / "ix"
    build_shards(folder, n_units=4, chunks=25, commit_every=60, workers=1)
    assert reindex(folder, "IVF16,Flat", train_size=100)["search_params"] == "nprobe=16"
    caplog.set_level(logging.WARNING, logger="embedingest")
    caplog.clear()
    assert reindex(folder, "IVF4,Flat", train_size=100)["search_params"] == "nprobe=4"
    assert json.loads((folder / "manifest.json").read_text())["search"] == {"params": "nprobe=4"}
    assert [m for m in caplog.messages if not m.startswith("faiss: ")] == [
        "the stored search parameters 'nprobe=16' are 'nprobe=4' for the new factory (4 lists)"]
    assert reindex(folder, "IVF8,Flat", train_size=100)["search_params"] == "nprobe=8"
    assert reindex(folder, "IVF64,Flat", train_size=100)["search_params"] == "nprobe=16"
    assert reindex(folder, "IVF64,Flat", train_size=100, search_params="nprobe=40")["search_params"] == "nprobe=40"
    caplog.clear()
    assert reindex(folder, "IVF32,Flat", train_size=100)["search_params"] == "nprobe=32"  # the builder's, cut
    assert [m for m in caplog.messages if not m.startswith("faiss: ")] == [
        "the stored search parameters 'nprobe=40' are 'nprobe=32' for the new factory (32 lists)"]
    assert reindex(folder, "IVF64,Flat", train_size=100)["search_params"] == "nprobe=32"  # kept as it is
    with open_index(folder) as index:
        assert {faiss.extract_index_ivf(s).nprobe for s in index.shards} == {32}


@pytest.mark.parametrize("factory", ["HNSW16,Flat,RFlat", "PCA8,HNSW16,Flat,RFlat"])
def test_an_hnsw_index_under_a_refine_index_gets_hnsw_search_defaults(tmp_path, factory):
    """HNSW16,Flat,RFlat (IndexRefineFlat over HNSW) kept faiss's efSearch of 16, which
    misses part of the true top 10: the graph was looked for under transforms only."""
    from embedingest.index.faiss_factory import _hnsw, default_search_params, parse_factory

    assert default_search_params(parse_factory(DIM, factory, "ip")) == "efSearch=64"
    folder = tmp_path / "ix"
    build_shards(folder, n_units=4, chunks=25, commit_every=60, workers=1)
    assert reindex(folder, factory, train_size=100)["search_params"] == "efSearch=64"
    with open_index(folder) as index:
        assert {_hnsw(s).hnsw.efSearch for s in index.shards} == {64}
    assert reindex(folder, "HNSW16", search_params="efSearch=32")["search_params"] == "efSearch=32"
    assert reindex(folder, factory, train_size=100)["search_params"] == "efSearch=32"  # kept: HNSW both


FAST_BUILD = ["--device", "cpu", "--num-workers", "0"]


def rebuild_command_of(out):
    """The command reindex gives for the index at ``out`` (built without embeddings)."""
    refused = CliRunner().invoke(main, ["reindex", str(out), "--index", "HNSW32"])
    assert refused.exit_code == 1, refused.output
    return refused.output.strip().splitlines()[-1].strip()


def test_the_rebuild_command_names_a_local_model_folder_by_its_path(tmp_path, monkeypatch):
    """A model folder given by its name (``--model mymodel``, from the folder above it) is
    recorded by that name: the command gave ``--model mymodel``, which fails elsewhere
    ('model 'mymodel' is not a folder here ...'). It gives the folder's path, quoted."""
    from embedingest.stages.model_folder import resolve_model

    models = tmp_path / "my models"
    model = models / "mymodel"
    model.mkdir(parents=True)
    for item in resolve_model(None)[0].iterdir():  # the bundled model's files, under another name
        (model / item.name).symlink_to(item)
    corpus, out = tmp_path / "c", tmp_path / "ix"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Bread rises because yeast ferments sugars in the dough.")
    monkeypatch.chdir(models)
    built = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(out), "--model", "mymodel", *FAST_BUILD])
    assert built.exit_code == 0, built.output
    assert json.loads((out / "manifest.json").read_text())["model"]["name"] == "mymodel"
    monkeypatch.chdir(tmp_path)
    command = rebuild_command_of(out)
    assert command == (f"embedingest build-index {corpus} --out {out} --model {shlex.quote(str(model))} "
                       "--index HNSW32 --save-embeddings --overwrite")
    program, *args = shlex.split(command)
    rebuilt = CliRunner().invoke(main, [*args, *FAST_BUILD])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert json.loads((out / "manifest.json").read_text())["model"]["path"] == str(model)


def test_the_rebuild_command_of_an_index_of_one_file_names_that_file(tmp_path):
    """build-index corpus/a.txt recorded the folder corpus (its keys are relative to it): the
    command named the folder, and run it indexed every file there. It names the file, while
    an index of a folder (of one file or more) is named by its folder."""
    from embedingest.index.store import IndexStore

    corpus, out = tmp_path / "the corpus", tmp_path / "ix"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Bread rises because yeast ferments sugars in the dough.")
    (corpus / "b.txt").write_text("Whales breathe air through a blowhole.")
    built = CliRunner().invoke(main, ["build-index", str(corpus / "a.txt"), "--out", str(out), *FAST_BUILD])
    assert built.exit_code == 0, built.output
    command = rebuild_command_of(out)
    assert command.startswith(f"embedingest build-index {shlex.quote(str(corpus / 'a.txt'))} --out {out} ")
    program, *args = shlex.split(command)
    rebuilt = CliRunner().invoke(main, [*args, *FAST_BUILD])
    assert rebuilt.exit_code == 0, rebuilt.output
    with IndexStore(out, read_only=True) as store:
        assert sorted(store.units()) == ["a.txt"]
    folder_index = tmp_path / "all"
    assert CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(folder_index), *FAST_BUILD]).exit_code == 0
    assert rebuild_command_of(folder_index).startswith(f"embedingest build-index {shlex.quote(str(corpus))} --out ")


def test_the_rebuild_command_names_the_file_the_manifest_records_even_once_it_is_gone(tmp_path):
    """The command guessed the one file from the index's units and the files of its
    folder; a file moved away since left the folder named, whose rebuild indexed the
    other files there. It names the file the manifest records."""
    corpus, out = tmp_path / "corpus", tmp_path / "ix"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Bread rises because yeast ferments sugars in the dough.")
    (corpus / "b.txt").write_text("Whales breathe air through a blowhole.")
    built = CliRunner().invoke(main, ["build-index", str(corpus / "a.txt"), "--out", str(out), *FAST_BUILD])
    assert built.exit_code == 0, built.output
    assert json.loads((out / "manifest.json").read_text())["corpus_path"] == str(corpus.resolve() / "a.txt")
    (corpus / "a.txt").rename(tmp_path / "a.txt")
    assert rebuild_command_of(out).startswith(
        f"embedingest build-index {shlex.quote(str(corpus.resolve() / 'a.txt'))} --out {out} ")


def test_an_index_of_one_file_that_recorded_its_folder_still_gets_that_file_in_its_rebuild_command(tmp_path):
    """An index built from one file before the file was recorded as itself records the
    file's folder: the command names the one file it holds where that folder holds others,
    and run, rebuilds that file alone, recorded as itself; an index of the folder is named
    by the folder."""
    from dataclasses import replace

    from embedingest.index.store import IndexStore

    corpus, out = tmp_path / "the corpus", tmp_path / "ix"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Bread rises because yeast ferments sugars in the dough.")
    (corpus / "b.txt").write_text("Whales breathe air through a blowhole.")
    built = CliRunner().invoke(main, ["build-index", str(corpus / "a.txt"), "--out", str(out), *FAST_BUILD])
    assert built.exit_code == 0, built.output
    store = IndexStore(out)
    store.write_manifest(replace(store.read_manifest(), corpus_path=str(corpus.resolve())))
    store.close()
    command = rebuild_command_of(out)
    assert command.startswith(f"embedingest build-index {shlex.quote(str(corpus.resolve() / 'a.txt'))} --out {out} ")
    program, *args = shlex.split(command)
    rebuilt = CliRunner().invoke(main, [*args, *FAST_BUILD])
    assert rebuilt.exit_code == 0, rebuilt.output
    with IndexStore(out, read_only=True) as store:
        assert sorted(store.units()) == ["a.txt"]
    assert json.loads((out / "manifest.json").read_text())["corpus_path"] == str(corpus.resolve() / "a.txt")
    folder_index = tmp_path / "all"
    built = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(folder_index), *FAST_BUILD])
    assert built.exit_code == 0, built.output
    assert rebuild_command_of(folder_index).startswith(
        f"embedingest build-index {shlex.quote(str(corpus.resolve()))} --out {folder_index} ")

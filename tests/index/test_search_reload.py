"""An Index handle opened before the index changed (a build that removed or changed files,
a removal before its manifest, a reindex) answers as the index is now, not with the
rows of documents removed since: it is opened again by the next search."""

from __future__ import annotations

import logging
import threading

from corpus_fixtures import TOPICS
from index_fixtures import build_index as build_fixture
from shard_fixtures import build_shards, unit_vectors

from embedingest import build_index, open_index
from embedingest.index.lookup import ShardRows
from embedingest.index.reindex import reindex
from embedingest.index.shard_store import ShardStore

FAST = dict(num_workers=0, num_consumers=1, batch_size=8)


def test_a_handle_opened_before_a_build_answers_as_the_index_is_after_it(tmp_path):
    """Before: the handle kept the removed file's rows (their files stay readable to a
    process that has them open) and the edited file's old text, until opened again."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TOPICS[:4]):
        (corpus / f"t{i}.txt").write_text(text)
    out = tmp_path / "idx"
    build_index(corpus, out=str(out), **FAST)
    index = open_index(out)
    (hit,) = index.search(TOPICS[1], k=1)[0]
    assert hit.source == "t1.txt" and len(index) == 4
    encoder = index.loaded_encoder
    (corpus / "t1.txt").unlink()
    (corpus / "t2.txt").write_text(TOPICS[5])
    (corpus / "t9.txt").write_text(TOPICS[6])
    build_index(corpus, out=str(out), **FAST)
    sources = [h.source for h in index.search(TOPICS[1], k=10)[0]]
    assert sorted(sources) == ["t0.txt", "t2.txt", "t3.txt", "t9.txt"] and len(index) == 4
    (hit,) = index.search(TOPICS[5], k=1)[0]
    assert (hit.source, hit.text) == ("t2.txt", TOPICS[5])
    assert index.search(TOPICS[6], k=1)[0][0].source == "t9.txt"
    assert index.loaded_encoder is encoder  # the same model: not loaded again
    index.close()


def test_a_removal_is_seen_before_the_build_writes_its_manifest(tmp_path):
    """A build removes a changed file's rows (a shard replaced by one without them) when it
    starts, and writes the manifest when it ends: the handle sees the removal at once, as
    a handle opened then would."""
    built = build_fixture(tmp_path, n_units=4, chunks=10, commit_every=25, workers=2)
    gone = built.unit_nos["doc2.txt"]
    with open_index(tmp_path) as index:
        assert index.ntotal == 40
        before = [h.id >> 32 for h in index.search_vectors(built.emb, k=40)[0]]
        assert gone in before
        ShardStore(tmp_path).remove_units([gone])
        after = [h.id >> 32 for h in index.search_vectors(built.emb, k=40)[0]]
        assert gone not in after and len(after) == 30 and index.ntotal == 30
        assert index.chunks([int(built.ids[built.ids >> 32 == gone][0])]) == {}


def test_a_manifest_written_again_unchanged_keeps_the_opening(tmp_path):
    """Every build rewrites the manifest, also when nothing changed: the handle reads it and
    stays as it is (a few stats a search, no reading of the shards again)."""
    built = build_fixture(tmp_path, n_units=2, chunks=10)
    with open_index(tmp_path) as index:
        rows = index.rows
        ShardStore(tmp_path).update_shards()
        assert len(index.search_vectors(built.emb[:1], k=3)[0]) == 3
        assert index.rows is rows


def test_a_reindex_under_an_open_handle_is_searched_as_its_new_generation(tmp_path):
    build_shards(tmp_path / "ix", n_units=4, chunks=10, commit_every=50, workers=2)
    q = unit_vectors(2, seed=4)
    with open_index(tmp_path / "ix") as index:
        assert index.params is None and index.manifest.generation == 0
        reindex(tmp_path / "ix", "IVF2,Flat", search_params="nprobe=2")
        got = [[h.id for h in hits] for hits in index.search_vectors(q, k=5)]
        assert (index.params, index.manifest.generation, index.manifest.factory) == ("nprobe=2", 1, "IVF2,Flat")
    with open_index(tmp_path / "ix") as fresh:
        assert got == [[h.id for h in hits] for hits in fresh.search_vectors(q, k=5)]


def test_an_index_that_cannot_be_opened_again_leaves_the_old_opening_answering(tmp_path, caplog):
    """As a server does: a manifest damaged meanwhile is said once, and the opening the
    handle has answers; a later change is tried again."""
    built = build_fixture(tmp_path, n_units=2, chunks=10)
    manifest = tmp_path / "manifest.json"
    with open_index(tmp_path) as index:
        good = manifest.read_bytes()
        manifest.write_text("not json")
        with caplog.at_level(logging.WARNING, logger="embedingest"):
            for _ in range(2):
                assert len(index.search_vectors(built.emb[:1], k=3)[0]) == 3
        (said,) = [r.getMessage() for r in caplog.records]
        assert said.startswith(f"the index at {tmp_path} changed but cannot be opened again (cannot read ")
        assert said.endswith("); still answering from the one opened before")
        manifest.write_bytes(good)
        assert index.ntotal == 20


def test_a_search_under_way_ends_on_the_opening_it_began_with(tmp_path, monkeypatch):
    """A search whose rows are being read when another thread opens the index again keeps
    its opening to its end (not closed under it), which is closed then."""
    built = build_fixture(tmp_path, n_units=3, chunks=10, commit_every=1000, workers=1)
    reading, release = threading.Event(), threading.Event()
    real = ShardRows.chunks

    def slow(self, ids):
        if not reading.is_set():
            reading.set()
            release.wait(30)
        return real(self, ids)

    monkeypatch.setattr(ShardRows, "chunks", slow)
    with open_index(tmp_path) as index:
        old = index.rows
        got = []
        worker = threading.Thread(target=lambda: got.append(index.search_vectors(built.emb[:1], k=30)[0]))
        worker.start()
        assert reading.wait(30)
        ShardStore(tmp_path).remove_units([built.unit_nos["doc1.txt"]])
        assert index.ntotal == 20 and index.rows is not old
        assert old._files  # still open for the search under way
        release.set()
        worker.join(30)
        assert len(got[0]) == 30 and all(h.text for h in got[0])  # answered from the opening it began with
        assert not old._files  # closed once that search ended

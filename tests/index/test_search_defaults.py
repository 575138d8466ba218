"""Search defaults (faiss parameters, k) stored with the index at build time and used by
open_index and the search command unless they give their own."""

from __future__ import annotations

import json
import os
import shutil

import faiss
import numpy as np
import pytest
from click.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from embedingest import build_index, open_index  # noqa: E402
from embedingest.cli import main  # noqa: E402
from embedingest.errors import ConfigError, SettingError  # noqa: E402
from embedingest.index.search import SearchParamsRefused  # noqa: E402

TOPICS = ["rivers", "bread", "volcanoes", "networks", "whales", "chess", "orbits", "glaciers"]
RECORDS = [(f"r{i}", f"Note {i} on {TOPICS[i % 8]} and {TOPICS[(i * 3) % 8]}, item {i * 7919 % 1000}.")
           for i in range(240)]
FAST = dict(num_workers=0, num_consumers=2, batch_size=64, train_size=240)


@pytest.fixture(scope="module")
def ivf(tmp_path_factory):
    out = tmp_path_factory.mktemp("ivf") / "idx"
    build_index(RECORDS, out=str(out), index="IVF8,Flat", search_params="nprobe=8", search_k=3, **FAST)
    return out


def nprobes(index) -> set[int]:
    return {faiss.extract_index_ivf(seg).nprobe for seg in index.shards}


def test_stored_nprobe_and_k_are_applied(ivf):
    manifest = json.loads((ivf / "manifest.json").read_text())
    assert manifest["search"] == {"params": "nprobe=8", "k": 3}
    queries = [f"{t} and {u}" for t in TOPICS for u in TOPICS[:3]]
    with open_index(ivf) as index:
        assert nprobes(index) == {8} and index.params == "nprobe=8" and index.default_k == 3
        default = index.search(queries)
        vectors = index.encoder.encode(queries)
        scores, ids = index.search_raw(vectors)
    with open_index(ivf, params="nprobe=1") as one:
        assert nprobes(one) == {1}
        scores1, ids1 = one.search_raw(vectors, 3)
    assert all(len(hits) == 3 for hits in default)
    assert [[h.id for h in hits] for hits in default] == ids.tolist()
    assert (ids1 != ids).any(), "nprobe=1 should miss some neighbours that nprobe=8 finds"
    assert (scores1 <= scores + 1e-6).all()  # a probe of fewer lists never finds better ones
    with pytest.raises(ConfigError, match=r"^search parameters 'n probe=2': 'n probe=2' is not NAME=NUMBER; e.g. "
                                          r"nprobe=16 \(IVF\)"):
        open_index(ivf, params="n probe=2")
    for blank in ("", "  "):  # "" turns the stored parameters off; blank too, as in build-index (it was an error)
        with open_index(ivf, params=blank) as none:
            assert none.params is None and nprobes(none) == {1}


def test_stored_nprobe_of_every_list_equals_brute_force(ivf):
    with open_index(ivf) as index:
        vectors = index.encoder.encode(["bread and rivers", "whales and chess"])
        scores, ids = index.search_raw(vectors, 10)
        exact = faiss.IndexFlatIP(index.manifest.dim)
        all_ids = []
        for seg in index.shards:
            id_map = faiss.vector_to_array(seg.id_map)  # segments are IDMaps over the IVF
            ivf_index = faiss.extract_index_ivf(seg)
            for lst in range(ivf_index.nlist):
                n = ivf_index.invlists.list_size(lst)
                if not n:
                    continue
                codes = faiss.rev_swig_ptr(ivf_index.invlists.get_codes(lst), n * ivf_index.code_size)
                exact.add(np.frombuffer(codes.tobytes(), dtype=np.float32).reshape(n, -1))
                all_ids.append(id_map[faiss.rev_swig_ptr(ivf_index.invlists.get_ids(lst), n)])
        want_s, want_pos = exact.search(vectors, 10)
    np.testing.assert_array_equal(ids, np.concatenate(all_ids)[want_pos])
    np.testing.assert_allclose(scores, want_s, rtol=1e-5)


def test_cli_search_uses_the_stored_k_and_params(ivf):
    runner = CliRunner()
    r = runner.invoke(main, ["search", str(ivf), "bread", "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.output)) == 3
    r = runner.invoke(main, ["search", str(ivf), "bread", "--json", "-k", "5", "--params", "nprobe=2"])
    assert r.exit_code == 0 and len(json.loads(r.output)) == 5
    r = runner.invoke(main, ["search", str(ivf), "bread", "-k", "0"])
    assert r.exit_code == 2 and "-k" in r.output


def test_rerun_keeps_updates_and_drops_defaults(tmp_path):
    out = tmp_path / "idx"
    build_index(RECORDS[:20], out=str(out), index="HNSW8", search_params="efSearch=64", **FAST)
    manifest = lambda: json.loads((out / "manifest.json").read_text())  # noqa: E731
    assert manifest()["search"] == {"params": "efSearch=64"}
    build_index(RECORDS[:21], out=str(out), index="HNSW8", **FAST)
    assert manifest()["search"] == {"params": "efSearch=64"}
    with open_index(out) as index:
        assert {faiss.downcast_index(seg.index).hnsw.efSearch for seg in index.shards} == {64}
    build_index(RECORDS[:21], out=str(out), index="HNSW8", search_params="", search_k=7, **FAST)
    assert manifest()["search"] == {"k": 7}
    # kept as faiss reads them: with the spaces, faiss took ' efSearch ' for a parameter it has not
    build_index(RECORDS[:21], out=str(out), index="HNSW8", search_params=" efSearch = 48 ", **FAST)
    assert manifest()["search"] == {"k": 7, "params": "efSearch=48"}
    with open_index(out) as index:
        assert {faiss.downcast_index(seg.index).hnsw.efSearch for seg in index.shards} == {48}


def test_parameters_that_do_not_apply_are_refused_before_the_work(tmp_path):
    with pytest.raises(ConfigError, match=r"--search-params 'nprobe=4' do not apply to index 'Flat'"):
        build_index(RECORDS[:5], out=str(tmp_path / "idx"), search_params="nprobe=4", **FAST)
    assert not (tmp_path / "idx").exists()  # refused before the folder is made (it left an empty index)
    # faiss takes efSearch=0 and then gives one hit whatever k: refused, not stored
    with pytest.raises(ConfigError, match=r"--search-params 'efSearch=0' do not apply to index 'HNSW8': "
                                          r"efSearch=0 must be a whole number of at least 1"):
        build_index(RECORDS[:5], out=str(tmp_path / "idx3"), index="HNSW8", search_params="efSearch=0", **FAST)
    with pytest.raises(ConfigError, match="search-k=0"):
        build_index(RECORDS[:5], out=str(tmp_path / "idx2"), search_k=0, **FAST)


def test_a_new_ivf_index_probes_sixteen_lists_unless_told_and_keeps_none_when_told(tmp_path):
    """faiss's own nprobe, 1, misses much of the true top 10 of a small corpus: a new IVF
    index keeps nprobe=16 (at most its lists) unless --search-params says otherwise; ''
    turns it off for good, and an update keeps what the index has."""
    manifest = lambda out: json.loads((out / "manifest.json").read_text())["search"]  # noqa: E731
    build_index(RECORDS[:64], out=str(tmp_path / "few"), index="IVF8,Flat", **FAST)
    assert manifest(tmp_path / "few") == {"params": "nprobe=8"}  # every list: exact
    build_index(RECORDS, out=str(tmp_path / "flat"), **FAST)
    build_index(RECORDS, out=str(tmp_path / "many"), index="IVF32,Flat", **FAST)
    assert manifest(tmp_path / "many") == {"params": "nprobe=16"}
    queries = [f"{t} and {u}" for t in TOPICS for u in TOPICS[:4]]
    with open_index(tmp_path / "many") as ivf, open_index(tmp_path / "flat") as flat:
        assert nprobes(ivf) == {16}
        found = [{h.id for h in hits} for hits in ivf.search(queries, 10)]
        exact = [{h.id for h in hits} for hits in flat.search(queries, 10)]
    with open_index(tmp_path / "many", params="nprobe=1") as one:
        probe_one = [{h.id for h in hits} for hits in one.search(queries, 10)]
    recall = lambda got: np.mean([len(g & e) / 10 for g, e in zip(got, exact)])  # noqa: E731
    assert recall(found) >= 0.9 and recall(found) > recall(probe_one)
    build_index(RECORDS[:64], out=str(tmp_path / "off"), index="IVF8,Flat", search_params="", **FAST)
    assert manifest(tmp_path / "off") == {}
    build_index(RECORDS[:65], out=str(tmp_path / "off"), index="IVF8,Flat", **FAST)
    assert manifest(tmp_path / "off") == {}
    build_index(RECORDS[:64], out=str(tmp_path / "given"), index="IVF8,Flat", search_params="nprobe=2", **FAST)
    assert manifest(tmp_path / "given") == {"params": "nprobe=2"}


def ef_searches(index) -> set[int]:
    return {faiss.downcast_index(seg.index if isinstance(seg, faiss.IndexIDMap) else seg).hnsw.efSearch
            for seg in (faiss.downcast_index(s) for s in index.shards)}


def test_a_new_hnsw_index_keeps_ef_search_64_unless_told(tmp_path):
    """faiss's own efSearch, 16, drops part of the true top 10 on larger corpora: a new HNSW
    index keeps efSearch=64 unless --search-params says otherwise; '' turns it off for
    good, and an update keeps what the index has."""
    manifest = lambda out: json.loads((out / "manifest.json").read_text())["search"]  # noqa: E731
    build_index(RECORDS[:64], out=str(tmp_path / "h"), index="HNSW8", **FAST)
    assert manifest(tmp_path / "h") == {"params": "efSearch=64"}
    with open_index(tmp_path / "h") as index:
        assert ef_searches(index) == {64} and index.params == "efSearch=64"
    with open_index(tmp_path / "h", params="efSearch=16") as index:
        assert ef_searches(index) == {16}
    build_index(RECORDS[:64], out=str(tmp_path / "off"), index="HNSW8", search_params="", **FAST)
    build_index(RECORDS[:65], out=str(tmp_path / "off"), index="HNSW8", **FAST)
    assert manifest(tmp_path / "off") == {}
    with open_index(tmp_path / "off") as index:
        assert ef_searches(index) == {16}  # faiss's own
    build_index(RECORDS[:64], out=str(tmp_path / "pca"), index="PCA32,HNSW8", **FAST)
    assert manifest(tmp_path / "pca") == {"params": "efSearch=64"}


def test_nprobe_above_the_lists_is_refused_by_open_index_search_serve_and_build_index(ivf, tmp_path):
    """Before: nprobe=9 on IVF8 was taken (faiss cut it to 8 without a word), and every
    refused --params exited 1; now each names the value and the range, and a command
    line's refusal exits 2 (a setting out of range in an option)."""
    with pytest.raises(SearchParamsRefused) as err:
        open_index(ivf, params="nprobe=9")
    assert str(err.value) == (f"search parameters 'nprobe=9' do not apply to the index at {str(ivf)!r} (factory "
                              "'IVF8,Flat'): params='nprobe=9': nprobe=9 is more than the index's 8 lists: give "
                              "nprobe 1 to 8; it takes nprobe (1 to 8), max_codes: e.g. params='nprobe=8'")
    with open_index(ivf, params="nprobe=8") as index:
        assert nprobes(index) == {8}
    older = tmp_path / "older"  # stored by an older build: searched, as faiss cuts it
    shutil.copytree(ivf, older)
    manifest = json.loads((older / "manifest.json").read_text())
    manifest["search"]["params"] = "nprobe=9"
    (older / "manifest.json").write_text(json.dumps(manifest))
    with open_index(older) as index:
        assert len(index.search(["bread"], k=3)[0]) == 3
    runner = CliRunner()
    for command in (["search", str(ivf), "bread"], ["serve", str(ivf), "--port", "0"]):
        r = runner.invoke(main, [*command, "--params", "nprobe=9"])
        assert r.exit_code == 2, r.output
        assert r.output.endswith("(factory 'IVF8,Flat'): --params 'nprobe=9': nprobe=9 is more than the index's "
                                 "8 lists: give nprobe 1 to 8; it takes nprobe (1 to 8), max_codes: e.g. "
                                 "--params 'nprobe=8'\n")
        for bad in ("nprobe=0", "nprobe", "efSearch=16"):
            r = runner.invoke(main, [*command, "--params", bad])
            assert r.exit_code == 2 and f"'{bad}'" in r.output, r.output
    with pytest.raises(SettingError, match=r"^--search-params 'nprobe=9' do not apply to index 'IVF8,Flat': "
                                           r"nprobe=9 is more than the index's 8 lists: give nprobe 1 to 8$"):
        build_index(RECORDS, out=str(tmp_path / "idx"), index="IVF8,Flat", search_params="nprobe=9", **FAST)
    assert not (tmp_path / "idx").exists()

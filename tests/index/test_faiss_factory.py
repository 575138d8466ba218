"""The faiss helpers: metrics, factory strings, empty indexes, damaged files, half floats,
training."""

import logging
import subprocess
import sys
import textwrap

import faiss
import numpy as np
import pytest
from index_fixtures import DIM, unit_vectors

from embedingest.errors import ConfigError
from embedingest.index.faiss_factory import (
    SearchParamOutOfRange,
    as_float32,
    empty_index,
    apply_search_params,
    faiss_message,
    metric_code,
    parse_factory,
    read_index_file,
    train,
)


def test_metric_codes_and_an_unknown_metric():
    assert (metric_code("ip"), metric_code("l2")) == (faiss.METRIC_INNER_PRODUCT, faiss.METRIC_L2)
    with pytest.raises(ConfigError) as err:
        metric_code("cosine")
    assert str(err.value) == "unknown metric 'cosine'; use one of ip, l2"


def test_parse_factory_makes_the_kind_asked_and_names_a_bad_string():
    index = parse_factory(DIM, "IVF4,Flat", "l2")
    assert isinstance(index, faiss.IndexIVFFlat) and index.d == DIM and index.metric_type == faiss.METRIC_L2
    with pytest.raises(ConfigError) as err:
        parse_factory(DIM, "Nonsense", "ip")
    message = str(err.value)
    assert message.startswith("faiss cannot build index factory 'Nonsense' for dim 16: ")
    assert message.endswith("; see faiss's index_factory strings (e.g. Flat, IVF1024,Flat, HNSW32)")
    assert "Error in" not in message and ".cpp" not in message  # no C++ location


def test_empty_index_is_untrained_only_by_refusal_and_a_trained_one_is_cloned():
    flat = empty_index(DIM, "Flat", "ip")
    assert isinstance(flat, faiss.IndexFlat) and flat.metric_type == faiss.METRIC_INNER_PRODUCT and flat.ntotal == 0
    with pytest.raises(ConfigError, match="^index factory 'IVF4,Flat' needs training: train it"):
        empty_index(DIM, "IVF4,Flat", "ip")
    trained = parse_factory(DIM, "IVF4,Flat", "ip")
    trained.train(unit_vectors(200))
    clone = empty_index(DIM, "IVF4,Flat", "ip", trained)
    assert clone is not trained and clone.is_trained and clone.ntotal == 0
    clone.add(unit_vectors(5))
    assert trained.ntotal == 0  # a clone, not the trained index itself


def test_faiss_message_keeps_what_failed_and_drops_where():
    exc = RuntimeError("Error in virtual void faiss::Foo::bar() at /src/faiss/Foo.cpp:42: Error: "
                       "'n > 0' failed\nsecond line")
    assert faiss_message(exc) == "'n > 0' failed"
    assert faiss_message(RuntimeError("plain words")) == "plain words"
    assert faiss_message(RuntimeError("")) == "RuntimeError"


def test_a_damaged_index_file_is_named_with_how_to_redo_it(tmp_path):
    path = tmp_path / "x.faiss"
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(ConfigError) as err:
        read_index_file(path, redo="delete it")
    assert str(err.value).startswith(f"cannot read {str(path)!r} (")
    assert str(err.value).endswith("): the file is damaged; delete it")
    with pytest.raises(ConfigError, match="damaged; do this$"):
        read_index_file(path, redo="do this")
    good = tmp_path / "good.faiss"
    faiss.write_index(faiss.IndexFlatL2(DIM), str(good))
    assert read_index_file(good, redo="delete it").d == DIM


def test_as_float32_of_each_dtype():
    x = unit_vectors(4)
    assert as_float32(x) is x  # already float32 and contiguous: no copy
    np.testing.assert_array_equal(as_float32(x.astype(np.float16)), x.astype(np.float16).astype(np.float32))
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(as_float32(bits).view(np.uint32), bits.astype(np.uint32) << 16)
    assert as_float32(x[:, ::2]).flags.c_contiguous
    with pytest.raises(ConfigError, match="^embeddings of dtype int8 cannot be indexed; send float32"):
        as_float32(np.zeros((2, 3), np.int8))


# -- what mutation testing found unchecked (docs/TESTING.md) ---------------------------


def test_faiss_s_own_words_are_in_the_messages_of_a_bad_factory_and_a_damaged_file(tmp_path):
    with pytest.raises(RuntimeError) as faiss_err:  # faiss's words vary with its version
        faiss.index_factory(DIM, "Nonsense")
    said = faiss_message(faiss_err.value)
    assert "Nonsense" in said  # e.g. "could not parse index string Nonsense"
    with pytest.raises(ConfigError) as err:
        parse_factory(DIM, "Nonsense", "ip")
    assert str(err.value) == (f"faiss cannot build index factory 'Nonsense' for dim 16: {said}; see "
                              "faiss's index_factory strings (e.g. Flat, IVF1024,Flat, HNSW32)")
    path = tmp_path / "x.faiss"
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(RuntimeError) as faiss_err:
        faiss.read_index(str(path))
    said = faiss_message(faiss_err.value)
    assert said and said != "None" and "index_read" not in said  # e.g. 'Index type 0x62726167 ("garb") not recognized'
    with pytest.raises(ConfigError) as err:
        read_index_file(path, redo="redo it")
    assert str(err.value) == f"cannot read {str(path)!r} ({said}): the file is damaged; redo it"


def test_an_untrained_factory_s_refusal_says_how_to_train_it():
    with pytest.raises(ConfigError) as err:
        empty_index(DIM, "IVF4,Flat", "ip")
    assert str(err.value) == ("index factory 'IVF4,Flat' needs training: train it on a sample with "
                              "IndexStore.train_index and pass the trained index path")


def test_as_float32_always_gives_float32():
    x = unit_vectors(4)
    half = as_float32(x.astype(np.float16))
    assert half.dtype == np.float32 and half.flags.c_contiguous
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    bf16 = as_float32(bits)
    assert bf16.dtype == np.float32
    np.testing.assert_allclose(bf16, x, rtol=2 ** -7)  # bfloat16 keeps 8 bits of mantissa


@pytest.mark.parametrize("factory, match", [
    ("IDMap,Flat", r"^index factory 'IDMap,Flat' has an IDMap: each shard maps its ids itself; give the "
                   r"factory without it \(e.g. 'Flat'\)$"),
    ("IDMap2,HNSW32", r"has an IDMap"),
    ("HNSW0", r"^index factory 'HNSW0': HNSW takes 2 to 512 links per node, not 0; e.g. HNSW32$"),
    ("HNSW1,Flat", r"not 1"),
    ("HNSW2147483647", r"not 2147483647"),  # gigabytes, then a C++ error from every process
    ("IVF2147483647,Flat", r"2147483647 lists is more than 16777216"),
    ("IVF64_HNSW4096,Flat", r"not 4096"),
    ("NSG8", r"^index factory 'NSG8' is an NSG graph, which faiss builds only from 100 vectors or more at "
             r"once, and a shard of an update may hold fewer; use HNSW \(e.g. HNSW32\)"),
    ("IVF16_NSG32,Flat", r"is an NSG graph"),
])
def test_factories_faiss_makes_but_a_shard_cannot_use_are_refused(factory, match):
    """Before: IDMap gave tracebacks in reindex and three in build-index (and a manifest
    left behind); HNSW0 aborted the process (SIGABRT) when vectors were added; NSG8 failed
    every update whose new shard held fewer than 100 vectors, with a consumer's traceback."""
    with pytest.raises(ConfigError, match=match):
        parse_factory(8, factory, "ip")


@pytest.mark.parametrize("params, reason", [
    ("efSearch=0", "efSearch=0 must be a whole number of at least 1"),  # faiss gave one hit whatever k
    ("efSearch=-5", "efSearch=-5 must be a whole number of at least 1"),
    ("efSearch=2.5", "efSearch=2.5 must be a whole number of at least 1"),  # faiss cut it to 2
    ("efSearch=16,efSearch=32", "efSearch is given twice (efSearch=16, efSearch=32): give it once"),
    ("efSearch=abc", "'efSearch=abc' is not NAME=NUMBER"),
    ("efSearch=nan", "'efSearch=nan' is not NAME=NUMBER"),
    ("efSearch", "'efSearch' is not NAME=NUMBER"),
    ("efSearch=16,", "'' is not NAME=NUMBER"),
    ("=3", "'=3' is not NAME=NUMBER"),
    ("ef Search=5", "'ef Search=5' is not NAME=NUMBER"),  # faiss: "'ret == 2' failed"
    ("efSearch=0_64", "'efSearch=0_64' is not NAME=NUMBER"),  # Python's float reads 64, faiss 0
    ("efSearch=1e30", "'efSearch=1e30' is not NAME=NUMBER"),
    ("efSearch=99999999999", "efSearch=99999999999 is out of range (at most 2147483647)"),
])
def test_search_params_faiss_would_take_or_misread_are_refused_by_name(params, reason):
    index = faiss.index_factory(DIM, "HNSW8")
    with pytest.raises(ValueError) as err:
        apply_search_params(index, params)
    assert str(err.value) == reason
    assert index.hnsw.efSearch == 16  # nothing set


def test_search_params_apply_and_nprobe_below_1_is_refused_before_the_first_search():
    x = unit_vectors(200, seed=3)
    hnsw = faiss.index_factory(DIM, "HNSW8")
    hnsw.add(x)
    apply_search_params(hnsw, "efSearch=1")
    assert hnsw.hnsw.efSearch == 1
    assert (hnsw.search(x[:1], 5)[1] >= 0).all()  # at least 1: every hit asked for comes
    ivf = faiss.index_factory(DIM, "IVF4,Flat")
    ivf.train(x)
    apply_search_params(ivf, "nprobe=3")
    assert ivf.nprobe == 3
    with pytest.raises(ValueError, match=r"^nprobe=0 must be a whole number of at least 1$"):
        apply_search_params(ivf, "nprobe=0")
    assert apply_search_params(ivf, " nprobe = 2 ") == "nprobe=2"  # faiss read ' nprobe ' as a name
    assert ivf.nprobe == 2
    with pytest.raises(ValueError) as err:  # a parameter the factory has not: faiss's reason, cut
        apply_search_params(ivf, "efSearch=8")
    assert "efSearch" in str(err.value) and "Error in" not in str(err.value) and ".cpp" not in str(err.value)


def test_training_gives_way_to_a_stop_at_once():
    """faiss held the main thread in C++ for the whole training: a reindex stopped with
    SIGTERM or Ctrl-C ended 30-40 s later. A stop now comes while it trains."""
    script = textwrap.dedent("""
        import signal, time, numpy as np, faiss
        from embedingest.index.faiss_factory import train
        def stop(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGALRM, stop)
        x = np.random.default_rng(0).random((20000, 64), dtype=np.float32)
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        t0 = time.perf_counter()
        try:
            train(faiss.index_factory(64, "IVF1024,PQ16"), x)  # about 15 s on two CPUs
            print("trained", time.perf_counter() - t0)
        except KeyboardInterrupt:
            print("stopped", time.perf_counter() - t0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    word, seconds = out.stdout.split()
    assert word == "stopped" and float(seconds) < 2.0, out.stdout + out.stderr


def test_faiss_warnings_during_training_are_logged_once_each(caplog):
    x = unit_vectors(300, seed=1)
    index = faiss.index_factory(DIM, "IVF4,PQ4")  # 300 points for 256 centroids, in each of 4 sub-quantizers
    with caplog.at_level(logging.WARNING, logger="embedingest"):
        train(index, x)
    assert index.is_trained
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("faiss: ")]
    assert len(lines) == 1 and "clustering 300 points to 256 centroids" in lines[0], lines
    assert lines[0].endswith(" times)") and not lines[0].startswith("faiss: WARNING")


def test_a_training_error_reaches_the_caller():
    with pytest.raises(RuntimeError, match="(?i)number of training points"):
        train(faiss.index_factory(DIM, "IVF64,Flat"), unit_vectors(10, seed=2))


@pytest.mark.parametrize("factory", ["L2norm,Flat", "L2norm,IVF4,Flat"])
def test_an_index_with_a_transform_that_stores_no_matrix_is_read_whole(tmp_path, factory):
    """faiss checks an L2norm's d x d against the bound on a vector read, though the file
    holds no such matrix: read within the file's size, every L2norm index was 'damaged'."""
    from embedingest.index.faiss_factory import read_bounded

    dim = 384
    index = faiss.index_factory(dim, factory)
    vectors = np.random.default_rng(0).standard_normal((200, dim)).astype(np.float32)
    index.train(vectors)
    index.add(vectors)
    path = tmp_path / "x.faiss"
    faiss.write_index(index, str(path))
    assert path.stat().st_size < 4 * dim * dim
    got = read_bounded(path)
    assert got.ntotal == 200 and got.d == dim
    np.testing.assert_array_equal(got.search(vectors[:3], 1)[1].ravel(), [0, 1, 2])


def test_a_file_whose_header_claims_more_vectors_than_it_holds_is_refused_without_the_memory(tmp_path):
    """A shard of a few KB whose vectors' size field says 500 million floats: faiss
    allocated and zeroed 2 GB before finding the file short (16 GB for 4e9, and the
    search was killed), by the mmap reading of search as by a plain read."""
    import struct

    index = faiss.IndexIDMap(faiss.IndexFlatIP(DIM))
    index.add_with_ids(unit_vectors(12), np.arange(12, dtype=np.int64))
    data = bytearray(faiss.serialize_index(index).tobytes())
    at = data.index(b"IxFI") + 37  # after d, ntotal, two dummies, is_trained and the metric: the codes' size
    assert struct.unpack_from("<Q", data, at)[0] == 12 * DIM
    struct.pack_into("<Q", data, at, 500_000_000)
    path = tmp_path / "x.faiss"
    path.write_bytes(bytes(data))
    script = textwrap.dedent(f"""
        import resource
        from embedingest.errors import ConfigError
        from embedingest.index.faiss_factory import read_index_file
        from embedingest.index.search import read_shard
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for read in (lambda p: read_index_file(p, redo="delete it"), lambda p: read_shard(p, "s0")):
            try:
                read({str(path)!r})
            except ConfigError as exc:
                print(str(exc))
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    *errors, grown_mb = out.splitlines()
    assert len(errors) == 2 and all(e.startswith(f"cannot read {str(path)!r} (") for e in errors)
    assert errors[0].endswith("): the file is damaged; delete it")
    assert errors[1].endswith("): the file is damaged; delete that shard's files (every file named s0.*) and run "
                              "the same build-index command again: the units it held are redone")
    assert int(grown_mb) < 200, out
    limit = faiss.get_deserialization_vector_byte_limit()
    faiss.write_index(index, str(path))  # a whole file is read as before, and faiss's bound put back
    assert read_index_file(path, redo="delete it").ntotal == 12 and faiss.get_deserialization_vector_byte_limit() == limit


@pytest.mark.parametrize("n", [1, 6, 17, 255, 256, 10_000])
def test_training_advice_names_a_factory_that_trains_on_that_many_vectors(n):
    """The advice was 'fewer bits per code (PQ, e.g. PQ16x8)' whatever the count: PQ16x8
    failed on 17 vectors as the factory it replaced did."""
    import re

    from embedingest.index.faiss_factory import train, training_advice

    advice = training_advice(n)
    lists = int(re.search(r"\(IVF(\d+)\)", advice)[1])
    rng = np.random.default_rng(n)
    sample = rng.standard_normal((n, 32)).astype(np.float32)
    train(ivf := faiss.index_factory(32, f"IVF{lists},Flat"), sample)
    assert ivf.is_trained
    bits = re.search(r"PQ16x(\d+)", advice)
    if n == 1:
        assert advice == "on 1 vector use at most 1 list (IVF1) or no PQ (it needs 2 vectors or more)"
    elif n < 256:
        pq = faiss.index_factory(32, f"PQ16x{bits[1]}")
        train(pq, sample)
        assert pq.is_trained and 2 ** (int(bits[1]) + 1) > n
    else:
        assert bits is None and advice.endswith("or fewer bits per code (PQ)")


def _trained_ivfpq(factory, metric, dim=DIM, seed=0):
    """``factory`` (IVF-PQ, its lists many) trained in a second, not by k-means over as many
    lists: random centroids, the PQ trained on a small sample."""
    rng = np.random.default_rng(seed)
    index = faiss.index_factory(dim, factory, metric)
    ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
    ivf.quantizer.add(rng.standard_normal((ivf.nlist, dim)).astype(np.float32))
    ivf.pq.train(rng.standard_normal((1000, dim)).astype(np.float32))
    ivf.is_trained = index.is_trained = True
    ivf.precompute_table()
    return index


@pytest.mark.parametrize("factory,metric", [("IVF8192,PQ16", faiss.METRIC_L2),
                                            ("IVF8192,PQ16", faiss.METRIC_INNER_PRODUCT),
                                            ("IVF8192,PQ16,RFlat", faiss.METRIC_L2)])
def test_an_ivfpq_index_whose_precomputed_tables_pass_the_bound_is_read_and_searched(tmp_path, factory, metric):
    """faiss checks an IVF-PQ's precomputed tables (8192 lists x 16 x 256 floats: 128 MiB,
    not in the file) against the bound on a vector read: every shard of the README's
    IVF4096,PQ32 was refused as damaged, with the advice to delete it. It is read whole,
    its tables as a build makes them (L2 only), and searches as the index written did."""
    from embedingest.index.search import read_shard

    index = faiss.IndexIDMap(_trained_ivfpq(factory, metric))
    vectors = unit_vectors(300, seed=4)
    index.add_with_ids(vectors, np.arange(300, dtype=np.int64) * 7)
    path = tmp_path / "s0.faiss"
    faiss.write_index(index, str(path))
    assert path.stat().st_size < 8192 * 16 * 256 * 4 // 10  # the tables are not in the file
    faiss.ParameterSpace().set_index_parameters(index, "nprobe=16")
    expected = index.search(vectors[:5], 4)
    limit = faiss.get_deserialization_vector_byte_limit()
    for got in (read_index_file(path, redo="delete it"), read_shard(path, "s0")):
        ivf = faiss.downcast_index(faiss.extract_index_ivf(got))
        assert got.ntotal == 300 and ivf.use_precomputed_table == (1 if metric == faiss.METRIC_L2 else 0)
        faiss.ParameterSpace().set_index_parameters(got, "nprobe=16")
        scores, ids = got.search(vectors[:5], 4)
        np.testing.assert_array_equal(ids, expected[1])
        np.testing.assert_allclose(scores, expected[0], rtol=1e-5)
    assert faiss.get_deserialization_vector_byte_limit() == limit


def test_a_truncated_ivfpq_file_is_still_refused_as_damaged(tmp_path):
    """Read again without its tables, an IVF-PQ file is bounded as before: cut short, it is
    damaged, whichever read finds it."""
    index = faiss.IndexIDMap(_trained_ivfpq("IVF8192,PQ16", faiss.METRIC_L2))
    index.add_with_ids(unit_vectors(300, seed=4), np.arange(300, dtype=np.int64))
    data = faiss.serialize_index(index).tobytes()
    path = tmp_path / "s0.faiss"
    path.write_bytes(data[:len(data) - 100])
    with pytest.raises(ConfigError, match=r"^cannot read .*: the file is damaged; delete it$"):
        read_index_file(path, redo="delete it")


def test_nprobe_above_the_index_s_lists_is_refused_naming_the_value_and_the_range():
    """Before: faiss cut nprobe=5 on IVF4 to 4 without a word, while a refusal of another
    parameter said the index takes 'nprobe (1 to 4)'."""
    for factory in ("IVF4,Flat", "OPQ4,IVF4,PQ4", "IVF4_HNSW8,Flat"):
        index = faiss.index_factory(DIM, factory)
        assert apply_search_params(index, "nprobe=4", within_lists=True) == "nprobe=4"
        with pytest.raises(SearchParamOutOfRange) as err:
            apply_search_params(index, "nprobe=5", within_lists=True)
        assert str(err.value) == "nprobe=5 is more than the index's 4 lists: give nprobe 1 to 4"
        assert faiss.extract_index_ivf(index).nprobe == 4  # nothing set

"""The faiss side of an index: metrics, factory strings, empty (trained) indexes and
reading index files, with faiss's errors turned into messages that say what to do.

Imports faiss and numpy only, so the shard writers in consumer processes use it too.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import tempfile
import threading
from pathlib import Path

import faiss
import numpy as np

from ..errors import ConfigError
from ..outfiles import native_path
from ..terminal import counted

METRICS = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}

log = logging.getLogger("embedingest")

# Bounds on factory sizes that faiss takes and then allocates for (HNSW2147483647 took gigabytes
# and ended in a C++ error from every process that made it).
MAX_HNSW_LINKS = 512
MAX_IVF_LISTS = 1 << 24


def metric_code(metric: str) -> int:
    """The faiss metric constant of ``"ip"`` or ``"l2"``."""
    try:
        return METRICS[metric]
    except KeyError:
        raise ConfigError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}") from None


def faiss_message(exc: RuntimeError) -> str:
    """What a faiss error says failed, without the C++ function and source line it names."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return re.sub(r"^Error in .*? at \S+:\d+: (Error: )?", "", lines[0])


# Search parameters faiss takes at any value but answers wrongly below 1: efSearch 0 or
# less gave one hit whatever k; nprobe 0 failed only at the first search.
_DECIMAL = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # faiss read 'n probe' as a name and said only 'ret == 2' failed
_AT_LEAST_ONE = re.compile(r"(?:\w+_)?(?:nprobe|efSearch)")


def search_params_text(params: str) -> str:
    """``params`` (``"nprobe=16, efSearch=64"``) as faiss's ParameterSpace reads them:
    NAME=NUMBER parts joined by commas, without spaces (faiss takes a space as part of a
    name). ValueError saying what is wrong when a part is not NAME=NUMBER, a name is given
    twice (faiss set the last), an nprobe or efSearch is not a whole number of at least 1
    (faiss cut 2.5 to 2) or a value is out of range."""
    parts: dict[str, str] = {}
    for part in params.split(","):
        name, sep, value = (p.strip() for p in part.partition("="))
        # plain decimals only: Python reads 0_64 and 1e30, faiss reads the same text as 0
        # and as an integer out of range
        if not (sep and _NAME.fullmatch(name) and _DECIMAL.fullmatch(value)):
            raise ValueError(f"{part.strip()!r} is not NAME=NUMBER")
        if name in parts:
            raise ValueError(f"{name} is given twice ({name}={parts[name]}, {name}={value}): give it once")
        number = float(value)
        if _AT_LEAST_ONE.fullmatch(name) and ("." in value or number < 1):
            raise ValueError(f"{name}={value} must be a whole number of at least 1")
        if abs(number) > 2**31 - 1:
            raise ValueError(f"{name}={value} is out of range (at most {2**31 - 1})")
        parts[name] = value
    return ",".join(f"{name}={value}" for name, value in parts.items())


class SearchParamOutOfRange(ValueError):
    """A search parameter the index takes, at a value it has no use for: said by us,
    not by faiss."""


def _check_nprobe(index: faiss.Index, text: str) -> None:
    """SearchParamOutOfRange when ``text`` sets an nprobe above the number of lists of
    ``index``'s IVF part: faiss cut it to that number without a word."""
    ivf = faiss.try_extract_index_ivf(index)
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name == "nprobe" and ivf is not None and int(value) > ivf.nlist:
            raise SearchParamOutOfRange(f"nprobe={value} is more than the index's {ivf.nlist} lists: give "
                                        f"nprobe 1 to {ivf.nlist}")


def apply_search_params(index: faiss.Index, params: str, within_lists: bool = False) -> str:
    """Set ``params`` on ``index`` through faiss's ParameterSpace; they are returned as
    :func:`search_params_text` writes them. ValueError saying what is wrong when they are
    not well formed or faiss has no such parameter for the factory; ``within_lists``: also
    an nprobe more than the index's lists (:class:`SearchParamOutOfRange`), as given to
    search or stored by a build (reindex takes over and cuts a stored one itself)."""
    text = search_params_text(params)
    if within_lists:
        _check_nprobe(index, text)
    try:
        faiss.ParameterSpace().set_index_parameters(index, text)
    except RuntimeError as exc:
        raise ValueError(faiss_message(exc)) from exc
    return text


# The search parameters faiss's ParameterSpace sets, as a refusal lists those an index takes
# (every index takes "verbose", and HNSW "efConstruction", which a search does not use).
_SEARCH_PARAMS = ("nprobe", "max_codes", "efSearch", "quantizer_efSearch", "k_factor_rf", "k_factor", "ht")


def search_params_taken(index: faiss.Index) -> list[str]:
    """The search parameters ``index`` takes, in words (``"nprobe (1 to 16)"``), for a
    refusal of others to list. Each is tried on ``index`` itself (a copy of a large
    index would cost its size): call it only on an index whose parameters are refused
    anyway, not one that goes on searching."""
    space, taken = faiss.ParameterSpace(), []
    for name in _SEARCH_PARAMS:
        try:
            space.set_index_parameter(index, name, 1)
        except RuntimeError:
            continue
        ivf = faiss.try_extract_index_ivf(index) if name == "nprobe" else None
        taken.append(f"nprobe (1 to {ivf.nlist})" if ivf is not None else name)
    return taken


def search_param_names(params: str) -> list[str]:
    """The names ``params`` sets (``"nprobe=16,efSearch=64"``: nprobe, efSearch)."""
    return [part.partition("=")[0].strip() for part in params.split(",") if part.strip()]


def parse_factory(dim: int, factory: str, metric: str) -> faiss.Index:
    """``faiss.index_factory(dim, factory, metric)``, a ConfigError naming the string when
    faiss cannot make it. A build calls it before it writes anything, so a bad
    ``--index`` never gets into a manifest. Strings faiss makes but a shard cannot use are
    refused too: an id map (each shard maps its ids itself), NSG (it cannot build from fewer
    than 100 vectors) and HNSW with fewer than 2 links per node (faiss aborts the process
    when it adds to one)."""
    if "IDMap" in factory:
        plain = factory.replace("IDMap2,", "").replace("IDMap,", "")
        raise ConfigError(f"index factory {factory!r} has an IDMap: each shard maps its ids itself; "
                          f"give the factory without it (e.g. {plain!r})")
    if re.search(r"NSG", factory):
        raise ConfigError(f"index factory {factory!r} is an NSG graph, which faiss builds only from 100 "
                          "vectors or more at once, and a shard of an update may hold fewer; use HNSW "
                          "(e.g. HNSW32), the graph built a vector at a time")
    links = [int(m) for m in re.findall(r"HNSW(\d+)", factory) if not 2 <= int(m) <= MAX_HNSW_LINKS]
    if links:
        raise ConfigError(f"index factory {factory!r}: HNSW takes 2 to {MAX_HNSW_LINKS} links per node, not "
                          f"{links[0]}; e.g. HNSW32")
    lists = [int(m) for m in re.findall(r"IVF(\d+)", factory) if int(m) > MAX_IVF_LISTS]
    if lists:
        raise ConfigError(f"index factory {factory!r}: {lists[0]} lists is more than {MAX_IVF_LISTS} (faiss "
                          "would allocate them all before the first vector); e.g. IVF65536 for a billion vectors")
    try:
        return faiss.index_factory(dim, factory, metric_code(metric))
    except RuntimeError as exc:
        raise ConfigError(f"faiss cannot build index factory {factory!r} for dim {dim}: "
                          f"{faiss_message(exc)}; see faiss's index_factory strings (e.g. Flat, IVF1024,Flat, "
                          "HNSW32)") from exc


def copy_index(index: faiss.Index) -> faiss.Index:
    """A copy of ``index``: ``faiss.clone_index``, else (faiss clones no L2norm transform,
    among others) the index serialized and read back."""
    try:
        return faiss.clone_index(index)
    except RuntimeError:
        return faiss.deserialize_index(faiss.serialize_index(index))


def empty_index(dim: int, factory: str, metric: str, trained: faiss.Index | None = None) -> faiss.Index:
    """An empty, trained index of the shard kind (without the id map): a copy of
    ``trained`` when given, else ``faiss.index_factory(dim, factory, metric)``."""
    if trained is not None:
        return copy_index(trained)
    index = parse_factory(dim, factory, metric)
    if not index.is_trained:
        raise ConfigError(f"index factory {factory!r} needs training: train it on a sample "
                          "with IndexStore.train_index and pass the trained index path")
    return index


def as_float32(emb: np.ndarray) -> np.ndarray:
    """float32, float16, or bfloat16 bits (uint16, as the engine delivers bf16) -> float32."""
    if emb.dtype == np.uint16:
        return (emb.astype(np.uint32) << 16).view(np.float32)
    if emb.dtype in (np.float32, np.float16):
        return np.ascontiguousarray(emb, dtype=np.float32)
    raise ConfigError(f"embeddings of dtype {emb.dtype} cannot be indexed; "
                      "send float32, float16 or bfloat16")


# faiss checks a transform's d_in x d_out floats against the same bound, stored or not (an
# L2norm stores none): room for one of 4096 x 4096, and no claimed vector costs more memory
TRANSFORM_ROOM = 4 * 4096 * 4096
_READ_LOCK = threading.Lock()  # faiss's bound on a vector read is one setting of the process


def read_bounded(path: Path, flags: int = 0) -> faiss.Index:
    """``faiss.read_index``, no vector in it taking more bytes than the file holds (or
    :data:`TRANSFORM_ROOM`, whichever is more). faiss
    believes the sizes a file gives: a header claiming billions of vectors made it
    allocate and zero that much memory before finding the file short (16 GB for a shard
    of 18 KB). Raises faiss's RuntimeError, or MemoryError, for a damaged file.

    An IVF-PQ index's precomputed tables (lists x sub-quantizers x 256 floats: 128 MiB
    for IVF4096,PQ32) are not in the file but computed as it is read, and faiss checks
    them against the same bound: every such index of the README's factories was refused
    as damaged. One refused for that alone is read again without them (everything the
    file holds still within the bound), and they are then computed as a build computes
    them (:func:`_precompute_ivfpq_tables`: only where they serve, at most faiss's
    ``precomputed_table_max_bytes``, 2 GiB; from lists and sub-quantizers the file was
    read whole with)."""
    with native_path(path) as name, _READ_LOCK:
        before = faiss.get_deserialization_vector_byte_limit()
        faiss.set_deserialization_vector_byte_limit(min(before, max(os.stat(name).st_size + 1, TRANSFORM_ROOM)))
        try:
            try:
                return faiss.read_index(name, flags)
            except RuntimeError as exc:
                if "precomputed_table" not in str(exc):
                    raise
            index = faiss.read_index(name, flags | faiss.IO_FLAG_SKIP_PRECOMPUTE_TABLE)
        finally:
            faiss.set_deserialization_vector_byte_limit(before)
    _precompute_ivfpq_tables(index)
    return index


def _precompute_ivfpq_tables(index: faiss.Index) -> None:
    """Compute the precomputed tables of the IVF-PQ index ``index`` is (or wraps: an id
    map, transforms, a refine index), read without them: faiss's own choice, as when the
    index was built (L2 by residual only; none over ``precomputed_table_max_bytes``)."""
    ivf = faiss.try_extract_index_ivf(index)
    ivf = faiss.downcast_index(ivf) if ivf is not None else None
    if isinstance(ivf, faiss.IndexIVFPQ) and ivf.by_residual and ivf.use_precomputed_table == 0:
        ivf.precompute_table()


def read_index_file(path: Path, flags: int = 0, *, redo: str) -> faiss.Index:
    """``faiss.read_index``; a damaged file is a ConfigError naming it and saying how to
    redo it (``redo``), never a traceback of faiss."""
    try:
        return read_bounded(path, flags)
    except (RuntimeError, MemoryError) as exc:
        raise ConfigError(f"cannot read {str(path)!r} ({faiss_message(exc)}): the file is damaged; "
                          f"{redo}") from exc


# The lists an IVF index probes unless told otherwise (at most its lists): faiss's own
# default, one list, misses much of the true top 10 (docs/BENCHMARKS.md, "IVF's search default").
DEFAULT_NPROBE = 16
# The candidates an HNSW search keeps unless told otherwise: faiss's own default, 16, misses
# part of the true top 10 (docs/BENCHMARKS.md, "HNSW's search default").
DEFAULT_EF_SEARCH = 64


def _hnsw(index: faiss.Index) -> faiss.IndexHNSW | None:
    """The HNSW graph index that ``index`` is, or that its wrappers (transforms, PCA say;
    a refine index, ``HNSW32,Flat,RFlat``; an id map) hold: faiss's ParameterSpace sets
    efSearch through them all."""
    index = faiss.downcast_index(index)
    while True:
        if isinstance(index, (faiss.IndexPreTransform, faiss.IndexIDMap, faiss.IndexIDMap2)):
            index = faiss.downcast_index(index.index)
        elif isinstance(index, faiss.IndexRefine):
            index = faiss.downcast_index(index.base_index)
        else:
            return index if isinstance(index, faiss.IndexHNSW) else None


def default_search_params(index: faiss.Index) -> str | None:
    """The search parameters a new index keeps when none are given: ``nprobe`` for an IVF
    factory (:data:`DEFAULT_NPROBE`, at most its lists), ``efSearch`` for an HNSW one
    (:data:`DEFAULT_EF_SEARCH`; also under transforms or a refine index), none for the
    others (a flat index is exact)."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        return f"nprobe={min(ivf.nlist, DEFAULT_NPROBE)}"
    return None if _hnsw(index) is None else f"efSearch={DEFAULT_EF_SEARCH}"


def training_advice(n: int) -> str:
    """What a factory can train on ``n`` vectors, for a refusal to name: IVF's k-means
    needs a vector a list, and PQ's a vector for each of a sub-quantizer's 2**bits
    centroids, so the advice gives the largest of each that fits (PQ16x8 needs 256)."""
    bits = min(8, n.bit_length() - 1)  # 2**bits <= n
    pq = ("no PQ (it needs 2 vectors or more)" if bits < 1 else
          f"at most {bits} bits per code (PQ, e.g. PQ16x{bits})" if bits < 8 else "fewer bits per code (PQ)")
    return f"on {counted(n, 'vector')} use at most {counted(max(1, n), 'list')} (IVF{max(1, n)}) or {pq}"


def train(index: faiss.Index, sample: np.ndarray) -> None:
    """``index.train(sample)``, in a thread while this one waits: faiss holds the calling
    thread in C++ until training ends (minutes for OPQ or a large IVF), and a Ctrl-C or a
    SIGTERM waited for it; waited for here, the stop is raised at once (the thread, a
    daemon, ends with the process). What faiss prints meanwhile (a clustering warning for
    every sub-quantizer and iteration: thousands of lines) is logged once per line."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            index.train(sample)
        except BaseException as exc:  # re-raised in the caller
            failed.append(exc)

    with _stderr_lines_once():
        worker = threading.Thread(target=run, name="faiss-train", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.1)
    if failed:
        raise failed[0]


@contextlib.contextmanager
def _stderr_lines_once():
    """File descriptor 2 (where faiss's C++ writes) into a file for the block, then each
    distinct line of it logged once, with how often it came."""
    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            counts = collections.Counter(line.strip() for line in held.read().decode(errors="replace").splitlines())
            for line, n in counts.items():
                if line:
                    log.warning("faiss: %s%s", line.removeprefix("WARNING "), f" ({n} times)" if n > 1 else "")

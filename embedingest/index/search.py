"""Query an index folder: every shard is searched and the per-shard top-k are merged,
so the result equals one search over all vectors (exactly so for Flat shards).

Shards are memory-mapped where faiss can (flat codes, IVF lists), so opening a large
index costs little memory and starts fast; the page cache holds what queries touch.

The manifest's query prompt goes before every text query, and its search defaults
(faiss parameters such as ``nprobe``, and ``k``) apply unless the caller gives its own.
An open index may be searched from several threads (a server's): the chunk rows are
read from the shards' Parquet files (:class:`~embedingest.index.lookup.ShardRows`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from ..config import DEFAULT_SEARCH_K
from ..errors import ConfigError
from ..outfiles import refuse_link
from .faiss_factory import (METRICS, apply_search_params, metric_code, read_bounded, read_index_file,
                            search_params_text)
from .lookup import ShardRows
from .shard_store import answering_folder
from ..sources.remote import is_remote
from ..sources.text import arrow_as_list
from ..stages.device_name import device_name
from .shards import SHARDS_DIR, list_shards, redo_advice
from .store import IndexStore, Manifest

PARALLEL_FROM = 20_000  # vectors; below, threads cost more than the scan
_MMAP_FLAGS = (
    faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY,  # flat codes, HNSW
    faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY,  # IVF inverted lists
)

log = logging.getLogger("embedingest")


@dataclass(frozen=True)
class Hit:
    """One result; rank 1 is the best. ``record_id`` is ``""`` for a hit of a whole-text
    file (no records in it), as the shards store it; ``char_start`` and ``char_end`` are
    None where the source has none."""

    rank: int
    score: float
    id: int
    source: str | None
    record_id: str | None
    chunk_no: int | None
    char_start: int | None
    char_end: int | None
    text: str | None


def read_shard(path: Path, name: str) -> faiss.Index:
    """Read the file of shard ``name`` memory-mapped where faiss supports it for its kind,
    else into memory; a damaged file is a ConfigError naming it and how to redo it."""
    for flags in _MMAP_FLAGS:
        try:
            return read_bounded(path, flags)
        except (RuntimeError, MemoryError):
            continue
    return read_index_file(path, redo=redo_advice(name))


def blank_query(text: str) -> bool:
    """Whether a query holds nothing to search for: only whitespace and control
    characters (``"\x00\x01"``), which the tokenizer drops, leaving an empty text."""
    return not any(c.isprintable() and not c.isspace() for c in text)


def _refuse_untokenized(tokenizer, queries: list[str]) -> None:
    """Refuse a query the model's tokenizer reduces to nothing (``"\ufffd"``, lone
    combining accents, format characters): without it the vector would be the query
    prompt's or the special tokens' alone, and its hits arbitrary. An encoder given by the
    caller may have no ``tokenizer``: nothing is checked then."""
    if tokenizer is None:
        return
    ids = tokenizer(queries, add_special_tokens=False)["input_ids"]
    empty = next((i for i, row in enumerate(ids) if len(row) == 0), None)
    if empty is not None:
        raise ConfigError(f"query {empty} ({queries[empty]!r}) holds nothing the model reads (its "
                          "tokenizer drops every character); give each query some words")
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None:
        unread = next((i for i, row in enumerate(ids) if all(t == unknown for t in row)), None)
        if unread is not None:
            raise ConfigError(f"query {unread} ({queries[unread]!r}) holds nothing the model reads (its "
                              f"tokenizer knows none of its characters: {tokenizer.unk_token} only); give "
                              "each query some words")


def _refuse_a_prompt_that_fills_the_model(encoder, prompt: str) -> None:
    """:func:`~embedingest.stages.prompts.refuse_filling_query_prompt` for ``encoder``. An
    encoder given by the caller may have no ``tokenizer`` or ``max_seq_length``: nothing
    is checked then."""
    from ..stages.prompts import refuse_filling_query_prompt  # torch: loaded with the encoder

    tokenizer, limit = getattr(encoder, "tokenizer", None), getattr(encoder, "max_seq_length", None)
    if tokenizer is not None and isinstance(limit, int):
        refuse_filling_query_prompt(tokenizer, limit, prompt)


_fork_hook = threading.Lock()
_fork_hooked = False


def _single_threaded_after_fork() -> None:
    """Once a process searched, its forked children search with one faiss thread: faiss's
    OpenMP pool does not survive a fork, and a child's first search (a
    ``multiprocessing.Pool`` of an ETL job, fork being Linux's default) hung for ever."""
    global _fork_hooked
    with _fork_hook:
        if not _fork_hooked:
            os.register_at_fork(after_in_child=lambda: faiss.omp_set_num_threads(1))
            _fork_hooked = True


class Index:
    """A searchable index folder; see :func:`open_index`."""

    def __init__(self, store: IndexStore, manifest: Manifest, shards: list[faiss.Index],
                 encoder=None, device: str = "cpu", query_prompt: str | None = None,
                 params: str | None = None, rows: ShardRows | None = None, query_runtime: str = "torch",
                 cache_dir: str | os.PathLike | None = None):
        self.store = store
        self.rows = rows  # the chunk rows, through the shards' Parquet files
        self.manifest = manifest
        self.shards = shards
        self.device = device
        self._encoder = encoder
        self._encoder_lock = threading.Lock()
        self._encode_lock = threading.Lock()
        self.query_prompt = manifest.prompts.get("query", "") if query_prompt is None else query_prompt
        self.params = params  # the faiss search parameters in force ("" or None: none)
        self.query_runtime = query_runtime  # asked for; the encoder's runtime says which runs
        self._cache_dir = cache_dir
        self._pool = None
        self._prompt_checked = None  # the encoder the query prompt was found to leave room in
        self._closed = False
        self._state = threading.Condition()  # guards _closed and _active: close() waits for searches
        self._active = 0

    @property
    def default_k(self) -> int:
        """Results per query when a search gives no k: the manifest's, else
        :data:`~embedingest.config.DEFAULT_SEARCH_K`."""
        return int(self.manifest.search.get("k") or DEFAULT_SEARCH_K)

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.ntotal

    @property
    def ntotal(self) -> int:
        """The vectors the index holds (ConfigError once closed: 0 would read as empty)."""
        self._check_open()
        return sum(s.ntotal for s in self.shards)

    def __reduce__(self):
        raise TypeError(f"an Index does not pickle (it holds open files and faiss indexes): pass the path and open "
                        f"it in each process with open_index({str(self.store.folder)!r})")

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"the index at {str(self.store.folder)!r} was closed: open it again "
                              "with open_index (a closed one would answer with nothing)")

    @contextlib.contextmanager
    def _open_while(self):
        """The block runs on an open index, which :meth:`close` (from another thread) frees
        only once the block is done: a search under way finishes, a later one is refused."""
        with self._state:
            self._check_open()
            self._active += 1
        try:
            yield
        finally:
            with self._state:
                self._active -= 1
                self._state.notify_all()

    def close(self) -> None:
        with self._state:
            self._closed = True
            while self._active:
                self._state.wait()
        self.shards = []
        if self.rows is not None:
            self.rows.close()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.store.close()

    @property
    def encoder(self):
        """The query encoder: the one given, else the manifest's model, loaded on first use.

        fp16 becomes fp32 on the CPU (the encoder refuses fp16 there); a model folder that
        is not on this machine is found by the manifest's model name instead.
        """
        with self._encoder_lock:
            if self._encoder is None:
                self._encoder = self._load_encoder()
        return self._encoder

    @property
    def loaded_encoder(self):
        """The query encoder if it is loaded (or was given), else None: loads nothing."""
        return self._encoder

    @property
    def query_runtime_in_use(self) -> str | None:
        """What encodes the queries ("torch", "onnx"), once the encoder is loaded; None
        before, or for an encoder given by the caller that does not say."""
        return getattr(self._encoder, "runtime", None)

    def _load_encoder(self):
        """The manifest's model, from its path or else by its name (the bundled model, a
        Hugging Face id in the local cache)."""
        import torch

        from ..stages.device import resolve_device
        from ..stages.encoder import TextEncoder
        from ..stages.model_folder import BUNDLED_NAME, resolve_model
        from ..stages.query_runtime import use_query_runtime
        from .cache import default_cache_dir
        from ..stages.hub import is_hub_id

        model = self.manifest.model
        path, name = model.get("path"), model.get("name")
        if not path or not Path(path).is_dir():
            if name != BUNDLED_NAME and not (isinstance(name, str) and is_hub_id(name)):
                raise ConfigError(f"the model of {str(self.store.folder)!r} ({name!r}) is not on "
                                  f"this machine (path {path!r}): put the model folder there (from Python, pass "
                                  "encoder= or query vectors)")
            try:
                path = str(resolve_model(name)[0])
            except ConfigError as exc:
                raise ConfigError(f"the model of {str(self.store.folder)!r} ({name!r}) is not on this "
                                  f"machine (path {path!r}) and not found by its name: {exc}") from exc
        dtype = self.manifest.dtype
        if dtype == "fp16" and str(self.device).startswith("cpu"):
            dtype = "fp32"
        resolve_device(self.device)  # a device torch lacks is named as such, not as the model's fault
        try:
            encoder = TextEncoder.load(path, self.device, dtype)
        except ConfigError as exc:  # its advice is a build's ("pass the folder ..."): a search's here
            why = str(exc).split("; ")[0]
            raise ConfigError(f"the model of {str(self.store.folder)!r} ({name!r}) cannot be loaded from "
                              f"{path!r}, where the index was built with it ({why}): put the model back "
                              "there (from Python, pass encoder= or query vectors)") from exc
        if encoder.info().get("name") != name or encoder.dim != self.manifest.dim:
            raise ConfigError(f"model at {path!r} is {encoder.info().get('name')!r} (dim "
                              f"{encoder.dim}), but the index was built with {name!r} (dim "
                              f"{self.manifest.dim}): rebuild with --overwrite or pass encoder=")
        use_query_runtime(encoder, self.query_runtime, self._cache_dir or default_cache_dir(),
                          torch.get_num_threads())
        return encoder

    def search(self, queries: str | list[str], k: int | None = None) -> list[list[Hit]]:
        """Top ``k`` chunks for each query text, best first (``k`` None: :attr:`default_k`);
        the query prompt goes before each text."""
        self._check_open()
        if isinstance(queries, str):
            queries = [queries]
        elif queries is None or not hasattr(queries, "__iter__") or isinstance(queries, (bytes, bytearray)):
            raise ConfigError(f"queries={queries!r}: give a text or a list of texts (bytes decoded: "
                              "queries.decode())")
        elif isinstance(queries, Mapping):
            raise ConfigError(f"queries is a {type(queries).__name__}: its keys would be searched; give a list of "
                              "texts (list(queries.values()) for its values)")
        queries = arrow_as_list(queries)  # a generator, a numpy array of texts, pyarrow strings
        if not queries:
            return []
        blank = [i for i, q in enumerate(queries) if not isinstance(q, str) or blank_query(q)]
        if blank:
            raise ConfigError(f"query {blank[0]} ({queries[blank[0]]!r}) is empty or not text; "
                              "give each query some words")
        texts = [self.query_prompt + q for q in queries]
        encoder = self.encoder
        with self._encode_lock:  # a tokenizer is not safe to share between threads
            vectors = encoder.encode(texts)  # first: it names a text that is not Unicode
            _refuse_untokenized(getattr(encoder, "tokenizer", None), queries)
            if self._prompt_checked is not encoder:
                _refuse_a_prompt_that_fills_the_model(encoder, self.query_prompt)
                self._prompt_checked = encoder
        return self.search_vectors(vectors, k)

    def chunks(self, ids) -> dict:
        """Chunk rows by vector id (:class:`~embedingest.index.store.Chunk`, with its
        source); unknown ids are absent."""
        with self._open_while():
            return {} if self.rows is None else self.rows.chunks(ids)

    def search_vectors(self, vectors: np.ndarray, k: int | None = None) -> list[list[Hit]]:
        """Top ``k`` chunks for each query vector (used as given: normalise them for "ip")."""
        with self._open_while():
            scores, ids = self._search_raw(vectors, k)
            found = np.unique(ids[ids >= 0]).tolist()
            rows = {} if self.rows is None else self.rows.chunks(found)
        missing = [i for i in found if i not in rows]
        if missing:
            raise ConfigError(
                f"{len(missing)} of the vectors found have no metadata row in "
                f"its shard's Parquet file (e.g. id {missing[0]}): the last build of this "
                "index was stopped before it finished (or one is running now); run the same "
                "build-index command again to finish it, then search")
        out = []
        for row_scores, row_ids in zip(scores, ids):
            hits = []
            for rank, (score, vid) in enumerate(zip(row_scores.tolist(), row_ids.tolist()), 1):
                if vid < 0:
                    break
                c = rows.get(vid)
                hits.append(Hit(rank, score, vid, *(
                    (c.source, c.record_id, c.chunk_no, c.char_start, c.char_end, c.text)
                    if c else (None,) * 6)))
            out.append(hits)
        return out

    def search_raw(self, vectors: np.ndarray, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each [nq, k], best first; id -1 pads rows when fewer than k exist."""
        with self._open_while():
            return self._search_raw(vectors, k)

    def _search_raw(self, vectors, k: int | None) -> tuple[np.ndarray, np.ndarray]:
        k = self.default_k if k is None else k
        if np.iscomplexobj(vectors):
            raise ConfigError("query vectors are complex numbers: give real ones")
        try:
            q = np.ascontiguousarray(vectors, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"query vectors of type {type(vectors).__name__} are no numbers ({exc}): give an array "
                              f"of shape (n, {self.manifest.dim}); texts go to search()") from None
        if q.ndim == 1:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != self.manifest.dim:
            raise ConfigError(f"query vectors of shape {np.shape(vectors)}, expected "
                              f"(n, {self.manifest.dim}) for the index at {str(self.store.folder)!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0:
            raise ConfigError(f"k must be a positive integer, got {k!r}")
        if not np.isfinite(q).all():
            raise ConfigError("query vectors hold NaN or infinite values: no vector is near them; "
                              "check how they were made")
        k = int(min(k, sum(s.ntotal for s in self.shards)))  # faiss takes Python's int only
        if k == 0:
            return np.empty((len(q), 0), np.float32), np.empty((len(q), 0), np.int64)
        _single_threaded_after_fork()
        heap = faiss.ResultHeap(len(q), k, keep_max=self.manifest.metric == "ip")
        shards = [seg for seg in self.shards if seg.ntotal]
        for result in self._map_shards(lambda seg: seg.search(q, min(k, seg.ntotal)), shards):
            heap.add_result(*result)
        heap.finalize()
        return heap.D, heap.I

    def _map_shards(self, fn, shards: list):
        """``fn`` over the shards, on several cores when there is enough to scan: faiss
        scans for a few queries on one thread (and releases the GIL), so large shards
        are searched side by side."""
        if len(shards) < 2 or sum(seg.ntotal for seg in shards) < PARALLEL_FROM:
            return map(fn, shards)
        with self._encoder_lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(min(len(shards), os.cpu_count() or 1),
                                                thread_name_prefix="embedingest-search")
        return self._pool.map(fn, shards)



def open_index(path: str | os.PathLike, device: str = "cpu", *, encoder=None,
               params: str | None = None, query_prompt: str | None = None,
               cache_dir: str | os.PathLike | None = None, cache_size: float | None = None,
               query_runtime: str = "torch") -> Index:
    """Open the index folder ``path`` (or an index in object storage, ``s3://bucket/prefix``)
    for search.

    ``device`` is where the query encoder runs (faiss search itself runs on the CPU).
    ``encoder``: any object with ``encode(list[str]) -> np.ndarray``, instead of loading
    the manifest's model. ``params``: faiss search parameters for every shard, e.g.
    ``"nprobe=16"`` (IVF) or ``"efSearch=128"`` (HNSW); None: those stored with the index
    (``build-index --search-params``), "" for none. ``query_prompt``: text put before each
    query; None: the index's (the model's query prompt, or ``build-index --query-prompt``).
    ``cache_dir``: where the vectors of an index in object storage are kept once downloaded
    (:mod:`embedingest.index.cache`; None: ``~/.cache/embedingest``), and the query
    encoder's ONNX graph; ``cache_size`` the most GiB of vectors it keeps (None: 20; 0: no
    bound; the least recently used files no open index uses go first). ``query_runtime``:
    "torch", "onnx" or "auto" (ONNX Runtime where it applies, else torch;
    :mod:`embedingest.stages.query_runtime`).
    """
    from ..stages.query_runtime import check_runtime

    check_runtime(query_runtime)
    for name, value, example in (("params", params, "'nprobe=16'"), ("query_prompt", query_prompt, "'query: '")):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{name}={value!r}: give text (e.g. {example}), or None for the index's")
    device = device_name(device)
    if params is not None and not params.strip():
        params = ""  # blank: none, as build-index takes it
    elif params is not None:
        try:  # a typo is named as one, not as parameters that do not apply to a shard
            params = search_params_text(params)
        except ValueError as exc:
            raise ConfigError(f"search parameters {params!r}: {exc}; e.g. nprobe=16 (IVF) or efSearch=128 "
                              "(HNSW)") from exc
    if is_remote(path):
        from .cache import RemoteShards

        remote = RemoteShards(path, cache_dir, cache_size)
        manifest = remote.manifest
        if params is None:
            params = manifest.search.get("params")
        try:
            shards, rows = _load_shards(remote.shards, remote.faiss_path, manifest, params,
                                        opener=remote.open_parquet, where=remote.where)
        except BaseException:
            remote.close()
            raise
        return Index(remote, manifest, shards, encoder=encoder, device=device, query_prompt=query_prompt,
                     params=params or None, rows=rows, query_runtime=query_runtime, cache_dir=cache_dir)
    folder = answering_folder(path)
    if folder != Path(path):
        log.warning("a rebuild of %s with --overwrite is running or was stopped: answering from the index "
                    "before it (%s) until one finishes", path, folder)
    store = IndexStore(folder, read_only=True)
    manifest = store.read_manifest()
    if params is None:
        params = manifest.search.get("params")
    shards, rows = _open_shards(store, manifest, params)
    return Index(store, manifest, shards, encoder=encoder, device=device, query_prompt=query_prompt,
                 params=params or None, rows=rows, query_runtime=query_runtime, cache_dir=cache_dir)


def _set_params(index: faiss.Index, params: str | None, name: str, manifest: Manifest) -> None:
    if params:
        try:
            apply_search_params(index, params)
        except ValueError as exc:
            stored = params == manifest.search.get("params")
            raise ConfigError(f"search parameters {params!r} do not apply to {name} "
                              f"(factory {manifest.factory!r}): {exc}"
                              + ("; they are the index's own: pass others (--params, '' for none) or "
                                 "store others with build-index --search-params" if stored else "")) from exc


def _open_shards(store: IndexStore, manifest: Manifest, params: str | None) -> tuple[list, ShardRows]:
    """The vectors of every committed shard (memory-mapped where faiss can) and their rows.
    Each shard's vectors must be its rows' (same count and ids, in the same order)."""
    refuse_link(store.folder / SHARDS_DIR)  # a shard is read from inside the index folder only
    live = list_shards(store.folder / SHARDS_DIR, generation=manifest.generation)
    _warn_of_lost_shards(manifest, live, store.folder / SHARDS_DIR)
    shards = [s for s in live if s.rows]
    return _load_shards(shards, lambda shard: shard.faiss_path(manifest.generation), manifest, params)


def _warn_of_lost_shards(manifest: Manifest, live: list, folder: Path) -> list[str]:
    """Shards the manifest names that are gone from ``folder`` without a shard that
    replaced them (a removal leaves one): their files were deleted or moved, and search
    would answer from the rest without a word. Logged as a warning (a build interrupted
    between its clean-up and its manifest can leave this for a moment too); returned."""
    present = {s.name for s in live} | {r for s in live for r in s.replaces}
    lost = [seg["name"] for seg in manifest.segments if seg["name"] not in present]
    if lost:
        rows = sum(seg.get("count", 0) for seg in manifest.segments if seg["name"] in lost)
        log.warning("the manifest of %s names %d shard(s) not in %s (%s; %d vectors): their files "
                    "were deleted or moved, so results leave them out; put them back, or run "
                    "build-index on the corpus again to redo their units",
                    folder.parent, len(lost), folder, ", ".join(lost[:3]) + (", ..." if len(lost) > 3 else ""),
                    rows)
    return lost


def _load_shards(shards: list, faiss_path, manifest: Manifest, params: str | None, *, opener=None,
                 where=None) -> tuple[list, ShardRows]:
    """The vectors of ``shards`` (each read from ``faiss_path(shard)``) and their rows
    (see :class:`ShardRows` for ``opener`` and ``where``)."""
    vectors, ids = [], []
    for shard in shards:
        path = faiss_path(shard)
        index = read_shard(path, shard.name)
        id_map = getattr(index, "id_map", None)
        if index.ntotal != shard.rows or index.d != manifest.dim or id_map is None \
                or not _ends_match(id_map, shard):
            raise ConfigError(
                f"{str(path)!r} holds {index.ntotal} vectors of dim {index.d}, but its shard has "
                f"{shard.rows} rows (or other ids) and the manifest says dim {manifest.dim}: the "
                f"shard is damaged; {redo_advice(shard.name)}")
        if index.metric_type != metric_code(manifest.metric):
            found = next((k for k, v in METRICS.items() if v == index.metric_type), index.metric_type)
            raise ConfigError(
                f"{str(path)!r} holds vectors compared by metric {found!r}, but the manifest says "
                f"{manifest.metric!r}: their scores cannot be merged (the hits would be ranked wrongly); "
                f"the shard is damaged or the manifest was changed: put back the manifest's metric, "
                f"or {redo_advice(shard.name)}")
        _set_params(index, params, shard.name, manifest)
        vectors.append(index)
        ids.append(faiss.vector_to_array(id_map))
    return vectors, ShardRows(shards, ids, opener=opener, where=where)


def _ends_match(id_map, shard) -> bool:
    """The lowest and highest ids of a shard's vectors are those its record gives."""
    ids = faiss.rev_swig_ptr(id_map.data(), id_map.size())
    return int(ids.min()) == shard.id_min and int(ids.max()) == shard.id_max

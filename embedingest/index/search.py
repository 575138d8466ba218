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
import dataclasses
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from ..config import DEFAULT_SEARCH_K
from ..errors import ConfigError, SettingError
from ..outfiles import refuse_link
from .faiss_factory import (METRICS, SearchParamOutOfRange, apply_search_params, default_search_params, metric_code,
                            read_bounded, read_index_file, search_param_names, search_params_taken,
                            search_params_text)
from .foreign import refuse_foreign_shards
from .lookup import IndexChanged, ShardRows
from .shard_store import ASIDE_DIR, answering_folder
from ..sources.remote import is_remote
from ..sources.text import arrow_as_list
from ..stages.device_name import device_name
from .shards import COMMIT_SUFFIX, SHARDS_DIR, list_shards, redo_advice
from .store import MANIFEST_NAME, IndexStore, Manifest

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


@dataclass(eq=False)
class _Opened:
    """One opening of the index, which a search uses from its start to its end: a reload
    makes another, and this one is closed once no search holds it (``users``)."""

    store: object  # IndexStore, or RemoteShards for an index in object storage
    manifest: Manifest
    shards: list
    rows: ShardRows | None
    params: str | None  # the faiss search parameters in force (None: none)
    query_prompt: str
    users: int = 0
    retired: bool = False

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
        self.store.close()


class _Folder:
    """A local index as :func:`open_index` was asked for it (its folder, and the search
    parameters and query prompt given: None, the manifest's), so a handle can tell that a
    build, a reindex or an ``--overwrite`` changed it since, and open it again."""

    def __init__(self, path: Path, params: str | None, query_prompt: str | None):
        self.path, self.params, self.query_prompt = path, params, query_prompt
        aside = path / ASIDE_DIR
        self._watched = (path / MANIFEST_NAME, aside / MANIFEST_NAME, path / SHARDS_DIR, aside / SHARDS_DIR)

    def signature(self) -> tuple:
        """Which manifests and shard folders are there (the folder's, and those a rebuild
        with --overwrite sets aside): a manifest is replaced by a rename (another inode),
        a folder's time moves when a shard is committed or deleted in it. A few ``stat``s."""
        return tuple(path_signature(path) for path in self._watched)

    def open(self) -> _Opened:
        folder = answering_folder(self.path)
        if folder != self.path:
            log.warning("a rebuild of %s with --overwrite is running or was stopped: answering from the index "
                        "before it (%s) until one finishes", self.path, folder)
        store = IndexStore(folder, read_only=True)
        manifest = store.read_manifest()
        params = manifest.search.get("params") if self.params is None else self.params
        shards, rows = _open_shards(store, manifest, params)
        prompt = manifest.prompts.get("query", "") if self.query_prompt is None else self.query_prompt
        return _Opened(store, manifest, shards, rows, params or None, prompt)

    def unchanged(self, opened: _Opened) -> bool:
        """Whether ``opened`` is still the index: the same folder answers, its manifest
        says the same (but for the time and version of the last run that wrote it, which
        rewrites it also when nothing changed), and every shard it reads is still
        committed (a build's removal replaces shards long before it writes the manifest;
        shards a running build adds count once its manifest names them)."""
        folder = answering_folder(self.path)
        if folder != opened.store.folder:
            return False
        manifest = IndexStore(folder, read_only=True).read_manifest()
        if _settings(manifest) != _settings(opened.manifest):
            return False
        try:
            names = set(os.listdir(folder / SHARDS_DIR))
        except OSError:
            return False
        return all(f"{shard.name}{COMMIT_SUFFIX}" in names for shard in opened.rows.shards)


def path_signature(path: Path) -> tuple | None:
    """Which file or folder is at ``path`` (inode, size, modification time), None when
    none is: a file replaced by a rename, or a folder whose entries changed, differs."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _settings(manifest: Manifest) -> dict:
    return {k: v for k, v in dataclasses.asdict(manifest).items() if k not in ("updated", "version")}


class Index:
    """A searchable index; see :func:`open_index`.

    A local index that a build, a reindex or an ``--overwrite`` changes while it is open
    is opened again by the next search (and ``len``, ``chunks``): a handle answers as the
    index is, not with the rows of documents removed since (their files stay readable
    to a process that has them open, so the old opening answered with them). Telling
    costs a few ``stat`` calls a search; the query encoder is kept unless the model
    changed, and a search under way ends on the opening it began with. An index that
    cannot be opened again (damaged, half replaced) leaves the old opening answering,
    logged. An index in object storage is searched as it was opened: open it again to
    see a build's changes."""

    def __init__(self, store: IndexStore, manifest: Manifest, shards: list[faiss.Index],
                 encoder=None, device: str = "cpu", query_prompt: str | None = None,
                 params: str | None = None, rows: ShardRows | None = None, query_runtime: str = "torch",
                 cache_dir: str | os.PathLike | None = None, *, folder: _Folder | None = None,
                 signature: tuple | None = None):
        prompt = manifest.prompts.get("query", "") if query_prompt is None else query_prompt
        self._now = _Opened(store, manifest, shards, rows, params, prompt)
        self.device = device
        self._encoder = encoder
        self._own_encoder = encoder is None  # loaded from the manifest's model: a reload may change it
        self._encoder_lock = threading.Lock()
        self._encode_lock = threading.Lock()
        self.query_runtime = query_runtime  # asked for; the encoder's runtime says which runs
        self._cache_dir = cache_dir
        self._pool = None
        self._prompt_checked = None  # the encoder the query prompt was found to leave room in
        self._closed = False
        self._state = threading.Condition()  # guards _closed, _active and _now: close() waits for searches
        self._active = 0
        self._folder = folder  # None: searched as opened (object storage, or made by the caller)
        self._seen = signature  # the folder's signature when _now was opened
        self._reload_lock = threading.Lock()

    @property
    def store(self):
        return self._now.store

    @property
    def manifest(self) -> Manifest:
        return self._now.manifest

    @property
    def shards(self) -> list:
        """The shards' faiss indexes (none once closed)."""
        return [] if self._closed else self._now.shards

    @property
    def rows(self) -> ShardRows | None:
        """The chunk rows, through the shards' Parquet files."""
        return self._now.rows

    @property
    def params(self) -> str | None:
        """The faiss search parameters in force (None: none)."""
        return self._now.params

    @property
    def query_prompt(self) -> str:
        return self._now.query_prompt

    def _refresh(self, force: bool = False) -> None:
        """Open the index again if it changed since it was opened (``force``: a shard it
        reads was replaced under it). One that cannot be opened again (a build damaged
        it, a folder half replaced) leaves the opening it has answering, logged, as a
        server does (:mod:`embedingest.serve.live`); the next change is tried again."""
        if self._folder is None:
            return
        seen = self._folder.signature()
        if seen == self._seen and not force:
            return
        with self._reload_lock:
            seen = self._folder.signature()
            if seen == self._seen and not force:
                return  # another thread opened it again meanwhile
            try:
                if not force and self._folder.unchanged(self._now):
                    self._seen = seen
                    return
                fresh = self._folder.open()
            except Exception as exc:
                self._seen = seen
                log.warning("the index at %s changed but cannot be opened again (%s); still answering from "
                            "the one opened before", self._folder.path, exc)
                return
            with self._state:
                if self._closed:  # closed meanwhile: nothing may stay open
                    fresh.close()
                    return
                old, self._now = self._now, fresh
                old.retired = True
                if not old.users:
                    old.close()
            self._seen = seen
        log.info("the index at %s changed since it was opened: opened again (%d vectors)", self._folder.path,
                 sum(s.ntotal for s in fresh.shards))
        with self._encoder_lock:
            if self._own_encoder and self._encoder is not None and (
                    fresh.manifest.model.get("name"), fresh.manifest.dim) != (
                    old.manifest.model.get("name"), old.manifest.dim):
                self._encoder = None  # the model changed (a rebuild with --overwrite): loaded anew
            if fresh.query_prompt != old.query_prompt:
                self._prompt_checked = None

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
        with self._open_while() as now:
            return sum(s.ntotal for s in now.shards)

    def __reduce__(self):
        raise TypeError(f"an Index does not pickle (it holds open files and faiss indexes): pass the path and open "
                        f"it in each process with open_index({str(self.store.folder)!r})")

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"the index at {str(self.store.folder)!r} was closed: open it again "
                              "with open_index (a closed one would answer with nothing)")

    @contextlib.contextmanager
    def _open_while(self, force: bool = False):
        """The block runs on an open index, as it is now (opened again first if it changed,
        or ``force``), and gets that opening: :meth:`close` (from another thread) and a
        reload free it only once the block is done; a search under way finishes, a later
        one after close() is refused."""
        self._check_open()
        self._refresh(force)
        with self._state:
            self._check_open()
            self._active += 1
            now = self._now
            now.users += 1
        try:
            yield now
        finally:
            with self._state:
                self._active -= 1
                now.users -= 1
                if now.retired and not now.users:
                    now.close()
                self._state.notify_all()

    def _again_if_changed(self, fn):
        """``fn(opened)`` on the index as it is; once more, opened again, when a shard it
        read was replaced or removed meanwhile (:class:`IndexChanged`: a build's commit)."""
        try:
            with self._open_while() as now:
                return fn(now)
        except IndexChanged:
            if self._folder is None:
                raise
        with self._open_while(force=True) as now:
            return fn(now)

    def close(self) -> None:
        with self._state:
            self._closed = True
            while self._active:
                self._state.wait()
            now = self._now
        now.close()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

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
        self._refresh()  # the query prompt of the index as it is now
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
        ids = list(ids) if not isinstance(ids, np.ndarray) else ids  # read twice when a build changed the index
        return self._again_if_changed(lambda now: {} if now.rows is None else now.rows.chunks(ids))

    def search_vectors(self, vectors: np.ndarray, k: int | None = None) -> list[list[Hit]]:
        """Top ``k`` chunks for each query vector (used as given: normalise them for "ip")."""
        def found_rows(now: _Opened):
            scores, ids = self._search_raw(now, vectors, k)
            found = np.unique(ids[ids >= 0]).tolist()
            return scores, ids, found, {} if now.rows is None else now.rows.chunks(found)

        scores, ids, found, rows = self._again_if_changed(found_rows)
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
        with self._open_while() as now:
            return self._search_raw(now, vectors, k)

    def _search_raw(self, now: _Opened, vectors, k: int | None) -> tuple[np.ndarray, np.ndarray]:
        manifest = now.manifest
        k = int(manifest.search.get("k") or DEFAULT_SEARCH_K) if k is None else k
        if np.iscomplexobj(vectors):
            raise ConfigError("query vectors are complex numbers: give real ones")
        try:
            q = np.ascontiguousarray(vectors, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"query vectors of type {type(vectors).__name__} are no numbers ({exc}): give an array "
                              f"of shape (n, {manifest.dim}); texts go to search()") from None
        if q.ndim == 1:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != manifest.dim:
            raise ConfigError(f"query vectors of shape {np.shape(vectors)}, expected "
                              f"(n, {manifest.dim}) for the index at {str(now.store.folder)!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0:
            raise ConfigError(f"k must be a positive integer, got {k!r}")
        if not np.isfinite(q).all():
            raise ConfigError("query vectors hold NaN or infinite values: no vector is near them; "
                              "check how they were made")
        k = int(min(k, sum(s.ntotal for s in now.shards)))  # faiss takes Python's int only
        if k == 0:
            return np.empty((len(q), 0), np.float32), np.empty((len(q), 0), np.int64)
        _single_threaded_after_fork()
        heap = faiss.ResultHeap(len(q), k, keep_max=manifest.metric == "ip")
        shards = [seg for seg in now.shards if seg.ntotal]
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
    A local index that a build, a reindex or a rebuild changes later is opened again by
    the next search of the handle (:class:`Index`); one in object storage is searched as
    it was opened.
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
            raise SettingError(f"search parameters {params!r}: {exc}; e.g. nprobe=16 (IVF) or efSearch=128 "
                               "(HNSW)") from exc
    if is_remote(path):
        from .cache import RemoteShards

        remote = RemoteShards(path, cache_dir, cache_size)
        manifest = remote.manifest
        if params is None:
            params = manifest.search.get("params")
        try:
            shards, rows = _load_shards(remote.shards, remote.faiss_path, manifest, params,
                                        opener=remote.open_parquet, where=remote.where, place=remote.url)
        except BaseException:
            remote.close()
            raise
        return Index(remote, manifest, shards, encoder=encoder, device=device, query_prompt=query_prompt,
                     params=params or None, rows=rows, query_runtime=query_runtime, cache_dir=cache_dir)
    folder = _Folder(Path(path), params, query_prompt)
    seen = folder.signature()  # before reading: a change while it is read is seen by the next search
    opened = folder.open()
    return Index(opened.store, opened.manifest, opened.shards, encoder=encoder, device=device,
                 query_prompt=opened.query_prompt, params=opened.params, rows=opened.rows,
                 query_runtime=query_runtime, cache_dir=cache_dir, folder=folder, signature=seen)


class SearchParamsRefused(ConfigError):
    """Search parameters the index's factory does not take. The message names them as the
    Python API takes them (``params=``); :meth:`worded` names the option they came from
    on a command line (``--params``), so a command names what its user typed, not a
    shard file."""

    def __init__(self, params: str, place: str, factory: str, reason: str, taken: list[str],
                 stored: bool, example: str | None, said_by_faiss: bool = True):
        self.params, self.place, self.factory, self.reason = params, place, factory, reason
        self.taken, self.stored, self.example, self.said_by_faiss = taken, stored, example, said_by_faiss
        super().__init__(self.worded("params"))

    def worded(self, option: str) -> str:
        """The message for parameters given as ``option`` (``params``: the keyword
        argument; ``--params``: the command's option)."""
        def given(value: str) -> str:
            return f"{option} {value!r}" if option.startswith("-") else f"{option}={value!r}"

        names = {t.split(" ")[0] for t in self.taken}
        unknown = [n for n in search_param_names(self.params) if n not in names]
        why = (f"it has no parameter {', '.join(unknown)}" if unknown else
               f"faiss: {self.reason}" if self.said_by_faiss else self.reason)
        takes = (f"it takes {', '.join(self.taken)}" if self.taken else "it takes no search parameters")
        head = (f"search parameters {self.params!r} do not apply to the index at {self.place!r} "
                f"(factory {self.factory!r}): ")
        if self.stored:
            return (head + f"they are the index's own (build-index --search-params), and {why}; {takes}: pass "
                    f"others ({given('')} for none) or store others with build-index --search-params")
        advice = (f"e.g. {given(self.example)}" if self.example else
                  f"leave out {option}" if not self.taken else f"give {' or '.join(sorted(names))}")
        return head + f"{given(self.params)}: {why}; {takes}: {advice}"


def _set_params(index: faiss.Index, params: str | None, manifest: Manifest, place: str) -> None:
    """Set ``params`` on a shard's ``index``; an nprobe over its lists is refused unless
    they are the index's stored ones (an older build stored such, and faiss cut them)."""
    if params:
        stored = params == manifest.search.get("params")
        try:
            apply_search_params(index, params, within_lists=not stored)
        except ValueError as exc:
            raise SearchParamsRefused(params, place, manifest.factory, str(exc), search_params_taken(index),
                                      stored, default_search_params(index),
                                      not isinstance(exc, SearchParamOutOfRange)) from exc


def _open_shards(store: IndexStore, manifest: Manifest, params: str | None) -> tuple[list, ShardRows]:
    """The vectors of every committed shard (memory-mapped where faiss can) and their rows.
    Each shard's vectors must be its rows' (same count and ids, in the same order), and
    each shard this index's (:mod:`~embedingest.index.foreign`)."""
    refuse_link(store.folder / SHARDS_DIR)  # a shard is read from inside the index folder only
    live = list_shards(store.folder / SHARDS_DIR, generation=manifest.generation)
    _warn_of_lost_shards(manifest, live, store.folder / SHARDS_DIR)
    shards = [s for s in live if s.rows]
    return _load_shards(shards, lambda shard: shard.faiss_path(manifest.generation), manifest, params,
                        place=str(store.folder), units=store.metadata_path)


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
                 where=None, place: str = "", units: Path | None = None) -> tuple[list, ShardRows]:
    """The vectors of ``shards`` (each read from ``faiss_path(shard)``) and their rows
    (see :class:`ShardRows` for ``opener`` and ``where``), of the index at ``place``;
    ``units``: its units database, which the shards' rows are compared with."""
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
        _set_params(index, params, manifest, place)
        vectors.append(index)
        ids.append(faiss.vector_to_array(id_map))
    rows = ShardRows(shards, ids, opener=opener, where=where)
    try:
        refuse_foreign_shards(rows, manifest, units)
    except BaseException:
        rows.close()
        raise
    return vectors, rows


def _ends_match(id_map, shard) -> bool:
    """The lowest and highest ids of a shard's vectors are those its record gives."""
    ids = faiss.rev_swig_ptr(id_map.data(), id_map.size())
    return int(ids.min()) == shard.id_min and int(ids.max()) == shard.id_max

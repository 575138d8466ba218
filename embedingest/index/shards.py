"""Index format 2: shards, each committed whole by the process that wrote it.

Every writer (a consumer process of the engine, a device process, a Ray actor) owns the
shards it writes, and each shard keeps its vectors and its chunks' metadata side by side::

    shards/<name>.faiss        the vectors under their ids (a faiss IndexIDMap)
    shards/<name>.parquet      one row per vector, in the same order: id, source,
                               record_id, chunk_no, span_start, span_end, text (zstd)
    shards/<name>.emb.npy      the vectors as float16, same order (only with --save-embeddings)
    shards/<name>.commit.json  written last: the size and sha256 of each file, the row
                               count and id range, the units this shard finished
                               (unit_no, n_chunks), the sha256 of those whose files
                               the loader hashed, and the shards it replaces

Each data file is written to a temporary name, checked, fsynced and renamed
(:mod:`embedingest.outfiles`); the commit record goes last, so a shard exists iff its
commit record exists and its files have the sizes it gives. A crash leaves whole shards
plus files no commit record names, which :func:`clean_shards` deletes. After a
``reindex`` (``generation`` g > 0) the vectors of a shard are ``<name>.g<g>.faiss``.

Chunk metadata leaves the tokenizing workers as one Arrow IPC record batch per engine
batch (:func:`encode_chunks`): opaque bytes that cross the main process untouched and
are decoded only by the writer of the shard. Vector id = ``unit_no << 32 | chunk_no``.
A unit is complete when one committed shard declares it finished with ``n`` chunks and
the committed ids of that unit are exactly chunks ``0..n-1``, once each
(:func:`incomplete_units`); its rows may be spread over the shards of several writers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import ConfigError
from ..outfiles import atomic_file, atomic_write_bytes, ensure_folder, fsync_dir, is_tmp_name, native_path
from ..sources.files import open_regular
from .formats import SHARDS_DIR

log = logging.getLogger("embedingest")

FORMAT = 2
COMMIT_SUFFIX = ".commit.json"
PARQUET_SUFFIX = ".parquet"
EMB_SUFFIX = ".emb.npy"
FAISS_SUFFIX = ".faiss"
CHUNK_BITS = 32
MAX_UNIT_NO = (1 << (63 - CHUNK_BITS)) - 1  # ids stay positive int64 (faiss uses -1 for "no result")
MAX_GENERATION = 2**31 - 1  # a generation is in file names (shard-....g<g>.faiss): a sane number of reindexes
SHARD_NAME = re.compile(r"shard-[A-Za-z0-9_]+-w[0-9]+-[0-9]+")
_KIND_SUFFIX = {"faiss": "faiss", "parquet": "parquet", "emb": "emb.npy"}  # a record's files by kind
_FILE_NAME = re.compile(r"(shard-[A-Za-z0-9_]+-w[0-9]+-[0-9]+)\.(?:g[0-9]+\.)?(faiss|parquet|emb\.npy|commit\.json)")

CHUNK_SCHEMA = pa.schema([
    pa.field("id", pa.int64(), nullable=False),
    pa.field("source", pa.string()),
    pa.field("record_id", pa.string()),
    pa.field("chunk_no", pa.int32(), nullable=False),
    pa.field("span_start", pa.int64()),
    pa.field("span_end", pa.int64()),
    pa.field("text", pa.string()),
])
"""One row per chunk, as the shard's Parquet file holds it (a chunk of a file without
records has record_id ""; span is the chunk's character range in its record's text)."""

CHUNK_COLUMNS = tuple(CHUNK_SCHEMA.names)


def schema_problem(schema: pa.Schema) -> str | None:
    """What makes ``schema`` (a shard's Parquet file's) other than :data:`CHUNK_SCHEMA`,
    in words; None when it is that one. Rows are read by these names and types: a
    column missing or of another type was a KeyError, or a number printed as a hit's text."""
    found = {f.name: f.type for f in schema}
    missing = [n for n in CHUNK_COLUMNS if n not in found]
    if missing:
        return f"it lacks the column{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    extra = [n for n in found if n not in CHUNK_SCHEMA.names]
    if extra or len(schema) != len(CHUNK_SCHEMA):
        return f"it has columns a shard has not ({', '.join(extra) or 'one twice'})"
    typed = next((f for f in CHUNK_SCHEMA if found[f.name] != f.type), None)
    if typed is not None:
        return f"its column {typed.name} is of type {found[typed.name]}, not {typed.type}"
    if schema.names != CHUNK_SCHEMA.names:
        return f"its columns are in the order {', '.join(schema.names)}, not {', '.join(CHUNK_COLUMNS)}"
    return None


def is_shard_file(name: str) -> bool:
    """Whether ``name`` is one a shard's files take (its vectors, rows, embeddings or
    commit record, of any generation)."""
    return _FILE_NAME.fullmatch(name) is not None


def shard_name(run_id: str, worker: int, part: int) -> str:
    """The part is zero-padded so a listing sorts in commit order."""
    return f"shard-{run_id}-w{worker}-{part:05d}"


def faiss_name(name: str, generation: int = 0) -> str:
    """The vectors file of shard ``name`` for index generation ``generation``."""
    return f"{name}{FAISS_SUFFIX}" if generation == 0 else f"{name}.g{generation}{FAISS_SUFFIX}"


def trained_name(generation: int) -> str:
    """The trained empty index of index generation ``generation`` (factories that train)."""
    return "trained.faiss" if generation == 0 else f"trained.g{generation}.faiss"


# -- chunk metadata in transit ---------------------------------------------------------------

def encode_chunks(ids: Sequence[int], sources: Sequence[str | None], record_ids: Sequence[str | None],
                  chunk_nos: Sequence[int], span_starts: Sequence[int | None],
                  span_ends: Sequence[int | None], texts: Sequence[str | None]) -> bytes:
    """The rows of one batch as one Arrow IPC record batch (bytes): made in a tokenizing
    worker, so the process that feeds the device only passes one bytes object along."""
    arrays = [arrow_column(col, f.type) for col, f in zip(
        (ids, sources, record_ids, chunk_nos, span_starts, span_ends, texts), CHUNK_SCHEMA)]
    return pa.RecordBatch.from_arrays(arrays, schema=CHUNK_SCHEMA).serialize().to_pybytes()


_INT_TYPES = {pa.int64(): np.int64, pa.int32(): np.int32}


def arrow_column(values: Sequence, type_: pa.DataType) -> pa.Array:
    """``pa.array(values, type=type_)`` for the integer and string columns of
    :data:`CHUNK_SCHEMA`, built from its buffers. pyarrow's first ``pa.array`` in a process
    imports pandas (a third of a second or more), and each tokenizing worker would pay
    it on its first batch, while the device waits for that batch. Values of another kind
    (floats, text too long for 32-bit offsets, strings that are not valid UTF-8) go to
    ``pa.array`` itself, which converts or refuses them as it always did."""
    n = len(values)
    valid = [v is not None for v in values]
    nulls = n - sum(valid)
    bitmap = pa.py_buffer(np.packbits(np.array(valid, dtype=bool), bitorder="little")) if nulls else None
    if pa.types.is_string(type_):
        try:
            data = [v.encode("utf-8") if v is not None else b"" for v in values]
        except (AttributeError, UnicodeEncodeError):
            return pa.array(values, type=type_)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(b) for b in data], out=offsets[1:])
        if offsets[-1] > np.iinfo(np.int32).max:
            return pa.array(values, type=type_)
        return pa.StringArray.from_buffers(n, pa.py_buffer(offsets.astype(np.int32)),
                                           pa.py_buffer(b"".join(data)), bitmap, nulls)
    dtype = _INT_TYPES.get(type_)
    raw = np.asarray([0 if v is None else v for v in values] if nulls else values)
    if dtype is None or (n and raw.dtype.kind not in "iu"):
        return pa.array(values, type=type_)
    if n and (raw.max() > np.iinfo(dtype).max or raw.min() < np.iinfo(dtype).min):
        return pa.array(values, type=type_)
    column = raw.astype(dtype)
    return pa.Array.from_buffers(type_, n, [bitmap, pa.py_buffer(np.ascontiguousarray(column))], nulls)


def decode_chunks(data: bytes | pa.RecordBatch) -> pa.RecordBatch:
    """The record batch of :func:`encode_chunks` (a record batch is taken as is)."""
    if isinstance(data, pa.RecordBatch):
        batch = data
    else:
        try:
            batch = pa.ipc.read_record_batch(pa.py_buffer(data), CHUNK_SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise ConfigError(f"chunk metadata of {len(data)} bytes is not a record batch of "
                              f"the shard schema: {exc}") from exc
    if not batch.schema.equals(CHUNK_SCHEMA):
        raise ConfigError(f"chunk metadata has schema {batch.schema}, not the shard schema "
                          f"{CHUNK_SCHEMA}")
    return batch


@dataclass(slots=True)
class BatchMeta:
    """What travels beside a batch's vectors to the shard writer (as the engine's batch
    id): its chunk rows as Arrow IPC bytes, the units whose last chunk is in this batch
    or an earlier one, as (unit_no, n_chunks), and the content hashes the loader made of
    some of them. Its repr stays short: the engine names batches by it in traces."""

    no: int
    chunks: bytes = b""
    units_done: tuple = ()
    unit_hashes: tuple = ()  # (unit_no, sha256) of units of units_done hashed by the loader

    def __repr__(self) -> str:
        return f"batch {self.no}"


# -- commit records ------------------------------------------------------------------------

HASH_BESIDE_BYTES = 1 << 18
"""A write of at least this many bytes is hashed in a thread while it is written."""
_hasher: ThreadPoolExecutor | None = None


def _hash_thread() -> ThreadPoolExecutor:
    """The process's hashing thread, started on first use."""
    global _hasher
    if _hasher is None:
        _hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedingest-hash")
    return _hasher


def _forget_hash_thread() -> None:
    """In a forked child the parent's thread does not exist: start another when needed."""
    global _hasher
    _hasher = None


os.register_at_fork(after_in_child=_forget_hash_thread)


class HashingFile:
    """A write-only file object that hashes and counts what passes to ``fh``. A large
    write is hashed in another thread while ``fh`` writes it (both let go of the GIL), so
    the sha256 of a shard's vectors costs little more than writing them; ``write``
    returns when both are done, so the caller may reuse its buffer."""

    def __init__(self, fh):
        self.fh, self.hash, self.size, self.closed = fh, hashlib.sha256(), 0, False

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) >= HASH_BESIDE_BYTES:
            hashed = _hash_thread().submit(self.hash.update, data)
            try:
                self.fh.write(data)
            finally:
                hashed.result()
        else:
            self.fh.write(data)
            self.hash.update(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.fh.flush()

    def close(self) -> None:
        self.closed = True  # the real file is closed (and committed) by atomic_file

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def summary(self, name: str) -> dict:
        return {"name": name, "size": self.size, "sha256": self.hash.hexdigest()}


def write_hashed(path: Path, produce) -> dict:
    """Write ``path`` atomically with ``produce(file)``; return {name, size, sha256}."""
    with atomic_file(path) as fh:
        out = HashingFile(fh)
        produce(out)
    return out.summary(path.name)


def write_commit(folder: Path, record: Mapping) -> Path:
    """Commit a shard: its record, written last, makes it exist."""
    path = folder / f"{record['name']}{COMMIT_SUFFIX}"
    data = json.dumps(dict(record), separators=(",", ":")).encode("utf-8")
    atomic_write_bytes(path, data, sync_dir=True)
    return path


@dataclass(frozen=True)
class Shard:
    """A committed shard, as its commit record describes it."""

    folder: Path
    name: str
    rows: int
    id_min: int
    id_max: int
    files: dict  # kind ("faiss", "parquet", "emb") -> {name, size, sha256}
    units: tuple  # (unit_no, n_chunks) of the units finished here
    replaces: tuple = ()
    record: dict = field(default_factory=dict, compare=False, repr=False)
    unit_hashes: tuple = ()  # (unit_no, sha256) of units finished here, hashed by the loader

    def path(self, kind: str) -> Path:
        return self.folder / self.files[kind]["name"]

    def faiss_path(self, generation: int = 0) -> Path:
        return self.folder / faiss_name(self.name, generation)

    @property
    def has_embeddings(self) -> bool:
        return "emb" in self.files

    def commit_path(self) -> Path:
        return self.folder / f"{self.name}{COMMIT_SUFFIX}"

    @property
    def generation(self) -> int:
        """The index generation the shard was written in (its ``faiss`` entry's)."""
        return int(self.record.get("generation", 0))

    def check_sizes(self, generation: int | None = None) -> str | None:
        """What is wrong with the files on disk (missing, other size), None when nothing.
        A shard written before a reindex to ``generation`` has its vectors in that
        generation's file, which must exist (its size is in no record)."""
        for kind, info in self.files.items():
            if kind == "faiss" and generation is not None and generation != self.generation:
                if not self.faiss_path(generation).is_file() or self.faiss_path(generation).is_symlink():
                    return f"its vectors file {self.faiss_path(generation).name!r} is missing"
                continue
            try:
                st = os.lstat(self.folder / info["name"])  # a link is never followed
            except OSError as exc:
                return f"its {kind} file {info['name']!r} cannot be read ({exc.strerror or exc})"
            if not stat.S_ISREG(st.st_mode):
                return f"its {kind} file {info['name']!r} is not a regular file (a link?)"
            size = st.st_size
            if size != info["size"]:
                return f"its {kind} file {info['name']!r} holds {size} bytes, not {info['size']}"
        return None

    def verify(self, kinds: Iterable[str] | None = None, generation: int | None = None) -> str | None:
        """Like :meth:`check_sizes` (of ``generation``), and the sha256 of every file (of
        ``kinds`` only, when given: what a reader reads) too, reading every byte."""
        problem = self.check_sizes(generation)
        if problem:
            return problem
        for kind, info in self.files.items():
            if kinds is not None and kind not in kinds:
                continue
            h = hashlib.sha256()
            with open(self.folder / info["name"], "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
            if h.hexdigest() != info["sha256"]:
                return f"its {kind} file {info['name']!r} does not hold the bytes that were committed"
        return None


def redo_advice(name: str) -> str:
    """How to redo the shard ``name`` when it is damaged: every message that finds one
    ends with it."""
    return (f"delete that shard's files (every file named {name}.*) and run the same build-index "
            "command again: the units it held are redone")


def damaged(shard: Shard, folder: str | os.PathLike, problem: str) -> ConfigError:
    """The error for ``shard`` of the index's shards folder ``folder``, damaged as
    ``problem`` says, with how to redo it."""
    return ConfigError(f"shard {shard.name} in {str(folder)!r} is damaged: {problem}; " + redo_advice(shard.name))


def read_commit(path: Path, text: bytes | str | None = None) -> Shard:
    """The shard of commit record ``path`` (whose content is ``text`` when given: a record
    read from object storage); ConfigError saying what is wrong and how to redo the
    shard when it is not a record embedingest wrote."""
    name = path.name[: -len(COMMIT_SUFFIX)]
    try:
        data = json.loads(_record_text(path) if text is None else text)
        files = data["files"]
        if data.get("format") != FORMAT or data.get("name") != name or not isinstance(files, dict):
            raise ValueError("it is not a commit record of this shard in format 2")
        for kind, info in files.items():
            # the shard's own file in its folder: a name the record gives is read, and
            # deleted when the shard is rewritten, so nothing else may be named
            found = _FILE_NAME.fullmatch(str(info.get("name", "")))
            if (kind not in _KIND_SUFFIX or not found or found.group(1) != name
                    or found.group(2) != _KIND_SUFFIX[kind] or not isinstance(info.get("size"), int)
                    or not _SHA256.fullmatch(str(info.get("sha256", "")))):
                raise ValueError(f"its {kind!r} entry {info!r} is not a file of the shard")
        for key in ("rows", "id_min", "id_max"):
            value = data[key]
            if not isinstance(value, int) or isinstance(value, bool) or (key == "rows" and value < 0):
                raise ValueError(f"{key} {value!r} is not a whole number{' of rows' if key == 'rows' else ''}")
        if data["rows"] and not {"faiss", "parquet"} <= files.keys():
            raise ValueError(f"it holds rows but names no {'parquet' if 'faiss' in files else 'faiss'} file")
        if not data["rows"] and files:  # a writer names files only with rows: the shard would be hidden
            raise ValueError("it says 0 rows but names files of them")
        generation = data.get("generation", 0)
        if not _whole(generation) or not 0 <= generation <= MAX_GENERATION:
            raise ValueError(f"generation {generation!r} is not a generation number (0 to {MAX_GENERATION})")
        units = _finished_units(data["units"])
        replaces = tuple(data.get("replaces", ()))
        if not all(isinstance(r, str) and SHARD_NAME.fullmatch(r) for r in replaces):
            raise ValueError(f"replaces {replaces!r} is not a list of shard names")
        return Shard(path.parent, name, data["rows"], data["id_min"], data["id_max"],
                     files, units, replaces, data, _unit_hashes(data.get("unit_sha256", {}), units))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ConfigError(f"cannot read the commit record {str(path)!r} ({type(exc).__name__}: "
                          f"{exc}); {redo_advice(name)}") from exc


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finished_units(value) -> tuple:
    """A record's ``units`` ([unit numbers, chunk counts]) as (unit_no, n_chunks) pairs.
    Each is a whole number a writer can have written: a unit number of a vector id (0 to
    :data:`MAX_UNIT_NO`), a chunk count of chunk numbers below 2**32. A tampered one was
    an OverflowError of every later update (2**70), or a unit no id matched (1.5), whose
    rows a later update took for strays and removed."""
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(c, list) for c in value)):
        raise ValueError("units is not a pair of lists [unit numbers, chunk counts]")
    pairs = tuple(zip(value[0], value[1], strict=True))
    for unit, n in pairs:
        if not _whole(unit) or not 0 <= unit <= MAX_UNIT_NO:
            raise ValueError(f"units holds the unit number {unit!r}, not a whole number from 0 to {MAX_UNIT_NO}")
        if not _whole(n) or not 0 <= n <= 1 << CHUNK_BITS:
            raise ValueError(f"units gives unit {unit} {n!r} chunks, not a whole number from 0 to {1 << CHUNK_BITS}")
    return pairs


def _record_text(path: Path) -> bytes:
    """A local commit record's bytes, read without following a link or waiting on a pipe
    (a record replaced by a named pipe, or a link to ``/dev/zero``, hung search and build)."""
    with open_regular(path, follow_links=False) as fh:
        return fh.read()


def _unit_hashes(hashes, units: tuple) -> tuple:
    """A record's ``unit_sha256`` ({unit_no as text: sha256}) as sorted pairs, each of a
    unit the record finishes."""
    if not isinstance(hashes, dict):
        raise ValueError(f"unit_sha256 {hashes!r} is not a mapping of unit numbers to hashes")
    finished = {u for u, _ in units}
    out = []
    for unit, digest in hashes.items():
        if not (isinstance(unit, str) and unit.isdecimal() and int(unit) in finished
                and isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise ValueError(f"unit_sha256 entry {unit!r}: {digest!r} is not the sha256 of a "
                             "unit the shard finishes")
        out.append((int(unit), digest))
    return tuple(sorted(out))


def hashes_record(unit_hashes: Iterable[tuple[int, str]]) -> dict:
    """The commit record's ``unit_sha256`` entry of ``unit_hashes`` pairs ({} when none)."""
    hashes = {str(int(u)): str(h) for u, h in sorted(unit_hashes)}
    return {"unit_sha256": hashes} if hashes else {}


def _commit_paths(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob(f"shard-*{COMMIT_SUFFIX}")
                  if SHARD_NAME.fullmatch(p.name[: -len(COMMIT_SUFFIX)]))


def list_shards(folder: str | os.PathLike, *, check: bool = True, generation: int = 0) -> list[Shard]:
    """The committed shards of ``folder`` (a shards directory), sorted by name, without
    those another committed shard replaces (a removal). With ``check`` a shard whose
    files (those of index generation ``generation``) are missing or of another size is
    a ConfigError naming it."""
    folder = Path(folder)
    shards = [read_commit(p) for p in _commit_paths(folder)]
    replaced = {r for s in shards for r in s.replaces}
    live = [s for s in shards if s.name not in replaced]
    if check:
        for shard in live:
            problem = shard.check_sizes(generation)
            if problem:
                raise damaged(shard, folder, problem)
    return live


def clean_shards(folder: str | os.PathLike, generation: int = 0) -> list[str]:
    """Delete what no live shard needs: temporary files, files of shards never
    committed, shards another one replaced, vectors of other generations, and shards
    whose record or files are damaged (their units are redone, as after a crash).
    Return the names deleted. Only a build holding the folder's lock may call it."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed: list[str] = []
    shards: dict[str, Shard] = {}
    for path in _commit_paths(folder):
        try:
            shards[path.name[: -len(COMMIT_SUFFIX)]] = read_commit(path)
        except ConfigError as exc:
            log.warning("%s", exc)
            removed += _unlink(path)
    replaced = {r for s in shards.values() for r in s.replaces}
    for name in sorted(replaced & shards.keys()):
        removed += _unlink(shards.pop(name).commit_path())
    for name, shard in list(shards.items()):
        problem = shard.check_sizes(generation)
        if problem:
            log.warning("shard %s is damaged (%s): it is deleted and its units are redone", name, problem)
            removed += _unlink(shards.pop(name).commit_path())
    fsync_dir(folder)
    for name, shard in list(shards.items()):  # a removal's record with nothing left in it
        if shard.replaces and not shard.rows and not shard.units and not shard.files:
            removed += _unlink(shards.pop(name).commit_path())
    keep = set()
    for shard in shards.values():
        keep.update(info["name"] for kind, info in shard.files.items() if kind != "faiss")
        if shard.rows:
            keep.add(faiss_name(shard.name, generation))
        keep.add(shard.commit_path().name)
    for path in sorted(folder.iterdir()):
        if path.is_file() and (is_tmp_name(path.name)
                               or (_FILE_NAME.fullmatch(path.name) and path.name not in keep)):
            removed += _unlink(path)
    fsync_dir(folder)
    return removed


def _unlink(path: Path) -> list[str]:
    try:
        path.unlink()
    except FileNotFoundError:
        return []
    return [path.name]


def delete_shard(shard: Shard) -> list[str]:
    """Commit record first (the shard stops existing), then its files; return the names
    deleted."""
    removed = _unlink(shard.commit_path())
    fsync_dir(shard.folder)
    for info in shard.files.values():
        removed += _unlink(shard.folder / info["name"])
    for path in shard.folder.glob(f"{shard.name}.g*{FAISS_SUFFIX}"):
        removed += _unlink(path)
    return removed


def embeddings_problem(emb, rows: int, dim: int) -> str | None:
    """What makes ``emb`` (a shard's saved embeddings, as loaded) other than ``rows``
    vectors of ``dim`` floats, in words; None when it is that."""
    shape, dtype = getattr(emb, "shape", None), getattr(emb, "dtype", None)
    if shape != (rows, dim) or dtype is None or dtype.kind != "f":
        return f"it holds an array of shape {shape} and type {dtype}, not {rows} vectors of {dim} floats"
    return None


def read_embeddings(shard: Shard, dim: int) -> np.ndarray:
    """A shard's saved embeddings, memory-mapped; a file that is not ``shard.rows``
    vectors of ``dim`` floats is a damaged shard (ConfigError), not a faiss assertion."""
    path = shard.path("emb")
    try:
        with native_path(path) as name:
            emb = np.load(name, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise damaged(shard, shard.folder, f"its emb file {path.name!r} cannot be read ({exc})") from exc
    problem = embeddings_problem(emb, shard.rows, dim)
    if problem:
        raise damaged(shard, shard.folder, f"its emb file {path.name!r} is not its vectors ({problem})")
    return emb


# -- completeness --------------------------------------------------------------------------

def read_ids(shard: Shard) -> np.ndarray:
    """The ids of a shard's rows, in row order (its Parquet file's id column)."""
    import pyarrow.parquet as pq

    if not shard.rows:
        return np.empty(0, np.int64)

    with native_path(shard.path("parquet")) as name, pq.ParquetFile(name) as pf:
        column = pf.read(columns=["id"], use_threads=False).column(0)
    return column.to_numpy().astype(np.int64, copy=False)


def incomplete_units(shards: Iterable[Shard], expected: Mapping[int, int] | None = None,
                     known: Iterable[int] | None = None) -> set[int]:
    """Units whose committed rows are not exactly chunks 0..n-1 once each, where n is
    what one committed shard declared when the unit finished: rows missing (a writer
    died before its commit), duplicates, rows of a unit no shard declared finished,
    or declared twice. With ``expected`` ({unit_no: n_chunks}) units of it that no
    shard holds, and rows of units not in it, count too; with ``known`` (unit numbers)
    units with rows or finished-marks that are not in it."""
    shards = list(shards)
    ids = np.concatenate([read_ids(s) for s in shards]) if shards else np.empty(0, np.int64)
    declared: dict[int, int] = {}
    bad: set[int] = set()
    for shard in shards:
        for unit, n in shard.units:
            if unit in declared and (n or declared[unit]):
                bad.add(unit)
            declared[unit] = n
    uniq, counts = np.unique(ids, return_counts=True)
    units = uniq >> CHUNK_BITS
    bad.update(np.unique(units[counts > 1]).tolist())
    present, first, n_present = np.unique(units, return_index=True, return_counts=True)
    last_chunk = uniq[first + n_present - 1] & ((1 << CHUNK_BITS) - 1)
    for unit, n, top in zip(present.tolist(), n_present.tolist(), last_chunk.tolist()):
        if declared.get(unit) != n or top >= n:
            bad.add(unit)
    seen = set(present.tolist())
    bad.update(u for u, n in declared.items() if n and u not in seen)
    if known is not None:
        known = set(known)
        bad.update(u for u in seen | declared.keys() if u not in known)
    if expected is not None:
        bad.update(u for u in seen if u not in expected)
        bad.update(u for u, n in expected.items() if n and (u not in seen or declared.get(u) != n))
    return bad


def finished_units(shards: Iterable[Shard]) -> dict[int, int]:
    """{unit_no: n_chunks} as the committed shards declare them (see :func:`incomplete_units`)."""
    out: dict[int, int] = {}
    for shard in shards:
        out.update(shard.units)
    return out


def finished_hashes(shards: Iterable[Shard]) -> dict[int, str]:
    """{unit_no: sha256} of the finished units whose files the loader hashed: the hash of
    the bytes their vectors were made from."""
    out: dict[int, str] = {}
    for shard in shards:
        out.update(shard.unit_hashes)
    return out


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def ensure_shards_dir(index_folder: str | os.PathLike) -> Path:
    """``<index>/shards``, made without following a link."""
    root = Path(index_folder)
    folder = root / SHARDS_DIR
    ensure_folder(root, folder)
    return folder

"""What every index folder holds besides its shards: the manifest, the units database
and the trained empty index (the shards are :mod:`embedingest.index.shard_store`'s).

Layout::

    manifest.json       settings and shard list (written atomically)
    units.sqlite        one row per unit (source file or record), written by the planning
                        process only
    trained.faiss       the trained empty index, for factories that need training

Vector id = ``unit_no << 32 | chunk_no`` (:func:`vector_ids`).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata as importlib_metadata
from pathlib import Path

import faiss
import numpy as np

from ..errors import ConfigError, EmbedingestError
from ..outfiles import atomic_write_bytes, is_tmp_name, json_bytes, refuse_link, write_faiss_index
from ..report import REPORT_NAME
from ..sources.files import file_kind, open_regular
from .faiss_factory import (METRICS, empty_index, faiss_message, metric_code, parse_factory, read_index_file,
                            train, training_advice)
from .formats import CURRENT as FORMAT
from .formats import MANIFEST_NAME, UNITS_NAME, V1_METADATA, require_current
from .shards import CHUNK_BITS, MAX_GENERATION, MAX_UNIT_NO

log = logging.getLogger("embedingest")

TRAINED_NAME = "trained.faiss"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS units(
    unit_no INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT UNIQUE NOT NULL, size INT,
    mtime_ns INT, sha256 TEXT, n_chunks INT, status TEXT, ctime_ns INT);
"""
# ctime_ns came later: a units table made before it gets the column, NULL in its rows.
_UNIT_COLUMNS = ("key", "size", "mtime_ns", "sha256", "n_chunks", "status", "ctime_ns")
_QUERY_BATCH = 500


def package_version() -> str:
    try:
        return importlib_metadata.version("embedingest")
    except importlib_metadata.PackageNotFoundError:
        return "0+unknown"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def vector_ids(unit_no: int, chunk_nos) -> np.ndarray:
    """The vector ids of chunks ``chunk_nos`` of unit ``unit_no``."""
    chunks = np.asarray(chunk_nos, dtype=np.int64)
    if not 0 <= unit_no <= MAX_UNIT_NO:
        raise EmbedingestError(f"unit number {unit_no} does not fit in a vector id")
    if chunks.size and (chunks.min() < 0 or chunks.max() >> CHUNK_BITS):
        raise EmbedingestError(f"chunk numbers of unit {unit_no} must lie in [0, 2**32), "
                               f"got {chunks.min()}..{chunks.max()}")
    return (np.int64(unit_no) << CHUNK_BITS) | chunks


def model_identity(model: Mapping) -> str | None:
    """What makes two encoders interchangeable: their name, else the path they load from."""
    return model.get("name") or model.get("path")


@dataclass
class Manifest:
    """The settings every shard of the index shares, and what was built."""

    model: dict  # TextEncoder.info(): "name" identifies the model, "path" is what search loads
    dim: int
    metric: str = "ip"
    factory: str = "Flat"
    dtype: str = "fp32"  # the encoder's compute dtype ("fp32", "fp16", "bf16")
    # The shards as {name, count}, as of the last update ("segments" on disk until the
    # index format changes).
    segments: list[dict] = field(default_factory=list)
    corpus: str | None = None  # fingerprint of the corpus the last run read
    corpus_path: str | None = None  # the folder, one file or URL built from (keys are relative to the folder)
    prompts: dict = field(default_factory=dict)  # {"document", "query"}: text put before each
    # {"tokens", "overlap"}: how texts were cut into chunks (empty: an index from before it was
    # kept); every update cuts the same way.
    chunking: dict = field(default_factory=dict)
    search: dict = field(default_factory=dict)  # search defaults: {"params": "nprobe=16", "k": 10}
    # {"text", "id"}: the fields records' texts and ids are read from (empty: an index from
    # before they were kept, read with the defaults until a run records its own); every
    # update reads the same ones.
    record_fields: dict = field(default_factory=dict)
    version: str = field(default_factory=package_version)
    created: str = field(default_factory=_now)
    updated: str = field(default_factory=_now)
    format: int = FORMAT
    generation: int = 0  # how many times `reindex` rebuilt the vectors (file names)

    @classmethod
    def from_dict(cls, data: Mapping, where: str = "manifest") -> Manifest:
        known = {f.name for f in fields(cls)}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} is not a JSON object: rebuild the index with --overwrite")
        missing = sorted({"model", "dim"} - set(data))
        if missing:
            raise ConfigError(f"{where} lacks {', '.join(missing)}: rebuild the index with --overwrite")
        for name, value in data.items():
            if name in _FIELD_TYPES and not _FIELD_TYPES[name][0](value):
                raise ConfigError(f"{where}: {name} is {value!r}, not {_FIELD_TYPES[name][1]}; the "
                                  "manifest was changed or damaged: put back the value it was built "
                                  "with, or rebuild the index with --overwrite")
        if data.get("format", 1) > FORMAT:
            raise ConfigError(f"{where} has format {data['format']}, newer than this embedingest "
                              f"({package_version()}) reads: upgrade embedingest")
        # A manifest without a format field is format 1 (the first releases wrote none).
        manifest = cls(**{k: v for k, v in data.items() if k in known} | {"format": data.get("format", 1)})
        metric_code(manifest.metric)
        return manifest

    def describe(self) -> str:
        return (f"model {model_identity(self.model)!r}, dim {self.dim}, metric {self.metric}, "
                f"factory {self.factory!r}")

    def compatible_with(self, other: Manifest) -> bool:
        return (model_identity(self.model) == model_identity(other.model) and self.dim == other.dim
                and self.metric == other.metric and self.factory == other.factory)


MAX_CHUNK_TOKENS = 1 << 20  # more than any model reads at once: a larger chunking is a changed manifest


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FIELD_TYPES = {
    "model": (lambda v: isinstance(v, dict) and all(
        v.get(k) is None or isinstance(v.get(k), str) for k in ("name", "path")),
        "an object with a string name and path"),
    "dim": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "metric": (lambda v: v in METRICS, f"one of {', '.join(map(repr, METRICS))}"),
    "factory": (lambda v: isinstance(v, str) and v.strip() != "", "a faiss factory string"),
    "dtype": (lambda v: isinstance(v, str), "a string"),
    "segments": (lambda v: isinstance(v, list) and all(
        isinstance(s, dict) and isinstance(s.get("name"), str) and _is_int(s.get("count")) and s["count"] >= 0
        for s in v), "a list of {name, count}"),
    "corpus": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "corpus_path": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "prompts": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(t, str)
                                                      for k, t in v.items()),
                "an object of texts ({\"document\": ..., \"query\": ...})"),
    "chunking": (lambda v: isinstance(v, dict) and (not v or (
        set(v) == {"tokens", "overlap"} and _is_int(v["tokens"]) and _is_int(v["overlap"])
        and 0 <= v["overlap"] < v["tokens"] <= MAX_CHUNK_TOKENS)),
        f"an object {{\"tokens\": N, \"overlap\": M}} with 0 <= M < N <= {MAX_CHUNK_TOKENS}"),
    "search": (lambda v: isinstance(v, dict) and (v.get("params") is None or isinstance(v["params"], str))
               and (v.get("k") is None or (_is_int(v["k"]) and v["k"] >= 1)),
               "an object with a string params and a positive integer k"),
    "record_fields": (lambda v: isinstance(v, dict) and (not v or (
        set(v) == {"text", "id"} and all(isinstance(f, str) and f for f in v.values()))),
        "an object {\"text\": FIELD, \"id\": FIELD} of field names"),
    "version": (lambda v: isinstance(v, str), "a string"),
    "created": (lambda v: isinstance(v, str), "a string"),
    "updated": (lambda v: isinstance(v, str), "a string"),
    "format": (_is_int, "an integer"),
    # in file names (trained.g<g>.faiss): 250 digits were "File name too long", naming no field
    "generation": (lambda v: _is_int(v) and 0 <= v <= MAX_GENERATION, f"an integer from 0 to {MAX_GENERATION}"),
}


@dataclass(frozen=True)
class Unit:
    unit_no: int
    key: str
    size: int | None
    mtime_ns: int | None
    sha256: str | None
    n_chunks: int | None
    status: str | None
    ctime_ns: int | None = None  # the file's inode change time; None in rows made before it was kept


@dataclass(frozen=True)
class Chunk:
    id: int
    unit_no: int
    source: str | None  # the unit's key
    record_id: str | None
    chunk_no: int
    char_start: int | None
    char_end: int | None
    text: str | None


def _sqlite_errors(method):
    """sqlite errors of an :class:`IndexStore` method as errors that say what to do: a full
    disk as ENOSPC (the CLI's "what was committed is kept" message), a damaged file as a
    ConfigError naming it."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as exc:
            raise _sqlite_error(exc, self.metadata_path) from exc
    return wrapper


def _sqlite_error(exc: sqlite3.Error, path: Path) -> Exception:
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name.startswith("SQLITE_FULL"):
        return OSError(errno.ENOSPC, f"No space left on device (sqlite: {exc})", str(path))
    if name.startswith("SQLITE_IOERR"):
        return OSError(errno.EIO, f"I/O error (sqlite: {exc})", str(path))
    if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or "no such table" in str(exc):
        return ConfigError(f"cannot read {str(path)!r} ({exc}): the index's metadata is damaged; "
                           "rebuild the index with --overwrite")
    return EmbedingestError(f"metadata database {str(path)!r}: {exc}")


def _refuse_special(path: Path) -> None:
    """ConfigError when ``path`` (the units database or a journal of it) is there but no
    regular file: sqlite said only 'disk I/O error' of a named pipe in place of the
    database (taken for a failing disk), waited for good, deaf to SIGTERM, on one in
    place of its journal, and said 'unable to open database file' of a folder."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else file_kind(mode)
        redone = " (the units it would name are redone)" if path.name == UNITS_NAME else ""
        raise ConfigError(f"{str(path)!r} is {kind}, not a file of the index's units database: move it "
                          f"away and run the same build-index command again{redone}")


# A -wal file shorter than its header and one frame of the smallest page holds no change.
_WAL_EMPTY_BELOW = 32 + 24 + 512


def read_only_uri(path: Path) -> str:
    """The sqlite URI that reads the units database ``path`` without creating a file in
    its folder (search and reindex change nothing there): sqlite's read-only mode makes
    ``-wal`` and ``-shm`` files where they are not. With no ``-wal`` file (its writer
    closed it), or one that holds no change, it is read as immutable; with both (a
    build has it open) read-only, through the writer's own files, which then creates
    nothing. ConfigError naming the file when a ``-wal`` file holding changes was left
    without its ``-shm`` (a build stopped, a folder copied without it): immutable would
    read the database without those changes, read-only would create the ``-shm``."""
    wal, shm = (path.with_name(path.name + suffix) for suffix in ("-wal", "-shm"))
    uri = f"file:{urllib.parse.quote(os.fsencode(path))}?mode=ro"
    try:
        wal_size = os.lstat(wal).st_size
    except FileNotFoundError:
        return uri + "&immutable=1"
    if os.path.lexists(shm):
        return uri
    if wal_size < _WAL_EMPTY_BELOW:
        return uri + "&immutable=1"
    raise ConfigError(f"{str(wal)!r} holds changes to the index's units that were never written into "
                      f"{path.name}, and its {shm.name} file is gone (a build was stopped, or the folder "
                      "copied without it): reading it would create files in the index folder; run the same "
                      "build-index command again, which takes the changes in")


class IndexStore:
    """The manifest, units and training of one index folder. Not safe for two writers
    at once; a reader (search) opens it ``read_only``."""

    def __init__(self, folder: str | os.PathLike, read_only: bool = False):
        self.folder = Path(folder)
        # A reader (search) never creates, changes or converts anything in the folder.
        self.read_only = read_only
        self.manifest_path = self.folder / MANIFEST_NAME
        self.metadata_path = self.folder / UNITS_NAME
        self.trained_path = self.folder / TRAINED_NAME
        self._db: sqlite3.Connection | None = None

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # -- manifest -------------------------------------------------------------------------

    def exists(self) -> bool:
        """Whether the folder has a manifest: anything of that name (a link or a pipe there is
        refused when it is read, not taken for a folder with no index)."""
        return os.path.lexists(self.manifest_path)

    def read_manifest(self) -> Manifest:
        """The manifest; ConfigError naming the folder when it is not an index, and the
        command that rebuilds it when it is one of an older format."""
        require_current(self.folder)
        if not self.exists():
            raise ConfigError(f"{str(self.folder)!r} is not an embedingest index "
                              f"(no {MANIFEST_NAME}); build one first or check the path")
        try:
            # never through a link, never waiting on a pipe (one there held search for good)
            with open_regular(self.manifest_path, follow_links=False) as fh:
                data = json.loads(fh.read().decode("utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise ConfigError(f"cannot read {str(self.manifest_path)!r}: {exc}; "
                              "rebuild the index with --overwrite") from exc
        return Manifest.from_dict(data, where=str(self.manifest_path))

    def write_manifest(self, manifest: Manifest) -> None:
        manifest.updated = _now()
        manifest.version = package_version()
        atomic_write_bytes(self.manifest_path, json_bytes(asdict(manifest)))

    def own_files(self) -> list[Path]:
        """The files (or links) of the folder this class keeps, those of a format-1 index
        and temporary files: what :meth:`wipe` deletes (other files stay)."""
        names = [name + suffix for name in (MANIFEST_NAME, TRAINED_NAME, REPORT_NAME, UNITS_NAME, V1_METADATA)
                 for suffix in (("", "-wal", "-shm") if name.endswith(".sqlite") else ("",))]
        # anything of those names but a folder: a link, a file, a pipe put in a file's place
        found = [self.folder / n for n in names
                 if (self.folder / n).is_symlink() or os.path.lexists(self.folder / n) and not (self.folder / n).is_dir()]
        return found + self._tmp_files(self.folder)

    def wipe(self) -> None:
        """Delete :meth:`own_files`."""
        self.close()
        for path in self.own_files():
            path.unlink(missing_ok=True)

    @staticmethod
    def _tmp_files(folder: Path) -> list[Path]:
        """The temporary files of ours (``is_tmp_name``) directly in ``folder``."""
        if not folder.is_dir():
            return []
        return [p for p in folder.iterdir() if is_tmp_name(p.name) and p.is_file()]

    @classmethod
    def _remove_tmp_files(cls, folder: Path) -> list[str]:
        gone = cls._tmp_files(folder)
        for path in gone:
            path.unlink()
        return [p.name for p in gone]

    # -- training -------------------------------------------------------------------------

    def train_index(self, factory: str, dim: int, metric: str, sample: np.ndarray,
                    more: bool = True) -> Path | None:
        """Train ``factory`` on ``sample`` and write the trained empty index every shard
        is cloned from; None (nothing written) when it needs no training. ``more``: a
        larger sample could be had (``--train-size`` cut it), so a refusal suggests one."""
        index = parse_factory(dim, factory, metric)
        if index.is_trained:
            return None
        sample = np.ascontiguousarray(sample, dtype=np.float32)
        if sample.ndim != 2 or sample.shape[1] != dim:
            raise ConfigError(f"training sample of shape {sample.shape}, expected (n, {dim})")
        try:
            train(index, sample)
        except RuntimeError as exc:
            larger = ("use a larger sample (--train-size)" if more else
                      f"the corpus gives only {len(sample)} vectors: add documents")
            raise ConfigError(f"cannot train {factory!r} on {len(sample)} vectors: "
                              f"{faiss_message(exc)}; {larger}, or {training_advice(len(sample))}") from exc
        self.folder.mkdir(parents=True, exist_ok=True)
        write_faiss_index(index, self.trained_path)
        return self.trained_path

    def empty_index(self, manifest: Manifest | None = None) -> faiss.Index:
        """An empty index of the kind the shards hold (trained when the factory needs it)."""
        manifest = manifest or self.read_manifest()
        trained = read_index_file(self.trained_path, redo="delete it and run build-index again "
                                  "(it is trained again)") if self.trained_path.is_file() else None
        return empty_index(manifest.dim, manifest.factory, manifest.metric, trained)

    # -- units ----------------------------------------------------------------------------

    @property
    def db(self) -> sqlite3.Connection:
        """The units database (created on first use by a writer), for this store's thread."""
        if self._db is None:
            self._db = self.connect()
        return self._db

    @_sqlite_errors
    def connect(self, busy_timeout_ms: int = 0) -> sqlite3.Connection:
        """A new connection to the units database, for another thread or process (sqlite
        connections stay in the thread that made them). A read-only store opens an
        existing database read-only, creating no file (:func:`read_only_uri`); a link in place
        of the database or its journal files is refused (sqlite would write through it)."""
        for suffix in ("", "-wal", "-shm", "-journal"):
            refuse_link(self.folder / (self.metadata_path.name + suffix))
            _refuse_special(self.folder / (self.metadata_path.name + suffix))
        if self.read_only and not self.metadata_path.is_file():
            raise ConfigError(
                f"{str(self.metadata_path)!r} does not exist: the build of this index was stopped "
                "before it wrote any metadata, or the file was deleted; run the same build-index "
                "command again to finish it")
        if self.read_only:
            db = sqlite3.connect(read_only_uri(self.metadata_path), uri=True)
            db.execute("SELECT count(*) FROM units LIMIT 0").fetchall()
            return db
        self.folder.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.metadata_path)
        if busy_timeout_ms:
            db.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        if "ctime_ns" not in {row[1] for row in db.execute("PRAGMA table_info(units)")}:
            db.execute("ALTER TABLE units ADD COLUMN ctime_ns INT")
        return db

    @_sqlite_errors
    def upsert_units(self, rows: Iterable[Mapping]) -> dict[str, int]:
        """Insert or update units by key (one transaction); return {key: unit_no}.

        Each row gives key and any of size, mtime_ns, sha256, n_chunks, status, ctime_ns; fields left
        out (or None) keep the value stored. unit_no is never reused (AUTOINCREMENT), so
        stray vectors of a deleted unit cannot be taken for those of a new one; an existing
        key is updated, not upserted: sqlite's upsert spends a number even when it updates.
        New keys are inserted in the order given (their numbers ascend in it), with one
        statement for all of them: a plan of a million new files is one ``executemany``. A
        key given twice is one row, its later fields over its earlier ones.
        """
        merged: dict[str, list] = {}
        for row in rows:
            values = [row.get(c) for c in _UNIT_COLUMNS]
            earlier = merged.setdefault(values[0], values)
            earlier[:] = [a if b is None else b for a, b in zip(earlier, values)]
        keys = list(merged)
        update = ("UPDATE units SET " + ", ".join(f"{c}=COALESCE(?, {c})" for c in _UNIT_COLUMNS[1:])
                  + " WHERE key=?")
        insert = f"INSERT INTO units({', '.join(_UNIT_COLUMNS)}) VALUES ({', '.join('?' * len(_UNIT_COLUMNS))})"
        with self.db as db:
            found = self._unit_nos(db, keys)
            db.executemany(update, (v[1:] + v[:1] for v in merged.values() if v[0] in found))
            db.executemany(insert, (v for v in merged.values() if v[0] not in found))
            out = self._unit_nos(db, keys)
            for key in keys:  # inside the transaction: nothing of this call is kept
                if out[key] > MAX_UNIT_NO:
                    raise EmbedingestError(f"unit number {out[key]} of {key!r} does not fit "
                                           "in a vector id: rebuild the index with --overwrite")
        return {key: out[key] for key in keys}

    @staticmethod
    def _unit_nos(db, keys: list[str]) -> dict[str, int]:
        out = {}
        for batch in _batches(keys):
            marks = ",".join("?" * len(batch))
            out.update(db.execute(f"SELECT key, unit_no FROM units WHERE key IN ({marks})", batch))
        return out

    @_sqlite_errors
    def units(self, keys: Iterable[str] | None = None) -> dict[str, Unit]:
        """Unit rows by key: all of them, or those of ``keys`` that exist."""
        if keys is None:
            return {r[1]: Unit(*r) for r in self.db.execute("SELECT * FROM units")}
        out = {}
        for batch in _batches(list(keys)):
            marks = ",".join("?" * len(batch))
            for r in self.db.execute(f"SELECT * FROM units WHERE key IN ({marks})", batch):
                out[r[1]] = Unit(*r)
        return out


def _batches(items: list, size: int = _QUERY_BATCH):
    for i in range(0, len(items), size):
        yield items[i:i + size]

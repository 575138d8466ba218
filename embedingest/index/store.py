"""The index folder: manifest, chunk metadata and FAISS shards, and the steps that keep
them consistent across crashes and incremental runs.

Layout::

    manifest.json       settings and shard list (written atomically)
    metadata.sqlite     units (source files or records) and their chunks (WAL mode)
    trained.faiss       the trained empty index, for factories that need training
    segments/           the shards: immutable seg-<run>-w<worker>-<part>.faiss + .ids.npy sidecars

The folder listing, not the manifest, says which shards exist (a shard exists iff its
``.faiss`` exists), because consumer processes commit shards while the manifest is only
rewritten by the main process. Vector id = ``unit_no << 32 | chunk_no``, so the sidecars
alone tell which units are fully embedded (:meth:`IndexStore.reconcile`).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import shutil
import sqlite3
import time
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata as importlib_metadata
from pathlib import Path

import faiss
import numpy as np

from ..errors import ConfigError, EmbedingestError
from ..outfiles import (
    atomic_write_bytes,
    ensure_folder,
    fsync_dir,
    is_tmp_name,
    new_run_id,
    refuse_link,
    write_faiss_index,
)
from ..report import REPORT_NAME
from ..sinks.faiss_shards import (
    METRICS,
    SHARD_NAME,
    SHARD_SUFFIX,
    SHARDS_DIR,
    TRAINED_NAME,
    empty_index,
    faiss_message,
    metric_code,
    parse_factory,
    shard_name,
    sidecar_path,
    write_shard,
)
from .faiss_edit import removes_in_place as _removes_in_place
from .faiss_edit import without as _without

log = logging.getLogger("embedingest")

MANIFEST_NAME = "manifest.json"
METADATA_NAME = "metadata.sqlite"
JOURNAL_NAME = "replacing.json"
FORMAT = 1
READ_FORMAT = 2  # the newest manifest format read (index/formats.py decides what else is)
CHUNK_BITS = 32
MAX_UNIT_NO = 2**31 - 1  # ids stay positive int64 (faiss uses -1 for "no result")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS units(
    unit_no INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT UNIQUE NOT NULL, size INT,
    mtime_ns INT, sha256 TEXT, n_chunks INT, status TEXT);
CREATE TABLE IF NOT EXISTS chunks(
    id INTEGER PRIMARY KEY, unit_no INT NOT NULL, record_id TEXT, chunk_no INT,
    char_start INT, char_end INT, text TEXT);
"""
_UNIT_COLUMNS = ("key", "size", "mtime_ns", "sha256", "n_chunks", "status")
_QUERY_BATCH = 500
# A unit's chunk rows are an id range (ids are unit_no << 32 | chunk_no): no index on
# unit_no to keep up on every insert.
_UNIT_ROWS = f"id BETWEEN ?1 << {CHUNK_BITS} AND (?1 << {CHUNK_BITS}) | {2**CHUNK_BITS - 1}"
_INSERT_ROWS = "INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?)"
_INSERT_JSON = ("INSERT OR REPLACE INTO chunks SELECT "
                + ", ".join(f"json_extract(value, '$[{i}]')" for i in range(7))
                + " FROM json_each(?)")


@functools.lru_cache(maxsize=1)
def sqlite_has_json() -> bool:
    """Whether this sqlite has json_each (built in since 3.38, an option before)."""
    try:
        sqlite3.connect(":memory:").execute("SELECT count(*) FROM json_each('[1]')")
        return True
    except sqlite3.OperationalError:
        return False


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
    corpus_path: str | None = None  # folder that unit keys (file paths) are relative to
    prompts: dict = field(default_factory=dict)  # {"document", "query"}: text put before each
    search: dict = field(default_factory=dict)  # search defaults: {"params": "nprobe=16", "k": 10}
    version: str = field(default_factory=package_version)
    created: str = field(default_factory=_now)
    updated: str = field(default_factory=_now)
    format: int = FORMAT
    generation: int = 0  # format 2: how many times `reindex` rebuilt the vectors (file names)

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
        if data.get("format", FORMAT) > READ_FORMAT:
            raise ConfigError(f"{where} has format {data['format']}, newer than this embedingest "
                              f"({package_version()}) reads: upgrade embedingest")
        manifest = cls(**{k: v for k, v in data.items() if k in known})
        metric_code(manifest.metric)
        return manifest

    def describe(self) -> str:
        return (f"model {model_identity(self.model)!r}, dim {self.dim}, metric {self.metric}, "
                f"factory {self.factory!r}")

    def compatible_with(self, other: Manifest) -> bool:
        return (model_identity(self.model) == model_identity(other.model) and self.dim == other.dim
                and self.metric == other.metric and self.factory == other.factory)


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
        isinstance(s, dict) and isinstance(s.get("name"), str) and _is_int(s.get("count")) for s in v),
        "a list of {name, count}"),
    "corpus": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "version": (lambda v: isinstance(v, str), "a string"),
    "created": (lambda v: isinstance(v, str), "a string"),
    "updated": (lambda v: isinstance(v, str), "a string"),
    "format": (_is_int, "an integer"),
    "generation": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
}


@dataclass(frozen=True)
class Shard:
    name: str
    path: Path
    count: int

    @property
    def ids_path(self) -> Path:
        return sidecar_path(self.path)

    def ids(self) -> np.ndarray:
        return np.load(self.ids_path)


@dataclass(frozen=True)
class Unit:
    unit_no: int
    key: str
    size: int | None
    mtime_ns: int | None
    sha256: str | None
    n_chunks: int | None
    status: str | None


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


class IndexStore:
    """One index folder. Not safe for two writers at once; readers (search) only list and
    read committed shards."""

    _schema = _SCHEMA  # what the database holds (format 2 keeps units only)
    _probe_sql = "SELECT count(*) FROM units JOIN chunks LIMIT 0"

    def __init__(self, folder: str | os.PathLike, read_only: bool = False):
        self.folder = Path(folder)
        # A reader (search) never creates, changes or converts anything in the folder.
        self.read_only = read_only
        self.manifest_path = self.folder / MANIFEST_NAME
        self.metadata_path = self.folder / METADATA_NAME
        self.trained_path = self.folder / TRAINED_NAME
        self.shards_dir = self.folder / SHARDS_DIR
        self.journal_path = self.shards_dir / JOURNAL_NAME
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
        return self.manifest_path.is_file()

    def read_manifest(self) -> Manifest:
        """The manifest; ConfigError naming the folder when it is not an index."""
        if not self.exists():
            raise ConfigError(f"{str(self.folder)!r} is not an embedingest index "
                              f"(no {MANIFEST_NAME}); build one first or check the path")
        try:
            data = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {str(self.manifest_path)!r}: {exc}; "
                              "rebuild the index with --overwrite") from exc
        return Manifest.from_dict(data, where=str(self.manifest_path))

    def write_manifest(self, manifest: Manifest) -> None:
        manifest.updated = _now()
        manifest.version = package_version()
        data = json.dumps(asdict(manifest), indent=2, ensure_ascii=False) + "\n"
        atomic_write_bytes(self.manifest_path, data.encode("utf-8"))

    def create_or_open(self, manifest: Manifest, overwrite: bool = False) -> Manifest:
        """Start a build with the settings in ``manifest``: a new index, or the existing one
        when it was built with the same model, dim, metric and factory (then its manifest,
        created time included, is returned). ``overwrite`` wipes whatever is there first.
        An index that holds no shard yet (its first build stopped before any commit,
        e.g. training failed) takes the new settings: there is nothing to rebuild."""
        if overwrite:
            self.wipe()
        self.folder.mkdir(parents=True, exist_ok=True)
        ensure_folder(self.folder, self.shards_dir)
        if self.exists():
            existing = self.read_manifest()
            if existing.compatible_with(manifest):
                return existing
            if any(self.shards_dir.glob("seg-*" + SHARD_SUFFIX)):
                raise ConfigError(
                    f"the index at {str(self.folder)!r} was built with {existing.describe()}, "
                    f"not {manifest.describe()}: use --overwrite to rebuild it, or another folder")
            log.info("the index at %s holds no shard yet: its settings (%s) become %s",
                     self.folder, existing.describe(), manifest.describe())
            self.trained_path.unlink(missing_ok=True)  # trained for the old settings
        self.write_manifest(manifest)
        return manifest

    def update_shards(self, manifest: Manifest | None = None, **changes) -> Manifest:
        """Rewrite the manifest with the current shard list and ``changes`` (e.g. corpus)."""
        manifest = manifest or self.read_manifest()
        for name, value in changes.items():
            setattr(manifest, name, value)
        manifest.segments = [{"name": s.name, "count": s.count} for s in self.shards()]
        self.write_manifest(manifest)
        return manifest

    def wipe(self) -> None:
        """Delete everything embedingest keeps in the folder (other files stay)."""
        self.close()
        if self.shards_dir.is_symlink():
            self.shards_dir.unlink()  # the link only: nothing outside the folder
        else:
            shutil.rmtree(self.shards_dir, ignore_errors=True)
        for name in (MANIFEST_NAME, TRAINED_NAME, REPORT_NAME, METADATA_NAME,
                     METADATA_NAME + "-wal", METADATA_NAME + "-shm"):
            (self.folder / name).unlink(missing_ok=True)
        self._remove_tmp_files(self.folder)

    # -- training -------------------------------------------------------------------------

    def train_index(self, factory: str, dim: int, metric: str, sample: np.ndarray) -> Path | None:
        """Train ``factory`` on ``sample`` and write ``trained.faiss``, the empty index
        every shard is cloned from; None (nothing written) when it needs no training."""
        index = parse_factory(dim, factory, metric)
        if index.is_trained:
            return None
        sample = np.ascontiguousarray(sample, dtype=np.float32)
        if sample.ndim != 2 or sample.shape[1] != dim:
            raise ConfigError(f"training sample of shape {sample.shape}, expected (n, {dim})")
        try:
            index.train(sample)
        except RuntimeError as exc:
            raise ConfigError(f"cannot train {factory!r} on {len(sample)} vectors: "
                              f"{str(exc).splitlines()[0]}; use a larger sample or fewer lists") from exc
        self.folder.mkdir(parents=True, exist_ok=True)
        write_faiss_index(index, self.trained_path)
        return self.trained_path

    def empty_index(self, manifest: Manifest | None = None) -> faiss.Index:
        """An empty index of the kind the shards hold (trained when the factory needs it)."""
        manifest = manifest or self.read_manifest()
        trained = read_index_file(self.trained_path, redo="delete it and run build-index again "
                                  "(it is trained again)") if self.trained_path.is_file() else None
        return empty_index(manifest.dim, manifest.factory, manifest.metric, trained)

    # -- shards -------------------------------------------------------------------------

    def _journal(self) -> list[tuple[str, str | None]]:
        """The (old, new) shard names of an interrupted removal. Only plain shard names
        inside segments/ are taken: anything else is an error, never a path followed."""
        if not self.journal_path.is_file():
            return []
        try:
            pairs = [(old, new) for old, new in json.loads(self.journal_path.read_text("utf-8"))["replace"]]
            bad = next((p for p in pairs if not (_is_shard_name(p[0])
                                                 and (p[1] is None or _is_shard_name(p[1])))), None)
            problem = None if bad is None else f"{list(bad)!r} is not a pair of shard names in segments/"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            raise ConfigError(
                f"{str(self.journal_path)!r} is not a removal journal embedingest wrote ({problem}); "
                "nothing it names is touched: delete it and run build-index again (the units it "
                "concerned are checked and redone)")
        return pairs

    def _superseded(self) -> set[str]:
        """Old shards of an interrupted :meth:`remove_units` whose replacement committed."""
        return {old for old, new in self._journal()
                if new is None or (self.shards_dir / new).is_file()}

    def shards(self) -> list[Shard]:
        """The committed shards, sorted by name (never one a removal has replaced)."""
        if not self.shards_dir.is_dir():
            return []
        superseded = self._superseded()
        out = []
        for path in sorted(self.shards_dir.glob("seg-*" + SHARD_SUFFIX)):
            if path.name in superseded:
                continue
            try:
                ids = np.load(sidecar_path(path), mmap_mode="r")
                if ids.dtype != np.int64 or ids.ndim != 1:
                    raise ValueError(f"it holds {ids.dtype} of shape {ids.shape}, not int64 ids")
            except (OSError, ValueError) as exc:
                raise ConfigError(f"shard {str(path)!r} has no readable ids sidecar ({exc}): the "
                                  f"folder was damaged; {_REDO_SHARD}") from exc
            out.append(Shard(path.name, path, ids.shape[0]))
        return out

    def clean_garbage(self) -> list[str]:
        """Finish an interrupted removal and delete temporary files and orphan sidecars;
        return the names deleted. Call it only while no build writes to the folder."""
        removed = []
        if self.journal_path.is_file():
            committed = self._superseded()
            for old, new in self._journal():
                drop = old if old in committed else new
                removed += self._delete_shard(self.shards_dir / drop) if drop else []
            self.journal_path.unlink()
            removed.append(JOURNAL_NAME)
        removed += self._remove_tmp_files(self.folder)
        if self.shards_dir.is_dir():
            removed += self._remove_tmp_files(self.shards_dir)
            for side in sorted(self.shards_dir.glob("seg-*.ids.npy")):
                if not side.with_name(side.name[: -len(".ids.npy")] + SHARD_SUFFIX).exists():
                    side.unlink()
                    removed.append(side.name)
            fsync_dir(self.shards_dir)
        return removed

    @staticmethod
    def _remove_tmp_files(folder: Path) -> list[str]:
        if not folder.is_dir():
            return []
        gone = [p for p in folder.iterdir() if is_tmp_name(p.name) and p.is_file()]
        for path in gone:
            path.unlink()
        return [p.name for p in gone]

    @staticmethod
    def _delete_shard(path: Path) -> list[str]:
        """``.faiss`` first (the shard stops existing), then its sidecar."""
        gone = [p for p in (path, sidecar_path(path)) if p.exists()]
        for p in gone:
            p.unlink()
        return [p.name for p in gone]

    def _all_ids(self) -> np.ndarray:
        parts = [s.ids() for s in self.shards()]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def present_ids(self) -> dict[int, int]:
        """Committed vectors per unit_no (duplicates counted), read from the sidecars only."""
        units, counts = np.unique(self._all_ids() >> CHUNK_BITS, return_counts=True)
        return dict(zip(units.tolist(), counts.tolist()))

    def reconcile(self, expected: Mapping[int, int] | None = None) -> set[int]:
        """Units whose committed vectors are not exactly chunks 0..n_chunks-1, once each:
        missing vectors (a crash before a commit), duplicates, or stray vectors of units
        not in ``expected`` ({unit_no: n_chunks}; default: every unit row). These must be
        removed with :meth:`remove_units` and redone (or dropped)."""
        if expected is None:
            expected = {u.unit_no: u.n_chunks or 0 for u in self.units().values()}
        ids, counts = np.unique(self._all_ids(), return_counts=True)
        units = ids >> CHUNK_BITS
        bad = set(np.unique(units[counts > 1]).tolist())
        present, first, n_present = np.unique(units, return_index=True, return_counts=True)
        last_chunk = ids[first + n_present - 1] & ((1 << CHUNK_BITS) - 1)
        for unit, n, top in zip(present.tolist(), n_present.tolist(), last_chunk.tolist()):
            if n != expected.get(unit, 0) or top >= n:
                bad.add(unit)
        seen = set(present.tolist())
        bad.update(u for u, n in expected.items() if n and u not in seen)
        return bad

    def remove_units(self, unit_nos: Iterable[int]) -> int:
        """Remove every vector of ``unit_nos`` from the shards; return how many.

        Each shard holding some is rewritten without them under a new name, then the old
        one is deleted. A journal (``segments/replacing.json``, written before any new
        shard) pairs old and new names, so after a crash anywhere :meth:`shards` and
        :meth:`clean_garbage` keep exactly one of each pair (the new one once it committed):
        no id is ever listed twice, and an interrupted removal is finished by calling this
        again (:meth:`reconcile` still reports the units whose vectors remain).
        """
        units = np.fromiter(set(unit_nos), dtype=np.int64)
        self.clean_garbage()
        hit = [(seg, np.isin(seg.ids() >> CHUNK_BITS, units)) for seg in self.shards()]
        plan = [(seg, drop) for seg, drop in hit if drop.any()]
        if not plan:
            return 0
        run = "rm" + new_run_id()
        pairs = [(seg.name, None if drop.all() else shard_name(run, 0, i))
                 for i, (seg, drop) in enumerate(plan)]
        atomic_write_bytes(self.journal_path, json.dumps({"replace": pairs}).encode())
        fsync_dir(self.shards_dir)
        removed, template = 0, None
        for (seg, _), (_, new) in zip(plan, pairs):
            if new is None:
                removed += seg.count
                continue
            index = read_index_file(seg.path)
            keep = ~np.isin(faiss.vector_to_array(index.id_map) >> CHUNK_BITS, units)
            if template is None and not _removes_in_place(index):
                template = self.empty_index()
            index, kept = _without(index, keep, template)
            write_shard(self.shards_dir / new, index, kept)
            removed += seg.count - len(kept)
        for seg, _ in plan:
            self._delete_shard(seg.path)
        fsync_dir(self.shards_dir)
        self.journal_path.unlink()
        fsync_dir(self.shards_dir)
        return removed

    # -- metadata -------------------------------------------------------------------------

    @property
    def db(self) -> sqlite3.Connection:
        """The metadata database (created on first use by a writer), for this store's thread."""
        if self._db is None:
            self._db = self.connect()
        return self._db

    @_sqlite_errors
    def connect(self, busy_timeout_ms: int = 0) -> sqlite3.Connection:
        """A new connection to the metadata database, for another thread or process
        (sqlite connections stay in the thread that made them). A read-only store opens
        an existing database read-only; a link in place of the database or its journal
        files is refused (sqlite would write through it)."""
        for suffix in ("", "-wal", "-shm", "-journal"):
            refuse_link(self.folder / (self.metadata_path.name + suffix))
        if self.read_only and not self.metadata_path.is_file():
            raise ConfigError(
                f"{str(self.metadata_path)!r} does not exist: the build of this index was stopped "
                "before it wrote any metadata, or the file was deleted; run the same build-index "
                "command again to finish it")
        if self.read_only:
            db = sqlite3.connect(f"file:{urllib.parse.quote(str(self.metadata_path))}?mode=ro",
                                 uri=True)
            db.execute(self._probe_sql).fetchall()
            return db
        self.folder.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.metadata_path)
        if busy_timeout_ms:
            db.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(self._schema)
        return db

    @_sqlite_errors
    def upsert_units(self, rows: Iterable[Mapping]) -> dict[str, int]:
        """Insert or update units by key (one transaction); return {key: unit_no}.

        Each row gives key and any of size, mtime_ns, sha256, n_chunks, status; fields left
        out (or None) keep the value stored. unit_no is
        never reused (AUTOINCREMENT), so stray vectors of a deleted unit cannot be taken
        for those of a new one.
        """
        sql = (f"INSERT INTO units({', '.join(_UNIT_COLUMNS)}) VALUES (?, ?, ?, ?, ?, ?) "
               "ON CONFLICT(key) DO UPDATE SET "
               + ", ".join(f"{c}=COALESCE(excluded.{c}, {c})" for c in _UNIT_COLUMNS[1:])
               + " RETURNING unit_no")
        out = {}
        with self.db as db:
            for row in rows:
                (unit_no,) = db.execute(sql, [row.get(c) for c in _UNIT_COLUMNS]).fetchone()
                if unit_no > MAX_UNIT_NO:
                    raise EmbedingestError(f"unit number {unit_no} of {row['key']!r} does not fit "
                                           "in a vector id: rebuild the index with --overwrite")
                out[row["key"]] = unit_no
        return out

    @_sqlite_errors
    def set_status(self, unit_nos: Iterable[int], status: str) -> None:
        with self.db as db:
            db.executemany("UPDATE units SET status=? WHERE unit_no=?",
                           ((status, int(u)) for u in unit_nos))

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

    @_sqlite_errors
    def insert_chunks(self, rows: Iterable[tuple]) -> int:
        """Insert (unit_no, record_id, chunk_no, char_start, char_end, text) rows in one
        transaction; a row with the id of an existing one replaces it (a redone unit)."""
        count = 0

        def with_ids():
            nonlocal count
            for unit_no, record_id, chunk_no, start, end, text in rows:
                count += 1
                yield (int(vector_ids(unit_no, chunk_no)), unit_no, record_id, chunk_no, start, end, text)
        with self.db as db:
            db.executemany(_INSERT_ROWS, with_ids())
        return count

    @_sqlite_errors
    def insert_chunk_json(self, payloads: Iterable[str], db: sqlite3.Connection | None = None) -> None:
        """Insert chunk rows given as JSON arrays of (id, unit_no, record_id, chunk_no,
        char_start, char_end, text) rows (:class:`~embedingest.sources.text_dataset.Chunks`),
        replacing rows of the same id, in one transaction. The build's hot path: each
        payload is one statement, parsed by sqlite with the GIL released. ``db`` is a
        connection from :meth:`connect` when called from another thread. An sqlite built
        without its JSON functions gets the rows bound one by one instead."""
        with db or self.db as conn:
            for payload in payloads:
                if sqlite_has_json():
                    conn.execute(_INSERT_JSON, (payload,))
                else:
                    conn.executemany(_INSERT_ROWS, json.loads(payload))

    @_sqlite_errors
    def mark_units_done(self, done: Iterable[tuple[int, int]], db: sqlite3.Connection | None = None) -> None:
        """Mark ``(unit_no, n_chunks)`` units done (after their chunk rows are written)."""
        with db or self.db as conn:
            conn.executemany("UPDATE units SET n_chunks=?, status='done' WHERE unit_no=?",
                             ((int(n), int(u)) for u, n in done))

    @_sqlite_errors
    def delete_chunks(self, unit_nos: Iterable[int]) -> None:
        """Delete the chunk rows of ``unit_nos`` (before they are chunked again)."""
        with self.db as db:
            db.executemany(f"DELETE FROM chunks WHERE {_UNIT_ROWS}", ((int(u),) for u in unit_nos))

    @_sqlite_errors
    def delete_units(self, unit_nos: Iterable[int]) -> None:
        """Delete units and their chunk rows (call :meth:`remove_units` for the vectors first)."""
        unit_nos = [(int(u),) for u in unit_nos]
        with self.db as db:
            db.executemany(f"DELETE FROM chunks WHERE {_UNIT_ROWS}", unit_nos)
            db.executemany("DELETE FROM units WHERE unit_no=?", unit_nos)

    @_sqlite_errors
    def chunks(self, ids: Iterable[int]) -> dict[int, Chunk]:
        """Chunk rows (with their unit's key as source) by vector id; unknown ids are absent."""
        out = {}
        for batch in _batches([int(i) for i in ids]):
            marks = ",".join("?" * len(batch))
            sql = ("SELECT c.id, c.unit_no, u.key, c.record_id, c.chunk_no, c.char_start, "
                   "c.char_end, c.text FROM chunks c LEFT JOIN units u ON u.unit_no = c.unit_no "
                   f"WHERE c.id IN ({marks})")
            for r in self.db.execute(sql, batch):
                out[r[0]] = Chunk(*r)
        return out


_REDO_SHARD = ("delete that shard's .faiss and .ids.npy files and run build-index again to "
                 "redo the units it held")


def read_index_file(path: Path, flags: int = 0, redo: str = _REDO_SHARD) -> faiss.Index:
    """``faiss.read_index``; a damaged file is a ConfigError naming it and saying how to
    redo it (``redo``), never a traceback of faiss."""
    try:
        return faiss.read_index(str(path), flags)
    except RuntimeError as exc:
        raise ConfigError(f"cannot read {str(path)!r} ({faiss_message(exc)}): the file is damaged; "
                          f"{redo}") from exc


def _is_shard_name(name) -> bool:
    return isinstance(name, str) and SHARD_NAME.fullmatch(name) is not None


def _batches(items: list, size: int = _QUERY_BATCH):
    for i in range(0, len(items), size):
        yield items[i:i + size]

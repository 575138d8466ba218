"""An index in object storage (``s3://bucket/prefix``) opened for search through a local
cache.

Opening reads ``manifest.json`` afresh, the commit records of the shards it names (and
only those: a shard being uploaded, or one a killed build left, is never read) and one
listing of ``shards/``; a shard whose objects are missing or of other sizes than its
record gives is refused, by name. Each shard's vectors file is downloaded once into
``<cache>/objects/<sha256>.faiss``, keyed by the sha256 its commit record gives and
checked against it while it downloads: a cached file is never stale, and one whose bytes
are not those committed is refused by name. Parquet files are not downloaded: their
footers, and the row groups that hold a query's hits, are read by range.

The cache (default ``~/.cache/embedingest``, under ``$XDG_CACHE_HOME`` when set) is
bounded (``cache_size``, :data:`DEFAULT_CACHE_GIB` GiB by default): after a download and
when an index closes, the least recently used vector files are deleted until the rest
fit, except those an open index uses, in this process or another of this host (each
holds a shared ``flock`` on the files it opened; eviction takes an exclusive one without
waiting, so a file in use is passed over). A file evicted is downloaded again when an
index needs it. The folder may be deleted at any time when no search runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

from ..config import QueryConfig
from ..errors import ConfigError
from ..outfiles import atomic_file
from .formats import CURRENT, MANIFEST_NAME
from .remote_store import Remote
from .shards import COMMIT_SUFFIX, SHARDS_DIR, Shard, faiss_name, read_commit
from .store import Manifest

OBJECTS_DIR = "objects"
DEFAULT_CACHE_GIB = QueryConfig.cache_size
_BLOCK = 1 << 22
log = logging.getLogger("embedingest")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/embedingest``, else ``~/.cache/embedingest``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "embedingest"


def _redo(url: str, name: str) -> str:
    return (f"delete that shard's objects ({url}/{SHARDS_DIR}/{name}.*) and run the same "
            "build-index command again: the units it held are redone")


class RemoteShards:
    """The committed shards of an index in object storage, as :func:`open_index` reads
    them: vectors from the local cache, rows by range from the bucket."""

    def __init__(self, url: str, cache_dir: str | os.PathLike | None = None,
                 cache_size: float | None = None):
        self.remote = Remote(url)
        self.folder = self.url = self.remote.url  # what messages name
        self.cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        gib = DEFAULT_CACHE_GIB if cache_size is None else cache_size
        self.bound = int(gib * 2**30) if gib else None  # 0: no bound
        self.held: dict[Path, int] = {}  # the cached files this index uses, with the fd locking each
        self.remote.check()
        try:
            data = json.loads(self.remote.read(MANIFEST_NAME))
        except FileNotFoundError:
            raise ConfigError(f"{self.url!r} holds no embedingest index (no {MANIFEST_NAME}); build "
                              f"one with embedingest build-index CORPUS --out {self.url}") from None
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"cannot read {self.remote.where(MANIFEST_NAME)}: {exc}; rebuild the "
                              "index with --overwrite") from exc
        if not isinstance(data, dict) or data.get("format") != CURRENT:
            raise ConfigError(f"{self.remote.where(MANIFEST_NAME)} is not an index of format "
                              f"{CURRENT}; rebuild it with build-index --out {self.url} --overwrite")
        self.manifest = Manifest.from_dict(data, where=self.remote.where(MANIFEST_NAME))
        self.generation = self.manifest.generation
        names = [s["name"] for s in self.manifest.segments]
        records = self.remote.read_many([f"{SHARDS_DIR}/{n}{COMMIT_SUFFIX}" for n in names]) if names else {}
        listed = self.remote.listing(SHARDS_DIR)
        self.shards: list[Shard] = []
        for name in names:
            rel = f"{SHARDS_DIR}/{name}{COMMIT_SUFFIX}"
            shard = read_commit(self.cache / SHARDS_DIR / f"{name}{COMMIT_SUFFIX}", records[rel])
            problem = self._check(shard, listed)
            if problem:
                raise ConfigError(f"shard {name} of {self.url} is damaged: {problem}; "
                                  + _redo(self.url, name))
            if shard.rows:
                self.shards.append(shard)

    def _check(self, shard: Shard, listed: dict[str, int]) -> str | None:
        """What is wrong with the shard's objects (missing, other size), None when nothing."""
        for kind, info in shard.files.items():
            name = info["name"]
            if kind == "faiss" and self.generation != shard.generation:
                name, size = faiss_name(shard.name, self.generation), None
            else:
                size = info["size"]
            if name not in listed:
                return f"its {kind} object {name!r} is missing"
            if size is not None and listed[name] != size:
                return f"its {kind} object {name!r} holds {listed[name]} bytes, not {size}"
        return None

    def where(self, shard: Shard) -> str:
        """The URL of a shard's Parquet file (for messages)."""
        return self.remote.where(f"{SHARDS_DIR}/{shard.files['parquet']['name']}")

    def open_parquet(self, shard: Shard):
        """The shard's Parquet file, read by range."""
        return self.remote.fs.open(self.remote.fresh(f"{SHARDS_DIR}/{shard.files['parquet']['name']}"),
                                   "rb", cache_type="none")

    def faiss_path(self, shard: Shard) -> Path:
        """The shard's vectors file in the cache, downloaded (and checked) when missing."""
        info = shard.files["faiss"]
        if self.generation == shard.generation:
            name, sha = info["name"], info["sha256"]
        else:  # a reindexed index: its vectors' files are in no record
            name = faiss_name(shard.name, self.generation)
            sha = None
        key = sha or hashlib.sha256(f"{self.url}/{SHARDS_DIR}/{name}".encode()).hexdigest()
        path = self.cache / OBJECTS_DIR / f"{key}.faiss"
        if path in self.held:
            return path
        if self._hold(path, None if sha is None else info["size"]):
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        with atomic_file(path) as fh, self.remote.fs.open(self.remote.fresh(f"{SHARDS_DIR}/{name}"), "rb") as src:
            for block in iter(lambda: src.read(_BLOCK), b""):
                h.update(block)
                fh.write(block)
            if sha is not None and h.hexdigest() != sha:
                raise ConfigError(f"shard {shard.name} of {self.url} is damaged: its faiss object "
                                  f"{name!r} does not hold the bytes that were committed (sha256 "
                                  f"{h.hexdigest()}, not {sha}); " + _redo(self.url, shard.name))
        if not self._hold(path, None):
            raise ConfigError(f"{str(path)!r} went while this index was opening (another process "
                              "evicted it): open the index again")
        self.evict()
        return path

    def _hold(self, path: Path, size: int | None) -> bool:
        """Lock ``path`` as used by this index (a shared flock) and mark it recently used;
        False when it is not there whole (missing, a link, another size, evicted)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        fcntl.flock(fd, fcntl.LOCK_SH)
        st = os.fstat(fd)
        if st.st_nlink == 0 or (size is not None and st.st_size != size):  # evicted meanwhile, or cut
            os.close(fd)
            return False
        os.utime(fd)  # the least recently used go first
        self.held[path] = fd
        return True

    def evict(self) -> list[Path]:
        """Delete the least recently used vector files that no open index uses until the
        cache holds at most its bound; return those deleted."""
        folder = self.cache / OBJECTS_DIR
        if self.bound is None or not folder.is_dir():
            return []
        files = []
        for entry in os.scandir(folder):
            if entry.name.endswith(".faiss") and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                files.append((st.st_mtime_ns, st.st_size, Path(entry.path)))
        total = sum(size for _, size, _ in files)
        gone = []
        for _, size, path in sorted(files):
            if total <= self.bound:
                break
            if path in self.held or not _unlink_unused(path):
                continue
            total -= size
            gone.append(path)
        if total > self.bound:
            log.warning("the cache %s holds %.1f MiB of vectors, above its bound of %.1f MiB: open "
                        "indexes use them (raise --cache-size to keep them all)", folder,
                        total / 2**20, self.bound / 2**20)
        return gone

    def close(self) -> None:
        """Release this index's files (they stay cached for the next search, within the
        bound) and evict down to the bound."""
        held, self.held = self.held, {}
        for fd in held.values():
            os.close(fd)
        self.evict()


def _unlink_unused(path: Path) -> bool:
    """Delete ``path`` unless an index holds it (its shared lock); True when deleted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    try:
        path.unlink()  # under the exclusive lock: no index took it meanwhile
        return True
    except OSError:
        return False
    finally:
        os.close(fd)

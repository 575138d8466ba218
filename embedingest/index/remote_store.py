"""An index in object storage (``s3://bucket/prefix``), written so that a reader never
sees half of it and two builds never lose each other's work (docs/INDEX_FORMAT.md,
"Object storage").

* **Lease.** One build at a time holds ``<prefix>/.run.lock``: created with a
  conditional write (``If-None-Match: *``), renewed while the build runs (``If-Match``
  its ETag) and deleted at its end. A lease its holder stopped renewing (a killed build)
  is taken over once it has expired, again by a conditional write, so two builds never
  both hold it.
* **Working folder.** The build mirrors the index into a fresh local folder
  (:func:`tempfile.mkdtemp`) and runs there exactly as on disk: plan, removals, encode,
  resume. Every shard writer uploads each shard it commits, its files first and its
  commit record last (:func:`upload_shard`), from wherever it runs.
* **Single committer.** The build's own process then uploads what it wrote itself
  (replacement shards of a removal, ``units.sqlite``, ``trained.faiss``,
  ``skipped.jsonl``) and writes ``manifest.json`` naming the live shards, with a
  conditional write on the manifest's ETag as the build found it: a manifest another
  build wrote meanwhile is never overwritten. Only then are replaced shards and
  uncommitted files deleted.
* Readers (:mod:`embedingest.index.cache`) read ``manifest.json`` and only the shards it
  names, so a shard being uploaded, or one a killed build left, is never read.

Credentials and the endpoint come from boto's usual places (``AWS_*`` variables,
``~/.aws``); nothing secret passes through embedingest's options.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import sqlite3
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..outfiles import atomic_file, json_bytes
from ..sources.remote import access_error, is_remote
from .formats import MANIFEST_NAME, UNITS_NAME
from .lock import IndexBusy
from .shards import COMMIT_SUFFIX, SHARD_NAME, SHARDS_DIR, Shard, faiss_name, list_shards, read_commit

log = logging.getLogger("embedingest")

LEASE_NAME = ".run.lock"
LEASE_SECONDS = 120.0
"""How long a lease lasts without renewal; it is renewed every quarter of that."""
REPORT_NAME = "skipped.jsonl"
_TOP_FILES = re.compile(r"manifest\.json|units\.sqlite|skipped\.jsonl|trained(?:\.g[0-9]+)?\.faiss")
_PRECONDITION = ("PreconditionFailed", "ConditionalRequestConflict")


def precondition_failed(exc: BaseException) -> bool:
    """Whether a call failed because its condition (If-Match, If-None-Match) did not hold."""
    for err in (exc, exc.__cause__):
        response = getattr(err, "response", None)
        if isinstance(response, Mapping) and response.get("Error", {}).get("Code") in _PRECONDITION:
            return True
    return False


class Remote:
    """An index's prefix in an S3 bucket, with the few calls a build and a reader make."""

    def __init__(self, url: str):
        url = url.rstrip("/")
        if not is_remote(url) or "::" in url or not url.startswith("s3://"):
            raise ConfigError(
                f"cannot keep an index at {url!r}: an index in object storage lives at an s3:// "
                "URL (S3 or an S3-compatible server, AWS_ENDPOINT_URL_S3), whose conditional "
                "writes make its commits safe; give an s3://bucket/prefix or a local folder")
        import fsspec

        try:
            self.fs, path = fsspec.core.url_to_fs(url)
        except ImportError as exc:
            raise ConfigError(f"cannot use {url!r}: {exc} (pip install 'embedingest[remote]')") from exc
        self.url, self.root = url, path.rstrip("/")
        self.bucket, _, self.prefix = self.root.partition("/")
        if not self.prefix:
            raise ConfigError(f"{url!r} is a whole bucket: give the index a prefix of its own, "
                              f"e.g. {url}/my-index")

    def where(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def fresh(self, rel: str) -> str:
        """The path of ``rel`` with fsspec's cached listings of it dropped: the store is
        read afresh (a listing cached earlier in this process would hide new objects and
        give old sizes)."""
        path = self._path(rel)
        self.fs.invalidate_cache(path)
        return path

    def _call(self, op: str, rel: str, **kw) -> dict:
        return self.fs.call_s3(op, Bucket=self.bucket, Key=f"{self.prefix}/{rel}", **kw)

    def check(self) -> None:
        """A ConfigError naming the URL and what to do when its bucket cannot be reached."""
        try:
            self.fs.call_s3("head_bucket", Bucket=self.bucket)
        except Exception as exc:  # whatever the backend raises: it says what was wrong
            raise access_error(self.url, exc) from exc

    def put(self, rel: str, data: bytes, *, if_match: str | None = None,
            if_none_match: bool = False) -> str:
        """Write ``data`` (one PUT: the object is whole or absent); its ETag."""
        cond = {"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"} if if_none_match else {}
        return self._call("put_object", rel, Body=data, **cond)["ETag"]

    def etag(self, rel: str) -> str | None:
        try:
            return self._call("head_object", rel)["ETag"]
        except FileNotFoundError:
            return None

    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(self.fresh(rel))

    def read_many(self, rels: list[str]) -> dict[str, bytes]:
        """Several small objects, fetched side by side."""
        if not rels:
            return {}
        data = self.fs.cat([self.fresh(r) for r in rels])
        return {r: data[self._path(r)] for r in rels}

    def delete(self, rel: str, if_match: str | None = None) -> None:
        self._call("delete_object", rel, **({"IfMatch": if_match} if if_match else {}))

    def listing(self, folder: str = "") -> dict[str, int]:
        """{name: size} of the objects directly in ``folder`` (read afresh)."""
        path = self._path(folder).rstrip("/") if folder else self.root
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
                for e in entries if e.get("type") == "file"}

    def upload(self, local: Path, rel: str) -> None:
        self.fs.put_file(os.fspath(local), self._path(rel))

    def download(self, rel: str, local: Path) -> None:
        """``rel`` to ``local`` through a temporary name (whole or not at all)."""
        with atomic_file(local) as fh, self.fs.open(self.fresh(rel), "rb") as src:
            shutil.copyfileobj(src, fh, 1 << 22)


def upload_shard(url: str, folder: str | os.PathLike, record: Mapping) -> None:
    """Upload a shard a writer committed in ``folder``: its files, then its commit record
    (the object that makes it a shard). Each PUT is atomic, so a writer killed half-way
    leaves whole objects no record names, which the next commit deletes."""
    remote, folder = Remote(url), Path(folder)
    for info in record["files"].values():
        remote.upload(folder / info["name"], f"{SHARDS_DIR}/{info['name']}")
    name = f"{record['name']}{COMMIT_SUFFIX}"
    remote.upload(folder / name, f"{SHARDS_DIR}/{name}")


class Lease:
    """Exclusive use of a remote index by one build (see the module doc)."""

    def __init__(self, remote: Remote, run: str = "", seconds: float = LEASE_SECONDS):
        self.remote, self.seconds = remote, seconds
        self.holder = {"run": run, "host": socket.gethostname(), "pid": os.getpid()}
        self.etag: str | None = None
        self.lost: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({**self.holder, "expires": time.time() + self.seconds}).encode()

    def __enter__(self) -> Lease:
        try:
            self.etag = self.remote.put(LEASE_NAME, self._body(), if_none_match=True)
        except OSError as exc:
            if not precondition_failed(exc):
                raise access_error(self.remote.url, exc) from exc
            self._take_over()
        self._thread = threading.Thread(target=self._renew, name="embedingest-lease", daemon=True)
        self._thread.start()
        return self

    def _take_over(self) -> None:
        """Take an expired lease (If-Match its ETag: one taker wins); else IndexBusy."""
        etag = self.remote.etag(LEASE_NAME)  # before the body: a renewal in between fails the take
        try:
            held = json.loads(self.remote.read(LEASE_NAME))
            expires = float(held["expires"])
        except (FileNotFoundError, ValueError, KeyError, TypeError, RecursionError):
            held, expires = {}, 0.0
        if etag is not None and expires > time.time():
            raise IndexBusy(
                f"another build (run {held.get('run')!r}, pid {held.get('pid')} on host "
                f"{held.get('host')!r}) holds {self.remote.where(LEASE_NAME)} until "
                f"{time.strftime('%H:%M:%S UTC', time.gmtime(expires))}; wait for it to end, or "
                "if it was stopped run again after that time (the index resumes)")
        try:
            self.etag = (self.remote.put(LEASE_NAME, self._body(), if_match=etag) if etag
                         else self.remote.put(LEASE_NAME, self._body(), if_none_match=True))
        except OSError as exc:
            if precondition_failed(exc):
                raise IndexBusy(f"another build took {self.remote.where(LEASE_NAME)} just now; "
                                "wait for it to end and run again") from None
            raise
        log.info("took over the expired lease of %s (run %r)", self.remote.url, held.get("run"))

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 4):
            try:
                self.etag = self.remote.put(LEASE_NAME, self._body(), if_match=self.etag)
            except Exception as exc:  # noqa: BLE001 - kept, and raised by check()
                if precondition_failed(exc):
                    self.lost = exc
                    return
                log.warning("could not renew the lease of %s (%s); trying again", self.remote.url, exc)

    def check(self) -> None:
        """IndexBusy when another build took the lease (this one stopped renewing it)."""
        if self.lost is not None:
            raise IndexBusy(f"this build lost its lease on {self.remote.url} (it was not renewed in "
                            f"{self.seconds:.0f} s and another build took it); nothing it uploaded "
                            "is lost: run the same command again to commit it")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None and self.etag is not None:
            with contextlib.suppress(Exception):
                self.remote.delete(LEASE_NAME, if_match=self.etag)


@dataclass
class RemoteBuild:
    """A build of the index at ``url`` in a local working folder: the lease, the mirror,
    and the commit at the end (also after an error: whole shards are kept, as on disk)."""

    url: str
    overwrite: bool = False
    run: str = ""
    folder: Path = field(init=False)
    manifest_etag: str | None = field(init=False, default=None)
    found: set = field(init=False, default_factory=set)  # names present when the build began

    def __post_init__(self):
        self.remote = Remote(self.url)
        self.url = self.remote.url
        self._lease: Lease | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RemoteBuild:
        self.remote.check()
        self._lease = self._stack.enter_context(Lease(self.remote, self.run))
        try:
            self.folder = Path(self._stack.enter_context(
                tempfile.TemporaryDirectory(prefix="embedingest-index-")))
            self._mirror()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _mirror(self) -> None:
        """Download the index into the working folder: its top files, and every file a
        shard's commit record names (none with ``overwrite``: they all go)."""
        top = self.remote.listing()
        self.manifest_etag = self.remote.etag(MANIFEST_NAME) if MANIFEST_NAME in top else None
        for name in top:
            if _TOP_FILES.fullmatch(name):
                self.remote.download(name, self.folder / name)
        listed = self.remote.listing(SHARDS_DIR)
        self.found = set(top) | {f"{SHARDS_DIR}/{n}" for n in listed}
        shards = self.folder / SHARDS_DIR
        shards.mkdir()
        if self.overwrite:
            return
        generation = self._generation()
        for name in sorted(listed):
            if not (name.endswith(COMMIT_SUFFIX) and SHARD_NAME.fullmatch(name[: -len(COMMIT_SUFFIX)])):
                continue
            self.remote.download(f"{SHARDS_DIR}/{name}", shards / name)
            try:
                files = read_commit(shards / name).files.values()
            except ConfigError as exc:  # the local build deletes it, and so does the commit
                self._unreadable(f"{SHARDS_DIR}/{name}", exc)
                continue
            names = [info["name"] for info in files]
            if generation:  # a reindexed index: its vectors are in files no record names
                names.append(faiss_name(name[: -len(COMMIT_SUFFIX)], generation))
            for file in names:
                if file in listed:  # one missing: the build finds the shard damaged
                    self.remote.download(f"{SHARDS_DIR}/{file}", shards / file)

    def _unreadable(self, rel: str, exc: ConfigError) -> None:
        """Warn of the commit record ``rel`` that read_commit refused, naming it in the bucket
        (not its copy in the working folder, which the build deletes)."""
        log.warning("cannot read the commit record %s (%s: %s): that shard is left out and its units "
                    "are redone", self.remote.where(rel), type(exc.__cause__).__name__, exc.__cause__)

    def pull_shards(self) -> None:
        """Download into the working folder the shards that writers elsewhere (a Ray run's
        actors) committed to the bucket since the mirror, whole ones only, so that the
        build's process checks and edits them as its own."""
        listed = self.remote.listing(SHARDS_DIR)
        local = self.folder / SHARDS_DIR
        for name in sorted(listed):
            if not (name.endswith(COMMIT_SUFFIX) and SHARD_NAME.fullmatch(name[: -len(COMMIT_SUFFIX)])) \
                    or f"{SHARDS_DIR}/{name}" in self.found or (local / name).is_file():
                continue
            rel = f"{SHARDS_DIR}/{name}"
            try:
                files = read_commit(local / name, self.remote.read(rel)).files.values()
            except ConfigError as exc:  # a tampered record: never one of this build's writers
                self._unreadable(rel, exc)
                continue
            if any(listed.get(info["name"]) != info["size"] for info in files):
                log.warning("shard %s in %s lacks whole objects: its units are redone", name, self.url)
                continue
            for info in files:
                self.remote.download(f"{SHARDS_DIR}/{info['name']}", local / info["name"])
            self.remote.download(f"{SHARDS_DIR}/{name}", local / name)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if (self.folder / MANIFEST_NAME).is_file():
                self.commit()
        except BaseException as failure:
            if exc is None:
                raise
            log.error("could not commit %s after the build failed: %s", self.url, failure)
        finally:
            self._stack.close()

    def _generation(self) -> int:
        path = self.folder / MANIFEST_NAME
        return int(json.loads(path.read_text(encoding="utf-8")).get("generation", 0)) if path.is_file() else 0

    def _push_shards(self, generation: int) -> None:
        """Upload the shards committed in the working folder that the bucket lacks (those
        the build's process wrote: a removal's; the writers upload their own)."""
        shards_dir = self.folder / SHARDS_DIR
        listed = self.remote.listing(SHARDS_DIR)
        for shard in list_shards(shards_dir, generation=generation):
            vectors = shards_dir / faiss_name(shard.name, generation)
            if generation and shard.rows and listed.get(vectors.name) != vectors.stat().st_size:
                self.remote.upload(vectors, f"{SHARDS_DIR}/{vectors.name}")  # a reindex's: no record names it
            files = [info for kind, info in shard.files.items() if kind != "faiss" or not generation]
            if any(listed.get(i["name"]) != i["size"] for i in files) or \
                    shard.commit_path().name not in listed:
                upload_shard(self.url, shards_dir, shard.record)

    def _push_top(self, names) -> None:
        """Upload top files of the working folder; ``units.sqlite`` as a consistent snapshot
        (sqlite's backup, the WAL included), since the build may have it open."""
        for path in sorted(self.folder.iterdir()):
            if path.name not in names or not path.is_file():
                continue
            if path.name != UNITS_NAME:
                self.remote.upload(path, path.name)
                continue
            snapshot = self.folder / ".units-snapshot.sqlite"
            snapshot.unlink(missing_ok=True)
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db, \
                    contextlib.closing(sqlite3.connect(snapshot)) as copy:
                db.backup(copy)
            self.remote.upload(snapshot, UNITS_NAME)
            snapshot.unlink()

    def checkpoint(self) -> None:
        """Save the build's progress so far (after its plan, after training): the shards its
        process committed, ``trained.faiss``, then ``units.sqlite``. A build killed later
        is resumed from these as one on disk is: its writers' uploaded shards are kept."""
        self._lease.check()
        self._push_shards(self._generation())
        self._push_top({n for n in os.listdir(self.folder)
                        if _TOP_FILES.fullmatch(n) and n.startswith("trained")} | {UNITS_NAME})

    def commit(self) -> dict:
        """Upload what the working folder holds that the bucket lacks, write the manifest
        naming the live shards (conditionally), then delete what no live shard needs;
        return the manifest written."""
        self._lease.check()
        data = json.loads((self.folder / MANIFEST_NAME).read_text(encoding="utf-8"))
        generation = int(data.get("generation", 0))
        self._push_shards(generation)
        self._push_top({n for n in os.listdir(self.folder) if _TOP_FILES.fullmatch(n)} - {MANIFEST_NAME})
        live = self._live_shards(generation)
        data["segments"] = [{"name": s.name, "count": s.rows} for s in live if s.rows]
        body = json_bytes(data)
        self._lease.check()
        try:
            if self.manifest_etag:
                self.remote.put(MANIFEST_NAME, body, if_match=self.manifest_etag)
            else:
                self.remote.put(MANIFEST_NAME, body, if_none_match=True)
        except OSError as exc:
            if not precondition_failed(exc):
                raise
            raise IndexBusy(f"another build changed {self.remote.where(MANIFEST_NAME)} while this one "
                            "ran, so it was not overwritten; nothing is lost (this run's shards are "
                            "uploaded): run the same command again to commit them") from None
        self._delete_unneeded(live, generation)
        return data

    def _live_shards(self, generation: int) -> list[Shard]:
        """The committed shards in the bucket (another machine's writers' too), without
        those replaced, those the build deleted from its working folder (``overwrite``,
        a removal, damage), and any whose objects are missing or of other sizes."""
        listed = self.remote.listing(SHARDS_DIR)
        local = self.folder / SHARDS_DIR
        kept = {p.name for p in local.glob(f"*{COMMIT_SUFFIX}")}
        names = [n for n in listed if n.endswith(COMMIT_SUFFIX)
                 and SHARD_NAME.fullmatch(n[: -len(COMMIT_SUFFIX)])
                 and (n in kept or f"{SHARDS_DIR}/{n}" not in self.found)]
        fetch = [f"{SHARDS_DIR}/{n}" for n in names if not (local / n).is_file()]
        for rel, body in self.remote.read_many(fetch).items():
            (local / rel.rsplit("/", 1)[-1]).write_bytes(body)
        shards = []
        for n in sorted(names):
            try:
                shards.append(read_commit(local / n))
            except ConfigError as exc:
                self._unreadable(f"{SHARDS_DIR}/{n}", exc)
        replaced = {r for s in shards for r in s.replaces}
        live = []
        for shard in shards:
            if shard.name in replaced:
                continue
            wanted = {i["name"]: i["size"] for k, i in shard.files.items() if k != "faiss"}
            if shard.rows:
                vectors = faiss_name(shard.name, generation)
                wanted[vectors] = shard.files["faiss"]["size"] if not generation else listed.get(vectors)
            bad = [n for n, size in wanted.items() if listed.get(n) != size or size is None]
            if bad:
                log.warning("shard %s in %s lacks whole objects (%s): it is left out and its units "
                            "are redone by the next build", shard.name, self.url, ", ".join(bad))
                continue
            live.append(shard)
        return live

    def _delete_unneeded(self, live: list[Shard], generation: int) -> None:
        """Commit records of shards not live first (they stop being shards), then every
        file under shards/ that no live shard names, and top files the build dropped."""
        keep = set()
        for shard in live:
            keep.add(shard.commit_path().name)
            keep.update(i["name"] for k, i in shard.files.items() if k != "faiss")
            if shard.rows:
                keep.add(faiss_name(shard.name, generation))
        listed = self.remote.listing(SHARDS_DIR)
        gone = sorted(n for n in listed if n not in keep)
        for name in sorted(gone, key=lambda n: not n.endswith(COMMIT_SUFFIX)):
            with contextlib.suppress(FileNotFoundError):
                self.remote.delete(f"{SHARDS_DIR}/{name}")
        for name in sorted(n for n in self.found if _TOP_FILES.fullmatch(n)):
            if not (self.folder / name).is_file():
                with contextlib.suppress(FileNotFoundError):
                    self.remote.delete(name)

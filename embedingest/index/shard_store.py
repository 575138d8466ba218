"""The index folder in format 2: :class:`IndexStore`'s manifest, units and training, with
the vectors and chunk rows in shards (:mod:`embedingest.index.shards`).

Layout::

    manifest.json       settings (format 2, generation) and the shard list (written atomically)
    units.sqlite        one row per unit (source file or record): key, size, mtime, hash;
                        written by the planning process only, never per chunk
    trained.faiss       the trained empty index (trained.g<g>.faiss after a reindex)
    shards/             <name>.faiss, .parquet, .emb.npy, .commit.json per shard

Whether a unit is done is not stored: it is what the committed shards say
(:func:`~embedingest.index.shards.incomplete_units`), so no process has to mark it
after the writers commit, and a crash anywhere leaves nothing to reconcile by hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..outfiles import ensure_folder, is_tmp_name
from .faiss_factory import default_search_params, parse_factory
from .foreign import Foreign, ParquetIds, foreign_shards, keys_of
from .formats import V1_SEGMENT_FILE, V1_SEGMENTS, index_format, require_current
from .lookup import ShardRows
from .shard_edit import remove_units as remove_shard_units
from .shards import (
    CHUNK_BITS,
    FORMAT,
    SHARDS_DIR,
    Shard,
    clean_shards,
    delete_shard,
    finished_hashes,
    finished_units,
    incomplete_units,
    is_shard_file,
    list_shards,
    read_ids,
    trained_name,
)
from .store import MANIFEST_NAME, Chunk, IndexStore, Manifest, Unit, _sqlite_errors, log


# Where --overwrite keeps the index it rebuilds until the rebuild has succeeded.
ASIDE_DIR = ".overwritten"


@dataclass(frozen=True)
class ShardVectors:
    """A committed shard as the manifest lists it: its vectors file and row count, with
    the shard itself (its ids are its Parquet rows')."""

    name: str
    path: Path
    count: int
    shard: Shard

    @property
    def ids_path(self) -> Path:
        return self.shard.path("parquet")

    def ids(self) -> np.ndarray:
        return read_ids(self.shard)


class ShardStore(IndexStore):
    """One index folder of format 2. Not safe for two planners at once (the run lock);
    the shard writers of a run write only their own shards."""

    def __init__(self, folder, read_only: bool = False):
        super().__init__(folder, read_only)
        self.shards_dir = self.folder / SHARDS_DIR
        self.generation = 0
        if index_format(self.folder) == FORMAT:
            self.generation = self.read_manifest().generation
        self.trained_path = self.folder / trained_name(self.generation)

    def create_or_open(self, manifest: Manifest, overwrite: bool = False) -> Manifest:
        """:meth:`IndexStore.create_or_open` in format 2. A folder holding a format-1
        index is refused with the command that rebuilds it, unless ``overwrite``."""
        manifest.format = FORMAT
        if overwrite:
            self.wipe()
        require_current(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        ensure_folder(self.folder, self.shards_dir)
        if self.exists():
            existing = self.read_manifest()
            if existing.compatible_with(manifest):
                self.generation = existing.generation
                self.trained_path = self.folder / trained_name(self.generation)
                return existing
            if any(s.rows for s in list_shards(self.shards_dir, check=False)):
                only_factory = dataclasses.replace(manifest, factory=existing.factory).compatible_with(existing)
                keep = (f"leave out --index (or pass --index {existing.factory!r}) to update it as it is "
                        f"(a reindex changes the factory), " if only_factory else "")
                raise ConfigError(
                    f"the index at {str(self.folder)!r} was built with {existing.describe()}, "
                    f"not {manifest.describe()}: {keep}use --overwrite to rebuild it, or another folder")
            log.info("the index at %s holds no shard yet: its settings (%s) become %s",
                     self.folder, existing.describe(), manifest.describe())
            self.trained_path.unlink(missing_ok=True)
        manifest.generation = self.generation = 0
        self.trained_path = self.folder / trained_name(0)
        if "params" not in manifest.search:
            params = default_search_params(parse_factory(manifest.dim, manifest.factory, manifest.metric))
            manifest.search = {**manifest.search, **({"params": params} if params else {})}
        self.write_manifest(manifest)
        return manifest

    def own_files(self) -> list[Path]:
        """Everything embedingest keeps in the folder, a format-1 index's files included:
        :meth:`IndexStore.own_files`, the shards' files (or ``shards/`` itself where it
        is a link: the link only, nothing outside the folder) and the trained files of
        every generation. Other files in ``shards/`` and ``segments/`` are not (a folder
        of the user's that has one of those names was deleted whole by ``--overwrite``)."""
        found = super().own_files()
        for folder, own in ((self.shards_dir, is_shard_file),
                            (self.folder / V1_SEGMENTS, V1_SEGMENT_FILE.fullmatch)):
            if folder.is_symlink():
                found.append(folder)
            elif folder.is_dir():
                found += [p for p in folder.iterdir()
                          if (own(p.name) or is_tmp_name(p.name)) and (p.is_symlink() or p.is_file())]
        return found + [p for p in self.folder.glob("trained.g*.faiss") if p.is_file()]

    def wipe(self) -> None:
        """Delete :meth:`own_files`; ``shards/`` and ``segments/`` go once empty (what
        else is there stays, and is named)."""
        super().wipe()
        for folder in (self.shards_dir, self.folder / V1_SEGMENTS):
            if folder.is_dir() and not folder.is_symlink():
                _remove_if_empty(folder)
        self.generation = 0
        self.trained_path = self.folder / trained_name(0)

    # -- shards ---------------------------------------------------------------------------

    def update_shards(self, manifest: Manifest | None = None, **changes) -> Manifest:
        """Rewrite the manifest with the current shard list and ``changes`` (e.g. corpus)."""
        manifest = manifest or self.read_manifest()
        for name, value in changes.items():
            setattr(manifest, name, value)
        manifest.segments = [{"name": s.name, "count": s.count} for s in self.shards()]
        self.write_manifest(manifest)
        return manifest

    def committed(self) -> list[Shard]:
        """The committed shards (their files checked against their records)."""
        return list_shards(self.shards_dir, generation=self.generation)

    def shards(self) -> list[ShardVectors]:
        """The shards holding vectors, as the manifest lists them."""
        return [ShardVectors(s.name, s.faiss_path(self.generation), s.rows, s)
                for s in self.committed() if s.rows]

    def clean_garbage(self) -> list[str]:
        """Delete what a crash or a removal left (see :func:`clean_shards`), temporary
        files, and shards copied in from another index (:meth:`drop_foreign`). Call it
        only while no build writes to the folder."""
        removed = self._remove_tmp_files(self.folder)
        removed += clean_shards(self.shards_dir, self.generation)
        return removed + self.drop_foreign()

    def drop_foreign(self) -> list[str]:
        """Delete every committed shard that is not this index's (copied in from another,
        told as search and export tell it: :func:`~embedingest.index.foreign.foreign_shards`),
        each logged with its name and what tells; return the names of the files deleted.
        A build kept such a shard where its unit numbers were this index's and looked
        whole, and readers then refused the index until it was taken out by hand. Once it
        is gone, the units it held the numbers of are redone as a damaged shard's are (no
        shard declares them done). Two shards holding one id where neither is known to be
        the copy stay: :meth:`reconcile` finds the units held twice, which the plan removes
        and redoes. Call it only while no build writes to the folder, after
        :func:`clean_shards` (the shards read are whole, their files regular ones)."""
        if not self.exists():
            return []
        manifest = self.read_manifest()
        rows = ParquetIds([s for s in self.committed() if s.rows])
        found: dict[str, Foreign] = {}
        for foreign in foreign_shards(rows, manifest, self.metadata_path, self._unit_keys, every=True):
            if foreign.shard is not None and foreign.shard.name not in found:
                found[foreign.shard.name] = foreign
        removed = []
        for foreign in found.values():
            log.warning("%s", foreign.says("it is deleted, and the units it held are redone"))
            removed += delete_shard(foreign.shard)
        return removed

    @_sqlite_errors
    def _unit_keys(self, unit_nos: Iterable[int]) -> dict[int, str] | None:
        """{unit_no: key} of ``unit_nos`` from the build's own connection (its WAL included)."""
        return keys_of(self.db, unit_nos)

    def reconcile(self, expected: Mapping[int, int] | None = None) -> set[int]:
        """Units whose committed rows are not exactly their chunks once each, and units
        with rows or finished-marks but no unit row (see :func:`incomplete_units`)."""
        known = None
        if expected is None:
            known = {u.unit_no for u in super().units().values()}
        return incomplete_units(self.committed(), expected, known)

    def remove_units(self, unit_nos: Iterable[int]) -> int:
        """Remove every row, vector and finished-mark of ``unit_nos``; return how many vectors.
        The empty index of the shards' kind is made only for a shard that faiss cannot edit
        in place: units no shard holds (a run stopped or refused while it trained, before
        any shard and any trained file) go without it."""
        template = self.empty_index if self.exists() else None
        return remove_shard_units(self.shards_dir, unit_nos, template, self.generation)

    # -- units ----------------------------------------------------------------------------

    def units(self, keys: Iterable[str] | None = None) -> dict[str, Unit]:
        """Unit rows by key, with ``n_chunks`` and ``status`` ("done" or "pending") as the
        committed shards say (their finished-marks; :meth:`reconcile` checks the rows), and
        ``sha256`` from the row or, for a file the loader hashed, the shard that finished it."""
        rows = super().units(keys)
        shards = self.committed()
        done, hashes = finished_units(shards), finished_hashes(shards)
        return {k: Unit(u.unit_no, u.key, u.size, u.mtime_ns, u.sha256 or hashes.get(u.unit_no),
                        done.get(u.unit_no, 0), "done" if u.unit_no in done else "pending", u.ctime_ns)
                for k, u in rows.items()}

    @_sqlite_errors
    def sync_status(self) -> None:
        """Write the status the shards give into ``units.sqlite`` (one transaction), and
        the hashes the loader made, for readers of that file: embedingest reads the
        status and those hashes from the shards."""
        shards = self.committed()
        done = finished_units(shards)
        with self.db as db:
            db.execute("UPDATE units SET status='pending', n_chunks=0")
            db.executemany("UPDATE units SET status='done', n_chunks=? WHERE unit_no=?",
                           ((n, u) for u, n in done.items()))
            db.executemany("UPDATE units SET sha256=? WHERE unit_no=? AND sha256 IS NULL",
                           ((h, u) for u, h in finished_hashes(shards).items()))

    @_sqlite_errors
    def spend_unit_nos(self, highest: int) -> None:
        """Make AUTOINCREMENT hand out numbers above ``highest`` only (numbers a shard
        held without a unit row, e.g. a killed writer's, are never given again)."""
        with self.db as db:
            row = db.execute("SELECT seq FROM sqlite_sequence WHERE name='units'").fetchone()
            if row is None and highest > 0:
                db.execute("INSERT INTO sqlite_sequence(name, seq) VALUES ('units', ?)", (int(highest),))
            elif row is not None and row[0] < highest:
                db.execute("UPDATE sqlite_sequence SET seq=? WHERE name='units'", (int(highest),))

    @_sqlite_errors
    def highest_unit_no(self) -> int:
        """The highest unit number ever given in this index: by ``units.sqlite`` (its
        AUTOINCREMENT counter) or found in a committed shard (0 when none)."""
        (seq,) = self.db.execute("SELECT max(coalesce((SELECT seq FROM sqlite_sequence WHERE "
                                 "name='units'), 0), coalesce((SELECT max(unit_no) FROM units), 0))"
                                 ).fetchone()
        shards = self.committed()
        in_shards = max([s.id_max >> CHUNK_BITS for s in shards if s.rows]
                        + [u for s in shards for u, _ in s.units], default=0)
        return max(int(seq), int(in_shards))

    @_sqlite_errors
    def delete_units(self, unit_nos: Iterable[int]) -> None:
        """Delete unit rows (call :meth:`remove_units` for their vectors and rows first)."""
        with self.db as db:
            db.executemany("DELETE FROM units WHERE unit_no=?", ((int(u),) for u in unit_nos))

    def chunks(self, ids: Iterable[int]) -> dict[int, Chunk]:
        """Chunk rows by vector id, from the shards (open_index keeps a reader open instead)."""
        rows = ShardRows(self.committed())
        try:
            return rows.chunks(list(ids))
        finally:
            rows.close()



def _remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` if it is empty; else say what stays in it."""
    kept = [p.name for p in folder.iterdir()]
    if kept:
        log.warning("%s: %d entries that are not the index's are kept (%s)", folder, len(kept),
                    ", ".join(sorted(kept)[:5]) + (", ..." if len(kept) > 5 else ""))
        return
    folder.rmdir()


class SetAside:
    """The files of an index that ``--overwrite`` rebuilds (:meth:`ShardStore.own_files`),
    moved into ``.overwritten/`` of its folder (renames, no copies) before the rebuild:
    one that fails (a factory the corpus cannot train, a full disk, Ctrl-C) puts them
    back with :meth:`restore`, one that succeeds deletes them (:func:`drop_set_aside`).
    (Deleting them first, as ``--overwrite`` did, left an empty index when the rebuild
    failed.) The folder holds a marker file: a ``.overwritten`` without it is not ours and is
    refused, never deleted; one with it is what a killed run left (that run's index is
    the one in place) and goes first."""

    def __init__(self, store: ShardStore):
        self.store = store
        self.folder = store.folder / ASIDE_DIR
        if os.path.lexists(self.folder) and not _ours(self.folder):
            raise ConfigError(f"{str(self.folder)!r} is not embedingest's, and --overwrite keeps the old "
                              "index there while it rebuilds: move it away, or build into another --out")
        drop_set_aside(store.folder)
        store.close()
        self.moved: list[tuple[Path, Path]] = []
        try:
            self.folder.mkdir()
            (self.folder / _MARKER).write_bytes(b"")
            for path in store.own_files():
                target = self.folder / path.relative_to(store.folder)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
                self.moved.append((path, target))
        except BaseException:
            self._put_back()  # only what was moved: nothing of the old index is deleted
            raise

    def restore(self) -> None:
        """Delete what the rebuild wrote and put the old files back."""
        self.store.wipe()
        self._put_back()

    def _put_back(self) -> None:
        for path, target in reversed(self.moved):
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(target, path)
        self.moved = []
        drop_set_aside(self.store.folder)


_MARKER = "EMBEDINGEST_SET_ASIDE"


def answering_folder(folder: str | os.PathLike) -> Path:
    """Where readers (search, serve) find the index of ``folder``: in ``.overwritten/``
    while a rebuild with --overwrite runs (or one was stopped), which holds the whole index
    from before it while the folder holds the rebuild's first shards; else the folder."""
    aside = Path(folder) / ASIDE_DIR
    return aside if _ours(aside) and (aside / MANIFEST_NAME).is_file() else Path(folder)


def refuse_unfinished_overwrite(folder: str | os.PathLike, what: str) -> None:
    """ConfigError when a rebuild with --overwrite of the index at ``folder`` has not
    finished (running, or stopped): the folder holds part of the new index, readers
    answer from the old one, and ``what`` (export, reindex) would work on the part."""
    if answering_folder(folder) != Path(folder):
        raise ConfigError(f"the index at {str(folder)!r} is being rebuilt with --overwrite, or a rebuild was "
                          f"stopped before its end ({ASIDE_DIR}/ holds the index from before it, which "
                          f"search answers from): finish the rebuild (run that build-index again), then "
                          f"{what}")


def _ours(folder: Path) -> bool:
    return not folder.is_symlink() and folder.is_dir() and (folder / _MARKER).is_file()


@contextlib.contextmanager
def set_aside_while(folder: str | os.PathLike, overwrite: bool):
    """Around a build of the index at ``folder`` (under its run lock): with ``overwrite``
    the old index is set aside (:class:`SetAside`) and put back if the block fails; when
    it succeeds, what is set aside there (this run's, or a killed run's) is deleted."""
    aside = SetAside(ShardStore(folder)) if overwrite else None
    try:
        yield
    except BaseException:
        if aside is not None:
            aside.restore()  # the index as it was before the command
        raise
    drop_set_aside(folder)


def drop_set_aside(folder: str | os.PathLike) -> None:
    """Delete ``.overwritten/`` of an index folder where it is ours (its marker in it);
    anything else of that name stays."""
    aside = Path(folder) / ASIDE_DIR
    if _ours(aside):
        shutil.rmtree(aside)

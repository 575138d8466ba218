"""Shards that are not this index's: a shard's files copied in from another index (in
place of one of this index's shards, or beside them) are whole and agree with their own
commit record, so the checks of a damaged shard pass, and search gave their hits other
texts and sources (two shards holding one id: the lookup finds one of the two rows),
export wrote ids twice, and a later build kept such a shard where this index's files
had not changed since (their units looked done). One owner tells them for all three:
search and export refuse the first (:func:`refuse_foreign_shards`), a build deletes every
one it finds and redoes the units they held
(:meth:`~embedingest.index.shard_store.ShardStore.drop_foreign`).

What ties a shard to its index is already recorded, and read when the index is opened;
nothing is added to the format:

* the manifest lists each shard by name with its row count as of the last update (a
  removal writes a shard of another name): a shard of that name with another count is
  another shard;
* an id is in one shard only (``unit_no << 32 | chunk_no``, never listed twice): two
  shards holding one id are this index's and an intruder, or a build was stopped after
  writing a unit twice;
* each row's ``source`` is its unit's key in ``units.sqlite`` (the writers take it from
  there): a shard whose rows name other files than this index's units of those numbers,
  or units this index never had, is another index's. One row group a shard is compared
  (its first, a few rows) and one query of ``units.sqlite``; the database is read
  without creating or changing a file (search changes nothing in the folder), and an
  index without it (an index in object storage, or one whose ``units.sqlite`` was
  deleted, or made again empty) is compared by the first two alone.

The ids come from the files open_index reads anyway (export reads each shard's id
column): nothing here reads a whole file.
"""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ConfigError
from ..outfiles import native_path
from .lookup import ShardRows, first_shared
from .shards import CHUNK_BITS, Shard, redo_advice
from .store import Manifest, read_only_uri

log = logging.getLogger("embedingest")

_QUERY_BATCH = 500


class ParquetIds:
    """What :func:`refuse_foreign_shards` reads of ``shards`` (as :class:`ShardRows`
    gives it), from their Parquet files' id column and first row group, for a reader
    that does not open the index for search (export). A file that cannot be read so is
    left out here: the reader that reads it whole next names what is wrong with it."""

    def __init__(self, shards: Iterable[Shard], opener: Callable[[Shard], object] | None = None,
                 where: Callable[[Shard], str] | None = None):
        self.shards, self._where, per_shard, self._first = [], where, [], []
        for shard in shards:
            try:
                if opener is not None:
                    with opener(shard) as fh:
                        ids, first = _ids_and_first_rows(fh)
                else:
                    with native_path(shard.path("parquet")) as name:
                        ids, first = _ids_and_first_rows(name)
            except (pa.ArrowException, OSError, KeyError, ValueError):
                continue
            self.shards.append(shard)
            per_shard.append(ids)
            self._first.append(first)
        self._offsets = np.cumsum([0] + [len(a) for a in per_shard], dtype=np.int64)
        flat = np.concatenate(per_shard) if per_shard else np.empty(0, np.int64)
        self._order = np.argsort(flat, kind="stable")
        self._sorted = flat[self._order]

    def where(self, no: int) -> str:
        shard = self.shards[no]
        return self._where(shard) if self._where is not None else str(shard.path("parquet"))

    def shared_id(self) -> tuple[int, int, int] | None:
        return first_shared(self._sorted, self._order, self._offsets)

    def shared_ids(self) -> list[tuple[int, int, int]]:
        """Every pair of shards holding an id, as (the lowest id they share, shard, other
        shard) in the order of those ids (a shard holding an id twice is paired with
        itself): a build deletes every copy, so the first pair alone (search's) is not
        enough, nor pairs of neighbours (of three shards holding one id, the first and
        the third are a pair too). One pass over the sorted ids per holder beyond two."""
        group = np.concatenate([[0], np.cumsum(self._sorted[1:] != self._sorted[:-1])])
        shard_of = np.searchsorted(self._offsets, self._order, side="right") - 1
        ends, ids = [], []
        for apart in range(1, len(group)):
            at = np.flatnonzero(group[apart:] == group[:-apart])
            if not len(at):
                break
            ends.append(np.sort(np.stack([shard_of[at], shard_of[at + apart]]), axis=0))
            ids.append(self._sorted[at])
        if not ends:
            return []
        first, second = np.concatenate(ends, axis=1)
        ids = np.concatenate(ids)
        pair = first * len(self.shards) + second
        order = np.lexsort((ids, pair))  # by pair, then id: a pair's first is its lowest id
        _, start = np.unique(pair[order], return_index=True)
        at = order[start]
        return sorted(zip(ids[at].tolist(), first[at].tolist(), second[at].tolist()))

    def first_rows(self, no: int) -> tuple[list[int], list[str | None]]:
        return self._first[no]

    def close(self) -> None:
        """Nothing is kept open (as :meth:`ShardRows.close`)."""


def _ids_and_first_rows(source) -> tuple[np.ndarray, tuple[list[int], list[str | None]]]:
    """A shard's Parquet file's id column, and the ids and sources of its first row group."""
    with pq.ParquetFile(source) as pf:
        ids = pf.read(columns=["id"], use_threads=False).column(0).to_numpy().astype(np.int64, copy=False)
        if not pf.metadata.num_row_groups:
            return ids, ([], [])
        first = pf.read_row_group(0, columns=["id", "source"], use_threads=False)
    return ids, (first.column("id").to_pylist(), first.column("source").to_pylist())


@dataclass(frozen=True)
class Foreign:
    """What tells that a shard is not this index's: ``why`` (naming it and its file) and
    ``fix`` (what a reader's user does), joined by ``joint``. ``shard`` is the copy; None
    where neither of two shards holding one id is known to be it (or one shard holds an
    id twice): a build then removes the units held twice and redoes them, as it always did."""

    shard: Shard | None
    why: str
    fix: str
    joint: str = "; "

    def says(self, what: str) -> str:
        return f"{self.why}{self.joint}{what}"

    def error(self) -> ConfigError:
        return ConfigError(self.says(self.fix))


def refuse_foreign_shards(rows: ShardRows | ParquetIds, manifest: Manifest, units: Path | None = None) -> None:
    """ConfigError naming the first shard of ``rows`` that is not this index's (see the
    module), with what to do; ``units``: the index's ``units.sqlite`` (None: not compared)."""
    found = next(foreign_shards(rows, manifest, units), None)
    if found is not None:
        raise found.error()


def foreign_shards(rows: ShardRows | ParquetIds, manifest: Manifest, units: Path | None = None,
                   keys: Callable[[Iterable[int]], dict[int, str] | None] | None = None,
                   every: bool = False) -> Iterator[Foreign]:
    """The shards of ``rows`` that are not this index's, in the order they are checked
    (a reader stops at the first: the later checks cost nothing then). ``units``: the
    index's ``units.sqlite``; ``keys(unit_nos)``: {unit_no: key} of this index's units,
    or None when there are none to compare with (by default read from ``units``, as
    :func:`unit_keys`; a build gives its own open database's). ``every``: each pair of
    shards holding one id (``rows`` a :class:`ParquetIds`), not the first alone."""
    yield from _miscounted(rows, manifest)
    yield from _shared_ids(rows, manifest, every)
    if keys is None and units is not None:
        keys = functools.partial(unit_keys, units)
    if keys is not None:
        yield from _other_units(rows, manifest, keys, units)


def _put_back(name: str, rows, manifest: Manifest) -> str:
    """What to do with shard ``name``, not this index's: take it out, and put back the
    shard it took the place of (the manifest names those that are gone), or let a build
    redo its units."""
    build = "run the same build-index command again, which deletes it and redoes the units it held"
    if name in {seg["name"] for seg in manifest.segments}:
        return f"put back this index's own files of shard {name}, or {build}"
    present = {s.name for s in rows.shards} | {r for s in rows.shards for r in s.replaces}
    lost = [seg["name"] for seg in manifest.segments if seg["name"] not in present]
    gone = (f" (the manifest lists {', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}, not in the folder)"
            if lost else "")
    return (f"move its files (every file named {name}.*) out of the index and put back the shard of this "
            f"index it took the place of{gone}, or {build}")


def _miscounted(rows, manifest: Manifest) -> Iterator[Foreign]:
    counts = {seg["name"]: seg["count"] for seg in manifest.segments}
    for no, shard in enumerate(rows.shards):
        count = counts.get(shard.name)
        if count is not None and count != shard.rows:
            yield Foreign(shard, f"shard {shard.name} ({rows.where(no)!r}) holds {shard.rows} rows, but the "
                                 f"manifest lists {count} for the shard of that name: it is not the shard this "
                                 "index wrote (copied in from another index?)",
                          _put_back(shard.name, rows, manifest))


def _shared_ids(rows, manifest: Manifest, every: bool) -> Iterator[Foreign]:
    named = {seg["name"] for seg in manifest.segments}
    for vid, a, b in rows.shared_ids() if every else filter(None, [rows.shared_id()]):
        first, second = rows.shards[a], rows.shards[b]
        which = f"e.g. id {vid}: unit {vid >> CHUNK_BITS}, chunk {vid & ((1 << CHUNK_BITS) - 1)}"
        if a == b:  # one shard holding an id twice: its own rows are wrong
            yield Foreign(None, f"shard {first.name} ({rows.where(a)!r}) holds ids twice ({which}): the shard "
                                "is damaged", redo_advice(first.name))
            continue
        unnamed = [no for no, s in ((a, first), (b, second)) if s.name not in named]
        if len(unnamed) == 1:
            odd = unnamed[0]
            other = second if odd == a else first
            shard = rows.shards[odd]
            yield Foreign(shard, f"shard {shard.name} ({rows.where(odd)!r}), which the manifest does not list, "
                                 f"holds ids that shard {other.name} holds too ({which}): it is not this index's "
                                 "(copied in from another index, or left by a build that was stopped)",
                          _put_back(shard.name, rows, manifest))
            continue
        yield Foreign(None, f"shards {first.name} ({rows.where(a)!r}) and {second.name} ({rows.where(b)!r}) hold "
                            f"the same ids ({which}): an id is in one shard only, so one of them was copied in "
                            "from another index (or a build was stopped after writing its units twice)",
                      "put back this index's own shard in place of the one copied in, or run the same "
                      "build-index command again: it removes the units held twice and redoes them")


def _other_units(rows, manifest: Manifest, keys, units: Path | None) -> Iterator[Foreign]:
    """Each shard whose first row group names a unit's file other than this index's unit
    of that number, or a unit this index has not (its first such row)."""
    sample: list[tuple[int, int, str | None]] = []  # (shard number, id, source)
    for no in range(len(rows.shards)):
        ids, sources = rows.first_rows(no)
        sample += [(no, i, s) for i, s in zip(ids, sources)]
    if not sample:
        return
    found = keys({i >> CHUNK_BITS for _, i, _ in sample})
    if found is None:
        return
    told = set()
    for no, vid, source in sample:
        unit = vid >> CHUNK_BITS
        key = found.get(unit)
        if key == source or no in told:
            continue
        told.add(no)
        name = rows.shards[no].name
        theirs = (f"unit {unit} of this index is {key!r}" if key is not None else
                  f"this index has no unit {unit}")
        yield Foreign(rows.shards[no],
                      f"shard {name} ({rows.where(no)!r}) is not this index's: its row of id {vid} is of "
                      f"{source!r}, but {theirs}{f' (in {str(units)!r})' if units is not None else ''}; it was "
                      "copied in from another index", _put_back(name, rows, manifest), ": ")


def unit_keys(path: Path, unit_nos: Iterable[int]) -> dict[int, str] | None:
    """{unit_no: key} of ``unit_nos`` in the units database ``path``; None when there is
    none to compare with (no file: an index read from its shards alone; no unit in it, see
    :func:`keys_of`), or it cannot be read (logged: the build that needs it says what is
    wrong with it). Read without creating a file (:func:`~embedingest.index.store.read_only_uri`;
    a ``-wal`` file left holding changes without its ``-shm``: not compared, logged).
    Nothing that is not a regular file (a link, a named pipe) is opened."""
    files = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
    kinds = []
    for file in files:
        try:
            kinds.append(os.lstat(file).st_mode)
        except FileNotFoundError:
            kinds.append(None)
        except OSError as exc:
            log.warning("cannot compare the shards with %s (%s): searching without that check", file, exc)
            return None
    if kinds[0] is None:
        return None
    odd = next((f for f, mode in zip(files, kinds) if mode is not None and not stat.S_ISREG(mode)), None)
    if odd is not None:
        log.warning("%s is not a regular file: the shards are not compared with the index's units", odd)
        return None
    try:
        uri = read_only_uri(path)
    except ConfigError as exc:
        log.warning("%s; until then the shards are not compared with the index's units", exc)
        return None
    try:
        db = sqlite3.connect(uri, uri=True)
        try:
            return keys_of(db, unit_nos)
        finally:
            db.close()
    except sqlite3.Error as exc:
        log.warning("cannot read %s (%s): the shards are not compared with the index's units", path, exc)
        return None


def keys_of(db: sqlite3.Connection, unit_nos: Iterable[int]) -> dict[int, str] | None:
    """{unit_no: key} of ``unit_nos`` in the units database ``db`` (sqlite3.Error when it
    cannot be read); None when it holds no unit at all: one made again after it was
    deleted is no record of the index's units (a build redoes every unit its shards hold,
    as it did before anything compared them)."""
    if db.execute("SELECT NOT EXISTS (SELECT 1 FROM units)").fetchone()[0]:
        return None
    wanted = sorted(set(unit_nos))
    out: dict[int, str] = {}
    for start in range(0, len(wanted), _QUERY_BATCH):
        batch = wanted[start:start + _QUERY_BATCH]
        out.update(db.execute(f"SELECT unit_no, key FROM units WHERE unit_no IN "
                              f"({','.join('?' * len(batch))})", batch))
    return out

"""``embedingest export``: an index of format 2 as plain Parquet files that pandas, DuckDB,
Polars or Spark read as they are.

One file per shard, ``<to>/<shard>.parquet``, with the shard's rows (id, source,
record_id, chunk_no, span_start, span_end, text) and, when the index kept its
embeddings (``--save-embeddings``), ``embedding``: a fixed-size list of float32 (the
saved float16 values widened; float16 columns are not read by every engine). Row groups
are large here (:data:`ROW_GROUP_ROWS`), for scans rather than lookups. Every file is
written to a temporary name and renamed; ``_SUCCESS`` is written last.

The index may be in object storage (``s3://bucket/prefix``): the shards its manifest
names are read from there (checked as ``open_index`` checks them), one at a time, into
the local folder ``to``.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import stat
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ConfigError
from ..outfiles import atomic_file, atomic_write_bytes, ensure_folder, is_tmp_name, native_path, refuse_link
from ..sources.files import is_within
from ..sources.remote import is_remote
from .foreign import ParquetIds, refuse_foreign_shards
from .formats import UNITS_NAME, require_current
from .lock import IndexBusy, no_build_running
from .shard_store import refuse_unfinished_overwrite
from .shards import (EMB_SUFFIX, SHARD_NAME, SHARDS_DIR, damaged, embeddings_problem, list_shards, read_embeddings,
                     schema_problem)
from .store import IndexStore

ROW_GROUP_ROWS = 65_536
SUCCESS_NAME = "_SUCCESS"


def _named_by_export(name: str) -> bool:
    """Whether an export writes a file named ``name``: ``_SUCCESS`` or a Parquet file
    named as a shard."""
    return name == SUCCESS_NAME or (name.endswith(".parquet") and SHARD_NAME.fullmatch(name[:-len(".parquet")]))


def is_export_folder(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds an export's files: a ``_SUCCESS`` file and Parquet files,
    every one of them named as a shard is (:data:`SHARD_NAME`). A Spark job's output
    (``part-*.parquet``) or a folder of other Parquet files is not one; nor is one with
    no Parquet file, which holds no rows to read back. Names only: nothing is opened, and
    a folder without ``_SUCCESS`` costs one stat (the walk asks of every folder)."""
    try:
        if not stat.S_ISREG(os.lstat(os.path.join(folder, SUCCESS_NAME)).st_mode):
            return False
        with os.scandir(folder) as entries:
            parquet = [e.name for e in entries if e.name.lower().endswith(".parquet")]
    except OSError:
        return False
    # every one as export names them (a .PARQUET too is read as Parquet, and named by no export)
    return bool(parquet) and all(_named_by_export(n) for n in parquet)


def _is_export_file(name: str) -> bool:
    """An export's file, or its temporary name (a killed export's)."""
    return _named_by_export(name) or is_tmp_name(name, of=_named_by_export)


@contextlib.contextmanager
def _exporting(to: Path):
    """Hold ``to`` for this export (a lock on the folder itself: no file is left in it):
    two exports into one folder each wrote their files, and a reader got both indexes."""
    fd = os.open(to, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise IndexBusy(f"another export is writing {str(to)!r}; wait for it to end, or choose another "
                            "folder") from None
        yield
    finally:
        os.close(fd)


def _clear_for_export(to: Path, overwrite: bool) -> None:
    """Make ``to`` ready for an export's files: an export's own files go where it is
    ``overwrite``n, or where they are all the folder holds and the export did not finish
    (no ``_SUCCESS``: stopped by a full disk or a kill, so the same command finishes it);
    any other entry refuses a folder without ``overwrite``, and another Parquet file one
    with it (a reader of the folder would read it with the export)."""
    entries = list(to.iterdir())
    own = [p for p in entries if _is_export_file(p.name)]
    others = [p for p in entries if p not in own]
    unfinished = not others and all(p.name != SUCCESS_NAME for p in own)
    if entries and not overwrite and not unfinished:
        raise ConfigError(f"export folder {str(to)!r} is not empty: choose a new folder or "
                          "pass --overwrite (overwrite=True)")
    foreign = sorted(p.name for p in others if p.suffix == ".parquet")
    if foreign:
        raise ConfigError(f"export folder {str(to)!r} holds Parquet files no export wrote "
                          f"({', '.join(map(repr, foreign[:5]))}{', ...' if len(foreign) > 5 else ''}), "
                          "which a reader of the folder would read with the export: move them "
                          "or choose another folder")
    for path in own:
        refuse_link(path)
        path.unlink()


def export_index(index: str | os.PathLike, to: str | os.PathLike, *, embeddings: bool | None = None,
                 overwrite: bool = False) -> dict:
    """Write the rows of the index at ``index`` to Parquet files in ``to``; return a
    summary (files, rows, whether embeddings are in them). ``embeddings``: None takes
    them when the index kept them; True refuses an index without them. ``to`` must be
    empty or not exist, unless ``overwrite``: then an export's own files there (Parquet
    files named as shards are, and ``_SUCCESS``) are replaced, and other files stay,
    but not other Parquet files (a reader of the folder would take them for the
    export's): they are refused, never deleted."""
    if is_remote(str(to)):
        raise ConfigError(f"export writes a local folder, not {str(to)!r}: export to a folder, then "
                          "copy it (e.g. aws s3 sync FOLDER URL)")
    if is_remote(index):
        return _export(index, to, embeddings, overwrite)
    with no_build_running(index, "export"):
        refuse_unfinished_overwrite(index, "export")
        return _export(index, to, embeddings, overwrite)


def _refuse_inside_corpus(to, corpus: str | None, where: str) -> None:
    """ConfigError when ``to`` is the corpus folder of the index at ``where`` (its
    manifest's ``corpus_path``) or inside it: the next build-index of that corpus would
    index the export's rows as documents, every hit twice."""
    if not corpus or is_remote(corpus):
        return
    if is_within(os.path.realpath(to), os.path.realpath(corpus)):
        raise ConfigError(f"export folder {str(to)!r} is inside {corpus!r}, the corpus folder of the index "
                          f"{where!r}: its next build-index would read the export's rows as documents; "
                          "choose a folder outside the corpus")


def _refuse_foreign(rows: ParquetIds, manifest, units=None) -> None:
    """Before any file is written: every shard is this index's
    (:func:`~embedingest.index.foreign.refuse_foreign_shards`; the ids are each shard's id
    column, one column of what the export reads whole next), else an export would write
    another index's rows, and ids twice."""
    try:
        refuse_foreign_shards(rows, manifest, units)
    finally:
        rows.close()


def _export(index, to, embeddings: bool | None, overwrite: bool) -> dict:
    if is_remote(index):
        from .cache import RemoteShards

        remote = RemoteShards(str(index))
        with_rows = remote.shards

        def rows_of(shard):
            with remote.open_parquet(shard) as fh:
                return pq.read_table(fh)

        def embeddings_of(shard):
            rel = f"{SHARDS_DIR}/{shard.files['emb']['name']}"
            emb = np.load(io.BytesIO(remote.remote.read(rel)), allow_pickle=False)
            problem = embeddings_problem(emb, shard.rows, dim)
            if problem:
                raise damaged(shard, remote.url, f"its emb object {rel!r} is not its vectors ({problem})")
            return emb

        dim = remote.manifest.dim
        where = index = remote.url
        _refuse_inside_corpus(to, remote.manifest.corpus_path, where)
        _refuse_foreign(ParquetIds(with_rows, opener=remote.open_parquet, where=remote.where), remote.manifest)
    else:
        index = Path(index)
        require_current(index)
        if not (index / "manifest.json").is_file():
            raise ConfigError(f"{str(index)!r} is not an embedingest index (no manifest.json)")
        if is_within(os.path.realpath(to), os.path.realpath(index)):
            raise ConfigError(f"export folder {str(to)!r} is inside the index {str(index)!r}: "
                              "choose a folder outside it")
        manifest = IndexStore(index).read_manifest()
        _refuse_inside_corpus(to, manifest.corpus_path, str(index))
        generation, dim = manifest.generation, manifest.dim
        refuse_link(index / SHARDS_DIR)  # a shard is read from inside the index folder only
        with_rows = [s for s in list_shards(index / SHARDS_DIR, generation=generation) if s.rows]
        _refuse_foreign(ParquetIds(with_rows), manifest, index / UNITS_NAME)

        def rows_of(shard):
            # export reads every byte anyway: those that were not committed are refused, not exported
            problem = shard.verify(("parquet", "emb") if embeddings else ("parquet",), generation)
            if problem:
                raise damaged(shard, shard.folder, problem)
            with native_path(shard.path("parquet")) as name:
                return pq.read_table(name)

        def embeddings_of(shard):
            return read_embeddings(shard, dim)

        where = str(index)
    to = Path(to)
    kept = all(s.has_embeddings for s in with_rows)
    if embeddings is None:
        embeddings = kept and bool(with_rows)
    elif embeddings and not kept:
        raise ConfigError(f"the index at {where!r} kept no embeddings (it was built without "
                          "--save-embeddings): export without them, or rebuild the index with "
                          "--save-embeddings")
    refuse_link(to)
    try:
        ensure_folder(to, to)
    except (NotADirectoryError, FileExistsError, PermissionError) as exc:
        raise ConfigError(f"cannot make the export folder {str(to)!r}: {exc.strerror or exc} "
                          f"({exc.filename}); choose another folder") from exc
    with _exporting(to):
        _clear_for_export(to, overwrite)
        rows = 0
        for shard in with_rows:
            try:
                table = rows_of(shard)
                emb = embeddings_of(shard) if embeddings else None
            except ConfigError:
                raise
            except (pa.ArrowException, ValueError, OSError) as exc:  # a record that names bad files
                raise damaged(shard, shard.folder, f"it cannot be read ({exc})") from exc
            problem = schema_problem(table.schema)
            if problem:
                raise damaged(shard, shard.folder, f"its parquet file is not a shard's rows file ({problem})")
            if embeddings:
                if emb.shape[0] != table.num_rows:
                    raise ConfigError(f"{shard.name}{EMB_SUFFIX} holds {emb.shape[0]} vectors for "
                                      f"{table.num_rows} rows: the shard is damaged; rebuild the index")
                flat = pa.array(np.ascontiguousarray(emb, dtype=np.float32).reshape(-1))
                table = table.append_column("embedding", pa.FixedSizeListArray.from_arrays(flat, emb.shape[1]))
            with atomic_file(to / f"{shard.name}.parquet") as fh:
                pq.write_table(table, fh, compression="zstd", row_group_size=ROW_GROUP_ROWS)
            rows += table.num_rows
        atomic_write_bytes(to / SUCCESS_NAME, b"", sync_dir=True)
    return {"index": where, "to": str(to), "files": len(with_rows), "rows": rows,
            "embeddings": bool(embeddings)}

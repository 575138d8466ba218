"""Removing units from a format-2 index: every shard holding rows of them, or declaring
them finished, is replaced by a new shard without them.

The new shard's commit record names the shard it replaces, so the switch is that one
atomic rename: until it, the old shard is live; after it, the old one is hidden (and
deleted here, or by :func:`~embedingest.index.shards.clean_shards` after a crash). No
id is ever listed twice and no journal is needed. Vectors are edited in place where
faiss allows it (codes kept exactly, :mod:`embedingest.index.faiss_edit`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import faiss
import numpy as np
import pyarrow.parquet as pq

from ..outfiles import native_path, new_run_id
from ..sinks.shard_writer import PARQUET_OPTIONS, ROW_GROUP_ROWS, write_faiss_hashed
from .faiss_edit import removes_in_place, without
from .faiss_factory import read_index_file
from .shards import (
    CHUNK_BITS,
    EMB_SUFFIX,
    FORMAT,
    PARQUET_SUFFIX,
    Shard,
    damaged,
    delete_shard,
    faiss_name,
    hashes_record,
    list_shards,
    now,
    read_embeddings,
    redo_advice,
    schema_problem,
    shard_name,
    write_commit,
    write_hashed,
)


def remove_units(shards_dir: str | Path, unit_nos: Iterable[int],
                 template: faiss.Index | Callable[[], faiss.Index] | None = None,
                 generation: int = 0, run_id: str | None = None) -> int:
    """Remove every row, vector and finished-mark of ``unit_nos`` from the shards in
    ``shards_dir``; return how many vectors went. ``template``: an empty index of the
    shards' kind (trained), needed only for kinds faiss cannot edit in place (HNSW), or a
    function making one, called only then (once): units that no shard holds rows of (those
    of a run stopped before its first shard, while it trained) go without any faiss index,
    so an index whose factory trains and has no trained file yet is not asked for one."""
    folder = Path(shards_dir)
    gone = {int(u) for u in unit_nos}
    units = np.fromiter(gone, dtype=np.int64)
    run = "rm" + (run_id or new_run_id())
    made: list = []

    def the_template() -> faiss.Index | None:  # made once, and only for a shard that needs it
        if not made:
            made.append(template() if callable(template) else template)
        return made[0]

    removed, part = 0, 0
    for shard in list_shards(folder, generation=generation):
        table = None
        if shard.rows:
            with native_path(shard.path("parquet")) as name:
                table = pq.read_table(name)
            problem = schema_problem(table.schema)
            if problem:  # rewritten as it is, the damage would pass to the shard replacing it
                raise damaged(shard, folder, f"its parquet file is not a shard's rows file ({problem})")
        ids = table.column("id").to_numpy() if table is not None else np.empty(0, np.int64)
        drop = np.isin(ids >> CHUNK_BITS, units)
        marks = [(u, n) for u, n in shard.units if u not in gone]
        if not drop.any() and len(marks) == len(shard.units):
            continue
        name = shard_name(run, 0, part)
        part += 1
        keep = ~drop
        files = {}
        if keep.any():
            files = _write_kept(folder, name, shard, table, keep, the_template, generation)
        record = {"format": FORMAT, "name": name, "rows": int(keep.sum()),
                  "id_min": int(ids[keep].min()) if keep.any() else 0,
                  "id_max": int(ids[keep].max()) if keep.any() else -1,
                  "dim": shard.record.get("dim"), "factory": shard.record.get("factory"),
                  "generation": generation, "row_group_rows": ROW_GROUP_ROWS, "files": files,
                  "units": [[u for u, _ in marks], [n for _, n in marks]],
                  "replaces": [shard.name], "run": run, "created": now(),
                  **hashes_record((u, h) for u, h in shard.unit_hashes if u not in gone)}
        write_commit(folder, record)  # the switch: the old shard is hidden from here on
        delete_shard(shard)
        removed += int(drop.sum())
    return removed


def _write_kept(folder: Path, name: str, shard: Shard, table, keep: np.ndarray,
                the_template: Callable[[], faiss.Index | None], generation: int) -> dict:
    files = {"parquet": write_hashed(folder / f"{name}{PARQUET_SUFFIX}", lambda fh: pq.write_table(
        table.filter(keep), fh, row_group_size=ROW_GROUP_ROWS, **PARQUET_OPTIONS))}
    index = read_index_file(shard.faiss_path(generation), redo=redo_advice(shard.name))
    if shard.has_embeddings:
        emb = np.asarray(read_embeddings(shard, index.d)[keep])
        files["emb"] = write_hashed(folder / f"{name}{EMB_SUFFIX}",
                                    lambda fh: np.lib.format.write_array(fh, emb, allow_pickle=False))
    template = None
    if not removes_in_place(index):
        template = the_template()
        if template is None:
            raise ValueError(f"removing vectors from {shard.name} needs the empty index template")
    index, kept = without(index, keep, template)
    if not np.array_equal(kept, table.column("id").to_numpy()[keep]):
        raise ValueError(f"the vectors of {shard.name} are not in the order of its rows")
    files["faiss"] = write_faiss_hashed(index, folder / faiss_name(name, generation))
    return files

"""build-index over a Ray Dataset: records embedded by a pool of Ray actors, one GPU (or
CPU) each, into one index folder that the CLI, ``open_index`` and later runs share.

Import it as ``embedingest.jobs.build_index.ray`` (``build_index_ray`` also as
``from embedingest import build_index_ray``). Three steps, which :func:`build_index_ray`
runs in order (call them yourself to put :class:`EmbedBatches` into a pipeline of your
own). The driver never reads the dataset (only the first ``train_size`` records, once,
when an IVF/PQ/HNSW factory is still to be trained): it reads the index, and one small
row per record that the actors send back.

1. :func:`plan_ray_index` (driver): opens the index, removes what a stopped run left
   half done, and puts one snapshot of the units the index holds complete into the
   object store (:class:`IndexedUnits`: per record a 16-byte digest of its id, 16 bytes
   of its text's sha256 and its unit number; 40 bytes a unit, read from
   ``units.sqlite`` and the commit records, not from the dataset). It starts a
   :class:`~embedingest.scaleout.ray_data.NumberBlocks` actor that hands out unit
   numbers above every number the index ever gave.
2. ``dataset.map_batches(EmbedBatches, fn_constructor_kwargs=plan.actor_kwargs(), ...)``:
   each actor loads the encoder on its GPU (or the CPU when Ray gave it none) and, per
   batch of records, hashes each one: a record whose id and content hash the snapshot
   holds passes without work; the others get fresh unit numbers (one request for the
   whole batch), are chunked and tokenized (in a thread, ahead of the GPU), encoded
   and sent through an egress engine whose consumers commit shards (vectors and chunk
   rows together) under the actor's own run id. The engine is closed at the end of
   each call, so when a call returns its shards are committed; it returns one row per
   record (id digest, status, unit number, size, hash, chunk count) and per skipped
   input: no chunk's row or text goes back to the driver.
3. :meth:`RayIndexPlan.finish` (driver): as those rows stream in, writes the unit row
   of every embedded record into ``units.sqlite`` (the only file the driver writes
   besides the manifest and the report); at the end removes the units of records not
   seen (deleted), the old units of changed records, both occurrences of a duplicated
   id, and whatever a retried actor call left behind, then writes one manifest.

Unit numbers are given in the order actors ask, so the vector ids of a Ray build are
not those ``build_index`` gives the same records (with one actor on a fresh index they
are); the index's content (each record's chunks, vectors and rows) is the same. A
changed record gets a new unit number (its old vectors are removed at the end, so a
stop in between leaves them as units without a row, which the next run removes); a
number is never given twice. A record id that occurs more than once in the dataset is
indexed by none of its occurrences: each is reported in ``skipped.jsonl`` (reason
``duplicate``) and the units they made are removed, so one key never has two units.

A run that stopped anywhere is finished by running it again, as with the CLI. The
shards folder (shards/) must be reachable by every actor (one host, or a shared file
system); ``units.sqlite`` is written by the driver only.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import ray
    import ray.data
except ImportError as exc:  # pragma: no cover - exercised only without ray
    raise ImportError(
        "embedingest.jobs.build_index.ray needs Ray Data, which is not installed: "
        "pip install 'embedingest[ray]' (or pip install 'ray[data]')") from exc

from ...config import IndexConfig
from ...errors import ConfigError
from ...exit_codes import exit_code
from ...index.shard_store import ShardStore
from ...index.store import MAX_UNIT_NO, Manifest
from ...report import REPORT_NAME, SkipReport
from ...runner import run_batches
from ...index.faiss_factory import parse_factory
from ...outfiles import new_run_id
from ...scaleout.ray_data import number_blocks
from ...sinks.shard_writer import commit_finished
from ...sources.remote import is_remote
from ...stages.device import precision
from ...stages.prefetch import thread_ahead
from .encode import (chunk_batches, embed_steps, needs_training, shard_sinks, train_if_needed,
                     vector_slots)
from .plan import fingerprint, search_defaults, settled_prompts

log = logging.getLogger("embedingest")

SAVE_EVERY_S = 60.0
"""With an index in object storage, how often the driver saves ``units.sqlite`` there
while rows arrive: a driver killed before its commit loses at most this much of the
actors' work (their shards are uploaded, but a shard whose unit has no row is redone)."""

UNCHANGED, INDEXED, BAD, SKIPPED = "unchanged", "indexed", "bad", "skipped"
RESULT_SCHEMA = pa.schema([
    ("digest", pa.binary(16)), ("record_id", pa.string()), ("status", pa.string()),
    ("unit_no", pa.int64()), ("size", pa.int64()), ("sha256", pa.string()),
    ("n_chunks", pa.int64()), ("skip_where", pa.string()), ("skip_reason", pa.string()),
])
"""What :class:`EmbedBatches` returns: one row per record, ``status`` "unchanged" (the
index holds it complete: ``unit_no`` is its unit), "indexed" (embedded now into
``n_chunks`` chunks under the new ``unit_no``) or "bad" (its text is not a string), and
one row per input the chunker skipped ("skipped", ``unit_no`` -1)."""


def _digest(record_id: str) -> bytes:
    return hashlib.blake2b(record_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _key(record_id: str) -> str:
    return f"record:{record_id}"


@dataclass(frozen=True)
class IndexedUnits:
    """The records the index holds complete, as three arrays sorted by id digest (16
    bytes of blake2b of the id; 16 bytes of the text's sha256; the unit number), put
    once into Ray's object store and shared by the actors of a node."""

    digests: np.ndarray
    hashes: np.ndarray
    unit_nos: np.ndarray

    @classmethod
    def build(cls, units: Iterable) -> IndexedUnits:
        """From unit rows (``key`` ``record:<id>``, ``sha256`` in hex, ``unit_no``)."""
        units = [u for u in units if u.key.startswith("record:") and u.sha256]
        digests = np.array([_digest(u.key[len("record:"):]) for u in units], dtype="S16")
        hashes = np.array([bytes.fromhex(u.sha256)[:16] for u in units], dtype="S16")
        unit_nos = np.array([u.unit_no for u in units], dtype=np.int64)
        order = np.argsort(digests, kind="stable")
        return cls(digests[order], hashes[order], unit_nos[order])

    def unchanged(self, digests: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """The unit number of each record the index holds with this content, else -1."""
        if not len(self.digests) or not len(digests):
            return np.full(len(digests), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.digests, digests), len(self.digests) - 1)
        same = (self.digests[pos] == digests) & (self.hashes[pos] == hashes)
        return np.where(same, self.unit_nos[pos], -1)


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    """One tokenizer per actor process, not one per call."""
    from ...stages.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


class EmbedBatches:
    """The Ray Data callable class: embeds the new and changed records of each batch
    into shards.

    Use it through ``map_batches(EmbedBatches, fn_constructor_kwargs=plan.actor_kwargs(),
    batch_format="numpy", concurrency=N, num_gpus=1)`` (or ``compute=ActorPoolStrategy``);
    the batch needs the configured id and text columns. Records the index holds with the
    same content pass without work.
    """

    def __init__(self, out: str, config: dict, indexed, numbers, dtype: str, chunk_tokens: int,
                 trained: str | None = None, generation: int = 0):
        import torch

        from ...stages.encoder import TextEncoder

        self.cfg = IndexConfig(**config)
        self.out, self.chunk_tokens, self.trained, self.generation = out, chunk_tokens, trained, generation
        self.remote = out if is_remote(out) else None
        if self.remote:  # a working folder of its own: each shard is uploaded once committed
            from ...index.remote_store import Remote

            self.out = tempfile.mkdtemp(prefix="embedingest-ray-")
            weakref.finalize(self, shutil.rmtree, self.out, True)
            self.cfg = dataclasses.replace(self.cfg, out=self.remote)
            if trained:
                self.trained = os.path.join(self.out, os.path.basename(trained))
                Remote(self.remote).download(os.path.basename(trained), Path(self.trained))
        self.indexed: IndexedUnits = ray.get(indexed) if isinstance(indexed, ray.ObjectRef) else indexed
        self.numbers = numbers
        self.device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        self.encoder = TextEncoder.load(self.cfg.model, device=self.device, dtype=dtype,
                                       cuda_graphs=self.cfg.cuda_graphs)
        self.run_id = f"{new_run_id()}_ray{os.getpid()}"
        self.calls = 0

    def __call__(self, batch: dict) -> pa.Table:
        from ...sources.text_dataset import Unit

        cfg = self.cfg
        ids = [str(i) for i in batch[cfg.id_field]]
        texts = list(batch[cfg.text_field])
        data = [t.encode("utf-8", "surrogatepass") if isinstance(t, str) else None for t in texts]
        shas = [hashlib.sha256(d).digest() if d is not None else b"" for d in data]
        keys = [_digest(i) for i in ids]  # bytes: numpy's S16 drops trailing zero bytes
        known = self.indexed.unchanged(np.array(keys, dtype="S16"),
                                       np.array([h[:16] for h in shas], dtype="S16"))
        rows = {name: [] for name in RESULT_SCHEMA.names}

        def row(n, status, unit_no=-1, n_chunks=0, where="", reason=""):
            values = (keys[n] if n is not None else b"\0" * 16, ids[n] if n is not None else "",
                      status, unit_no, len(data[n]) if n is not None and data[n] is not None else 0,
                      shas[n].hex() if n is not None else "", n_chunks, where, reason)
            for name, value in zip(RESULT_SCHEMA.names, values):
                rows[name].append(value)

        todo = []
        for n, rid in enumerate(ids):
            if data[n] is None:
                row(n, BAD, where=f"record {rid}", reason=f"field: {cfg.text_field!r} is not a string")
            elif known[n] >= 0:
                row(n, UNCHANGED, unit_no=int(known[n]))
            else:
                todo.append(n)
        if todo:
            first = ray.get(self.numbers.take.remote(len(todo)))
            units = [Unit(first + k, _key(ids[n]), text=texts[n], record_id=ids[n])
                     for k, n in enumerate(todo)]
            done, skipped = self._embed(units)
            for n, unit in zip(todo, units):
                row(n, INDEXED, unit_no=unit.unit_no, n_chunks=done.get(unit.unit_no, 0))
            for where, reason in skipped:
                row(None, SKIPPED, where=where, reason=reason)
        return pa.Table.from_pydict(rows, schema=RESULT_SCHEMA)

    def _embed(self, units: list) -> tuple[dict[int, int], list[tuple[str, str]]]:
        """Embed ``units`` into shards committed before it returns; return the chunk count
        of each unit that finished and the inputs the chunker skipped."""
        cfg, enc = self.cfg, self.encoder
        batches = chunk_batches(units, enc, cfg, self.chunk_tokens, tokenizer_loader=_tokenizer)
        sinks = shard_sinks(self.out, enc.dim, cfg, f"{self.run_id}_{self.calls:05d}", self.trained,
                            self.generation)
        self.calls += 1
        done: dict[int, int] = {}
        skipped: list[tuple[str, str]] = []
        marks: list[tuple[int, int]] = []

        def keep(item) -> None:
            """Only what finished goes back to the driver: the rows are in the shards."""
            done.update((int(u), int(n)) for u, n in item["units_done"])

        run_batches(sinks, thread_ahead(iter(batches)), embed_steps(enc, self.device, keep, marks),
                    device=self.device, slot_spec=vector_slots(cfg, enc.dim),
                    num_consumers=cfg.num_consumers, num_slots=cfg.num_slots or None,
                    on_skip=lambda where, reason: skipped.append((where, reason)))
        commit_finished(sinks, marks)
        if self.remote:  # uploaded: the local copies go
            for path in Path(self.out, "shards").iterdir():
                path.unlink()
        return done, skipped


@dataclass
class _Seen:
    """One entry per record row the actors sent back (24 bytes and a status each): what
    the end of the run needs to find deleted records and duplicated ids."""

    digests: list = dataclasses.field(default_factory=list)
    unit_nos: list = dataclasses.field(default_factory=list)
    n_chunks: list = dataclasses.field(default_factory=list)
    indexed: list = dataclasses.field(default_factory=list)

    def add(self, table: pa.Table) -> None:
        self.digests.append(np.array(table.column("digest").to_pylist(), dtype="S16"))
        self.unit_nos.append(table.column("unit_no").to_numpy())
        self.n_chunks.append(table.column("n_chunks").to_numpy())
        self.indexed.append(np.asarray(table.column("status").to_pylist(), dtype=object) == INDEXED)

    def arrays(self) -> tuple[np.ndarray, ...]:
        def cat(parts, dtype):
            return np.concatenate(parts) if parts else np.empty(0, dtype)
        return (cat(self.digests, "S16"), cat(self.unit_nos, np.int64),
                cat(self.n_chunks, np.int64), cat(self.indexed, bool))


@dataclass
class RayIndexPlan:
    """What the driver decided (see :func:`plan_ray_index`); :meth:`finish` completes it."""

    out: Path
    config: IndexConfig
    dtype: str
    chunk_tokens: int
    trained: str | None
    indexed: object  # ObjectRef of the IndexedUnits
    numbers: object  # the NumberBlocks actor
    known: tuple  # (id digests, unit_nos) of every record's unit row when the run started
    others: list  # unit_nos of rows that are not records (files): never in a dataset
    model_name: str
    counts: dict
    report: SkipReport
    store: ShardStore
    started: float
    settings: dict = dataclasses.field(default_factory=dict)  # manifest fields: prompts, search defaults
    writers: str | None = None  # the s3:// URL the actors upload their shards to

    def actor_kwargs(self) -> dict:
        """``fn_constructor_kwargs`` for :class:`EmbedBatches`."""
        return {"out": self.writers or str(self.out), "config": dataclasses.asdict(self.config),
                "indexed": self.indexed, "numbers": self.numbers, "dtype": self.dtype,
                "chunk_tokens": self.chunk_tokens, "trained": self.trained,
                "generation": self.store.generation}

    def finish(self, results: ray.data.Dataset, progress: bool = False,
               pull: Callable[[], None] | None = None,
               save: Callable[[], None] | None = None) -> dict:
        """Consume ``results`` (the output of ``map_batches(EmbedBatches, ...)``): write
        the unit row of each embedded record as its row arrives, count, report skipped
        inputs; once all arrived, remove deleted records, the old units of changed ones,
        duplicated ids and units the shards do not hold complete (see the module
        docstring); write the manifest and the skip report; return a summary like
        ``build_index``'s. When ``results`` fails, what arrived is kept and the error
        raised: the next run finishes the work. ``pull()``, called once every row
        arrived, brings the shards the actors uploaded into ``out``, and ``save()``, called
        every :data:`SAVE_EVERY_S` seconds while rows arrive, saves the unit rows written
        so far (an index in object storage, whose driver may be killed before it commits)."""
        from tqdm import tqdm

        store, counts, report = self.store, self.counts, self.report
        seen, outdated = _Seen(), []
        saved = time.monotonic()
        bar = tqdm(unit="record", disable=not progress, dynamic_ncols=True)
        try:
            for table in results.iter_batches(batch_format="pyarrow", batch_size=None):
                outdated += self._take(table, seen)
                bar.update(table.num_rows)
                if save is not None and time.monotonic() - saved > SAVE_EVERY_S:
                    save()
                    saved = time.monotonic()
            if pull is not None:
                pull()
            self._settle(seen, outdated)
        finally:
            bar.close()
            manifest = store.update_shards(corpus=fingerprint(store), **self.settings)
            report.write(self.out)
            store.close()
            ray.kill(self.numbers)
        seconds = time.perf_counter() - self.started
        summary = {"index": str(self.out), "device": "ray", "dtype": self.dtype,
                   "model": self.model_name, **counts,
                   "vectors_total": sum(s["count"] for s in manifest.segments),
                   "segments": len(manifest.segments), "skipped": len(report),
                   "skipped_by_reason": report.by_reason(),
                   "report": str(self.out / REPORT_NAME), "report_run": report.run,
                   "skipped_earlier": report.earlier, "seconds": round(seconds, 3),
                   "docs_per_s": round(counts["docs"] / seconds, 1) if seconds else 0.0,
                   "chunks_per_s": round(counts["chunks"] / seconds, 1) if seconds else 0.0}
        summary["exit_code"] = exit_code(len(report.entries))
        return summary

    def _take(self, table: pa.Table, seen: _Seen) -> list[int]:
        """One table of :class:`EmbedBatches`: skipped inputs to the report, records to
        ``seen``, embedded ones into ``units.sqlite``; return the units they replace."""
        counts, report = self.counts, self.report
        status = table.column("status").to_pylist()
        for n in (i for i, s in enumerate(status) if s in (BAD, SKIPPED)):
            report.add(table.column("skip_where")[n].as_py(), table.column("skip_reason")[n].as_py(),
                       stage="read")
        records = table.filter(pc.is_in(table.column("status"), pa.array([UNCHANGED, INDEXED])))
        seen.add(records)
        new = records.filter(pc.equal(records.column("status"), INDEXED))
        n_chunks = new.column("n_chunks").to_numpy()
        counts["units_unchanged"] += records.num_rows - new.num_rows
        counts["units_indexed"] += new.num_rows
        counts["chunks"] += int(n_chunks.sum())
        counts["docs"] += int((n_chunks > 0).sum())
        if not new.num_rows:
            return []
        return self.store.put_numbered_units(
            {"unit_no": u, "key": _key(r), "size": s, "sha256": h} for u, r, s, h in zip(
                new.column("unit_no").to_pylist(), new.column("record_id").to_pylist(),
                new.column("size").to_pylist(), new.column("sha256").to_pylist()))

    def _settle(self, seen: _Seen, outdated: list[int]) -> None:
        """The end of a run whose every record was seen: remove the units of deleted
        records, the old units of changed ones, every unit of a duplicated id, and the
        units the shards do not hold complete (a retried actor call's leftovers); drop
        the unit rows of the deleted and duplicated."""
        store, counts = self.store, self.counts
        digests, unit_nos, n_chunks, indexed = seen.arrays()
        uniq, inverse, times = np.unique(digests, return_inverse=True, return_counts=True)
        twice = times[inverse] > 1
        dup_nos = set(unit_nos[twice].tolist())
        if dup_nos:
            keys = {u.unit_no: u.key for u in store.units().values() if u.unit_no in dup_nos}
            by_digest = {}
            for d, u in zip(digests[twice].tolist(), unit_nos[twice].tolist()):
                by_digest.setdefault(d, []).append(keys.get(u))
            for d, found in by_digest.items():
                key = next((k for k in found if k), None)
                rid = key[len("record:"):] if key else d.hex()
                for _ in found:
                    self.report.add(f"record {rid}", f"duplicate: the record id {rid!r} occurs "
                                    f"{len(found)} times in the dataset; ids must be unique, so "
                                    "none of them is indexed", stage="plan")
            counts["units_indexed"] -= int((twice & indexed).sum())
            counts["units_unchanged"] -= int((twice & ~indexed).sum())
            counts["chunks"] -= int(n_chunks[twice & indexed].sum())
            counts["docs"] -= int((n_chunks[twice & indexed] > 0).sum())
        counts["duplicate_ids"] = int((times > 1).sum())
        counts["units_seen"] = int((times == 1).sum())
        known_digests, known_nos = self.known
        deleted = set(known_nos[~np.isin(known_digests, uniq)].tolist()) | set(self.others)
        bad = store.reconcile()
        drop = deleted | dup_nos
        removed = store.remove_units(set(outdated) | drop | bad)
        store.delete_units(drop)
        counts["units_removed"] = len(deleted)
        counts["vectors_removed"] += removed
        rows = {u.unit_no for u in store.units().values()}
        counts["units_incomplete"] = len(bad & rows)
        if counts["units_incomplete"]:
            log.warning("%d records have vectors that do not match their rows (an actor failed "
                        "and was retried?); their vectors are removed: run again to redo them",
                        counts["units_incomplete"])


def plan_ray_index(dataset: ray.data.Dataset, out: str | os.PathLike,
                   config: IndexConfig | None = None, *, num_gpus: float = 0,
                   writers: str | None = None, **overrides) -> RayIndexPlan:
    """Create or open the index at ``out`` and plan the run over ``dataset`` (see the
    module docstring): only the index is read, and the dataset's first ``train_size``
    records when a factory must be trained. ``num_gpus`` is what the actors will get:
    with GPUs the default precision is fp16, else fp32. ``device``, ``devices`` and
    ``num_workers`` do not apply here; Ray places the actors. ``writers``: the s3:// URL
    of an index whose working folder ``out`` is (:func:`build_index_ray` with an s3://
    ``out``): the actors write in folders of their own and upload their shards there."""
    from ...stages.encoder import TextEncoder
    from ...stages.prompts import Prompts

    cfg = dataclasses.replace(config or IndexConfig(), **overrides)
    cfg.validate()
    started = time.perf_counter()
    out = Path(out)
    columns = set(dataset.schema().names)
    for field, option in ((cfg.id_field, "id_field"), (cfg.text_field, "text_field")):
        if field not in columns:
            raise ConfigError(f"the dataset has no column {field!r} ({option}); its columns are "
                              f"{', '.join(sorted(columns))}: set {option}, or add the column "
                              "(e.g. Dataset.add_column) since records are tracked by id")
    dtype = precision(cfg.dtype, bool(num_gpus))
    cfg = cfg.for_device(bool(num_gpus))
    encoder = TextEncoder.load(cfg.model, device="cpu", dtype="fp32")
    chunk_tokens = min(cfg.chunk_tokens, encoder.max_seq_length)
    if cfg.overlap >= chunk_tokens:
        raise ConfigError(f"overlap={cfg.overlap} must be smaller than the chunk size "
                          f"{chunk_tokens}")
    parse_factory(encoder.dim, cfg.index, cfg.metric)  # every option checked before the first write
    report = SkipReport()
    out.mkdir(parents=True, exist_ok=True)
    store = ShardStore(out)
    try:
        wanted = Prompts.read(encoder.model_dir).resolve(cfg.doc_prompt, cfg.query_prompt)
        manifest = store.create_or_open(
            Manifest(model=encoder.info() | {"dtype": dtype}, dim=encoder.dim, metric=cfg.metric,
                     factory=cfg.index, dtype=dtype, prompts=wanted), overwrite=cfg.overwrite)
        settings = {"prompts": settled_prompts(manifest, cfg, str(out)),
                    "search": search_defaults(manifest, cfg)}
        cfg = dataclasses.replace(cfg, doc_prompt=settings["prompts"]["document"])
        store.clean_garbage()
        half_done = store.reconcile()  # a stopped run's units, and vectors of units with no row
        removed = store.remove_units(half_done) if half_done else 0
        units = store.units()
        complete = [u for u in units.values() if u.status == "done" and u.n_chunks]
        records = [u for u in units.values() if u.key.startswith("record:")]
        known = (np.array([_digest(u.key[len("record:"):]) for u in records], dtype="S16"),
                 np.array([u.unit_no for u in records], dtype=np.int64))
        others = [u.unit_no for u in units.values() if not u.key.startswith("record:")]
        sample = _sample(dataset, cfg) if needs_training(store, cfg, encoder.dim) else []
        trained = train_if_needed(store, manifest, encoder, sample, cfg, chunk_tokens)
        numbers = number_blocks(store.highest_unit_no() + 1, MAX_UNIT_NO)
    except BaseException:
        store.close()
        raise
    counts = {"units_seen": 0, "units_indexed": 0, "units_unchanged": 0, "units_removed": 0,
              "vectors_removed": removed, "docs": 0, "chunks": 0}
    return RayIndexPlan(out, cfg, dtype, chunk_tokens, trained,
                        ray.put(IndexedUnits.build(complete)), numbers, known, others,
                        encoder.info()["name"], counts, report, store, started, settings, writers)


def _sample(dataset: ray.data.Dataset, cfg: IndexConfig) -> list:
    """The texts of the dataset's first ``train_size`` records, as units: the training
    sample (``limit`` reads no further than it needs)."""
    from ...sources.text_dataset import Unit

    units = []
    head = dataset.select_columns([cfg.id_field, cfg.text_field]).limit(cfg.train_size)
    for batch in head.iter_batches(batch_format="numpy", batch_size=1024):
        for rid, text in zip(batch[cfg.id_field], batch[cfg.text_field]):
            if isinstance(text, str):
                units.append(Unit(len(units), _key(str(rid)), text=text, record_id=str(rid)))
    return units


def build_index_ray(dataset: ray.data.Dataset, out: str | os.PathLike,
                    config: IndexConfig | None = None, *, concurrency: int | tuple = 1,
                    num_gpus: float = 0, num_cpus: float | None = None,
                    records_per_call: int = 8192, progress: bool = False, **overrides) -> dict:
    """Build or update the index at ``out`` (a folder every actor reaches, or an s3://
    URL) from ``dataset`` (id and text columns) with ``concurrency`` :class:`EmbedBatches`
    actors of ``num_gpus`` GPUs each; return a summary dict like ``build_index``'s.
    Options are :class:`IndexConfig` fields.

    With an s3:// ``out`` the driver holds the index's lease and a working folder, as
    ``build_index`` does (docs/INDEX_FORMAT.md, "Object storage"); each actor writes in
    a temporary folder of its own and uploads every shard it commits, so the nodes share
    no path.

    ``records_per_call`` records go to an actor per call; each call that has records to
    embed starts and closes the actor's engine (a fraction of a second), so keep it in
    the thousands. Leave a CPU free for reading the dataset (``concurrency x num_cpus``
    below the cluster's CPUs when the actors use no GPU): Ray Data would otherwise wait
    forever for one.
    """
    def run(plan: RayIndexPlan, pull=None, remote=None) -> dict:
        results = dataset.map_batches(
            EmbedBatches, fn_constructor_kwargs=plan.actor_kwargs(), batch_size=records_per_call,
            batch_format="numpy", concurrency=concurrency, num_gpus=num_gpus or None,
            num_cpus=num_cpus)
        return plan.finish(results, progress=progress, pull=pull,
                           save=remote.checkpoint if remote else None)

    if not is_remote(out):
        return run(plan_ray_index(dataset, out, config, num_gpus=num_gpus, **overrides))
    from ...index.remote_store import RemoteBuild

    overwrite = overrides.get("overwrite", config.overwrite if config else False)
    with RemoteBuild(str(out), overwrite=overwrite) as remote:
        plan = plan_ray_index(dataset, remote.folder, config, num_gpus=num_gpus,
                              writers=remote.url, **overrides)
        remote.checkpoint()  # trained.faiss, which the actors download, and units.sqlite
        summary = run(plan, pull=remote.pull_shards, remote=remote)
    summary.update(index=remote.url, report=f"{remote.url}/{REPORT_NAME}")
    return summary

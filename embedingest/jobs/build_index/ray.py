"""build-index over a Ray Dataset: records embedded by a pool of Ray actors, one GPU (or
CPU) each, into one index folder that the CLI, ``open_index`` and later runs share.

Import it as ``embedingest.jobs.build_index.ray`` (``build_index_ray`` also as
``from embedingest import build_index_ray``). Three steps, which :func:`build_index_ray`
runs in order (call them yourself to put :class:`EmbedBatches` into a pipeline of your
own). The driver never reads a record's text (only the first ``train_size`` texts, once,
when an IVF/PQ/HNSW factory is still to be trained): it reads the index, and small rows
that Ray's workers compute from the records.

1. :func:`plan_ray_index` (driver): opens the index, then runs a first, cheap pass over
   the dataset in its order (``preserve_order``): Ray tasks hash each record and send
   back one row (16-byte digest of its id, the id, its size and sha256, or why it is
   bad). The driver plans exactly as ``build_index`` does with the same records
   (``plan_units`` and ``apply_plan``: unchanged, new, changed, deleted, half done), so
   the new and changed records get the unit numbers ``build_index`` gives them, in
   the dataset's order, and their unit rows are written (pending) before anything is
   embedded. One snapshot of what to embed goes into the object store
   (:class:`Assigned`: per record its id digest, 16 bytes of its sha256 and its unit
   number, 40 bytes a record to embed).
2. ``dataset.map_batches(EmbedBatches, fn_constructor_kwargs=plan.actor_kwargs(), ...)``:
   each actor loads the encoder on its GPU (or the CPU when Ray gave it none) and, per
   batch of records, hashes each one: a record the snapshot does not name passes without
   work; the others are chunked and tokenized (in a thread, ahead of the GPU) under the
   unit number the plan gave them, encoded and sent through an egress engine whose
   consumers commit shards (vectors and chunk rows together) under the actor's own run
   id. The engine is closed at the end of each call, so when a call returns its shards
   are committed; it returns one row per embedded record (unit number, chunk count) and
   per skipped input: no chunk's row or text goes back to the driver.
3. :meth:`RayIndexPlan.finish` (driver): counts those rows, reports the skipped inputs,
   removes what the shards do not hold complete (a retried actor call's leftovers), and
   writes one manifest.

The ids are those of ``build_index`` on the same records in the same order, whatever the
number of actors and the blocks and batches (docs/INDEX_FORMAT.md, "Vector ids"): a
record keeps its unit number while its text is the same, a changed record gets a fresh
one, a number is never given twice, and a run that stopped anywhere is finished by
running it again, which gives the index (ids included) of a clean run. A record id that
occurs more than once in the dataset is indexed by none of its occurrences: each is
reported in ``skipped.jsonl`` (reason ``duplicate``) and a unit it had is removed, so one
key never has two units.

The driver holds one small row per record (id, size, hash) while it plans, never a text
or a chunk. The actors write their shards into the index folder when the driver's folder
is theirs (one host), or, for an ``s3://`` index, in temporary folders of their own,
uploading each shard they commit; ``units.sqlite`` is written by the driver only.
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
from ...index.lock import RunLock
from ...index.shard_store import ShardStore, set_aside_while
from ...index.store import Manifest
from ...report import REPORT_NAME, SkipReport
from ...runner import run_batches
from ...index.faiss_factory import parse_factory
from ...outfiles import new_run_id
from ...sources.remote import is_remote
from ...sources.text import lone_surrogate
from ...stages.device import precision
from ...stages.prefetch import thread_ahead
from .encode import (chunk_batches, commit_marks, embed_steps, needs_training, shard_sinks, train_if_needed,
                     vector_slots)
from .plan import (apply_plan, check_search_params, fingerprint, plan_units, reading, refuse_unfit_chunks_of,
                   settled_chunking, settled_embeddings, settled_factory, settled_fields, settled_settings,
                   stored_manifest)

log = logging.getLogger("embedingest")

INDEXED, SKIPPED = "indexed", "skipped"
RESULT_SCHEMA = pa.schema([
    ("record_id", pa.string()), ("status", pa.string()), ("unit_no", pa.int64()),
    ("n_chunks", pa.int64()), ("skip_where", pa.string()), ("skip_reason", pa.string()),
])
"""What :class:`EmbedBatches` returns: one row per record it embedded (``status``
"indexed", into ``n_chunks`` chunks under ``unit_no``) and one per input it skipped
("skipped", ``unit_no`` -1): what the chunker skipped, or a record whose text is not the
one planned."""

DESCRIBE_SCHEMA = pa.schema([
    ("digest", pa.binary(16)), ("record_id", pa.string()), ("size", pa.int64()),
    ("sha256", pa.string()), ("problem", pa.string()),
])
"""The first pass's rows (:func:`describe_records`), one per record: its id's digest, the
id, its text's size and sha256, and why it cannot be indexed ("" when it can)."""


def _digest(record_id: str) -> bytes:
    return hashlib.blake2b(record_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _key(record_id: str) -> str:
    return f"record:{record_id}"


@dataclass(frozen=True)
class _Hashed:
    """A batch's records as both passes see them: ids as text, the texts' bytes (None
    when not a string), their sha256 and the ids' digests."""

    ids: list
    texts: list
    data: list
    shas: list
    digests: list

    @classmethod
    def of(cls, batch: dict, id_field: str, text_field: str) -> _Hashed:
        ids = [str(i) for i in batch[id_field]]
        texts = list(batch[text_field])
        data = [t.encode("utf-8", "surrogatepass") if isinstance(t, str) else None for t in texts]
        shas = [hashlib.sha256(d).digest() if d is not None else b"" for d in data]
        return cls(ids, texts, data, shas, [_digest(i) for i in ids])


def describe_records(batch: dict, id_field: str, text_field: str) -> pa.Table:
    """The first pass (a Ray task per batch): one :data:`DESCRIBE_SCHEMA` row per record,
    judged as ``build_index`` judges in-memory records."""
    h = _Hashed.of(batch, id_field, text_field)
    problems = []
    for rid, text in zip(h.ids, h.texts):
        if not isinstance(text, str):
            problems.append(f"field: {text_field!r} is not a string")
        else:
            wrong = lone_surrogate(text) or lone_surrogate(rid)
            problems.append(f"unicode: the text or id holds {wrong}" if wrong else "")
    return pa.Table.from_pydict(
        {"digest": h.digests, "record_id": h.ids,
         "size": [len(d) if d is not None else 0 for d in h.data],
         "sha256": [sha.hex() for sha in h.shas], "problem": problems}, schema=DESCRIBE_SCHEMA)


@dataclass(frozen=True)
class Assigned:
    """The records this run embeds, as three arrays sorted by id digest (16 bytes of
    blake2b of the id; 16 bytes of the text's sha256; the unit number the plan gave it),
    put once into Ray's object store and shared by the actors of a node."""

    digests: np.ndarray
    hashes: np.ndarray
    unit_nos: np.ndarray

    @classmethod
    def build(cls, rows: Iterable[tuple[str, str, int]]) -> Assigned:
        """From (record id, sha256 in hex, unit number) triples."""
        rows = list(rows)
        digests = np.array([_digest(r) for r, _, _ in rows], dtype="S16")
        hashes = np.array([bytes.fromhex(h)[:16] for _, h, _ in rows], dtype="S16")
        unit_nos = np.array([u for _, _, u in rows], dtype=np.int64)
        order = np.argsort(digests, kind="stable")
        return cls(digests[order], hashes[order], unit_nos[order])

    def lookup(self, digests: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """The unit number of each record to embed; -1 for a record not to embed, -2 for
        one whose id is to be embedded but whose text is not the one planned."""
        if not len(self.digests) or not len(digests):
            return np.full(len(digests), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.digests, digests), len(self.digests) - 1)
        found = self.digests[pos] == digests
        same = found & (self.hashes[pos] == hashes)
        return np.where(same, self.unit_nos[pos], np.where(found, -2, -1))


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    """One tokenizer per actor process, not one per call."""
    from ...stages.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


class EmbedBatches:
    """The Ray Data callable class: embeds the records of each batch that the plan
    assigned a unit number into shards.

    Use it through ``map_batches(EmbedBatches, fn_constructor_kwargs=plan.actor_kwargs(),
    batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=N), num_gpus=1)``;
    the batch needs the configured id and text columns. Records the plan did not assign
    (unchanged, bad, duplicated) pass without work.
    """

    def __init__(self, out: str, config: dict, assigned, dtype: str, chunk_tokens: int,
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
        self.assigned: Assigned = ray.get(assigned) if isinstance(assigned, ray.ObjectRef) else assigned
        self.device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        self.encoder = TextEncoder.load(self.cfg.model, device=self.device, dtype=dtype,
                                       cuda_graphs=self.cfg.cuda_graphs)
        self.run_id = f"{new_run_id()}_ray{os.getpid()}"
        self.calls = 0

    def __call__(self, batch: dict) -> pa.Table:
        from ...sources.text_dataset import Unit

        h = _Hashed.of(batch, self.cfg.id_field, self.cfg.text_field)
        # bytes: numpy's S16 drops trailing zero bytes, alike on both sides
        nos = self.assigned.lookup(np.array(h.digests, dtype="S16"),
                                   np.array([sha[:16] for sha in h.shas], dtype="S16"))
        rows = {name: [] for name in RESULT_SCHEMA.names}

        def row(rid, status, unit_no=-1, n_chunks=0, where="", reason=""):
            for name, value in zip(RESULT_SCHEMA.names, (rid, status, unit_no, n_chunks, where, reason)):
                rows[name].append(value)

        for n in np.flatnonzero(nos == -2):
            rid = h.ids[n]
            row(rid, SKIPPED, where=f"record {rid}",
                reason="changed: its text is not the one the run's plan read (the dataset changed "
                       "during the run); run again to index it")
        todo = np.flatnonzero(nos >= 0)
        if len(todo):
            units = [Unit(int(nos[n]), _key(h.ids[n]), text=h.texts[n], record_id=h.ids[n])
                     for n in todo]
            done, skipped = self._embed(units)
            for unit in units:
                row(unit.record_id, INDEXED, unit_no=unit.unit_no, n_chunks=done.get(unit.unit_no, 0))
            for where, reason in skipped:
                row("", SKIPPED, where=where, reason=reason)
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
        marks: list[tuple[int, int, str | None]] = []

        def keep(item) -> None:
            """Only what finished goes back to the driver: the rows are in the shards."""
            done.update((int(u), int(n)) for u, n in item["units_done"])

        run_batches(sinks, thread_ahead(iter(batches)), embed_steps(enc, self.device, keep, marks),
                    device=self.device, slot_spec=vector_slots(cfg, enc.dim),
                    num_consumers=cfg.num_consumers, num_slots=cfg.num_slots or None,
                    on_skip=lambda where, reason: skipped.append((where, reason)))
        commit_marks(sinks, marks)
        if self.remote:  # uploaded: the local copies go
            for path in Path(self.out, "shards").iterdir():
                path.unlink()
        return done, skipped


@dataclass
class RayIndexPlan:
    """What the driver decided (see :func:`plan_ray_index`); :meth:`finish` completes it."""

    out: Path
    config: IndexConfig
    dtype: str
    chunk_tokens: int
    trained: str | None
    assigned: object  # ObjectRef of the Assigned records
    model_name: str
    counts: dict
    report: SkipReport
    store: ShardStore
    started: float
    settings: dict = dataclasses.field(default_factory=dict)  # manifest fields: prompts, chunking, search defaults
    writers: str | None = None  # the s3:// URL the actors upload their shards to
    # (unit numbers, chunk counts) of each results table: 16 bytes a record, so the counts
    # can leave out what the reconciliation removes
    embedded: list = dataclasses.field(default_factory=list)

    def actor_kwargs(self) -> dict:
        """``fn_constructor_kwargs`` for :class:`EmbedBatches`."""
        return {"out": self.writers or str(self.out), "config": dataclasses.asdict(self.config),
                "assigned": self.assigned, "dtype": self.dtype,
                "chunk_tokens": self.chunk_tokens, "trained": self.trained,
                "generation": self.store.generation}

    def finish(self, results: ray.data.Dataset, progress: bool = False,
               pull: Callable[[], None] | None = None) -> dict:
        """Consume ``results`` (the output of ``map_batches(EmbedBatches, ...)``): count,
        report skipped inputs; once all arrived, remove the units the shards do not hold
        complete (a retried actor call's leftovers); write the manifest and the skip
        report; return a summary like ``build_index``'s. When ``results`` fails, what
        arrived is kept and the error raised: the next run finishes the work (the unit
        rows were written by the plan). ``pull()``, called once every row arrived, brings
        the shards the actors uploaded into ``out``."""
        from tqdm import tqdm

        store, counts, report = self.store, self.counts, self.report
        bar = tqdm(unit="record", disable=not progress, dynamic_ncols=True)
        try:
            for table in results.iter_batches(batch_format="pyarrow", batch_size=None):
                bar.update(self._take(table))
            if pull is not None:
                pull()
            bad = store.reconcile()
            counts["vectors_removed"] += store.remove_units(bad) if bad else 0
            counts["units_incomplete"] = len(bad)
            if bad:
                self._incomplete(bad)
        finally:
            bar.close()
            manifest = store.update_shards(corpus=fingerprint(store), **self.settings)
            report.write(self.out)
            store.close()
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

    def _take(self, table: pa.Table) -> int:
        """One table of :class:`EmbedBatches`: skipped inputs to the report, embedded
        records counted; return how many records it holds."""
        counts, report = self.counts, self.report
        status = table.column("status").to_pylist()
        for n in (i for i, s in enumerate(status) if s == SKIPPED):
            report.add(table.column("skip_where")[n].as_py(), table.column("skip_reason")[n].as_py(),
                       stage="read")
        new = table.filter(pc.equal(table.column("status"), INDEXED))
        n_chunks = new.column("n_chunks").to_numpy()
        self.embedded.append((new.column("unit_no").to_numpy(), n_chunks))
        counts["units_indexed"] += new.num_rows
        counts["chunks"] += int(n_chunks.sum())
        counts["docs"] += int((n_chunks > 0).sum())
        return new.num_rows

    def _incomplete(self, bad: set[int]) -> None:
        """Units whose committed rows were not their chunks once each (an actor killed
        mid-call, its call retried by Ray: the first try's shards hold part of them again),
        now removed: each is reported (the run's status says so) and left out of the
        counts; the next run indexes them."""
        counts = self.counts
        if self.embedded:
            units = np.concatenate([u for u, _ in self.embedded])
            chunks = np.concatenate([c for _, c in self.embedded])
            hit = np.isin(units, np.fromiter(bad, np.int64, len(bad)))
            counts["units_indexed"] -= int(hit.sum())
            counts["chunks"] -= int(chunks[hit].sum())
            counts["docs"] -= int((chunks[hit] > 0).sum())
        names = {u.unit_no: u.key for u in self.store.units().values() if u.unit_no in bad}
        for unit_no in sorted(bad):
            key = names.get(unit_no)
            rid = key[len("record:"):] if key and key.startswith("record:") else None
            where = f"record {rid}" if rid is not None else f"unit {unit_no}"
            self.report.add(where, "incomplete: its chunks were committed more than once (an actor "
                            "was stopped and Ray ran its call again), so its vectors were removed; "
                            "run again to index it", stage="write")


def _described(dataset: ray.data.Dataset, cfg: IndexConfig) -> pa.Table:
    """The first pass: :func:`describe_records` over ``dataset`` in its order, by Ray
    tasks; the driver gets the small rows only."""
    described = dataset.select_columns([cfg.id_field, cfg.text_field]).map_batches(
        describe_records, fn_kwargs={"id_field": cfg.id_field, "text_field": cfg.text_field},
        batch_format="numpy", batch_size=None)
    options = described.context.execution_options  # shared with ``dataset``: put back after
    kept, options.preserve_order = options.preserve_order, True
    try:
        tables = list(described.iter_batches(batch_format="pyarrow", batch_size=None))
    finally:
        options.preserve_order = kept
    return pa.concat_tables(tables) if tables else DESCRIBE_SCHEMA.empty_table()


def _candidates(described: pa.Table, report: SkipReport, store: ShardStore) -> tuple[list, set, int]:
    """The records to plan, as ``record_candidates`` makes them: bad ones reported, and
    each occurrence of an id the dataset gives twice (none is indexed); also the unit
    numbers those ids had and how many ids were duplicated."""
    digests = np.array(described.column("digest").to_pylist(), dtype="S16")
    _, inverse, times = np.unique(digests, return_inverse=True, return_counts=True)
    times = times[inverse] if len(digests) else np.empty(0, np.int64)
    ids = described.column("record_id").to_pylist()
    problems = described.column("problem").to_pylist()
    sizes, shas = described.column("size").to_pylist(), described.column("sha256").to_pylist()
    out, duplicated = [], set()
    for n, rid in enumerate(ids):
        if problems[n] and times[n] == 1:
            report.add(f"record {rid}", problems[n], stage="read")
        elif times[n] > 1:
            duplicated.add(rid)
            report.add(f"record {rid}", f"duplicate: the record id {rid!r} occurs {times[n]} times "
                       "in the dataset; ids must be unique, so none of them is indexed", stage="plan")
        else:
            out.append({"key": _key(rid), "size": sizes[n], "mtime_ns": None, "sha256": shas[n],
                        "record_id": rid})
    had = {u.unit_no for u in store.units([_key(r) for r in duplicated]).values()}
    return out, had, len(duplicated)


def plan_ray_index(dataset: ray.data.Dataset, out: str | os.PathLike,
                   config: IndexConfig | None = None, *, num_gpus: float = 0,
                   writers: str | None = None, **overrides) -> RayIndexPlan:
    """Create or open the index at ``out`` and plan the run over ``dataset`` (see the
    module docstring): a first pass of Ray tasks hashes the records, the driver plans as
    ``build_index`` does, numbers the records to embed and writes their unit rows; it
    reads the dataset's first ``train_size`` texts when a factory must be trained.
    ``num_gpus`` is what the actors will get: with GPUs the default precision is fp16,
    else fp32. ``device``, ``devices`` and ``num_workers`` do not apply here; Ray places
    the actors. ``writers``: the s3:// URL of an index whose working folder ``out`` is
    (:func:`build_index_ray` with an s3:// ``out``): the actors write in folders of their
    own and upload their shards there."""
    from ...stages.encoder import TextEncoder
    from ...stages.prompts import Prompts, refuse_filling_query_prompt

    cfg = dataclasses.replace(config or IndexConfig(), **overrides)
    cfg.validate()
    started = time.perf_counter()
    out = Path(out)
    stored = stored_manifest(out, cfg.overwrite)
    fields = settled_fields(stored, cfg, str(out))
    cfg = reading(cfg, fields)
    columns = set(dataset.schema().names)
    for field, option in ((cfg.id_field, "id_field"), (cfg.text_field, "text_field")):
        if field not in columns:
            raise ConfigError(f"the dataset has no column {field!r} ({option}); its columns are "
                              f"{', '.join(sorted(columns))}: set {option}, or add the column "
                              "(e.g. Dataset.add_column) since records are tracked by id")
    dtype = precision(cfg.dtype, bool(num_gpus))
    cfg = cfg.for_device(bool(num_gpus))
    encoder = TextEncoder.load(cfg.model, device="cpu", dtype="fp32")
    cfg = settled_factory(stored, cfg)
    refuse_unfit_chunks_of(encoder, stored, cfg, settled_chunking(stored, cfg, encoder.max_seq_length, str(out)))
    parse_factory(encoder.dim, cfg.index, cfg.metric)  # every option checked before the first write
    check_search_params(encoder.dim, cfg.index, cfg.metric, cfg.search_params)
    wanted = Prompts.read(encoder.model_dir).resolve(cfg.doc_prompt, cfg.query_prompt)
    refuse_filling_query_prompt(encoder.tokenizer, encoder.max_seq_length, wanted["query"])
    report = SkipReport()
    out.mkdir(parents=True, exist_ok=True)
    store = ShardStore(out)
    try:
        manifest = store.create_or_open(
            Manifest(model=encoder.info() | {"dtype": dtype}, dim=encoder.dim, metric=cfg.metric,
                     factory=cfg.index, dtype=dtype, prompts=wanted,
                     chunking=settled_chunking(None, cfg, encoder.max_seq_length, str(out)),
                     record_fields=fields),
            overwrite=cfg.overwrite)
        settings, cfg = settled_settings(manifest, cfg, encoder.max_seq_length, str(out))
        settings["record_fields"] = settled_fields(manifest, cfg, str(out))
        chunk_tokens = cfg.chunk_tokens
        store.clean_garbage()  # damaged shards go first: the rule below reads the shards that stay
        cfg = settled_embeddings(store, cfg, str(out))
        candidates, duplicated_units, duplicate_ids = _candidates(_described(dataset, cfg), report, store)
        plan = plan_units(store, candidates, report)
        log.info("%s: %d records to index, %d unchanged, %d deleted", out, len(plan.todo),
                 plan.unchanged, len(plan.deleted))
        removed, unit_nos = apply_plan(store, plan)
        assigned = Assigned.build((c["record_id"], c["sha256"], unit_nos[c["key"]]) for c in plan.todo)
        sample = _sample(dataset, cfg) if plan.todo and needs_training(store, cfg, encoder.dim) else []
        trained = train_if_needed(store, manifest, encoder, sample, cfg, chunk_tokens)
    except BaseException:
        store.close()
        raise
    counts = {"units_seen": plan.seen_keys, "units_indexed": 0, "units_unchanged": plan.unchanged,
              "units_removed": len(set(plan.deleted) - duplicated_units),
              "vectors_removed": removed, "docs": 0, "chunks": 0, "duplicate_ids": duplicate_ids,
              "units_incomplete": 0}
    return RayIndexPlan(out, cfg, dtype, chunk_tokens, trained, ray.put(assigned),
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


def actor_pool(concurrency: int | tuple) -> ray.data.ActorPoolStrategy:
    """Ray Data's actor pool for ``concurrency``: ``n`` actors, or ``(min, max)`` (or
    ``(min, max, initial)``) a pool that grows with the work. Passed as ``compute=``: Ray
    deprecates ``map_batches(concurrency=)`` and warns on every call that uses it."""
    if isinstance(concurrency, tuple):
        if len(concurrency) not in (2, 3):
            raise ConfigError(f"concurrency={concurrency!r}: give a number of actors, or (min, max) for a pool "
                              "that grows with the work")
        initial = {"initial_size": concurrency[2]} if len(concurrency) == 3 else {}  # Ray 2.4x on
        return ray.data.ActorPoolStrategy(min_size=concurrency[0], max_size=concurrency[1], **initial)
    return ray.data.ActorPoolStrategy(size=concurrency)


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
    def run(plan: RayIndexPlan, pull=None) -> dict:
        results = dataset.map_batches(
            EmbedBatches, fn_constructor_kwargs=plan.actor_kwargs(), batch_size=records_per_call,
            batch_format="numpy", compute=actor_pool(concurrency), num_gpus=num_gpus or None,
            num_cpus=num_cpus)
        return plan.finish(results, progress=progress, pull=pull)

    overwrite = overrides.get("overwrite", config.overwrite if config else False)
    if not is_remote(out):
        Path(out).mkdir(parents=True, exist_ok=True)
        with RunLock(out), set_aside_while(out, overwrite):  # as build_index
            return run(plan_ray_index(dataset, out, config, num_gpus=num_gpus, **overrides))
    from ...index.remote_store import RemoteBuild

    with RemoteBuild(str(out), overwrite=overwrite) as remote:
        plan = plan_ray_index(dataset, remote.folder, config, num_gpus=num_gpus,
                              writers=remote.url, **overrides)
        remote.checkpoint()  # trained.faiss, which the actors download, and units.sqlite
        summary = run(plan, pull=remote.pull_shards)
    summary.update(index=remote.url, report=f"{remote.url}/{REPORT_NAME}")
    return summary

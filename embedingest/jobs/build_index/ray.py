"""build-index over a Ray Dataset: records embedded by a pool of Ray actors, one GPU (or
CPU) each, into one index folder that the CLI, ``open_index`` and later runs share.

Import it as ``embedingest.jobs.build_index.ray`` (``build_index_ray`` also as
``from embedingest import build_index_ray``). Three steps, which :func:`build_index_ray`
runs in order (call them yourself to put
:class:`EmbedBatches` into a pipeline of your own):

1. :func:`plan_ray_index` (driver): one cheap pass over the dataset computes each
   record's content hash, in dataset order, so unit numbers, hence vector ids, are
   those of ``build_index`` on the same records; then exactly the CLI's plan: unchanged
   records are kept, changed, deleted and half-done ones removed, the rest marked
   pending. Records are units keyed ``record:<id>``, so ids must be unique.
2. ``dataset.map_batches(EmbedBatches, fn_constructor_kwargs=plan.actor_kwargs(), ...)``:
   each actor loads the encoder on its GPU (or the CPU when Ray gave it none), and for
   every batch of records chunks and tokenizes the pending ones (in a thread, ahead of
   the GPU), encodes them, and sends the vectors through an egress engine whose
   consumers commit shards (vectors and chunk rows together) under the actor's own run
   id. The engine is closed at the end of each call, so when a call returns its shards
   are committed; it returns one small row per record (its unit number and chunk
   count) and per skipped input: no chunk's row or text goes back to the driver.
3. :meth:`RayIndexPlan.finish` (driver): counts those rows, checks which units the
   committed shards hold complete, writes one manifest.

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
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import pyarrow as pa
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
from ...index.store import Manifest
from ...report import REPORT_NAME, SkipReport
from ...runner import run_batches
from ...scaleout.ray_data import in_order
from ...index.faiss_factory import parse_factory
from ...outfiles import new_run_id
from ...stages.device import precision
from ...stages.prefetch import thread_ahead
from ...sinks.shard_writer import commit_finished
from .encode import (chunk_batches, embed_steps, needs_training, shard_sinks, train_if_needed,
                     vector_slots)
from .plan import apply_plan, fingerprint, plan_units, search_defaults, settled_prompts

log = logging.getLogger("embedingest")

RESULT_SCHEMA = pa.schema([
    ("unit_no", pa.int64()), ("n_chunks", pa.int64()), ("skip_where", pa.string()),
    ("skip_reason", pa.string()),
])
"""What :class:`EmbedBatches` returns: one row per embedded record (its chunks, in chunk
order) and one row per skipped input (``unit_no`` -1)."""


@dataclass(frozen=True)
class TodoMap:
    """Record id -> unit number of the records to embed, as two sorted arrays (16-byte
    id digests and unit numbers) that Ray shares between the actors of a node."""

    digests: np.ndarray
    unit_nos: np.ndarray

    @classmethod
    def build(cls, mapping: Mapping[str, int]) -> TodoMap:
        digests = np.array([_digest(k) for k in mapping], dtype="S16")
        unit_nos = np.fromiter(mapping.values(), dtype=np.int64, count=len(mapping))
        order = np.argsort(digests)
        return cls(digests[order], unit_nos[order])

    def lookup(self, ids: list[str]) -> np.ndarray:
        """The unit number of each id, -1 for ids not to embed."""
        if not len(self.digests) or not ids:
            return np.full(len(ids), -1, dtype=np.int64)
        keys = np.array([_digest(i) for i in ids], dtype="S16")
        pos = np.minimum(np.searchsorted(self.digests, keys), len(self.digests) - 1)
        return np.where(self.digests[pos] == keys, self.unit_nos[pos], -1)


def _digest(record_id: str) -> bytes:
    return hashlib.blake2b(record_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _hash_records(batch: dict, id_field: str, text_field: str) -> dict:
    """Id, size and content hash of each record (the plan's input), as build_index makes them."""
    ids, sizes, hashes, bad = [], [], [], []
    for rid, text in zip(batch[id_field], batch[text_field]):
        ids.append(str(rid))
        if isinstance(text, str):
            data = text.encode("utf-8", "surrogatepass")
            sizes.append(len(data))
            hashes.append(hashlib.sha256(data).hexdigest())
            bad.append("")
        else:
            sizes.append(0)
            hashes.append("")
            bad.append(f"field: {text_field!r} is not a string")
    return {"id": np.array(ids, dtype=object), "size": np.array(sizes, dtype=np.int64),
            "sha256": np.array(hashes, dtype=object), "bad": np.array(bad, dtype=object)}


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    """One tokenizer per actor process, not one per call."""
    from ...stages.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


class EmbedBatches:
    """The Ray Data callable class: embeds the pending records of each batch into shards.

    Use it through ``map_batches(EmbedBatches, fn_constructor_kwargs=plan.actor_kwargs(),
    batch_format="numpy", concurrency=N, num_gpus=1)`` (or ``compute=ActorPoolStrategy``);
    the batch needs the configured id and text columns. Records that are not pending
    (unchanged since the last run) pass without work.
    """

    def __init__(self, out: str, config: dict, todo, dtype: str, chunk_tokens: int,
                 trained: str | None = None):
        import torch

        from ...stages.encoder import TextEncoder

        self.cfg = IndexConfig(**config)
        self.out, self.chunk_tokens, self.trained = out, chunk_tokens, trained
        self.todo: TodoMap = ray.get(todo) if isinstance(todo, ray.ObjectRef) else todo
        self.device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        self.encoder = TextEncoder.load(self.cfg.model, device=self.device, dtype=dtype,
                                       cuda_graphs=self.cfg.cuda_graphs)
        self.run_id = f"{new_run_id()}_ray{os.getpid()}"
        self.generation = ShardStore(out).generation
        self.calls = 0

    def __call__(self, batch: dict) -> pa.Table:
        from ...sources.text_dataset import Unit

        cfg = self.cfg
        ids = [str(i) for i in batch[cfg.id_field]]
        unit_nos = self.todo.lookup(ids)
        units = [Unit(int(no), f"record:{rid}", text=text, record_id=rid)
                 for rid, text, no in zip(ids, batch[cfg.text_field], unit_nos)
                 if no >= 0 and isinstance(text, str)]
        if not units:
            return RESULT_SCHEMA.empty_table()
        return self._embed(units)

    def _embed(self, units: list) -> pa.Table:
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
        return _result_table(units, done, skipped)


def _result_table(units, done, skipped) -> pa.Table:
    rows = [{"unit_no": unit.unit_no, "n_chunks": done.get(unit.unit_no, 0), "skip_where": "",
             "skip_reason": ""} for unit in units]
    rows += [{"unit_no": -1, "n_chunks": 0, "skip_where": where, "skip_reason": reason}
             for where, reason in skipped]
    return pa.Table.from_pylist(rows, schema=RESULT_SCHEMA)


@dataclass
class RayIndexPlan:
    """What the driver decided (see :func:`plan_ray_index`); :meth:`finish` completes it."""

    out: Path
    config: IndexConfig
    dtype: str
    chunk_tokens: int
    trained: str | None
    todo: object  # ObjectRef of the TodoMap
    pending: int  # records to embed
    model_name: str
    counts: dict
    report: SkipReport
    store: ShardStore
    started: float
    settings: dict = dataclasses.field(default_factory=dict)  # manifest fields: prompts, search defaults

    def actor_kwargs(self) -> dict:
        """``fn_constructor_kwargs`` for :class:`EmbedBatches`."""
        return {"out": str(self.out), "config": dataclasses.asdict(self.config), "todo": self.todo,
                "dtype": self.dtype, "chunk_tokens": self.chunk_tokens, "trained": self.trained}

    def finish(self, results: ray.data.Dataset | None, progress: bool = False) -> dict:
        """Consume ``results`` (the output of ``map_batches(EmbedBatches, ...)``; None
        when nothing was pending): count finished records and skipped inputs (the rows
        are in the shards the actors committed), check which units the shards hold
        complete (those that are not are redone by the next run), write the manifest and
        the skip report; return a summary like ``build_index``'s."""
        from tqdm import tqdm

        store, counts, report = self.store, self.counts, self.report
        bar = tqdm(total=self.pending, unit="record", disable=not progress, dynamic_ncols=True)
        try:
            for table in (results.iter_batches(batch_format="pyarrow", batch_size=None)
                          if results is not None else ()):
                for row in table.to_pylist():
                    _record_row(row, counts, report)
                    bar.update(row["unit_no"] >= 0)
            bad = store.reconcile()
            if bad:
                log.warning("%d records have vectors that do not match their rows (an actor "
                            "failed and was retried?); run again to redo them", len(bad))
            counts["units_incomplete"] = len(bad)
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


def _record_row(row: dict, counts: dict, report: SkipReport) -> None:
    if row["unit_no"] < 0:
        report.add(row["skip_where"], row["skip_reason"], stage="read")
        return
    counts["units_indexed"] += 1
    counts["chunks"] += row["n_chunks"]
    counts["docs"] += bool(row["n_chunks"])


def plan_ray_index(dataset: ray.data.Dataset, out: str | os.PathLike,
                   config: IndexConfig | None = None, *, num_gpus: float = 0,
                   **overrides) -> RayIndexPlan:
    """Create or open the index at ``out`` and plan the run over ``dataset`` (see the
    module docstring). ``num_gpus`` is what the actors will get: with GPUs the default
    precision is fp16, else fp32. ``device``, ``devices`` and ``num_workers`` do not
    apply here; Ray places the actors."""
    from ...sources.text_dataset import Unit
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
        with in_order(_hashed(dataset, cfg)) as hashed:
            plan = plan_units(store, _candidates(hashed, cfg, report), report)
        removed, unit_nos = apply_plan(store, plan)
        todo = {c["record_id"]: unit_nos[c["key"]] for c in plan.todo}
        trained = None
        if todo:
            sample = ([Unit(todo[rid], f"record:{rid}", text=text, record_id=rid)
                       for rid, text in _sample(dataset, cfg, todo)]
                      if needs_training(store, cfg, encoder.dim) else [])
            trained = train_if_needed(store, manifest, encoder, sample, cfg, chunk_tokens)
    except BaseException:
        store.close()
        raise
    counts = {"units_seen": plan.seen_keys, "units_indexed": 0, "units_unchanged": plan.unchanged,
              "units_removed": len(plan.deleted), "vectors_removed": removed, "docs": 0,
              "chunks": 0}
    return RayIndexPlan(out, cfg, dtype, chunk_tokens, trained, ray.put(TodoMap.build(todo)),
                        len(todo), encoder.info()["name"], counts, report, store, started, settings)


def _hashed(dataset: ray.data.Dataset, cfg: IndexConfig) -> ray.data.Dataset:
    return dataset.select_columns([cfg.id_field, cfg.text_field]).map_batches(
        _hash_records, fn_kwargs={"id_field": cfg.id_field, "text_field": cfg.text_field},
        batch_format="numpy")


def _candidates(hashed: ray.data.Dataset, cfg: IndexConfig, report: SkipReport) -> Iterator[dict]:
    """plan_units' candidates from the hash pass; duplicate ids are an error."""
    seen: set[str] = set()
    for batch in hashed.iter_batches(batch_format="numpy", batch_size=4096):
        for rid, size, sha, bad in zip(batch["id"], batch["size"], batch["sha256"], batch["bad"]):
            if bad:
                report.add(f"record {rid}", bad, stage="read")
                continue
            if rid in seen:
                raise ConfigError(f"record id {rid!r} occurs more than once in the dataset; ids "
                                  f"({cfg.id_field!r}) must be unique, since the index tracks "
                                  "records by id")
            seen.add(rid)
            yield {"key": f"record:{rid}", "size": int(size), "mtime_ns": None, "sha256": sha,
                   "record_id": rid}


def _sample(dataset: ray.data.Dataset, cfg: IndexConfig,
            todo: Mapping[str, int]) -> Iterator[tuple[str, str]]:
    """The first ``train_size`` pending records: the training sample's texts."""
    n = 0
    for batch in dataset.select_columns([cfg.id_field, cfg.text_field]).iter_batches(
            batch_format="numpy", batch_size=1024):
        for rid, text in zip(batch[cfg.id_field], batch[cfg.text_field]):
            rid = str(rid)
            if rid in todo and isinstance(text, str):
                yield rid, text
                n += 1
                if n >= cfg.train_size:
                    return


def build_index_ray(dataset: ray.data.Dataset, out: str | os.PathLike,
                    config: IndexConfig | None = None, *, concurrency: int | tuple = 1,
                    num_gpus: float = 0, num_cpus: float | None = None,
                    records_per_call: int = 8192, progress: bool = False, **overrides) -> dict:
    """Build or update the index at ``out`` from ``dataset`` (id and text columns) with
    ``concurrency`` :class:`EmbedBatches` actors of ``num_gpus`` GPUs each; return a
    summary dict like ``build_index``'s. Options are :class:`IndexConfig` fields.

    ``records_per_call`` records go to an actor per call; each call starts and closes
    the actor's engine (a fraction of a second), so keep it in the thousands. Leave a
    CPU free for reading the dataset (``concurrency x num_cpus`` below the cluster's
    CPUs when the actors use no GPU): Ray Data would otherwise wait forever for one.
    """
    plan = plan_ray_index(dataset, out, config, num_gpus=num_gpus, **overrides)
    results = None
    if plan.pending:
        results = dataset.map_batches(
            EmbedBatches, fn_constructor_kwargs=plan.actor_kwargs(), batch_size=records_per_call,
            batch_format="numpy", concurrency=concurrency, num_gpus=num_gpus or None,
            num_cpus=num_cpus)
    return plan.finish(results, progress=progress)

"""build-index's encode step on one device: batches of tokenized chunks from DataLoader
workers (each batch's chunk rows as Arrow bytes), the encoder's forward, the vectors and
the rows through the egress engine to the shard writers, which commit them together
(index format 2). Also the training of IVF/PQ/HNSW factories on a first sample, which
reads batches the same way.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

from ...config import IndexConfig
from ...engine.consumers import exit_with_parent, loader_context
from ...engine.egress import EgressEngine
from ...engine.worker_loader import WorkerLoader
from ...errors import ConfigError
from ...index.shard_store import ShardStore
from ...index.shards import BatchMeta
from ...index.store import Manifest
from ...report import SkipReport
from ...runner import BatchSteps, run_batches
from ...scaleout.devices import share_of_cpus
from ...index.faiss_factory import parse_factory
from ...outfiles import new_run_id
from ...sinks.shard_writer import ShardWriterFactory, commit_finished
from ...sources.remote import is_remote
from ...sources.text_dataset import JoinedParts, TextChunkDataset, Unit, plan_parts
from ...stages.encoder import ModelFacts, TextEncoder
from ...stages.prompts import chunk_prompt, with_prompt
from ...stages.tokenizer import load_tokenizer

log = logging.getLogger("embedingest")


def needs_training(store: ShardStore, cfg: IndexConfig, dim: int) -> bool:
    """Whether ``cfg.index`` must still be trained: an IVF/PQ/HNSW factory, no
    ``trained.faiss`` yet."""
    return not store.trained_path.is_file() and not parse_factory(dim, cfg.index, cfg.metric).is_trained


def chunk_batches(units: list[Unit], encoder: TextEncoder, cfg: IndexConfig, chunk_tokens: int,
                  tokenizer_loader=load_tokenizer, parts=None) -> IterableDataset:
    """Batches of tokenized chunks of ``units``, the document prompt's tokens in each
    chunk (an iterable dataset; :func:`make_loader` runs it in DataLoader workers, with
    ``parts``, the files its workers read in parts). The overlap is ``cfg``'s, as a run
    settled it, else the default; so are the record fields."""
    doc_prompt = encoder.prompts.for_role("document", cfg.doc_prompt)
    encoder.check_prompt(doc_prompt)
    overlap = cfg.chunking()[1]
    fields = cfg.record_fields()
    prompt = chunk_prompt(encoder.tokenizer, doc_prompt, chunk_tokens, overlap)
    ds = TextChunkDataset(units, encoder.model_dir, batch_size=cfg.batch_size,
                          max_tokens=prompt.max_tokens, overlap=overlap,
                          window=cfg.sort_window * cfg.batch_size, text_field=fields["text"],
                          id_field=fields["id"], tokenizer_loader=tokenizer_loader,
                          pad_multiple=16 if encoder.device.type == "cuda" else 1,
                          fast_chunker=cfg.fast_tokenizer, parts=parts)
    return with_prompt(ds, prompt)


def make_loader(units: list[Unit], encoder: TextEncoder, cfg: IndexConfig, workers: int,
                chunk_tokens: int, pin: bool) -> JoinedParts:
    """:func:`chunk_batches` from ``workers`` DataLoader worker processes, a large JSON
    lines or Parquet file read by several of them in parts (their items joined again)."""
    parts = plan_parts(units, workers) if cfg.split_files else {}
    if parts:
        keys = {u.unit_no: u.key for u in units}
        log.info("read in parts by the %d tokenizing workers: %s", workers,
                 ", ".join(f"{keys[u]} ({n})" for u, (n, _) in list(parts.items())[:5])
                 + (f" and {len(parts) - 5} more files" if len(parts) > 5 else ""))
    return JoinedParts(WorkerLoader(chunk_batches(units, encoder, cfg, chunk_tokens, parts=parts),
                                    batch_size=None, num_workers=workers, pin_memory=pin,
                                    prefetch_factor=4 if workers else None, persistent_workers=False,
                                    worker_init_fn=functools.partial(exit_with_parent, os.getpid()),
                                    multiprocessing_context=loader_context() if workers else None))


def shard_sinks(out: str | Path, dim: int, cfg: IndexConfig, run_id: str,
                trained: str | None, generation: int = 0) -> ShardWriterFactory:
    """The engine's sinks: shards under ``out``, written under ``run_id`` in index
    generation ``generation``."""
    return ShardWriterFactory(str(out), dim, cfg.index, cfg.metric, run_id=run_id,
                              commit_every=cfg.commit_every, trained=trained,
                              save_embeddings=cfg.save_embeddings, generation=generation,
                              remote=cfg.out if is_remote(cfg.out) else None)


def vector_slots(cfg: IndexConfig, dim: int) -> dict:
    """One host slot of the engine: a batch of vectors and their ids."""
    return {"emb": ((cfg.batch_size, dim), "float32"), "ids": ((cfg.batch_size,), "int64")}


def embed_steps(encoder: TextEncoder, device: str, done=None, marks: list | None = None) -> BatchSteps:
    """What the batch loop does with a batch of chunks: token ids and mask to the device,
    the encoder's vectors and their ids to the engine (one part per batch), with the
    batch's rows and finished units (and the hashes the loader made of them) as its
    :class:`~embedingest.index.shards.BatchMeta`. Units that finished in a batch without
    rows wait in ``marks`` ((unit_no, n_chunks, sha256 or None) triples) for the next
    batch with rows; the caller commits those left at the end (:func:`commit_marks`).

    Units of no chunks (a file skipped whole) always wait for the end: every run reads
    them again and first removes their marks, and a mark in a shard of vectors made that
    shard be rewritten whole, by every re-run of an unchanged corpus."""
    marks = marks if marks is not None else []

    def send(item):
        if not len(item["ids"]):
            return None
        return (item["input_ids"].to(device, non_blocking=True),
                item["attention_mask"].to(device, non_blocking=True))

    def forward(batch_no: int, item, on_device):
        marks.extend(finished(item))
        meta = BatchMeta(batch_no, item["chunks"].data, *split_marks([m for m in marks if m[1]]))
        marks[:] = [m for m in marks if not m[1]]
        return [(meta, {"emb": encoder.forward(*on_device), "ids": item["ids"]})]

    def handed_over(item) -> None:
        if not len(item["ids"]):
            marks.extend(finished(item))
        if done is not None:
            done(item)

    return BatchSteps(send, forward, skipped=lambda item: item["skipped"], done=handed_over)


def finished(item) -> list[tuple[int, int, str | None]]:
    """The units a loader item finishes, as (unit_no, n_chunks, sha256 or None): the hash
    where the loader made it."""
    hashes = {int(u): str(h) for u, h in item.get("unit_hashes", ())}
    return [(int(u), int(n), hashes.get(int(u))) for u, n in item["units_done"]]


def split_marks(marks: list[tuple[int, int, str | None]]) -> tuple[tuple, tuple]:
    """(unit_no, n_chunks) pairs and (unit_no, sha256) pairs of ``marks``, as a shard takes them."""
    return (tuple((u, n) for u, n, _ in marks), tuple((u, h) for u, _, h in marks if h is not None))


def commit_marks(sinks: ShardWriterFactory, marks: list[tuple[int, int, str | None]]) -> None:
    """Commit the finished units no batch carried (:func:`commit_finished`)."""
    units_done, unit_hashes = split_marks(marks)
    commit_finished(sinks, units_done, unit_hashes=unit_hashes)


def start_batches(units: list[Unit], encoder: TextEncoder | ModelFacts, cfg: IndexConfig, device: str,
                  chunk_tokens: int):
    """The encode step's batches of ``units``: an iterator over :func:`make_loader`, whose
    worker processes start now (forked: start them before anything starts threads here)
    and prepare the first batches while the caller goes on (loads the model)."""
    workers = loader_workers(cfg, units)
    return iter(make_loader(units, encoder, cfg, workers, chunk_tokens, pin=device.startswith("cuda")))


def loader_workers(cfg: IndexConfig, units: list[Unit]) -> int:
    """DataLoader workers for ``units``: none for in-memory records (they would be
    pickled to each worker), else the configured share of the cores, or fewer when
    there is less work: a file each, or a part each of a file read in parts."""
    if not units or units[0].path is None:
        return 0
    share = share_of_cpus(cfg.num_workers)
    extra = sum(n - 1 for n, _ in plan_parts(units, share).values()) if cfg.split_files else 0
    return min(share, len(units) + extra)


def train_if_needed(store: ShardStore, manifest: Manifest, encoder: TextEncoder, units: list[Unit],
                     cfg: IndexConfig, chunk_tokens: int) -> str | None:
    """Train IVF/PQ/HNSW factories once, on the first ``train_size`` chunks of this run."""
    if store.trained_path.is_file():
        return str(store.trained_path)
    if parse_factory(manifest.dim, manifest.factory, manifest.metric).is_trained:
        return None
    sample, n = [], 0
    loader = make_loader(units, encoder, cfg, loader_workers(cfg, units),
                      chunk_tokens, pin=False)
    for item in loader:
        if len(item["ids"]):
            sample.append(encoder.forward(item["input_ids"], item["attention_mask"]).float().cpu())
            n += len(item["ids"])
        if n >= cfg.train_size:
            break
    if n == 0:
        return None
    vectors = torch.cat(sample)[: cfg.train_size].numpy()
    try:
        store.train_index(manifest.factory, manifest.dim, manifest.metric, vectors, more=n >= cfg.train_size)
    except RuntimeError as exc:
        raise ConfigError(f"cannot train index {manifest.factory!r} on {len(vectors)} vectors: {exc}; "
                          "use a smaller factory (fewer IVF lists) or a larger corpus") from exc
    return str(store.trained_path)


def shard_engine(store: ShardStore, out: str | Path, dim: int, cfg: IndexConfig, device: str,
                 trained: str | None, run_id: str | None = None) -> EgressEngine:
    """The encode step's egress engine, not started: its slots hold a batch of ``dim``-wide
    vectors and ids, its consumers write shards under ``out`` (:func:`shard_sinks`)."""
    sinks = shard_sinks(out, dim, cfg, run_id or new_run_id(), trained, store.generation)
    return EgressEngine(sinks, num_consumers=cfg.num_consumers, num_slots=engine_slots(cfg, device),
                        device=device, slot_spec=vector_slots(cfg, dim))


def engine_slots(cfg: IndexConfig, device: str) -> int | None:
    """Host slots of the engine: as configured, else on a GPU 8 per consumer. A slot holds
    one batch's vectors (1.5 MB for 1024 x 384 floats), and a consumer's periodic write
    of a row group or a shard must not leave the GPU waiting for a free slot."""
    if cfg.num_slots:
        return cfg.num_slots
    return 8 * cfg.num_consumers if device.startswith("cuda") else None


def encode_units(units: list[Unit], encoder: TextEncoder, store: ShardStore, report: SkipReport,
                 cfg: IndexConfig, out: Path, device: str, chunk_tokens: int, trained: str | None,
                 counts: dict, progress: bool, run_id: str | None = None, on_item=None,
                 timing: dict | None = None, batches=None, engine: EgressEngine | None = None):
    """The encode step on one device: the batch loop (:func:`~embedingest.runner.run_batches`)
    over ``units``, each batch's rows going with its vectors to the shard writers;
    returns the engine's stats. ``timing`` (a dict) receives where this process's time
    went (the loop's keys). ``batches``: the loader's batches, already started
    (:func:`start_batches`); by default a loader is made here. ``engine``: the engine of
    :func:`shard_engine`, perhaps started already; by default one is made here."""
    from tqdm import tqdm

    loader = batches if batches is not None else start_batches(units, encoder, cfg, device, chunk_tokens)
    if engine is None:
        engine = shard_engine(store, out, encoder.dim, cfg, device, trained, run_id)
    sinks = engine.sink_factory
    marks: list[tuple[int, int, str | None]] = []
    timing = timing if timing is not None else {}
    docs = 0
    bar = tqdm(total=len(units), unit="unit", disable=not progress, dynamic_ncols=True)
    t0 = time.perf_counter()

    def done(item) -> None:
        nonlocal docs
        n = len(item["ids"])
        counts["chunks"] += n
        docs += item["chunks"].n_docs
        counts["units_done"] += len(item["units_done"])
        if on_item is not None:
            on_item(len(item["units_done"]), n)
        if progress:
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.update(len(item["units_done"]))
            bar.set_postfix(docs_s=f"{docs / dt:,.0f}", chunks_s=f"{counts['chunks'] / dt:,.0f}",
                            refresh=False)

    try:
        engine = run_batches(sinks, loader, embed_steps(encoder, device, done, marks), device=device,
                             slot_spec=vector_slots(cfg, encoder.dim), num_consumers=cfg.num_consumers,
                             num_slots=engine_slots(cfg, device),
                             on_skip=functools.partial(report.add, stage="read"), timing=timing,
                             engine=engine)
        commit_marks(sinks, marks)
    finally:
        counts["docs"] = docs
        bar.close()
    return engine.stats


class OneDevice:
    """Where build-index runs when it runs on one device: the encoder loaded here, the
    training and the encode step in this process. :class:`~.devices.SeveralDevices` is
    the same interface over one process per device.

    The model is described first (:meth:`describe`: its tokenizer and config, not its
    weights), so the run is planned, the tokenizing workers started and the engine's
    consumers too (:meth:`start_batches`) before the weights load."""

    def __init__(self, device: str, dtype: str):
        self.device = self.name = device
        self.dtype = dtype
        self._batches = None
        self._engine: EgressEngine | None = None
        self._engine_dim: int | None = None

    def describe(self, cfg: IndexConfig) -> ModelFacts:
        return ModelFacts.read(cfg.model, device=self.device, dtype=self.dtype)

    def load_encoder(self, cfg: IndexConfig, facts: ModelFacts | None = None) -> TextEncoder:
        if facts is None:
            facts = self.describe(cfg)
        return TextEncoder.from_facts(facts, cuda_graphs=cfg.cuda_graphs)

    def start_batches(self, units: list[Unit], facts: ModelFacts, cfg: IndexConfig,
                      chunk_tokens: int, store: ShardStore) -> bool:
        """Start the encode step's loader now (its workers fork before the model loads),
        then its engine (the consumers start while the model loads)."""
        self._batches = start_batches(units, facts, cfg, self.device, chunk_tokens)
        trained = str(store.trained_path) if store.trained_path.is_file() else None
        self._engine = shard_engine(store, store.folder, facts.dim, cfg, self.device, trained).start()
        self._engine_dim = facts.dim
        return True

    def train(self, store: ShardStore, manifest: Manifest, encoder: TextEncoder, units: list[Unit],
              cfg: IndexConfig, chunk_tokens: int) -> str | None:
        return train_if_needed(store, manifest, encoder, units, cfg, chunk_tokens)

    def encode(self, units: list[Unit], sizes: list[int], encoder: TextEncoder, store: ShardStore,
               report: SkipReport, cfg: IndexConfig, chunk_tokens: int, trained: str | None,
               counts: dict, progress: bool, timing: dict):
        batches, self._batches = self._batches, None  # the loop holds the only reference
        engine, self._engine = self._engine, None
        if engine is not None and self._engine_dim != encoder.dim:  # the facts' width was wrong
            engine.stop()
            engine = None
        return encode_units(units, encoder, store, report, cfg, store.folder, self.device,
                            chunk_tokens, trained, counts, progress, timing=timing, batches=batches,
                            engine=engine)

    def engines(self, stats) -> list:
        """(device, engine stats) pairs, for the trace."""
        return [(self.device, stats)]

    def close(self) -> None:
        """Shut down the workers of a loader and the engine started but not used (the run
        failed first)."""
        batches, self._batches = self._batches, None
        engine, self._engine = self._engine, None
        try:
            if batches is not None:
                batches.close()
        finally:
            if engine is not None:
                engine.stop()

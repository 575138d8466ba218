"""build-index's encode step on one device: batches of tokenized chunks from DataLoader
workers, the encoder's forward, the vectors through the egress engine to FAISS shard
writers, the chunk rows to the metadata store. Also the training of IVF/PQ/HNSW
factories on a first sample, which reads batches the same way.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from ...config import IndexConfig
from ...engine import EgressEngine
from ...engine.consumers import exit_with_parent, loader_context
from ...errors import ConfigError
from ...index.store import IndexStore, Manifest
from ...index.writer import MetadataWriter
from ...report import SkipReport
from ...scaleout.devices import share_of_cpus
from ...sinks.faiss_shards import FaissShardSinkFactory, new_run_id, parse_factory
from ...sources.text_dataset import TextChunkDataset, Unit
from ...stages.encoder import TextEncoder
from ...stages.prefetch import prefetch
from ...stages.prompts import chunk_prompt, with_prompt
from ...stages.tokenizer import load_tokenizer


def needs_training(store: IndexStore, cfg: IndexConfig, dim: int) -> bool:
    """Whether ``cfg.index`` must still be trained: an IVF/PQ/HNSW factory, no
    ``trained.faiss`` yet."""
    return not store.trained_path.is_file() and not parse_factory(dim, cfg.index, cfg.metric).is_trained


def make_loader(units: list[Unit], encoder: TextEncoder, cfg: IndexConfig, workers: int,
            chunk_tokens: int, pin: bool) -> DataLoader:
    """Batches of tokenized chunks, the document prompt's tokens in each chunk."""
    doc_prompt = encoder.prompts.for_role("document", cfg.doc_prompt)
    encoder.check_prompt(doc_prompt)
    prompt = chunk_prompt(encoder.tokenizer, doc_prompt, chunk_tokens, cfg.overlap)
    ds = TextChunkDataset(units, encoder.model_dir, batch_size=cfg.batch_size,
                          max_tokens=prompt.max_tokens, overlap=cfg.overlap,
                          window=cfg.sort_window * cfg.batch_size, text_field=cfg.text_field,
                          id_field=cfg.id_field, tokenizer_loader=load_tokenizer,
                          pad_multiple=16 if encoder.device.type == "cuda" else 1)
    return DataLoader(with_prompt(ds, prompt), batch_size=None, num_workers=workers, pin_memory=pin,
                      prefetch_factor=4 if workers else None, persistent_workers=False,
                      worker_init_fn=functools.partial(exit_with_parent, os.getpid()),
                      multiprocessing_context=loader_context() if workers else None)


def loader_workers(cfg: IndexConfig, n_units: int, in_memory: bool) -> int:
    """DataLoader workers for ``n_units`` units: none for in-memory records (they would
    be pickled to each worker), else the configured share of the cores."""
    if in_memory or n_units == 0:
        return 0
    return min(share_of_cpus(cfg.num_workers), n_units)


def train_if_needed(store: IndexStore, manifest: Manifest, encoder: TextEncoder, units: list[Unit],
                     cfg: IndexConfig, chunk_tokens: int) -> str | None:
    """Train IVF/PQ/HNSW factories once, on the first ``train_size`` chunks of this run."""
    if store.trained_path.is_file():
        return str(store.trained_path)
    if parse_factory(manifest.dim, manifest.factory, manifest.metric).is_trained:
        return None
    sample, n = [], 0
    loader = make_loader(units, encoder, cfg, loader_workers(cfg, len(units), units and units[0].path is None),
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
        store.train_index(manifest.factory, manifest.dim, manifest.metric, vectors)
    except RuntimeError as exc:
        raise ConfigError(f"cannot train index {manifest.factory!r} on {len(vectors)} vectors: {exc}; "
                          "use a smaller factory (fewer IVF lists) or a larger corpus") from exc
    return str(store.trained_path)


def encode_units(units: list[Unit], encoder: TextEncoder, store: IndexStore, report: SkipReport,
                cfg: IndexConfig, out: Path, device: str, chunk_tokens: int, trained: str | None,
                counts: dict, progress: bool, run_id: str | None = None, on_item=None,
                timing: dict | None = None):
    """The encode step on one device; ``timing`` (a dict) receives where the main
    process's time went (see ``main_loop`` in the summary)."""
    from tqdm import tqdm

    cuda = device.startswith("cuda")
    workers = loader_workers(cfg, len(units), units[0].path is None)
    loader = make_loader(units, encoder, cfg, workers, chunk_tokens, pin=cuda)
    sinks = FaissShardSinkFactory(str(out), encoder.dim, cfg.index, cfg.metric,
                                  run_id=run_id or new_run_id(), commit_every=cfg.commit_every,
                                  trained=trained)
    spec = {"emb": ((cfg.batch_size, encoder.dim), "float32"), "ids": ((cfg.batch_size,), "int64")}
    meta = MetadataWriter(store)
    docs, finished = 0, False
    # Where the main process's time goes: starting the workers and consumers until the
    # first batch, waiting for tokenized batches (the workers are the bound), launching
    # the forward and handing over the copy, metadata rows, and closing (the consumers'
    # last commits).
    timing = timing if timing is not None else {}
    timing.update(start_s=0.0, first_batch_s=0.0, input_wait_s=0.0, encode_submit_s=0.0, metadata_s=0.0,
                  close_s=0.0)
    bar = tqdm(total=len(units), unit="unit", disable=not progress, dynamic_ncols=True)
    t0 = time.perf_counter()
    engine = EgressEngine(sinks, num_consumers=cfg.num_consumers, num_slots=cfg.num_slots or None,
                          device=device, slot_spec=spec)
    try:
        with engine, torch.inference_mode(), contextlib.ExitStack() as stack:
            def send(item):
                if not len(item["ids"]):
                    return None
                return (item["input_ids"].to(device, non_blocking=True),
                        item["attention_mask"].to(device, non_blocking=True))

            # closed on the way out, whatever stops the loop: the loader's workers are
            # shut down here, not whenever the generator is collected
            batches = stack.enter_context(
                contextlib.closing(prefetch(loader, send, device, engine.span)))
            timing["start_s"] = time.perf_counter() - t0  # the engine's consumers started
            for batch_no in itertools.count():
                t_wait = time.perf_counter()
                item, moved = next(batches, (None, None))
                t_encode = time.perf_counter()
                timing["first_batch_s" if batch_no == 0 else "input_wait_s"] += t_encode - t_wait
                if item is None:
                    t_close = t_encode
                    break
                for where, reason in item["skipped"]:
                    report.add(where, reason, stage="read")
                if moved is not None:
                    engine.mark_compute_start()
                    emb = encoder.forward(*moved)
                    engine.submit(batch_no, {"emb": emb, "ids": item["ids"]})
                t_meta = time.perf_counter()
                timing["encode_submit_s"] += t_meta - t_encode
                meta.add(item)
                timing["metadata_s"] += time.perf_counter() - t_meta
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
        finished = True
    finally:
        counts["docs"] = docs
        bar.close()
        meta.close(raise_errors=finished)
        timing.update(metadata_blocked_s=round(meta.blocked_s, 3), metadata_write_s=round(meta.write_s, 3))
        if finished:
            timing["close_s"] = time.perf_counter() - t_close
    return engine.stats



class OneDevice:
    """Where build-index runs when it runs on one device: the encoder loaded here, the
    training and the encode step in this process. :class:`~.devices.SeveralDevices` is
    the same interface over one process per device."""

    def __init__(self, device: str, dtype: str):
        self.device = self.name = device
        self.dtype = dtype

    def load_encoder(self, cfg: IndexConfig) -> TextEncoder:
        return TextEncoder.load(cfg.model, device=self.device, dtype=self.dtype,
                                cuda_graphs=cfg.cuda_graphs)

    def train(self, store: IndexStore, manifest: Manifest, encoder: TextEncoder, units: list[Unit],
              cfg: IndexConfig, chunk_tokens: int) -> str | None:
        return train_if_needed(store, manifest, encoder, units, cfg, chunk_tokens)

    def encode(self, units: list[Unit], sizes: list[int], encoder: TextEncoder, store: IndexStore,
               report: SkipReport, cfg: IndexConfig, chunk_tokens: int, trained: str | None,
               counts: dict, progress: bool, timing: dict):
        return encode_units(units, encoder, store, report, cfg, store.folder, self.device,
                            chunk_tokens, trained, counts, progress, timing=timing)

    def engines(self, stats) -> list:
        """(device, engine stats) pairs, for the trace."""
        return [(self.device, stats)]

    def close(self) -> None:
        """Nothing runs elsewhere."""

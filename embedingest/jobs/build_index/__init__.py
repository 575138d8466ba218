"""build-index: a text corpus to FAISS index shards, incrementally and crash-safely.

source (files or records) -> DataLoader workers (read, chunk, tokenize, length-sorted
batches, each batch's chunk rows as Arrow bytes) -> encoder on the device -> egress
engine -> consumer processes, each committing its own shards: vectors, chunk rows and
(with --save-embeddings) float16 embeddings (index format 2, docs/INDEX_FORMAT.md). The
main process passes each batch's rows on as one bytes object; it keeps only the units
(one row per file or record) and is the only one that decides what a run must do: it
compares the corpus with what the index holds (sizes, mtimes, content hashes; the units the committed
shards hold complete), removes the rows and vectors of changed, deleted or half-done
units, and indexes only those and the new ones. So a run that was killed at
any point is finished by running the same command again, with every chunk exactly once.

Start-up: the model is described first (its tokenizer and config, not its weights), so
the run is planned and, on one device, the tokenizing workers forked and at work before
the weights load and CUDA starts; an unchanged corpus loads no weights at all.

The package: :mod:`.plan` (what a run does), :mod:`.encode` (the encode step on one
device), :mod:`.devices` (on several devices of one host), :mod:`.ray` (over a Ray
Dataset); this module runs the steps in order and writes the summary.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

from ...config import IndexConfig
from ...engine.egress import refuse_while_bootstrapping
from ...errors import ConfigError
from ...exit_codes import exit_code
from ...index.lock import RunLock
from ...index.shard_store import ShardStore, set_aside_while
from ...index.store import Manifest
from ...report import REPORT_NAME, SkipReport
from ...scaleout.devices import devices_of
from ...index.faiss_factory import parse_factory
from ...index.formats import index_format
from ...sources.files import input_folder, refuse_output_as_input, refuse_report_in_out
from ...sources.remote import check_remote, is_remote, local_path
from ...sources.text_dataset import Unit
from ...stages.device import precision, resolve_device
from ...stages.encoder import ModelFacts
from ...stages.prompts import Prompts, refuse_filling_query_prompt
from ...stages.tokenizer import load_tokenizer
from .devices import SeveralDevices
from .encode import OneDevice, needs_training
from .plan import (apply_plan, check_search_params, corpus_path, default_out, file_candidates, fingerprint,
                   plan_units, reading, record_candidates, refuse_another_corpus, refuse_corpus_in_index,
                   refuse_unfit_chunks_of, settled_chunking, settled_embeddings, settled_factory, settled_fields,
                   settled_settings, stored_manifest, unit_key)

__all__ = ["build_index", "default_out", "plan_units", "record_candidates", "settled_fields", "unit_key"]

log = logging.getLogger("embedingest")


def build_index(corpus, config: IndexConfig | None = None, *, progress: bool = False,
                timeline: str | os.PathLike | None = None, trace: str | os.PathLike | None = None,
                **overrides) -> dict:
    """Build or update the index of ``corpus`` and return a summary dict.

    ``corpus`` is a file or folder path, an fsspec URL (``s3://bucket/prefix``: see
    :mod:`~embedingest.sources.remote`), or an iterable of ``(id, text)`` pairs, dicts
    with the configured text and id fields, or texts alone (numbered by position). Options are the fields of
    :class:`IndexConfig`, given as ``config`` and/or keyword ``overrides``; ``timeline``
    names a PNG to draw the last batches' engine timeline into, ``trace`` a JSON file for
    the run's phases and every batch's engine records in the Chrome trace format.
    """
    refuse_while_bootstrapping("build_index()")
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(IndexConfig)})
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} for build_index; known settings are "
                          f"the fields of IndexConfig: {', '.join(f.name for f in dataclasses.fields(IndexConfig))}")
    cfg = dataclasses.replace(config or IndexConfig(), **overrides)
    cfg.validate()
    t_start = time.perf_counter()
    devices = devices_of(cfg)
    several = len(devices) > 1  # the one place that asks: the rest goes through ``where``
    # Several devices were checked by devices_of, without touching CUDA here: their
    # processes can then be forked.
    device = devices[0] if several else str(resolve_device(devices[0] if devices else cfg.device))
    dtype = precision(cfg.dtype, device.startswith("cuda"))
    cfg = cfg.for_device(device.startswith("cuda"))
    report = SkipReport()
    corpus = local_path(corpus)  # file://...: a local path, with the local checks
    if not isinstance(corpus, (str, os.PathLike)):  # checked whole before anything starts
        local = cfg.out and not is_remote(cfg.out)
        fields = settled_fields(stored_manifest(Path(cfg.out), cfg.overwrite) if local else None, cfg,
                                str(cfg.out))
        cfg = reading(cfg, fields)  # the fields they are read with now: an index's other ones are refused
        corpus = record_candidates(corpus, cfg, report)
    # Several devices' processes start up (imports, model) while this process plans.
    where = SeveralDevices(devices, cfg, dtype) if several else OneDevice(device, dtype)
    try:
        return _load_and_build(corpus, cfg, where, dtype, report, progress, timeline, t_start, trace)
    finally:
        where.close()


def _load_and_build(corpus, cfg: IndexConfig, where: OneDevice | SeveralDevices, dtype: str,
                    report: SkipReport, progress: bool, timeline, t_start: float, trace=None) -> dict:
    """Describe the model (its tokenizer and config; on several devices, their loaded
    encoder), then build under the folder's run lock."""
    in_memory = not isinstance(corpus, (str, os.PathLike))
    remote = not in_memory and is_remote(corpus)
    if remote:
        check_remote(corpus)  # a missing bucket or credential stops the run before any write
    elif not in_memory and not Path(corpus).exists():
        raise ConfigError(f"corpus {str(corpus)!r} does not exist; pass a folder or a file")
    out_url = cfg.out if cfg.out and is_remote(cfg.out) else None
    if out_url:
        from ...index.remote_store import Remote

        Remote(out_url).check()  # a missing bucket or credential stops the run before any write
    if in_memory and not cfg.out:
        raise ConfigError("records given in memory need out=, a folder of their own: without it every "
                          "such call would share one default folder, and each would remove the "
                          "records of the one before")
    out = Path(cfg.out) if cfg.out and not out_url else default_out(corpus)
    if not in_memory and not remote and not out_url:
        refuse_output_as_input(out, corpus, "corpus folder", "the index files")
        refuse_corpus_in_index(corpus, out)
    if not out_url:
        refuse_report_in_out(out, {"--timeline": timeline, "--trace": trace})
    phases = {}  # seconds of each step, in their order, for the summary: where a run's time goes
    model = where.describe(cfg)
    if model.dim is None:  # the config does not say the width: the weights do
        model = where.load_encoder(cfg, model)
        phases["load_model_s"] = time.perf_counter() - t_start
    # every option checked before the first write (a remote index's settings, under its lease)
    stored = None if out_url else stored_manifest(out, cfg.overwrite)
    kind = settled_factory(stored, cfg)
    if not out_url:
        settled_fields(stored, cfg, str(out))
        refuse_unfit_chunks_of(model, stored, cfg, settled_chunking(stored, cfg, model.max_seq_length, str(out)))
    parse_factory(model.dim, kind.index, kind.metric)
    if cfg.index is not None or not out_url:
        check_search_params(model.dim, kind.index, kind.metric, cfg.search_params)
    built = [model]  # the encoder, once loaded: released however the run ends
    build = (corpus, cfg, model, built, where, dtype, in_memory, report, progress,
             timeline, t_start, phases, trace)
    try:
        if out_url:
            return _build_remote(out_url, build)
        index_format(out)  # another program's folder is refused before the lock's files go in
        out.mkdir(parents=True, exist_ok=True)
        with RunLock(out), set_aside_while(out, cfg.overwrite):
            return _build_locked(corpus, cfg, out, *build[2:])
    finally:
        if not isinstance(built[-1], ModelFacts):
            built[-1].release()  # a job in a longer process must not keep the GPU's memory


def _build_remote(url: str, build: tuple) -> dict:
    """Build the index at ``url`` (object storage) in a local working folder, holding the
    index's lease; its shards are uploaded as they commit, the manifest last
    (:mod:`embedingest.index.remote_store`)."""
    from ...index.remote_store import RemoteBuild

    corpus, cfg = build[:2]
    with RemoteBuild(url, overwrite=cfg.overwrite) as remote:
        with RunLock(remote.folder):
            summary = _build_locked(corpus, cfg, remote.folder, *build[2:], checkpoint=remote.checkpoint)
    summary.update(index=remote.url, report=f"{remote.url}/{REPORT_NAME}")
    return summary


def _open_index(store: ShardStore, model, cfg: IndexConfig, dtype: str, corpus, in_memory: bool,
                overwrite: bool) -> Manifest:
    """The index's manifest for ``model`` (an encoder or the facts of one), created or
    checked against the folder's (:meth:`ShardStore.create_or_open`). A new one records
    its chunking from the start: a run killed before its end leaves shards of that cut."""
    wanted = Prompts.read(model.info()["path"]).resolve(cfg.doc_prompt, cfg.query_prompt)
    if wanted["query"]:  # the encoder of several devices is in their processes: its tokenizer read here
        tokenizer = getattr(model, "tokenizer", None) or load_tokenizer(model.info()["path"])
        refuse_filling_query_prompt(tokenizer, model.max_seq_length, wanted["query"])
    return store.create_or_open(
        Manifest(model=model.info(), dim=model.dim, metric=cfg.metric, factory=cfg.index,
                 dtype=dtype, prompts=wanted, corpus_path=corpus_path(corpus, in_memory),
                 chunking=settled_chunking(None, cfg, model.max_seq_length, str(store.folder)),
                 record_fields=cfg.record_fields()),
        overwrite=overwrite)


def _loaded(where: OneDevice | SeveralDevices, cfg: IndexConfig, model, built: list, phases: dict):
    """The encoder of ``model``: loaded now if ``model`` is its facts (the time goes to
    ``load_model_s``)."""
    if not isinstance(model, ModelFacts):
        return model
    t0 = time.perf_counter()
    encoder = where.load_encoder(cfg, model)
    built.append(encoder)
    phases["load_model_s"] = phases.get("load_model_s", 0.0) + time.perf_counter() - t0
    return encoder


def _build_locked(corpus, cfg: IndexConfig, out: Path, model, built: list, where: OneDevice | SeveralDevices,
                  dtype: str, in_memory: bool, report: SkipReport, progress: bool,
                  timeline, t_start: float, phases: dict, trace=None, checkpoint=None) -> dict:
    """The body of :func:`build_index`, run while holding the folder's run lock: plan,
    start the tokenizing workers, load the model (unless loaded), train, encode, then the
    manifest, the skip report and the summary. ``checkpoint()`` is called after the plan
    and after training (an index in object storage saves its progress there).

    ``model`` is the encoder, or the facts of it (:class:`ModelFacts`) while its weights
    are not loaded: then the workers tokenize the first batches while they load. A
    width the facts got wrong (``dim``) is put right before anything is encoded."""
    store = ShardStore(out)
    settings = {}  # what the manifest keeps besides the vectors: prompts, chunking, search defaults
    stored = stored_manifest(out, cfg.overwrite)
    cfg = settled_factory(stored, cfg)
    # checked again under the lock, and first here for an index in object storage
    refuse_unfit_chunks_of(model, stored, cfg, settled_chunking(stored, cfg, model.max_seq_length, str(out)))
    try:
        try:
            manifest = _open_index(store, model, cfg, dtype, corpus, in_memory, cfg.overwrite)
        except ConfigError:
            if not isinstance(model, ModelFacts):
                raise
            model = _loaded(where, cfg, model, built, phases)  # its own width, then the same check
            manifest = _open_index(store, model, cfg, dtype, corpus, in_memory, False)
        here = corpus_path(corpus, in_memory)
        if not cfg.out:
            refuse_another_corpus(out, corpus, manifest.corpus_path, here, lambda: store.units().keys())
            # a file of the folder the index records, the one file it holds: still that folder's index
            # (a folder's index that holds one file is told so too, and its folder's run goes on)
            here = manifest.corpus_path or here
        settings, cfg = settled_settings(manifest, cfg, model.max_seq_length, str(out))
        settings["record_fields"] = settled_fields(manifest, cfg, str(out))
        cfg = reading(cfg, settings["record_fields"])
        settings["corpus_path"] = here
        chunk_tokens = cfg.chunk_tokens
        store.clean_garbage()  # damaged shards and copies of another index's go first: the rule below reads the rest
        cfg = settled_embeddings(store, cfg, str(out))
        candidates = (corpus if in_memory
                      else file_candidates(corpus, report, out, cfg.follow_outside_links))
        within = None if in_memory else input_folder(corpus, cfg.follow_outside_links)
        plan = plan_units(store, candidates, report, within)
        log.info("%s: %d units to index, %d unchanged, %d deleted", out, len(plan.todo),
                 plan.unchanged, len(plan.deleted))
        removed, unit_nos = apply_plan(store, plan)
        units = [Unit(unit_nos[c["key"]], c["key"], path=c.get("path"), text=c.get("text"),
                      record_id=c.get("record_id"), sha256=c.get("sha256"), within=within,
                      size=c.get("size") if c.get("path") else None)
                 for c in plan.todo]
        if checkpoint:
            checkpoint()
        early = (isinstance(model, ModelFacts) and bool(units)
                 and not needs_training(store, cfg, manifest.dim)
                 and where.start_batches(units, model, cfg, chunk_tokens, store))
        if early:
            log.info("%s: the tokenizing workers start while the model loads", out)
        phases["plan_s"] = time.perf_counter() - t_start - sum(phases.values())
        phases.setdefault("load_model_s", 0.0)  # its place in the order, also when nothing loads
        encoder = _loaded(where, cfg, model, built, phases) if units else model
        if encoder.dim != manifest.dim:  # a new index the facts' width was wrong for: no shard yet
            manifest = _open_index(store, encoder, cfg, dtype, corpus, in_memory, False)
        t_train = time.perf_counter()
        trained = where.train(store, manifest, encoder, units, cfg, chunk_tokens) if units else None
        if checkpoint and trained:
            checkpoint()
        t_encode = time.perf_counter()
        phases["train_s"] = t_encode - t_train
        counts = {"chunks": 0, "docs": 0, "units_done": 0}
        timing: dict = {}  # where this process's time went in the encode step
        stats = None
        if units:
            stats = where.encode(units, [c["size"] for c in plan.todo], encoder, store, report, cfg,
                                 chunk_tokens, trained, counts, progress, timing=timing)
        phases["encode_s"] = time.perf_counter() - t_encode
        if stats is not None and timeline and stats.records:
            from ...engine.timeline import render_timeline

            render_timeline(stats.records, timeline, spans=stats.spans,
                            title=f"build-index {out} ({where.device}, {dtype})")
    finally:
        try:
            if store.exists():
                manifest = store.update_shards(corpus=fingerprint(store), **settings)
            report.write(out)
        finally:
            store.close()
    seconds = time.perf_counter() - t_start
    phases.setdefault("load_model_s", 0.0)  # nothing to encode: the weights were not needed
    phases["finish_s"] = seconds - sum(phases.values())
    total = sum(s["count"] for s in manifest.segments)
    summary = {
        "index": str(out), "device": where.name,
        "dtype": dtype, "model": model.info()["name"],
        "units_seen": plan.seen_keys, "units_indexed": counts["units_done"],
        "units_unchanged": plan.unchanged, "units_removed": len(plan.deleted),
        "vectors_removed": removed, "docs": counts["docs"], "chunks": counts["chunks"],
        "vectors_total": total, "segments": len(manifest.segments),
        "skipped": len(report), "skipped_by_reason": report.by_reason(),
        "passed_over": dict(report.passed_over.most_common()),
        "report": str(out / REPORT_NAME), "report_run": report.run,
        "skipped_earlier": report.earlier, "seconds": round(seconds, 3), "started": t_start,
        "docs_per_s": round(counts["docs"] / seconds, 1) if seconds else 0.0,
        "chunks_per_s": round(counts["chunks"] / seconds, 1) if seconds else 0.0,
        "engine": stats.summary() if stats else None,
        "phases": {key: round(value, 3) for key, value in phases.items()},
        "timing": {key: round(value, 3) for key, value in timing.items()} or None,
    }
    summary["exit_code"] = exit_code(len(report.entries))
    if trace:
        from ...engine.trace import phase_spans, write_trace

        engines = [] if stats is None else where.engines(stats)
        summary["trace"] = str(write_trace(trace, engines, phases=phase_spans("build-index", t_start, phases),
                                           title=f"build-index {out} ({summary['device']}, {dtype})"))
    return summary



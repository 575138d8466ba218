"""build-index: a text corpus to FAISS index shards, incrementally and crash-safely.

source (files or records) -> DataLoader workers (read, chunk, tokenize, length-sorted
batches) -> encoder on the device -> egress engine -> consumer processes, one FAISS
shard each. The main process keeps the chunk metadata (sqlite) and is the only one that
decides what a run must do: it compares the corpus with what the index holds (content
hashes; committed vector counts per unit), removes the vectors of changed, deleted or
half-done units, and indexes only those and the new ones. So a run that was killed at
any point is finished by running the same command again, with every chunk exactly once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from ..config import IndexConfig
from ..engine import EgressEngine
from ..engine.consumers import exit_with_parent, loader_context
from ..engine.egress import refuse_while_bootstrapping
from ..errors import ConfigError
from ..exit_codes import exit_code
from ..index.lock import RunLock
from ..index.store import IndexStore, Manifest
from ..index.writer import MetadataWriter
from ..report import REPORT_NAME, SkipReport
from ..scaleout.devices import devices_of
from ..sinks.faiss_shards import FaissShardSinkFactory, new_run_id, parse_factory
from ..sources.files import open_regular, os_error_reason, refuse_output_as_input, walk_files
from ..sources.text import TEXT_EXTENSIONS, lone_surrogate
from ..sources.text_dataset import TextChunkDataset, Unit
from ..stages.device import resolve_device
from ..stages.encoder import TextEncoder, load_tokenizer
from ..stages.prefetch import prefetch
from ..stages.prompts import Prompts, chunk_prompt, with_prompt

log = logging.getLogger("embedingest")


def default_out(corpus) -> Path:
    if isinstance(corpus, (str, os.PathLike)):
        name = Path(corpus).resolve().name
        return Path("indexes") / (Path(name).stem if Path(corpus).is_file() else name)
    return Path("indexes") / "records"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as fh:  # a file turned into a pipe must not hang the planning
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class _Plan:
    todo: list[dict]  # unit rows to (re)index: key, size, mtime_ns, sha256, path | text, record_id
    unchanged: int
    redo: list[int]  # unit_nos whose old vectors and chunks go first
    deleted: list[int]  # unit_nos no longer in the corpus
    seen_keys: int


def _file_candidates(root: Path, report: SkipReport, out: Path) -> Iterable[dict]:
    base = root if root.is_dir() else root.parent
    for path in walk_files(root, TEXT_EXTENSIONS, on_skip=lambda p, r: report.add(p, r, stage="list"),
                           on_other=report.pass_over, exclude=out):
        try:
            st = path.stat()
        except OSError as exc:
            report.add(str(path), f"unreadable: {exc.strerror or exc}", stage="list")
            continue
        yield {"key": unit_key(path.relative_to(base).as_posix()), "size": st.st_size,
               "mtime_ns": st.st_mtime_ns, "path": str(path)}


def unit_key(relative_path: str) -> str:
    """A file's key in the index: its path below the corpus folder.

    The metadata store and JSON take only valid text, so the bytes of a name that is not
    UTF-8 (which Python holds as surrogates) are written as ``\\xNN`` escapes; a
    backslash is written twice, so that a name holding a literal ``\\xe9`` keeps a key
    of its own. Every other name (valid UTF-8, no backslash) is its own key.
    """
    escaped = relative_path.replace("\\", "\\\\")
    return escaped.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _record_candidates(records: Iterable, cfg: IndexConfig, report: SkipReport) -> list[dict]:
    """The in-memory records as units, all checked before anything is written.

    Ids are compared as text (``1`` and ``"1"`` are one id); a record without an id, or
    with ``None``, takes its position as id. The index keeps one entry per id, so an id
    given twice is a :class:`ConfigError` naming both positions, never a silent merge.
    """
    out, first = [], {}
    for n, rec in enumerate(records):
        if isinstance(rec, Mapping):
            rid, text = rec.get(cfg.id_field), rec.get(cfg.text_field)
        elif isinstance(rec, (tuple, list)) and len(rec) == 2:
            rid, text = rec
        else:
            report.add(f"record {n}", "field: expected (id, text) or a dict", stage="read")
            continue
        rid = str(n if rid is None else rid)
        if rid in first:
            raise ConfigError(
                f"record id {rid!r} is given twice, by records {first[rid]} and {n} (counting "
                f"from 0); the index keeps one entry per id, compared as text, so give each "
                f"record its own id (or leave ids out: a record without one is numbered by "
                f"its position)")
        first[rid] = n
        if not isinstance(text, str):
            report.add(f"record {rid}", f"field: {cfg.text_field!r} is not a string", stage="read")
            continue
        problem = lone_surrogate(text) or lone_surrogate(rid)
        if problem:
            report.add(f"record {rid}", f"unicode: the text or id holds {problem}", stage="read")
            continue
        data = text.encode("utf-8")
        out.append({"key": f"record:{rid}", "size": len(data), "mtime_ns": None,
                    "sha256": hashlib.sha256(data).hexdigest(), "text": text, "record_id": rid})
    return out


def plan_units(store: IndexStore, candidates: Iterable[dict], report: SkipReport) -> _Plan:
    """Split the corpus into unchanged units and units to (re)index; find deleted ones.

    A unit is unchanged when it was finished before, its committed vectors are exactly its
    chunks, and its size and mtime (or, if those moved, its content hash) are the same.
    """
    known = store.units()
    incomplete = store.reconcile()
    todo, redo, seen, unchanged = [], [], set(), 0
    touched = []
    for cand in candidates:
        key = cand["key"]
        if key in seen:  # two files or records under one key: keep the first, say so
            report.add(cand.get("path") or key, f"duplicate: the key {key!r} is given twice; "
                       "only the first is indexed", stage="plan")
            continue
        seen.add(key)
        old = known.get(key)
        # A unit with no chunks was skipped whole; its reason is only in the report of the
        # run that read it (lost if that run was killed), so read it again: every run reports it.
        ok = (old is not None and old.status == "done" and bool(old.n_chunks)
              and old.unit_no not in incomplete)
        if ok and cand.get("sha256") is None and (old.size, old.mtime_ns) == (cand["size"], cand["mtime_ns"]):
            unchanged += 1
            continue
        if cand.get("sha256") is None:
            try:
                cand["sha256"] = _sha256(Path(cand["path"]))
            except OSError as exc:
                report.add(cand["path"], os_error_reason(exc), stage="hash")
                continue
        if ok and cand["sha256"] == old.sha256:
            unchanged += 1
            touched.append({"key": key, "size": cand["size"], "mtime_ns": cand["mtime_ns"]})
            continue
        if old is not None:
            redo.append(old.unit_no)
        todo.append(cand)
    if touched:
        store.upsert_units(touched)
    deleted = [u.unit_no for k, u in known.items() if k not in seen]
    known_nos = {u.unit_no for u in known.values()}
    stray = [u for u in incomplete if u not in known_nos]  # vectors of units with no row
    return _Plan(todo, unchanged, redo + stray, deleted, len(seen))


def _loader(units: list[Unit], encoder: TextEncoder, cfg: IndexConfig, workers: int,
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


def _workers(cfg: IndexConfig, n_units: int, in_memory: bool) -> int:
    if in_memory or n_units == 0:
        return 0
    from ..scaleout.devices import share_of_cpus

    return min(share_of_cpus(cfg.num_workers), n_units)


def _train_if_needed(store: IndexStore, manifest: Manifest, encoder: TextEncoder, units: list[Unit],
                     cfg: IndexConfig, chunk_tokens: int) -> str | None:
    """Train IVF/PQ/HNSW factories once, on the first ``train_size`` chunks of this run."""
    if store.trained_path.is_file():
        return str(store.trained_path)
    import faiss

    from ..sinks.faiss_shards import metric_code

    try:
        probe = faiss.index_factory(manifest.dim, manifest.factory, metric_code(manifest.metric))
    except RuntimeError as exc:
        raise ConfigError(f"--index {manifest.factory!r} is not a faiss index_factory string for dim "
                          f"{manifest.dim}: {str(exc).splitlines()[0]}") from exc
    if probe.is_trained:
        return None
    sample, n = [], 0
    loader = _loader(units, encoder, cfg, _workers(cfg, len(units), units and units[0].path is None),
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


def build_index(corpus, config: IndexConfig | None = None, *, progress: bool = False,
                timeline: str | os.PathLike | None = None, trace: str | os.PathLike | None = None,
                **overrides) -> dict:
    """Build or update the index of ``corpus`` and return a summary dict.

    ``corpus`` is a file or folder path, or an iterable of ``(id, text)`` pairs or dicts
    with the configured text and id fields. Options are the fields of
    :class:`IndexConfig`, given as ``config`` and/or keyword ``overrides``; ``timeline``
    names a PNG to draw the last batches' engine timeline into, ``trace`` a JSON file for
    the run's phases and every batch's engine records in the Chrome trace format.
    """
    refuse_while_bootstrapping("build_index()")
    cfg = dataclasses.replace(config or IndexConfig(), **overrides)
    cfg.validate()
    t_start = time.perf_counter()
    devices = devices_of(cfg)
    # Several devices were checked by devices_of, without touching CUDA here: their
    # processes can then be forked.
    device = devices[0] if len(devices) > 1 else str(resolve_device(devices[0] if devices else cfg.device))
    dtype = cfg.dtype if cfg.dtype != "auto" else ("fp16" if device.startswith("cuda") else "fp32")
    cfg = cfg.for_device(device.startswith("cuda"))
    report = SkipReport()
    if not isinstance(corpus, (str, os.PathLike)):  # checked whole before anything starts
        corpus = _record_candidates(corpus, cfg, report)
    early = None
    if len(devices) > 1:  # they start up (imports, model) while this process plans
        from ..scaleout.multi_device import start_device_processes

        early = start_device_processes(devices, cfg, dtype)
    try:
        return _prepare_and_build(corpus, cfg, devices, device, dtype, early, report, progress,
                                  timeline, t_start, trace)
    finally:
        if early is not None:
            early.close()


def _prepare_and_build(corpus, cfg: IndexConfig, devices: list[str], device: str, dtype: str, early,
                       report: SkipReport, progress: bool, timeline, t_start: float, trace=None) -> dict:
    """Load the encoder, then build under the folder's run lock."""
    in_memory = not isinstance(corpus, (str, os.PathLike))
    if not in_memory and not Path(corpus).exists():
        raise ConfigError(f"corpus {str(corpus)!r} does not exist; pass a folder or a file")
    out = Path(cfg.out) if cfg.out else default_out(corpus)
    if not in_memory:
        refuse_output_as_input(out, corpus, "corpus folder", "the index files")
    phases = {}  # seconds of each step, for the summary: where a run's time goes
    if early is not None:  # the device processes hold the model
        from ..scaleout.multi_device import encoder_on_devices

        encoder = encoder_on_devices(early)
    else:
        encoder = TextEncoder.load(cfg.model, device=device, dtype=dtype, cuda_graphs=cfg.cuda_graphs)
    phases["load_model_s"] = time.perf_counter() - t_start
    chunk_tokens = min(cfg.chunk_tokens, encoder.max_seq_length)
    if cfg.overlap >= chunk_tokens:
        raise ConfigError(f"overlap={cfg.overlap} must be smaller than the chunk size {chunk_tokens}")
    parse_factory(encoder.dim, cfg.index, cfg.metric)  # every option checked before the first write
    out.mkdir(parents=True, exist_ok=True)
    try:
        with RunLock(out):
            return _build(corpus, cfg, out, encoder, devices, device, dtype, early, in_memory,
                          chunk_tokens, report, progress, timeline, t_start, phases, trace)
    finally:
        encoder.release()  # a job in a longer process must not keep the GPU's memory


def _build(corpus, cfg: IndexConfig, out: Path, encoder: TextEncoder, devices: list[str], device: str,
           dtype: str, early, in_memory: bool, chunk_tokens: int, report: SkipReport, progress: bool,
           timeline, t_start: float, phases: dict, trace=None) -> dict:
    """The body of :func:`build_index`, run while holding the folder's run lock."""
    store = IndexStore(out)
    settings = {}  # what the manifest keeps besides the vectors: prompts, search defaults
    try:
        wanted = Prompts.read(encoder.info()["path"]).resolve(cfg.doc_prompt, cfg.query_prompt)
        manifest = store.create_or_open(
            Manifest(model=encoder.info(), dim=encoder.dim, metric=cfg.metric, factory=cfg.index,
                     dtype=dtype, prompts=wanted, corpus_path=_corpus_path(corpus, in_memory)),
            overwrite=cfg.overwrite)
        settings = {"prompts": _settled_prompts(manifest, cfg, str(out)),
                    "search": _search_defaults(manifest, cfg),
                    "corpus_path": _corpus_path(corpus, in_memory)}
        cfg = dataclasses.replace(cfg, doc_prompt=settings["prompts"]["document"])
        store.clean_garbage()
        cands = corpus if in_memory else _file_candidates(Path(corpus), report, out)
        plan = plan_units(store, cands, report)
        log.info("%s: %d units to index, %d unchanged, %d deleted", out, len(plan.todo),
                 plan.unchanged, len(plan.deleted))
        gone = plan.redo + plan.deleted
        removed = store.remove_units(gone) if gone else 0
        store.delete_units(plan.deleted)
        store.delete_chunks(plan.redo)
        nos = store.upsert_units([{k: c.get(k) for k in ("key", "size", "mtime_ns", "sha256")}
                                  | {"status": "pending", "n_chunks": 0} for c in plan.todo])
        units = [Unit(nos[c["key"]], c["key"], path=c.get("path"), text=c.get("text"),
                      record_id=c.get("record_id")) for c in plan.todo]
        t_plan = time.perf_counter()
        phases["plan_s"] = t_plan - t_start - phases["load_model_s"]
        trained = None
        if units and early is not None:
            from ..scaleout.multi_device import train_on_device

            trained = train_on_device(early, out, manifest, units, cfg, chunk_tokens)
        elif units:
            trained = _train_if_needed(store, manifest, encoder, units, cfg, chunk_tokens)
        t_encode = time.perf_counter()
        phases["train_s"] = t_encode - t_plan
        counts = {"chunks": 0, "docs": 0, "units_done": 0}
        main_loop: dict = {}
        stats = None
        if units and len(devices) > 1:
            from ..scaleout.multi_device import encode_on_devices

            stats = encode_on_devices(early, units, [c["size"] for c in plan.todo], cfg, out,
                                      chunk_tokens, trained, counts, report, progress)
        elif units:
            stats = _encode_all(units, encoder, store, report, cfg, out, device, chunk_tokens,
                                trained, counts, progress, timing=main_loop)
        phases["encode_s"] = time.perf_counter() - t_encode
        if stats is not None and timeline and stats.records:
            from ..engine.timeline import render_timeline

            render_timeline(stats.records, timeline, spans=stats.spans,
                            title=f"build-index {out} ({device}, {dtype})")
    finally:
        try:
            if store.exists():
                manifest = store.update_shards(corpus=_fingerprint(store), **settings)
            report.write(out)
        finally:
            store.close()
    seconds = time.perf_counter() - t_start
    phases["finish_s"] = seconds - sum(phases.values())
    total = sum(s["count"] for s in manifest.segments)
    summary = {
        "index": str(out), "device": ",".join(devices) if len(devices) > 1 else device,
        "dtype": dtype, "model": encoder.info()["name"],
        "units_seen": plan.seen_keys, "units_indexed": counts["units_done"],
        "units_unchanged": plan.unchanged, "units_removed": len(plan.deleted),
        "vectors_removed": removed, "docs": counts["docs"], "chunks": counts["chunks"],
        "vectors_total": total, "segments": len(manifest.segments),
        "skipped": len(report), "skipped_by_reason": report.by_reason(),
        "passed_over": dict(report.passed_over.most_common()),
        "report": str(out / REPORT_NAME), "report_run": report.run,
        "skipped_earlier": report.earlier, "seconds": round(seconds, 3),
        "docs_per_s": round(counts["docs"] / seconds, 1) if seconds else 0.0,
        "chunks_per_s": round(counts["chunks"] / seconds, 1) if seconds else 0.0,
        "engine": stats.summary() if stats else None,
        "phases": {key: round(value, 3) for key, value in phases.items()},
        "main_loop": {key: round(value, 3) for key, value in main_loop.items()} or None,
    }
    summary["exit_code"] = exit_code(len(report.entries))
    if trace:
        from ..engine.trace import phase_spans, write_trace

        engines = ([] if stats is None else list(zip(stats.devices, stats.per_device))
                   if hasattr(stats, "per_device") else [(device, stats)])
        summary["trace"] = str(write_trace(trace, engines, phases=phase_spans("build-index", t_start, phases),
                                           title=f"build-index {out} ({summary['device']}, {dtype})"))
    return summary


def _corpus_path(corpus, in_memory: bool) -> str | None:
    """The folder unit keys are relative to (for serving a hit's file), None for records."""
    if in_memory:
        return None
    root = Path(corpus).resolve()
    return str(root if root.is_dir() else root.parent)


def _settled_prompts(manifest: Manifest, cfg: IndexConfig, where: str) -> dict:
    """The prompts this run uses: the index's document prompt stays what its vectors were
    made with (a different one given is refused); the query prompt can change."""
    document = manifest.prompts.get("document", "")
    if cfg.doc_prompt is not None and cfg.doc_prompt != document:
        raise ConfigError(f"the index at {where!r} was built with document prompt {document!r}, "
                          f"not {cfg.doc_prompt!r}: pass --doc-prompt {document!r}, or --overwrite "
                          f"to rebuild it with the new prompt")
    query = cfg.query_prompt if cfg.query_prompt is not None else manifest.prompts.get("query", "")
    return {"document": document, "query": query}


def _search_defaults(manifest: Manifest, cfg: IndexConfig) -> dict:
    """The index's search defaults updated with those given (``search_params=""`` drops
    the stored parameters); parameters are checked against the factory now, not at the
    first search."""
    search = dict(manifest.search)
    if cfg.search_params is not None:
        search.pop("params", None)
        if cfg.search_params.strip():
            import faiss

            from ..sinks.faiss_shards import metric_code

            try:
                probe = faiss.index_factory(manifest.dim, manifest.factory, metric_code(manifest.metric))
                faiss.ParameterSpace().set_index_parameters(probe, cfg.search_params)
            except RuntimeError as exc:
                raise ConfigError(f"--search-params {cfg.search_params!r} do not apply to index "
                                  f"{manifest.factory!r}: {str(exc).splitlines()[0]}; nprobe is for "
                                  f"IVF factories, efSearch for HNSW") from exc
            search["params"] = cfg.search_params.strip()
    if cfg.search_k is not None:
        search["k"] = cfg.search_k
    return search


def _fingerprint(store: IndexStore) -> str:
    h = hashlib.sha256()
    for key, sha in store.db.execute("SELECT key, sha256 FROM units WHERE status='done' ORDER BY key"):
        h.update(f"{key}\0{sha}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _encode_all(units: list[Unit], encoder: TextEncoder, store: IndexStore, report: SkipReport,
                cfg: IndexConfig, out: Path, device: str, chunk_tokens: int, trained: str | None,
                counts: dict, progress: bool, run_id: str | None = None, on_item=None,
                timing: dict | None = None):
    """The encode step on one device; ``timing`` (a dict) receives where the main
    process's time went (see ``main_loop`` in the summary)."""
    from tqdm import tqdm

    cuda = device.startswith("cuda")
    workers = _workers(cfg, len(units), units[0].path is None)
    loader = _loader(units, encoder, cfg, workers, chunk_tokens, pin=cuda)
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

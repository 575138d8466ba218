"""``embedingest reindex``: new faiss vectors files for every shard, of another factory,
from the embeddings the index kept (``--save-embeddings``); no model, no corpus.

The vectors of index generation g are ``shards/<name>.g<g>.faiss`` (and the trained
empty index ``trained.g<g>.faiss``), so the new files are written beside the old ones
and nothing the index uses changes until the manifest, rewritten last (atomically),
names the new factory and generation. A crash before that leaves the index as it was
(the new files are garbage the next writer deletes); after it, the old files are.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
from pathlib import Path

import faiss
import numpy as np

from ..config import CHUNK_TOKENS, ID_FIELD, OVERLAP, TEXT_FIELD
from ..errors import ConfigError
from ..outfiles import refuse_link, write_faiss_index
from ..sources.remote import is_remote
from .faiss_factory import (apply_search_params, copy_index, default_search_params, faiss_message, parse_factory,
                            train, training_advice)
from .formats import MANIFEST_NAME, rebuild_command, require_current
from .lock import RunLock
from .shard_store import refuse_unfinished_overwrite
from .shards import SHARDS_DIR, clean_shards, damaged, list_shards, read_embeddings, read_ids, trained_name
from .store import IndexStore, Manifest
from ..terminal import shell_quote

log = logging.getLogger("embedingest")

ADD_BLOCK = 65_536


def reindex(index: str | os.PathLike, factory: str, *, train_size: int = 50_000,
            search_params: str | None = None, seed: int = 0) -> dict:
    """Rebuild the vectors of the index at ``index`` as faiss ``factory`` from its saved
    embeddings; return a summary. Factories that need training are trained on
    ``train_size`` vectors drawn evenly from all shards (with ``seed``).
    ``search_params`` become the index's search defaults (None keeps the stored ones
    when they apply to the new factory, else drops them; "" drops them). Kept, the old
    factory's automatic ones become the new factory's (IVF16's nprobe=16 is IVF4's
    nprobe=4) and an nprobe over the new factory's lists is cut to them, said in the log
    (:func:`_settled_params`).

    An index in object storage (``s3://bucket/prefix``) is reindexed as a build updates
    it (docs/INDEX_FORMAT.md, "Object storage"): under its lease, in a local working
    folder that mirrors it (room for the whole index is needed there), the new vectors
    files uploaded, then the manifest written conditionally, then the old files deleted."""
    if is_remote(index):
        from .remote_store import RemoteBuild

        with RemoteBuild(str(index)) as remote:
            if not (remote.folder / MANIFEST_NAME).is_file():
                raise ConfigError(f"{remote.url!r} holds no embedingest index (no {MANIFEST_NAME}); "
                                  f"build one with embedingest build-index CORPUS --out {remote.url}")
            summary = reindex(remote.folder, factory, train_size=train_size,
                              search_params=search_params, seed=seed)
        return summary | {"index": remote.url}
    folder = Path(index)
    require_current(folder)
    store = IndexStore(folder)
    store.read_manifest()  # not an index: said before a lock file is made
    with RunLock(folder):
        refuse_unfinished_overwrite(folder, "reindex")
        refuse_link(folder / SHARDS_DIR)  # the new vectors are written inside the index folder only
        manifest = store.read_manifest()
        shards = [s for s in list_shards(folder / SHARDS_DIR, generation=manifest.generation) if s.rows]
        template = parse_factory(manifest.dim, factory, manifest.metric)
        params, dropped, changed = _settled_params(manifest, template, search_params)
        missing = [s.name for s in shards if not s.has_embeddings]
        if missing:
            raise ConfigError(
                f"the index at {str(folder)!r} kept no embeddings for {len(missing)} of its {len(shards)} "
                f"shards (e.g. {missing[0]}): it was built without --save-embeddings, so it cannot be "
                f"reindexed without the model; rebuild it with:\n  "
                + rebuild_command(folder, dataclasses.asdict(manifest) | {"factory": factory,
                                                                           "corpus_path": _built_from(folder, manifest)},
                                  save_embeddings=True,
                                  options=kept_options(manifest, params, default_search_params(template))))
        generation = manifest.generation + 1
        embs = []
        for shard in shards:  # every byte is read anyway: those that were not committed are refused
            problem = shard.verify(("emb",), manifest.generation)
            if problem:
                raise damaged(shard, shard.folder, problem)
            embs.append(read_embeddings(shard, manifest.dim))
        total = sum(len(e) for e in embs)
        trained_path = None
        written: list[Path] = []  # the new generation's files, deleted if the switch does not come
        try:
            if not template.is_trained:
                sample = _sample(embs, train_size, seed)
                try:
                    train(template, sample)
                except RuntimeError as exc:
                    raise ConfigError(f"cannot train {factory!r} on {len(sample)} vectors: {faiss_message(exc)}; "
                                      f"{training_advice(len(sample))}, or index more vectors first") from exc
                trained_path = folder / trained_name(generation)
                write_faiss_index(template, trained_path)
                written.append(trained_path)
            for shard, emb in zip(shards, embs):
                ids = read_ids(shard)
                index_ = faiss.IndexIDMap(copy_index(template))
                for start in range(0, len(emb), ADD_BLOCK):
                    block = np.ascontiguousarray(emb[start:start + ADD_BLOCK], dtype=np.float32)
                    index_.add_with_ids(block, ids[start:start + ADD_BLOCK])
                write_faiss_index(index_, shard.faiss_path(generation))
                written.append(shard.faiss_path(generation))
            old = (manifest.factory, manifest.generation)
            manifest.factory, manifest.generation = factory, generation
            if params is None:
                manifest.search.pop("params", None)
            else:
                manifest.search["params"] = params
            store.write_manifest(manifest)  # the switch
        except BaseException:
            _drop_unswitched(store, generation, written)
            raise
        if dropped:  # said once the switch is made: a reindex that fails keeps them
            log.warning("the stored search parameters %r do not apply to the new factory: dropped", dropped)
        if changed:
            log.warning("the stored search parameters %r are %r for the new factory (%d lists)", *changed,
                        faiss.try_extract_index_ivf(template).nlist)
        removed = clean_shards(folder / SHARDS_DIR, generation)
        for gen in range(generation):
            (folder / trained_name(gen)).unlink(missing_ok=True)
    log.info("reindexed %s: %s (generation %d) -> %s (generation %d); %d old files deleted",
             folder, old[0], old[1], factory, generation, len(removed))
    return {"index": str(folder), "factory": factory, "previous_factory": old[0],
            "generation": generation, "shards": len(shards), "vectors": total,
            "trained": trained_path is not None, "search_params": params}


def _built_from(folder: Path, manifest: Manifest) -> str | None:
    """The corpus a rebuild of the index at ``folder`` names: the one its manifest records
    (a folder, one file, a URL), as recorded; for an index written before build-index FILE
    recorded the file itself, the file its folder stands for (:func:`_file_of_old_index`)."""
    root = manifest.corpus_path
    if not root or is_remote(root) or not os.path.isdir(root):
        return root
    return _file_of_old_index(folder, root) or root


def _file_of_old_index(folder: Path, root: str) -> str | None:
    """The one file an index written before build-index recorded a file as itself was
    built from, where its manifest records that file's folder ``root`` (its unit keys are
    relative to it): named, the folder would index every file in it. Told from the index's
    units: one key, a file right in ``root``, which holds other files now; None otherwise.
    An index of a folder that held one file when it was built, and holds others now, is
    told the same way and named by that file: the rebuild holds what the index holds."""
    try:  # read-only: a refusal's message creates no database where there was none
        with IndexStore(folder, read_only=True) as store:
            keys = [row[0] for row in store.db.execute("SELECT key FROM units LIMIT 2")]
    except (ConfigError, sqlite3.Error):
        return None  # no units to tell: the folder, as recorded
    if len(keys) != 1 or "/" in keys[0] or not (Path(root) / keys[0]).is_file():
        return None
    from ..sources.files import walk_paths  # only for this message
    from ..sources.text import TEXT_EXTENSIONS

    file = os.path.join(root, keys[0])
    try:
        others = any(p != file for p in walk_paths(root, TEXT_EXTENSIONS, exclude=folder))
    except (OSError, ConfigError):
        return None
    return file if others else None


def kept_options(manifest: Manifest, params: str | None, plain_params: str | None = None) -> list[str]:
    """The build-index options (shell-quoted) that give a rebuild of the index what its
    manifest keeps besides model, factory and metric, where it is not what a plain build
    gives: chunking, prompts, the search defaults (``params``: the parameters the new
    factory keeps; ``plain_params``: those a plain build of it keeps, ``''`` given where
    the index has none) and the record fields. Without them the rebuild's chunks, vectors
    and searches would not be the index's."""
    options = []
    limit = manifest.model.get("max_seq_length")
    tokens = min(CHUNK_TOKENS, limit) if isinstance(limit, int) else CHUNK_TOKENS
    if manifest.chunking and (manifest.chunking["tokens"], manifest.chunking["overlap"]) != (tokens, OVERLAP):
        options += ["--chunk-tokens", str(manifest.chunking["tokens"]), "--overlap", str(manifest.chunking["overlap"])]
    declared = _declared_prompts(manifest.model)
    for role, option in (("document", "--doc-prompt"), ("query", "--query-prompt")):
        prompt = manifest.prompts.get(role, "")
        if prompt != declared[role]:
            options += [option, shell_quote(prompt)]
    if params != plain_params:
        options += ["--search-params", shell_quote(params or "")]
    if manifest.search.get("k") is not None:
        options += ["--search-k", str(manifest.search["k"])]
    for role, option, default in (("text", "--text-field", TEXT_FIELD), ("id", "--id-field", ID_FIELD)):
        if manifest.record_fields.get(role, default) != default:
            options += [option, shell_quote(manifest.record_fields[role])]
    return options


def _declared_prompts(model: dict) -> dict:
    """The prompts a build with the index's model folder takes when given none (those it
    declares); none where the folder cannot be read (a prompt the index has is then given)."""
    path = model.get("path")
    if isinstance(path, str) and Path(path).is_dir():
        from ..stages.prompts import Prompts  # torch: only for this message

        try:
            return Prompts.read(path).resolve()
        except ConfigError:
            pass
    return {"document": "", "query": ""}


def _drop_unswitched(store: IndexStore, generation: int, written: list[Path]) -> None:
    """Delete ``written`` (files of ``generation``) after a reindex failed (a full disk, a
    Ctrl-C), unless the manifest already names that generation: the index stays as it was,
    without a partial next generation taking the disk until the next run."""
    try:
        switched = store.read_manifest().generation == generation
    except ConfigError:
        return  # the manifest cannot say: keep every file
    if not switched:
        for path in written:
            path.unlink(missing_ok=True)


def _sample(embs: list[np.ndarray], size: int, seed: int) -> np.ndarray:
    """``size`` vectors drawn without replacement across the shards (all when fewer)."""
    counts = np.array([len(e) for e in embs])
    total = int(counts.sum())
    if total == 0:
        raise ConfigError("the index holds no vectors to train on")
    pick = np.sort(np.random.default_rng(seed).choice(total, min(size, total), replace=False))
    starts = np.concatenate([[0], np.cumsum(counts)])
    parts = []
    for no, emb in enumerate(embs):
        mine = pick[(pick >= starts[no]) & (pick < starts[no + 1])] - starts[no]
        if len(mine):
            parts.append(np.asarray(emb[mine], dtype=np.float32))
    return np.ascontiguousarray(np.concatenate(parts))


def _settled_params(manifest, template: faiss.Index,
                    given: str | None) -> tuple[str | None, str | None, tuple[str, str] | None]:
    """The search parameters after the reindex (see :func:`reindex`), the stored ones it
    drops (they do not apply to the new factory), else None, and the stored ones it keeps
    changed, with what they become (``("nprobe=16", "nprobe=4")``), else None.

    Stored parameters that are the old factory's automatic default (a new index's
    ``nprobe=16``, at most its lists; :func:`default_search_params`) become the new
    factory's: IVF16's nprobe=16 is nprobe=4 for IVF4, IVF8's nprobe=8 is nprobe=16 for
    IVF64. (A builder who gave that very value is taken as having kept the default: the
    manifest does not say which.) Other stored ones are kept as they are, but an
    ``nprobe`` over the new factory's lists is cut to them (faiss probes no more; the
    stored number said otherwise, and went on to a later factory with more lists)."""
    stored = manifest.search.get("params")
    params = stored if given is None else given.strip()
    # none given: a factory that becomes IVF (or HNSW) gets a new index's nprobe (efSearch);
    # one that was of that kind keeps what it had, none included: its builder may have
    # turned them off
    new, old = default_search_params(template), _old_defaults(manifest)
    same_kind = _param_name(new) == _param_name(old)
    fresh = None if given is not None or same_kind else new
    if not params:
        return fresh, None, None
    if given is None and same_kind and params == old:  # the automatic default: the new factory's
        return new, None, None if new == params else (params, new)
    probe = faiss.IndexIDMap(copy_index(template))
    try:
        text = apply_search_params(probe, params)
    except ValueError as exc:
        if given is not None:
            raise ConfigError(f"search parameters {params!r} do not apply to the new factory: "
                              f"{exc}; nprobe is for IVF factories, efSearch for HNSW") from exc
        return fresh, params, None
    if given is None:
        clamped = _clamped_nprobe(text, faiss.try_extract_index_ivf(template))
        if clamped != text:
            return clamped, None, (text, clamped)
    return text, None, None


def _clamped_nprobe(params: str, ivf) -> str:
    """``params`` with an ``nprobe`` over the lists of ``ivf`` (None: not IVF) cut to them."""
    if ivf is None:
        return params
    parts = []
    for part in params.split(","):
        name, _, value = part.partition("=")
        if name == "nprobe" and int(value) > ivf.nlist:
            part = f"nprobe={ivf.nlist}"
        parts.append(part)
    return ",".join(parts)


def _old_defaults(manifest) -> str | None:
    """The search parameters a new index of the factory before the reindex would keep."""
    return default_search_params(parse_factory(manifest.dim, manifest.factory, manifest.metric))


def _param_name(params: str | None) -> str | None:
    """``nprobe`` of ``nprobe=16``: which kind of default these are."""
    return params.split("=", 1)[0] if params else None


"""build-index's plan: what a run must do, decided in the main process (or Ray's driver)
before anything is encoded.

The corpus (files under a folder, or in-memory records) becomes candidate units; each is
compared with what the index holds (size, mtime and ctime, else the content hash; committed
vector counts), so a run indexes only new and changed units, removes the vectors of
changed, deleted and half-done ones, and a killed run is finished by running it again.
Also here: the settings a run keeps in the manifest (factory, chunking, prompts, search
defaults: an update keeps the index's, and is refused others that would mix two kinds of
vectors) and the corpus fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ...config import METRIC, IndexConfig
from ...errors import ConfigError, SettingError
from ...index.export import SUCCESS_NAME, is_export_folder
from ...index.shard_store import ASIDE_DIR, ShardStore
from ...index.formats import MANIFEST_NAME, holds_index
from ...index.shards import SHARDS_DIR
from ...index.store import Manifest
from ...report import REPORT_NAME, SkipReport
from ...index.faiss_factory import apply_search_params, parse_factory
from ...sources.files import file_sha256, is_within, os_error_reason, reads_within, walk_paths
from ...sources.names import has_extension, name_as_text
from ...sources.remote import input_name, is_remote, walk_remote
from ...sources.text import TEXT_EXTENSIONS, arrow_as_list, field_names, lone_surrogate
from ...stages.prompts import Prompts, refuse_unfit_chunks
from ...stages.tokenizer import load_tokenizer
from ...terminal import shell_quote

log = logging.getLogger("embedingest")


def default_out(corpus) -> Path:
    if is_remote(corpus):
        name = input_name(corpus)
        return Path("indexes") / (Path(name).stem if has_extension(name, TEXT_EXTENSIONS) else name)
    if isinstance(corpus, (str, os.PathLike)):
        path = Path(corpus)
        if path.is_file():  # by the name given, as corpus_path records it (a link: the link's)
            return Path("indexes") / Path(path.absolute().name).stem
        return Path("indexes") / path.resolve().name
    return Path("indexes") / "records"


HASH_THREADS = 8  # large files hashed at once while planning
HASH_APART = 1 << 20  # bytes from which a file is hashed in the thread pool


@dataclass
class Plan:
    """What a run does (:func:`plan_units`); :func:`apply_plan` clears the way for it."""

    todo: list[dict]  # unit rows to (re)index: key, size, mtime_ns, ctime_ns, sha256, path | text, record_id
    unchanged: int
    replaced: list[int]  # unit_nos to index again: their old vectors and chunks go first
    deleted: list[int]  # unit_nos no longer in the corpus
    seen_keys: int
    renumbered: list[int] = dataclasses.field(default_factory=list)  # of replaced: changed content


def index_folder_reason(folder: str) -> str | None:
    """Why a folder of the corpus is not read: it is an index (its manifest says so, not a
    dataset's manifest.json beside a shards/ of its own) or an export of one, whose rows
    would be indexed as documents, every hit twice."""
    if holds_index(folder):
        return ("index: an embedingest index, not documents (its corpus is what to index); "
                "move it out of the corpus folder")
    if is_export_folder(folder):
        return (f"export: an embedingest export ({SUCCESS_NAME} and Parquet files named as shards), "
                "not documents (its index's corpus is what to index); move it out of the corpus folder")
    return None


def refuse_corpus_in_index(corpus, out: Path) -> None:
    """ConfigError when the corpus is, or is inside, a folder the index at ``out`` writes
    (its shards/, or .overwritten/ where a rebuild sets the old index aside): each run
    would read the shards it wrote as documents, and add them again; when it is one of
    the index's own text files (its manifest, its skip report), the index's only document
    (every unit it held removed); and when ``out`` is inside another index's shards/."""
    real = os.path.realpath(corpus)
    own_folder = os.path.realpath(out)
    if os.path.dirname(real) == own_folder and os.path.basename(real) in (MANIFEST_NAME, REPORT_NAME):
        raise ConfigError(f"corpus {str(corpus)!r} is a file of the index {str(out)!r} itself: read as the "
                          "corpus, it would be the index's only document, and every unit the index holds would "
                          "be removed; give the documents' folder or file as the corpus")
    index = next((p for p in Path(own_folder).parents if p.name == SHARDS_DIR
                  and (p.parent / MANIFEST_NAME).is_file()), None)
    if index is not None:
        raise ConfigError(f"--out {str(out)!r} is inside {str(index)!r}, the shards folder of the index "
                          f"{str(index.parent)!r}, whose builds delete what they did not write there: give an "
                          "--out outside it")
    for name in (SHARDS_DIR, ASIDE_DIR):
        own = os.path.realpath(out / name)
        if is_within(real, own):
            where = "is" if real == own else "is inside"
            raise ConfigError(f"corpus {str(corpus)!r} {where} {str(out / name)!r}, a folder the index "
                              f"{str(out)!r} writes: its shard files would be read as documents on every "
                              "run; move the documents to a folder of their own, or give another --out")


def file_candidates(root: Path | str, report: SkipReport, out: Path,
                    outside_links: bool = False) -> Iterable[dict]:
    """The text files under ``root`` (``out`` left out) as candidate units, not yet hashed;
    ``root`` may be a URL (see :func:`remote_candidates`). Links out of ``root`` are
    skipped unless ``outside_links`` (:func:`~...sources.files.walk_paths`). A folder
    that cannot be listed now, or a file that cannot be stat'ed, is reported and given
    as ``{"unlisted": key}``: what the index holds below that key is unknown, not
    deleted (:func:`plan_units` keeps it)."""
    if is_remote(root):
        yield from remote_candidates(root, report)
        return
    root = Path(root)
    base = root if root.is_dir() else root.parent
    prefix = os.path.join(str(base), "")  # the walk's paths start with it: no pathlib per file

    def relative(name: str) -> str:
        if name == str(base):
            return ""
        return name[len(prefix):] if name.startswith(prefix) else Path(name).relative_to(base).as_posix()

    unlisted: list[str] = []
    for name in walk_paths(root, TEXT_EXTENSIONS, on_skip=lambda p, r: report.add(p, r, stage="list"),
                           on_other=report.pass_over, exclude=out, outside_links=outside_links,
                           not_input=index_folder_reason, on_unlisted=unlisted.append):
        try:
            st = os.stat(name)
        except OSError as exc:
            report.add(name, f"unreadable: {exc.strerror or exc}", stage="list")
            if not isinstance(exc, (FileNotFoundError, NotADirectoryError)):
                unlisted.append(name)
            continue
        yield {"key": unit_key(relative(name)), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
               "ctime_ns": st.st_ctime_ns, "path": name}
    yield from ({"unlisted": unit_key(relative(name))} for name in unlisted)  # plan_units reads them last


def remote_candidates(url: str, report: SkipReport) -> Iterable[dict]:
    """The text objects below ``url`` as candidate units, keyed by their path below it as
    the files of a folder are, so the same files in a bucket and on disk get the same
    ids. An object whose store gives neither a time nor a version is hashed now, so the
    plan compares its content instead of trusting an absent stamp."""
    for obj in walk_remote(url, TEXT_EXTENSIONS, on_skip=lambda p, r: report.add(p, r, stage="list"),
                           on_other=report.pass_over):
        candidate = {"key": unit_key(obj.rel), "size": obj.size, "mtime_ns": obj.mtime_ns,
                     "path": obj.url}
        if obj.mtime_ns is None:
            try:
                candidate["sha256"] = file_sha256(obj.url)
            except OSError as exc:
                report.add(obj.url, os_error_reason(exc), stage="hash")
                continue
        yield candidate


def unit_key(relative_path: str) -> str:
    """A file's key in the index: its path below the corpus folder, as valid text (the
    metadata store and JSON take no other), one to one: see ``name_as_text``."""
    return name_as_text(relative_path)


def _check_records(records) -> None:
    """Refuse a corpus that is not an iterable of records, naming what to give instead: a
    dict or a DataFrame iterates over its keys or column names, which would be indexed
    as texts (or all skipped), and a number or None cannot be read at all."""
    hint = ""
    if isinstance(records, Mapping):
        hint = "; for a dict of id to text, give its .items()"
    elif hasattr(records, "columns") and hasattr(records, "to_dict"):
        hint = "; for a DataFrame, give df.to_dict('records') (its columns named text and id)"
    elif not isinstance(records, (bytes, bytearray)) and isinstance(records, Iterable):
        return
    raise ConfigError(f"corpus of type {type(records).__name__}: give a folder, a file, a URL, or an "
                      f"iterable of records ((id, text) pairs, dicts, or texts){hint}")


_MISSING = object()  # a record without the text field


def record_candidates(records: Iterable, cfg: IndexConfig, report: SkipReport) -> list[dict]:
    """The in-memory records as units, all checked before anything is written.

    Ids are compared as text (``1`` and ``"1"`` are one id); a record without an id, or
    with ``None``, or a text given alone, takes its position as id. The index keeps one entry per id, so an id
    given twice is a :class:`ConfigError` naming both positions, never a silent merge.
    """
    _check_records(records)
    records = arrow_as_list(records)
    fields = cfg.record_fields()
    out, first = [], {}
    for n, rec in enumerate(records):
        if isinstance(rec, Mapping):
            rid, text = rec.get(fields["id"]), rec.get(fields["text"], _MISSING)
        elif isinstance(rec, (tuple, list)) and len(rec) == 2:
            rid, text = rec
        elif isinstance(rec, str):  # a text alone: numbered by its position
            rid, text = None, rec
        else:
            report.add(f"record {n}", "field: expected (id, text), a dict or a text", stage="read")
            continue
        rid = str(n if rid is None else rid)
        if rid in first:
            raise ConfigError(
                f"record id {rid!r} is given twice, by records {first[rid]} and {n} (counting "
                f"from 0); the index keeps one entry per id, compared as text, so give each "
                f"record its own id (or leave ids out: a record without one is numbered by "
                f"its position)")
        first[rid] = n
        if text is _MISSING:
            report.add(f"record {rid}", f"field: no {fields['text']!r} field (fields: {field_names(rec)}); choose "
                                        "the text field with text_field=", stage="read")
            continue
        if not isinstance(text, str):
            report.add(f"record {rid}", f"field: {fields['text']!r} is not a string", stage="read")
            continue
        problem = lone_surrogate(text) or lone_surrogate(rid)
        if problem:
            report.add(f"record {rid}", f"unicode: the text or id holds {problem}", stage="read")
            continue
        data = text.encode("utf-8")
        out.append({"key": f"record:{rid}", "size": len(data), "mtime_ns": None,
                    "sha256": hashlib.sha256(data).hexdigest(), "text": text, "record_id": rid})
    return out


def plan_units(store: ShardStore, candidates: Iterable[dict], report: SkipReport,
               within: str | None = None) -> Plan:
    """Split the corpus into unchanged units and units to (re)index; find deleted ones.

    A unit is unchanged when it was finished before, its committed vectors are exactly its
    chunks, and its size, mtime and ctime (or, if those moved, its content hash) are the
    same (:func:`_same_stamp`).
    A unit to redo keeps its number while its content is the one its row names (a run
    that stopped, resumed: the ids a clean run gives); a changed content gets a fresh
    number (``renumbered``), so no id ever names two texts.

    Only a file whose stamp moved is hashed here, to compare with the hash its row holds
    (a file outside ``within``, the input folder's real path, once opened is reported,
    not hashed: see ``sources.files.reads_within``).
    A new file (or one whose row has no hash yet) goes to the todo list unhashed
    (``sha256`` None): the loader worker that reads it hashes it, and the shard that
    finishes the unit records the hash (:func:`~embedingest.index.shards.finished_hashes`).
    So the plan's cost is a stat per file, not a read, and a unit's hash is that of the
    bytes its vectors were made from. Without a hash to compare, an unfinished unit whose
    stamp is the same keeps its number; one whose stamp moved gets a fresh one.

    A finished unit below a folder that could not be listed (a candidate
    ``{"unlisted": key}``, see :func:`file_candidates`) is kept and counted unchanged:
    unknown is not deleted.
    """
    known = store.units()
    incomplete = store.reconcile()
    todo, replaced, renumbered, seen, unchanged = [], [], [], set(), 0
    touched, pending, unlisted = [], [], []
    for cand in candidates:
        if "unlisted" in cand:
            unlisted.append(cand["unlisted"])
            continue
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
        same_stamp = old is not None and _same_stamp(old, cand)
        if cand.get("sha256") is None and same_stamp:
            if ok:
                unchanged += 1
                if old.ctime_ns is None and cand.get("ctime_ns") is not None:
                    touched.append(_stamp(cand))  # a row made before ctimes were kept gets one
                continue
            cand["sha256"] = old.sha256  # the same file, half done: its row's hash (or None)
        pending.append((cand, ok, old is not None and old.sha256 is not None))
    for cand, ok in _hashed(pending, report, within):
        key = cand["key"]
        old = known.get(key)
        if ok and cand["sha256"] == old.sha256:
            unchanged += 1
            touched.append(_stamp(cand))
            continue
        if old is not None:
            replaced.append(old.unit_no)
            same = (cand["sha256"] == old.sha256 if cand["sha256"] is not None and old.sha256 is not None
                    else _same_stamp(old, cand))
            if not same:
                renumbered.append(old.unit_no)
        todo.append(cand)
    if touched:
        store.upsert_units(touched)
    kept = _kept_unlisted(known, seen, unlisted, incomplete)
    if kept:
        log.warning("%d files indexed before are in folders that cannot be listed now (in the skip "
                    "report); they are kept as they were until those folders can be read", len(kept))
    unchanged += len(kept)
    deleted = [u.unit_no for k, u in known.items() if k not in seen and k not in kept]
    known_nos = {u.unit_no for u in known.values()}
    stray = [u for u in incomplete if u not in known_nos]  # vectors of units with no row
    return Plan(todo, unchanged, replaced + stray, deleted, len(seen) + len(kept), renumbered)


def _same_stamp(old, cand: dict) -> bool:
    """Whether a file's stamp is its row's: size, mtime and inode change time. A rewrite
    that keeps the size and sets the mtime back (``cp -p``, ``rsync -a``, ``touch -r``)
    still moves the ctime; a ctime that moved alone (chmod, a hard link) costs a hash,
    not a reindex. A row or candidate without one (made before ctimes were kept, an
    object in a bucket) compares size and mtime, as then."""
    if (old.size, old.mtime_ns) != (cand["size"], cand["mtime_ns"]):
        return False
    ctime = cand.get("ctime_ns")
    return old.ctime_ns is None or ctime is None or old.ctime_ns == ctime


def _stamp(cand: dict) -> dict:
    """The stamp fields of a candidate, to update its unit's row with."""
    return {k: cand.get(k) for k in ("key", "size", "mtime_ns", "ctime_ns")}


def _kept_unlisted(known: Mapping, seen: set[str], unlisted: list[str], incomplete: set[int]) -> set[str]:
    """The keys of finished units not seen because they lie at or below a key of
    ``unlisted`` (a folder that could not be listed, ``""`` the corpus folder): kept as
    they are. A half-done one is removed as ever: it cannot be finished now."""
    if not unlisted:
        return set()
    whole = "" in unlisted
    prefixes = tuple(f"{u}/" for u in unlisted)
    under = set(unlisted)
    return {k for k, u in known.items()
            if k not in seen and u.status == "done" and u.n_chunks and u.unit_no not in incomplete
            and (whole or k in under or k.startswith(prefixes))}


def _hashed(pending: list[tuple[dict, bool, bool]], report: SkipReport,
            within: str | None = None) -> Iterator[tuple[dict, bool]]:
    """``pending`` (candidate, whether its old unit counts, whether to hash it) in order,
    as (candidate, counts) pairs; each candidate to hash gets its ``sha256``. Files of
    :data:`HASH_APART` bytes or more are hashed by a thread pool while this thread hashes
    the others (hashlib releases the GIL on large buffers, so large files hash in
    parallel; a small file's cost is Python's, which threads would only fight over). A
    file that cannot be read is reported and left out."""
    to_hash = [cand for cand, _, hash_it in pending if hash_it and cand.get("sha256") is None]
    large = [cand["path"] for cand in to_hash if (cand.get("size") or 0) >= HASH_APART]
    digests: dict[str, str | OSError] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(large)))) as pool:
        futures = {path: pool.submit(_sha256_or_error, path, within) for path in large}
        for cand in to_hash:
            if cand["path"] not in futures:
                digests[cand["path"]] = _sha256_or_error(cand["path"], within)
        digests.update((path, f.result()) for path, f in futures.items())
    for cand, ok, hash_it in pending:
        if hash_it and cand.get("sha256") is None:
            digest = digests[cand["path"]]
            if isinstance(digest, OSError):
                report.add(cand["path"], os_error_reason(digest), stage="hash")
                continue
            cand["sha256"] = digest
        cand.setdefault("sha256", None)
        yield cand, ok


def _sha256_or_error(path: str, within: str | None = None) -> str | OSError:
    """The file's sha256, or why it could not be read; inside ``within`` (a folder's real
    path) only, as the workers read (``sources.files.reads_within``)."""
    try:
        with reads_within(within):
            return file_sha256(path)
    except OSError as exc:
        return exc


def apply_plan(store: ShardStore, plan: Plan) -> tuple[int, dict[str, int]]:
    """Remove what ``plan`` replaces or deletes and mark its units to index as pending;
    return the number of vectors removed and each pending unit's number by key.

    New units (and changed ones, whose rows go) are numbered in the order of
    ``plan.todo`` from above every number the index ever gave, in ``units.sqlite`` or in
    a shard (a stray's vectors are removed first, its number stays spent): the same
    records in the same order get the same ids on every path (one process, several
    devices, Ray)."""
    outdated = plan.replaced + plan.deleted
    highest = store.highest_unit_no()
    removed = store.remove_units(outdated) if outdated else 0
    store.delete_units(plan.deleted + plan.renumbered)
    store.spend_unit_nos(highest)
    unit_nos = store.upsert_units([{k: c.get(k) for k in ("key", "size", "mtime_ns", "ctime_ns", "sha256")}
                                   | {"status": "pending", "n_chunks": 0} for c in plan.todo])
    return removed, unit_nos


def corpus_path(corpus, in_memory: bool) -> str | None:
    """The corpus as the manifest records it and a rebuild names it: a folder's real path,
    one file's (its folder's real path and the name given, which is its unit key), or the
    URL; None for records. A file is recorded as itself, not as its folder (unit keys are
    relative to that folder either way): the folder, named, indexes every file in it."""
    if in_memory:
        return None
    if is_remote(corpus):
        return corpus.rstrip("/")
    path = Path(corpus)
    if path.is_dir():
        return str(path.resolve())
    return str(path.absolute().parent.resolve() / path.name)


def same_corpus(recorded: str | None, here: str | None, keys: Callable[[], Iterable[str]]) -> bool:
    """Whether the index whose manifest records the corpus ``recorded`` is the index of
    ``here`` (both :func:`corpus_path`; None, for records, matches any). An index written
    before a file was recorded as itself records the file's folder: it is the index of a
    file in that folder when it holds no unit but that file's (``keys()``: its unit keys)."""
    if not recorded or not here or recorded == here:
        return True
    if is_remote(here) or os.path.dirname(here) != recorded:
        return False
    own = unit_key(os.path.basename(here))
    return all(key == own for key in keys())


def refuse_another_corpus(out: Path, corpus, recorded: str | None, here: str | None,
                          keys: Callable[[], Iterable[str]]) -> None:
    """ConfigError when ``out``, the default --out of ``corpus`` (recorded as ``here``),
    holds the index of another corpus (``recorded``; ``keys()``: its unit keys): corpora
    of one name (a/docs and b/docs, or docs/ and docs/docs.md) share a default --out, and
    the run would make one's index the other's, removing files or adding them."""
    if same_corpus(recorded, here, keys):
        return
    if not is_remote(here) and is_within(recorded, here):
        effect = f"to which this run would add every other file of {str(corpus)!r}"
    else:
        effect = "whose files this run would remove from it"
    raise ConfigError(f"{str(out)!r} (the default --out for {str(corpus)!r}) holds the index of another "
                      f"corpus, {recorded!r}, {effect}: give this corpus an --out of its own, or --out "
                      f"{str(out)!r} to make it the index of this one")


def settled_prompts(manifest: Manifest, cfg: IndexConfig, where: str) -> dict:
    """The prompts this run uses: the index's document prompt stays what its vectors were
    made with (a different one given is refused); the query prompt can change."""
    document = manifest.prompts.get("document", "")
    if cfg.doc_prompt is not None and cfg.doc_prompt != document:
        raise ConfigError(f"the index at {where!r} was built with document prompt {document!r}, "
                          f"not {cfg.doc_prompt!r}: pass --doc-prompt {document!r}, or --overwrite "
                          f"to rebuild it with the new prompt")
    query = cfg.query_prompt if cfg.query_prompt is not None else manifest.prompts.get("query", "")
    return {"document": document, "query": query}


def stored_manifest(out: Path, overwrite: bool) -> Manifest | None:
    """The manifest of the index at ``out`` that a run will update (None for a new index,
    one rebuilt with ``overwrite``, or one that cannot be read: the run's own opening of it
    says what is wrong). Read without the run lock, for the checks made before the folder
    is: the run checks again once it holds the lock."""
    if overwrite or not (out / MANIFEST_NAME).is_file():
        return None
    try:
        with ShardStore(out, read_only=True) as store:
            return store.read_manifest()
    except (ConfigError, OSError):
        return None


def settled_factory(stored: Manifest | None, cfg: IndexConfig) -> IndexConfig:
    """``cfg`` with its faiss factory and metric made concrete: those given, else the
    index's (an update keeps them), else Flat and ip; one given that is not the index's is
    refused when the index is opened."""
    return dataclasses.replace(cfg, index=cfg.factory(stored.factory if stored else None),
                               metric=cfg.metric or (stored.metric if stored else METRIC))


def settled_chunking(index: Manifest | None, cfg: IndexConfig, max_tokens: int, where: str) -> dict:
    """How this run cuts texts into chunks, ``{"tokens", "overlap"}``: as given, else as
    the index it updates (``index``, its manifest; None for a new one), else the defaults;
    the size capped at the model's ``max_tokens``. An index's chunks stay one size and
    overlap (search would rank chunks of two sizes against each other, and a text's chunks
    would no longer be cut alike), so settings other than the index's are refused, and an
    index with vectors that does not record its own (made before it was kept) is updated
    only with both given."""
    stored = index.chunking if index is not None else {}
    if index is not None and not stored and index.segments and None in (cfg.chunk_tokens, cfg.overlap):
        raise ConfigError(f"the index at {where!r} does not record how its texts were cut into chunks (an "
                          "older embedingest made it): give the --chunk-tokens and --overlap it was built with "
                          "(they are kept from then on), or --overwrite to rebuild it")
    if stored and stored["tokens"] > max_tokens:
        raise ConfigError(f"the index at {where!r} cuts texts into chunks of {stored['tokens']} tokens, more than "
                          f"this model takes ({max_tokens}): use the model it was built with, or --overwrite to "
                          "rebuild it")
    asked, overlap = cfg.chunking(stored)
    tokens = min(asked, max_tokens)
    if overlap >= tokens:
        raise SettingError(f"overlap={overlap} must be smaller than the chunk size {tokens} (chunk-tokens "
                          f"{asked}, the model takes at most {max_tokens}): give a smaller --overlap")
    if stored and (tokens, overlap) != (stored["tokens"], stored["overlap"]):
        raise ConfigError(f"the index at {where!r} cuts texts into chunks of {stored['tokens']} tokens "
                          f"overlapping by {stored['overlap']}, not {tokens} by {overlap}: leave out "
                          f"--chunk-tokens and --overlap (or give {stored['tokens']} and "
                          f"{stored['overlap']}) to update it, or --overwrite to rebuild it cut the new way")
    return {"tokens": tokens, "overlap": overlap}


def settled_settings(manifest: Manifest, cfg: IndexConfig, max_tokens: int, where: str) -> tuple[dict, IndexConfig]:
    """What the manifest of the index at ``where`` keeps after this run (its prompts,
    chunking and search defaults, each the index's or refused when it would change them),
    and ``cfg`` with those the run uses made concrete."""
    settings = {"prompts": settled_prompts(manifest, cfg, where),
                "chunking": settled_chunking(manifest, cfg, max_tokens, where),
                "search": search_defaults(manifest, cfg)}
    return settings, dataclasses.replace(cfg, doc_prompt=settings["prompts"]["document"],
                                         chunk_tokens=settings["chunking"]["tokens"],
                                         overlap=settings["chunking"]["overlap"])


def settled_embeddings(store: ShardStore, cfg: IndexConfig, where: str) -> IndexConfig:
    """``cfg`` with ``save_embeddings`` as the index at ``where`` (``store``) needs it: an
    index that keeps its vectors' embeddings keeps them for every shard (``reindex`` and
    ``export`` read them all). One whose vectors have none is refused them: the run would
    save those of new files only, and the index could still be neither reindexed nor
    exported with them."""
    shards = [s for s in store.committed() if s.rows]
    if any(s.has_embeddings for s in shards):
        return dataclasses.replace(cfg, save_embeddings=True)
    if cfg.save_embeddings and shards:
        vectors = sum(s.rows for s in shards)
        raise ConfigError(f"the index at {where!r} keeps no embeddings of its {vectors} vectors (it was built "
                          "without --save-embeddings), and this run would save those of new files only: "
                          "leave out --save-embeddings to update it, or --overwrite to rebuild it with "
                          "every embedding saved")
    return cfg


def check_search_params(dim: int, factory: str, metric: str, params: str | None) -> str | None:
    """``--search-params`` ``params`` as the index keeps them (None, blank: none);
    SettingError (a bad option: usage status 2) unless they apply to ``factory``, an
    nprobe above its lists included (faiss cut it silently): a build checks them before
    its first write, and again against the index it updates."""
    from ...index.faiss_factory import SearchParamOutOfRange

    if params is None or not params.strip():
        return None
    try:
        return apply_search_params(parse_factory(dim, factory, metric), params, within_lists=True)
    except SearchParamOutOfRange as exc:
        raise SettingError(f"--search-params {params!r} do not apply to index {factory!r}: {exc}") from exc
    except ValueError as exc:
        raise SettingError(f"--search-params {params!r} do not apply to index {factory!r}: {exc}; "
                           "nprobe is for IVF factories, efSearch for HNSW") from exc


def search_defaults(manifest: Manifest, cfg: IndexConfig) -> dict:
    """The index's search defaults updated with those given (``search_params=""`` drops
    the stored parameters); parameters are checked against the factory now, not at the
    first search."""
    search = dict(manifest.search)
    if cfg.search_params is not None:
        search.pop("params", None)
        params = check_search_params(manifest.dim, manifest.factory, manifest.metric, cfg.search_params)
        if params:
            search["params"] = params
    if cfg.search_k is not None:
        search["k"] = cfg.search_k
    return search


def fingerprint(store: ShardStore) -> str:
    h = hashlib.sha256()
    for key, unit in sorted(store.units().items()):
        if unit.status == "done":
            h.update(f"{key}\0{unit.sha256}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def settled_fields(index: Manifest | None, cfg: IndexConfig, where: str) -> dict:
    """The record fields this run reads texts and ids from, ``{"text", "id"}``: those given,
    else the index's (``index``, its manifest; None for a new one), else the defaults. An
    index reads every record alike, so fields other than those it records are refused (its
    unchanged files would stay read one way and the others be read another); an index
    from before they were kept takes the run's, and keeps them."""
    recorded = index.record_fields if index is not None else {}
    fields = cfg.record_fields(recorded)
    for role, option in (("text", "--text-field"), ("id", "--id-field")):
        if recorded and fields[role] != recorded[role]:
            raise ConfigError(f"the index at {where!r} reads the {role} of its records from the field "
                              f"{recorded[role]!r}, not {fields[role]!r}: leave out {option} (or give "
                              f"{option} {shell_quote(recorded[role])}) to update it, or --overwrite to rebuild it "
                              f"with the new field")
    return fields


def reading(cfg: IndexConfig, fields: dict) -> IndexConfig:
    """``cfg`` with the record fields ``fields`` (:func:`settled_fields`) made concrete."""
    return dataclasses.replace(cfg, text_field=fields["text"], id_field=fields["id"])


def refuse_unfit_chunks_of(model, stored: Manifest | None, cfg: IndexConfig, chunking: dict) -> None:
    """SettingError unless the run's chunks (``chunking``) hold the model's special tokens,
    the document prompt (the index's, else the run's) and the overlap with room for text:
    checked with the model's own tokenizer before the folder is touched (a loader worker
    found it only after the manifest had recorded the chunking)."""
    path = model.info()["path"]
    prompt = (stored.prompts.get("document", "") if stored is not None
              else Prompts.read(path).resolve(cfg.doc_prompt)["document"])
    tokenizer = getattr(model, "tokenizer", None) or load_tokenizer(path)
    refuse_unfit_chunks(tokenizer, chunking["tokens"], chunking["overlap"], prompt, model.max_seq_length)

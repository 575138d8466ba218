"""Read, chunk and batch text in DataLoader workers, so the GPU never waits on Python.

Use it as ``DataLoader(TextChunkDataset(units, model_dir), batch_size=None,
num_workers=N, pin_memory=True)``: the dataset makes whole batches itself. Unit ``i`` of
the list goes to worker ``i % N``; each worker loads its own tokenizer (the dataset is
pickled with the model folder, not the tokenizer), reads its units with
:func:`~embedingest.sources.text.iter_records`, cuts them with
:class:`~embedingest.stages.fast_chunker.FastChunker` (the chunks of the model's own
tokenizer, with the ids from nanotoken where it gives exactly those), and keeps a window
of chunks sorted by length so each batch holds chunks of similar length and padding stays
small.

Each yielded item is a dict:

* ``input_ids``, ``attention_mask``: ``LongTensor[B, L]``, padded with the tokenizer's
  pad id to the longest chunk of the batch;
* ``ids``: ``LongTensor[B]``, the vector id of each chunk, ``unit_no << 32 | chunk_no``
  (``chunk_no`` counts the chunks of a unit across all its records, from 0);
* ``chunks``: a :class:`Chunks` of B rows ``{id, unit_no, record_id, chunk_no,
  char_start, char_end, text, source}`` as one Arrow record batch in bytes (iterate
  it for dicts). It is neither a list nor a dict on purpose: the DataLoader's
  pin-memory thread would walk every element of those while holding the GIL;
* ``units_done``: ``(unit_no, n_chunks)`` pairs (the DataLoader turns the tuples into
  2-item lists) for every unit whose last chunk is in this item or an earlier one;
  every unit appears exactly once over the whole iteration, units with no chunks too
  (with 0), so a caller can checkpoint progress by unit;
* ``unit_hashes``: ``(unit_no, sha256)`` of the units of ``units_done`` that this worker
  hashed: a file unit given without its hash (``Unit.sha256`` None, as the plan leaves
  new files) is hashed by the worker that reads it, so no one process reads every file
  twice; a file that cannot be hashed is skipped whole, as one that cannot be read;
* ``skipped``: ``(where, reason)`` for the bad inputs met since the previous item: the
  reasons of :func:`~embedingest.sources.text.iter_records`, plus ``empty`` for a text
  with no tokens and ``read`` for an unexpected error, which skips the rest of a unit.

An item may carry bookkeeping only: then B is 0 and ``input_ids``/``attention_mask`` have
shape ``[0, 0]`` and ``ids`` shape ``[0]``; such an item comes only at the end of a
worker's units, when the last units had no chunks left to carry their bookkeeping.

A text file larger than :data:`STREAM_ABOVE` is read and chunked a block at a time, and
a long text is chunked lazily, so a worker's memory does not grow with one input's size.
A NUL character is read as U+FFFD (:data:`NUL_AS`), in texts and record ids alike.

Every worker gets a pickled copy of the whole unit list, memory texts included, so
large in-memory corpora are better given as files.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import ConfigError
from ..index.shards import decode_chunks, encode_chunks
from ..stages.chunker import DEFAULT_PIECE_CHARS, Chunk, Chunker
from ..stages.fast_chunker import FastChunker
from ..stages.tokenizer import load_tokenizer
from .file_parts import part_count
from .files import file_sha256, os_error_reason, reads_within
from .text import empty_reason, iter_records, lone_surrogate, splittable, text_format

log = logging.getLogger("embedingest")

MAX_UNIT_NO = 2**31 - 1
MAX_CHUNKS_PER_UNIT = 2**32


@dataclass(frozen=True)
class Unit:
    """One piece of work: a file (``path``) or a text held in memory (``text``).

    ``unit_no`` is the high half of the vector ids of its chunks, so it must be unique
    in a run and below 2**31 (ids are signed 64-bit); ``key`` names the unit in
    manifests and in the skip report of a memory unit.
    """

    unit_no: int
    key: str
    path: str | None = None
    text: str | None = None
    record_id: str | None = None
    sha256: str | None = None  # of the file's bytes; None: the worker that reads it hashes it
    size: int | None = None  # the file's size when the run planned it (None: not known)
    # the folder the file must still lie in when it is read (a real path; None: no check),
    # see sources.files.reads_within
    within: str | None = None

    def __post_init__(self):
        if not isinstance(self.unit_no, int) or not 0 <= self.unit_no <= MAX_UNIT_NO:
            raise ConfigError(f"unit_no={self.unit_no!r} of unit {self.key!r} must be an "
                              f"integer from 0 to {MAX_UNIT_NO}")
        if (self.path is None) == (self.text is None):
            raise ConfigError(f"unit {self.key!r} must have exactly one of path and text")


RECORDS_PER_CALL = 256  # records tokenized by one encode_batch call
# Whole-text files (.txt, .md, .rst) larger than this, decompressed, are read and chunked a
# block at a time: memory stays the same whatever their size.
STREAM_ABOVE = 4 * 2**20
# The metadata store cuts a text at a NUL character, so a chunk stored with one would not
# be its span: NUL is read as the replacement character, which tokenizers drop as they
# drop NUL (the chunk's tokens, and so its vector, are the same).
NUL_AS = "\ufffd"

CHUNK_FIELDS = ("id", "unit_no", "record_id", "chunk_no", "char_start", "char_end", "text")


class Chunks:
    """The metadata of one batch's chunks: one Arrow IPC record batch of the shard
    schema (:data:`~embedingest.index.shards.CHUNK_SCHEMA`), made here in the worker.

    The process that feeds the device hands these bytes to the engine with the batch's
    vectors (:class:`~embedingest.index.shards.BatchMeta`), and the shard writer that
    gets the batch decodes them: no process but the writer handles a row per chunk.
    An object that is not a ``Sequence`` or ``Mapping`` passes the DataLoader's
    pin-memory step untouched. ``n_docs`` counts the records whose first chunk is in
    this batch. Iterating decodes the rows, as dicts of :data:`CHUNK_FIELDS` and
    ``source`` (the unit's key).
    """

    __slots__ = ("data", "n_docs", "n")

    def __init__(self, rows: Sequence[tuple], sources: Mapping[int, str]):
        """``rows``: tuples of the :data:`CHUNK_FIELDS` values, then whether the chunk is
        its record's first; ``sources``: unit_no -> the unit's key."""
        self.data = encode_chunks([r[0] for r in rows], [sources[r[1]] for r in rows],
                                  [r[2] for r in rows], [r[3] for r in rows],
                                  [r[4] for r in rows], [r[5] for r in rows], [r[6] for r in rows])
        self.n_docs = sum(r[-1] for r in rows)
        self.n = len(rows)

    def __len__(self) -> int:
        return self.n

    def rows(self) -> list[dict]:
        """The rows, decoded (as :data:`CHUNK_FIELDS` and ``source``)."""
        return [{"id": r["id"], "unit_no": r["id"] >> 32, "record_id": r["record_id"],
                 "chunk_no": r["chunk_no"], "char_start": r["span_start"], "char_end": r["span_end"],
                 "text": r["text"], "source": r["source"]} for r in decode_chunks(self.data).to_pylist()]

    def __getitem__(self, i: int) -> dict:
        return self.rows()[i]

    def __iter__(self):
        return iter(self.rows())


def _stepped_within(items: Iterator, within: str | None) -> Iterator:
    """``items`` (a reader's generator), each step run inside ``reads_within(within)``:
    the check holds while the reader opens and reads, and is off again at each yield, so
    generators left open (a loader stopped early) cannot leave it set or unset for others."""
    while True:
        with reads_within(within):
            try:
                item = next(items)
            except StopIteration:
                return
        yield item


def plan_parts(units: Sequence[Unit], max_parts: int) -> dict[int, tuple[int, int]]:
    """``{unit_no: (parts, size)}`` for the files of ``units`` that ``max_parts`` workers
    read in parts (:func:`~embedingest.sources.file_parts.part_count`, at the size the
    plan saw, else the size they have now); the others are read whole, each by one worker."""
    if max_parts < 2:
        return {}
    sizes: dict[int, int] = {}
    pdfs: set[int] = set()
    for unit in units:
        if unit.path is not None and splittable(unit.path):
            try:
                sizes[unit.unit_no] = unit.size if unit.size is not None else os.stat(unit.path).st_size
            except OSError:
                continue  # its worker reports it
            if text_format(unit.path)[0] == ".pdf":
                pdfs.add(unit.unit_no)
    share = sum(sizes.values()) // max_parts
    counts = {u: (part_count(size, max_parts, share, pdf=u in pdfs), size) for u, size in sizes.items()}
    return {u: c for u, c in counts.items() if c[0] > 1}


def merge_parts(items: Iterable[dict]) -> Iterator[dict]:
    """The loader's ``items`` with the parts of each file read in parts joined: the
    file's ``(unit_no, n_chunks)`` (and the hash its part 0 made) join ``units_done``
    (``unit_hashes``) of the item that brings the last of its parts' ends, so it finishes
    once, after all its chunks, as any unit does; a file none of whose parts met a
    record or a problem is reported empty (:func:`~.text.empty_reason`), as one read whole is."""
    pending: dict[int, list] = {}
    for item in items:
        for unit_no, _, parts, n, seen, path, sha in item.pop("parts_done", ()):
            got = pending.setdefault(int(unit_no), [0, 0, 0, ""])
            got[0], got[1], got[2] = got[0] + 1, got[1] + int(n), got[2] + int(seen)
            got[3] = str(sha) or got[3]
            if got[0] < int(parts):
                continue
            del pending[int(unit_no)]
            item["units_done"] = [*item["units_done"], (int(unit_no), got[1])]
            if got[3]:
                item["unit_hashes"] = [*item["unit_hashes"], (int(unit_no), got[3])]
            if not got[2]:
                item["skipped"] = [*item["skipped"], (str(path), empty_reason(path))]
        yield item


class JoinedParts:
    """A loader (any iterable of the dataset's items) iterated through :func:`merge_parts`."""

    def __init__(self, loader: Iterable[dict]):
        self.loader = loader

    def __iter__(self) -> JoinedIterator:
        return JoinedIterator(iter(self.loader))


class JoinedIterator:
    """An iteration of :class:`JoinedParts`: ``inner`` is the loader's own iterator (its
    worker processes already started when it was made)."""

    def __init__(self, inner: Iterator[dict]):
        self.inner = inner
        self._items = merge_parts(inner)

    def __iter__(self) -> JoinedIterator:
        return self

    def __next__(self) -> dict:
        return next(self._items)

    def close(self) -> None:
        """Stop the loader's worker processes now, not when it is collected."""
        shutdown = getattr(self.inner, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class TextChunkDataset(IterableDataset):
    """Batches of token chunks from ``units`` (see the module docstring)."""

    def __init__(self, units: Sequence[Unit], model_dir: str | os.PathLike, *,
                 batch_size: int = 64, max_tokens: int = 256, overlap: int = 32,
                 window: int | None = None, max_batch_tokens: int | None = None,
                 text_field: str = "text", id_field: str = "id",
                 piece_chars: int = DEFAULT_PIECE_CHARS,
                 tokenizer_loader: Callable[[str], object] = load_tokenizer,
                 pad_multiple: int = 16, fast_chunker: bool = True,
                 parts: Mapping[int, tuple[int, int]] | None = None):
        """``tokenizer_loader(model_dir)`` runs in each worker (a module-level function:
        it is pickled); the default loads the tokenizer exactly as the encoder uses it.
        Batches are padded to a multiple of ``pad_multiple`` tokens: a few shapes instead
        of one per length, so the GPU libraries pick their kernels once, not per batch.
        ``fast_chunker`` takes token ids from nanotoken where it gives exactly the model's
        tokens (:class:`~embedingest.stages.fast_chunker.FastChunker`); False forces the
        model's own tokenizer for every text (the same chunks, slower). ``parts``:
        ``{unit_no: (parts, size)}`` for the files to read in parts (:func:`plan_parts`),
        each part by another worker; iterate :func:`merge_parts` over the loader then."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} must be a positive integer")
        window = 16 * batch_size if window is None else window
        if not isinstance(window, int) or window < batch_size:
            raise ConfigError(f"window={window!r} must be an integer of at least "
                              f"batch_size={batch_size}")
        if max_batch_tokens is not None and (not isinstance(max_batch_tokens, int)
                                             or max_batch_tokens < max_tokens):
            raise ConfigError(f"max_batch_tokens={max_batch_tokens!r} must be at least "
                              f"max_tokens={max_tokens}, or one chunk could not fit a batch")
        seen: set[int] = set()
        for unit in units:
            if unit.unit_no in seen:
                raise ConfigError(f"unit_no {unit.unit_no} is given twice (unit "
                                  f"{unit.key!r}); unit numbers must be unique")
            seen.add(unit.unit_no)
        self.units = list(units)
        self.model_dir = str(model_dir)
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.overlap = overlap
        self.window = window
        self.max_batch_tokens = max_batch_tokens
        self.text_field = text_field
        self.id_field = id_field
        self.piece_chars = piece_chars
        self.tokenizer_loader = tokenizer_loader
        self.pad_multiple = max(1, int(pad_multiple))
        self.fast_chunker = bool(fast_chunker)
        # unit_no -> (parts, planned size, its chunk counter's slot)
        split = [(u, n, size) for u, (n, size) in (parts or {}).items() if n > 1]
        self.parts = {u: (n, size, slot) for slot, (u, n, size) in enumerate(split)}
        # The next chunk number of each file read in parts, shared by its parts' workers
        # (made before they fork), so its chunks are numbered 0..n-1 as any unit's are.
        self.counters = multiprocessing.RawArray("q", len(self.parts)) if self.parts else None
        self.counters_lock = multiprocessing.Lock() if self.parts else None

    def work(self) -> list[tuple[Unit, int, int]]:
        """``(unit, part, parts)`` of every piece of work, in order: a file read in parts
        gives one piece per part, next to each other, so no worker gets two parts of one
        file (parts never outnumber the workers, :func:`plan_parts`)."""
        return [(unit, p, n) for unit in self.units
                for n in (self.parts.get(unit.unit_no, (1,))[0],) for p in range(n)]

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            # Parallelism comes from the worker processes: a Rust thread pool per worker
            # as well would put cores x workers threads on the cores.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        tokenizer = self.tokenizer_loader(self.model_dir)
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            pad_id = tokenizer.eos_token_id
        if pad_id is None:
            raise ConfigError(f"the tokenizer in {self.model_dir!r} has neither a pad nor an "
                              f"eos token to pad batches with")
        chunker = FastChunker(tokenizer, self.max_tokens, self.overlap, self.piece_chars,
                              fast=self.fast_chunker, arrays=True)
        if chunker.fast_missed and worker == 0:
            log.warning("the fast chunker is off (%s): the model's own tokenizer cuts every "
                        "text, the same chunks several times slower; `pip install nanotoken` "
                        "(a dependency of embedingest) to turn it on", chunker.fallback_reason)
        return _WorkerBatches(self, chunker, pad_id).run(self.work()[worker::workers])


class _WorkerBatches:
    """The state of one worker: the window of chunks and the bookkeeping of units."""

    def __init__(self, ds: TextChunkDataset, chunker: Chunker, pad_id: int):
        self.ds = ds
        self.chunker = chunker
        self.pad_id = pad_id
        self.window: list[tuple[Sequence[int], tuple]] = []
        self.in_window: dict[int, int] = {}
        self.total: dict[int, int] = {}
        self.reading: int | None = None
        self.done: list[tuple[int, int]] = []
        self.hashes: dict[int, str] = {}  # unit_no -> sha256 of the units hashed here, until done
        self.hashed: list[tuple[int, str]] = []
        self.skipped: list[tuple[str, str]] = []
        self.sources: dict[int, str] = {}  # unit_no -> key, of this worker's units
        self.part_of: dict[int, tuple[int, int, str]] = {}  # unit_no -> (part, parts, path) read here
        self.seen: dict[int, int] = {}  # unit_no -> records and skips met, of parts
        self.parts_done: list[tuple] = []
        # The window starts at one batch and doubles up to its full size, so the first
        # batch leaves after one batch's worth of chunks, not a whole window's (with a
        # dozen workers each filling 16 batches first, the GPU would wait seconds).
        self.limit = min(ds.window, ds.batch_size)

    def run(self, work: list[tuple[Unit, int, int]]) -> Iterator[dict]:
        self.sources = {unit.unit_no: unit.key for unit, _, _ in work}
        for unit, part, parts in work:
            u = self.reading = unit.unit_no
            self.in_window[u] = self.total[u] = 0
            if parts > 1:
                self.part_of[u], self.seen[u] = (part, parts, unit.path), 0
            for input_ids, chunk in self._unit_chunks(unit, part, parts):
                if len(self.window) >= self.limit:
                    yield from self._flush(final=False)
                    self.limit = min(self.ds.window, 2 * self.limit)
                self.window.append((input_ids, chunk))
                self.in_window[u] += 1
                self.total[u] += 1
            self.reading = None
            if self.in_window[u] == 0:
                self._finish(u)
        yield from self._flush(final=True)
        if self.done or self.skipped or self.parts_done:
            yield self._item([])

    def _finish(self, unit_no: int) -> None:
        del self.in_window[unit_no]
        n = self.total.pop(unit_no)
        if unit_no in self.part_of:
            part, parts, path = self.part_of.pop(unit_no)
            self.parts_done.append((unit_no, part, parts, n, self.seen.pop(unit_no), path,
                                    self.hashes.pop(unit_no, "")))
            return
        self.done.append((unit_no, n))
        if unit_no in self.hashes:
            self.hashed.append((unit_no, self.hashes.pop(unit_no)))

    def _chunk_no(self, unit_no: int, local: int) -> int:
        """The number of a unit's next chunk, ``local`` its number in what this worker
        read of it: for a file read in parts, the next of the parts' shared counter."""
        if unit_no not in self.part_of:
            return local
        slot = self.ds.parts[unit_no][2]
        with self.ds.counters_lock:
            n = self.ds.counters[slot]
            self.ds.counters[slot] = n + 1
        return n

    def _unit_chunks(self, unit: Unit, part: int = 0, parts: int = 1
                     ) -> Iterator[tuple[Sequence[int], tuple]]:
        """``(input_ids, chunk row)`` for every chunk of ``unit`` (a row as :class:`Chunks`
        takes it), of its part ``part`` of ``parts``; bad input is reported. Part 0 hashes
        the file."""
        where = unit.path if unit.path is not None else unit.key
        if unit.text is not None:
            problem = lone_surrogate(unit.text) or lone_surrogate(unit.record_id or "")
            if problem:
                self._skip(where, f"unicode: the text or its id holds {problem}")
                return
            records = iter([(unit.record_id or "", unit.text)])
        else:
            if unit.sha256 is None and part == 0:
                try:  # before the read: the page cache then serves the read
                    with reads_within(unit.within):
                        self.hashes[unit.unit_no] = file_sha256(
                            unit.path, self.ds.parts[unit.unit_no][1] if parts > 1 else None)
                except OSError as exc:
                    self._skip(where, os_error_reason(exc))
                    return
            records = _stepped_within(iter_records(
                unit.path, text_field=self.ds.text_field, id_field=self.ds.id_field,
                on_skip=self._skip, stream_above=STREAM_ABOVE,
                part=(part, parts, self.ds.parts[unit.unit_no][1]) if parts > 1 else None), unit.within)
        local = 0
        try:
            for record_id, chunks in self._record_chunks(records):
                if unit.unit_no in self.seen:
                    self.seen[unit.unit_no] += 1
                first = True
                for chunk, text in chunks:
                    chunk_no = self._chunk_no(unit.unit_no, local)
                    if chunk_no >= MAX_CHUNKS_PER_UNIT:
                        self._skip(where, f"limit: more than {MAX_CHUNKS_PER_UNIT} chunks "
                                          f"in one unit; the rest of it is skipped")
                        return
                    yield chunk.input_ids, (
                        unit.unit_no << 32 | chunk_no, unit.unit_no, record_id, chunk_no,
                        chunk.char_start, chunk.char_end, text, first)
                    local += 1
                    first = False
                if first:
                    label = f"{where}:{record_id}" if record_id else where
                    self._skip(label, "empty: the text has no tokens")
        except Exception as exc:  # a bug or a library error on odd input must not end the run
            self._skip(where, f"read: {type(exc).__name__}: {exc}; the rest of the unit "
                              f"is skipped")

    def _record_chunks(self, records: Iterable[tuple[str, str | Iterable[str]]]
                       ) -> Iterator[tuple[str, Iterator[tuple[Chunk, str]]]]:
        """``(record_id, its (chunk, text) pairs)`` in record order. Texts that fit one
        piece are tokenized a group at a time (one call each); a longer text, or one
        streamed from its file, is chunked lazily, so it is never held as chunks whole.
        NUL characters are read as U+FFFD (see :data:`NUL_AS`)."""
        group: list[tuple[str, str]] = []
        for record_id, text in records:
            record_id = record_id.replace("\0", NUL_AS)
            if isinstance(text, str) and len(text) <= self.chunker.piece_chars:
                group.append((record_id, text.replace("\0", NUL_AS)))
                if len(group) == RECORDS_PER_CALL:
                    yield from self._group_chunks(group)
                    group = []
                continue
            yield from self._group_chunks(group)
            group = []
            text = (text.replace("\0", NUL_AS) if isinstance(text, str)
                    else (part.replace("\0", NUL_AS) for part in text))
            yield record_id, self.chunker.iter_text(text)
        yield from self._group_chunks(group)

    def _group_chunks(self, group: list[tuple[str, str]]
                      ) -> Iterator[tuple[str, Iterator[tuple[Chunk, str]]]]:
        if group:
            chunked = self.chunker.chunk_many([text for _, text in group])
            for (record_id, text), chunks in zip(group, chunked):
                yield record_id, ((c, text[c.char_start:c.char_end]) for c in chunks)

    def _skip(self, where: str, reason: str) -> None:
        self.skipped.append((str(where), reason))
        if self.reading in self.seen:
            self.seen[self.reading] += 1

    def _flush(self, final: bool) -> Iterator[dict]:
        """Yield the window as length-sorted batches; unless ``final``, keep back the
        last batch when it is not full, to be filled by the chunks still to come."""
        ds = self.ds
        self.window.sort(key=lambda entry: len(entry[0]))
        batches: list[list[tuple[Sequence[int], tuple]]] = []
        batch: list[tuple[Sequence[int], tuple]] = []
        for entry in self.window:
            if batch and ds.max_batch_tokens is not None \
                    and (len(batch) + 1) * self._width(len(entry[0])) > ds.max_batch_tokens:
                batches.append(batch)
                batch = []
            batch.append(entry)
            if len(batch) == ds.batch_size:
                batches.append(batch)
                batch = []
        if final and batch:
            batches.append(batch)
            batch = []
        self.window = batch
        for full in batches:
            yield self._item(full)

    def _width(self, longest: int) -> int:
        """Padded width of a batch whose longest chunk has ``longest`` tokens."""
        m = self.ds.pad_multiple
        return min(-(-longest // m) * m, max(longest, self.ds.max_tokens))

    def _item(self, batch: list[tuple[Sequence[int], tuple]]) -> dict:
        # One copy of all the batch's ids into place: the fast chunker's arrays are not
        # converted one Python int at a time.
        lengths = np.fromiter((len(ids) for ids, _ in batch), np.int64, count=len(batch))
        width = self._width(int(lengths.max()) if len(batch) else 0)
        mask = np.arange(width) < lengths[:, None]
        input_ids = np.full((len(batch), width), self.pad_id, dtype=np.int64)
        if len(batch):
            input_ids[mask] = np.concatenate([np.asarray(ids, dtype=np.int64) for ids, _ in batch])
        attention_mask = mask.astype(np.int64)
        rows = [chunk for _, chunk in batch]
        chunks = Chunks(rows, self.sources)
        for unit_no in (row[1] for row in rows):
            self.in_window[unit_no] -= 1
            if self.in_window[unit_no] == 0 and unit_no != self.reading:
                self._finish(unit_no)
        item = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "ids": torch.tensor([row[0] for row in rows], dtype=torch.long),
            "chunks": chunks,
            "units_done": self.done,
            "unit_hashes": self.hashed,
            "skipped": self.skipped,
            "parts_done": self.parts_done,
        }
        self.done, self.hashed, self.skipped, self.parts_done = [], [], [], []
        return item

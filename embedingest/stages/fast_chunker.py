"""The chunker's fast exact path: token ids from nanotoken, character spans only at window edges.

The model's own tokenizer (``tokenizers``, Rust WordPiece with offsets) spends most of its
time on per-token offset bookkeeping, and a chunk needs only two offsets: where its first
token starts and where its last ends. :class:`FastChunker` gives exactly the chunks of
:class:`~embedingest.stages.chunker.Chunker` (same ids, windows, overlap and spans) this way:

1. Each text is cut into pieces of about :data:`PIECE_CHARS` characters, just before a
   space, tab or line break. For BERT's normalizer and pre-tokenizer these are hard
   boundaries (the added tokens hold no whitespace), so the pieces' ids joined are the
   text's ids. A stretch without whitespace longer than a reference piece is cut where
   :class:`Chunker` cuts it, so the ids stay the reference's there too.
2. nanotoken (a Rust WordPiece that reads the model's tokenizer.json) encodes the pieces of
   a group of texts in one call: a flat array of ids and the row offsets of the pieces.
3. For a window's first and last token, the row offsets name the piece. In a piece of
   plain printable ASCII (no control character, no added token written as text) the
   token's offsets follow from the ids alone: BERT cuts such text into runs of letters
   and digits and single punctuation characters, a word piece covers as many characters
   as its vocabulary string (less the ``##``), and the unknown token its whole word. Any
   other piece (about 30 tokens) is encoded once more by the model's own tokenizer, with
   offsets, and its ids are checked against nanotoken's.

The model's own tokenizer (through :class:`Chunker`) stays the reference, and does the work
where the fast path cannot vouch for the result: nanotoken is not installed, the tokenizer is
not BERT's WordPiece, nanotoken refuses it or gives other ids on a start-up check, or a
text (for a text streamed in parts: a segment of it) with a piece at a window edge whose
ids disagree. Each of these falls back silently; :attr:`FastChunker.fallback_reason` says
why the whole path is off. A text streamed in parts (a large file read a block at a time)
takes the fast path a segment at a time (:meth:`FastChunker.iter_text`).
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from collections.abc import Iterable, Iterator

import numpy as np

from .chunker import _UP_TO_LAST_SPACE, DEFAULT_PIECE_CHARS, Chunk, Chunker, _cut, bert_text_rules

PIECE_CHARS = 128  # characters a piece holds, about: what a non-ASCII window edge re-encodes
GROUP_PIECES = 1 << 16  # pieces per nanotoken call at most (texts are not split across calls)
SEGMENT_CHARS = 1 << 20  # characters of a streamed text tokenized at a time, about
NANOTOKEN_CACHE = 1 << 16  # entries per level of nanotoken's word cache (its default grows large)

# BERT's pre-tokenizer on printable ASCII: runs of letters and digits, single punctuation.
_ASCII_PRE = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9 \t\n\r]")
_SPACE = re.compile(r"[ \t\n\r]")  # where BERT's words end for sure, as for Chunker's pieces
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_SPACES = " \t\n\r"  # the only whitespace of a plain piece (_CONTROL excludes the rest)
_NOT_SPACE = np.ones(256, dtype=bool)
_NOT_SPACE[[ord(c) for c in _SPACES]] = False
# Strings that have tripped tokenizers: the start-up check encodes them with both.
_CHECK = [
    "Hello, World! It's 3.14 o'clock; x[SEP]y [CLS] [cls] [MASK]s",
    "ünïcödé Crème brûlée ΣΑΣ ß İstanbul ﬁne Å e\u0301 東京都 한국어 ภาษาไทย",
    "emoji \U0001F600 \U0001F44D\U0001F3FD \U0001F468\u200d\U0001F469\u200d\U0001F467 \u2764\ufe0f",
    "ctl\x00a\x01b\x0bc\x0cd\x1be\x7ff\x85g \u200b\ufeff\u00a0\u3000\u00ad h\ti\r\nj",
    "a" * 99 + " " + "b" * 100 + " " + "c" * 101 + " internationalization antidisestablishment",
]


class FastChunker(Chunker):
    """:class:`Chunker` with the fast exact path (see the module docstring); the same
    arguments, the same chunks. ``fast=False`` forces the model's own tokenizer.

    ``arrays=True`` gives the fast path's ``input_ids`` as int64 numpy arrays instead of
    lists (the same values): a batch is then assembled without one Python int per token.
    Texts that take the reference path still come as lists.
    """

    def __init__(self, tokenizer, max_tokens: int = 256, overlap: int = 32,
                 piece_chars: int = DEFAULT_PIECE_CHARS, max_chars: int | None = None, *,
                 fast: bool = True, arrays: bool = False):
        super().__init__(tokenizer, max_tokens, overlap, piece_chars, max_chars)
        self.arrays = arrays
        self._special_arrays = np.array(self.prefix, np.int64), np.array(self.suffix, np.int64)
        self._nt = None
        self.fallback_reason: str | None = "fast=False was asked for"
        self._covered = False  # the tokenizer is one the fast path covers
        if fast:
            spec_text = self._tok.to_str()
            spec = json.loads(spec_text)
            self.fallback_reason = _spec_problem(spec)
            self._covered = self.fallback_reason is None
            if self._covered:
                self._nt, self.fallback_reason = _nanotoken_for(self._tok, spec_text)
            if self._nt is not None:
                self._edges = _EdgeOffsets(self._tok, spec)

    @property
    def fast_missed(self) -> bool:
        """Whether the fast path is off for a tokenizer it covers (nanotoken missing, or
        refusing it, or giving other ids): the same chunks, several times slower."""
        return self._covered and self._nt is None

    @property
    def fast(self) -> bool:
        """Whether the fast path is on (else every text takes the model's own tokenizer)."""
        return self._nt is not None

    def chunk(self, text: str) -> list[Chunk]:
        if self._nt is None:
            return super().chunk(text)
        return self.chunk_many([text])[0]

    def iter_chunks(self, text: str) -> Iterator[Chunk]:
        if self._nt is None:
            yield from super().iter_chunks(text)
        else:
            yield from self.chunk(text)

    def iter_text(self, text: str | Iterable[str]) -> Iterator[tuple[Chunk, str]]:
        """As :meth:`Chunker.iter_text`. A text streamed in parts is cut into segments of
        about :data:`SEGMENT_CHARS` characters where its tokens do not change (see
        :meth:`_segments`), each taking the fast path, with windows across their joins:
        memory stays bounded by a few segments."""
        if self._nt is None:
            yield from super().iter_text(text)
        elif isinstance(text, str):
            for chunk in self.chunk(text):
                yield chunk, text[chunk.char_start:chunk.char_end]
        else:
            yield from self._stream_fast(text)

    def _segments(self, parts: Iterable[str]) -> Iterator[tuple[int, str]]:
        """``(offset, segment)`` covering the text the ``parts`` make. A segment ends just
        before its buffer's last space, tab or line break (a hard boundary, as between
        :meth:`_cut_points`' pieces); a buffer with none after its first character lies
        inside a stretch without whitespace, which started at that first character or
        just after it: it ends where :meth:`Chunker._cut_at` cuts the stretch from there,
        as the reference cuts it. So each segment starts where the reference starts a
        piece, or at whitespace, and the segments' tokens joined are the text's."""
        held: list[str] = []
        size = base = 0
        for part in parts:
            if not part:
                continue
            held.append(part)
            size += len(part)
            if size < SEGMENT_CHARS:
                continue
            buf, a = "".join(held), 0
            while len(buf) - a >= SEGMENT_CHARS:
                cut = max(buf.rfind(c, a + 1) for c in " \t\n\r")
                if cut > a:
                    yield base, buf[a:cut]
                    base, a = base + cut - a, cut
                    continue
                # No whitespace after buf[a]: pieces as the reference cuts the stretch,
                # up to the last piece, which may end in parts still to come.
                while len(buf) - a > self.piece_chars:
                    cut = self._cut_at(buf, a, len(buf))
                    yield base, buf[a:cut]
                    base, a = base + cut - a, cut
                break
            held, size = [buf[a:]], len(buf) - a
        if size:
            yield base, "".join(held)

    def _stream_fast(self, parts: Iterable[str]) -> Iterator[tuple[Chunk, str]]:
        """The chunks of a text given in parts, a segment at a time (see :meth:`iter_text`).

        Before a segment's windows are yielded, every piece the next windows may still
        ask offsets of (those after the next window's start) has its ids checked, so a
        disagreement can only come from the newest segment, whose windows are then made
        again from the model's own tokenizer; nothing yielded is taken back."""
        joined = _Joined([])
        pos = covered = 0
        for base, segment in self._segments(parts):
            try:
                grown = joined.plus(self._segment_doc(base, segment), base, segment)
                chunks, next_pos, next_covered = self._windows_of(grown, pos, covered, final=False)
                grown.check_from(next_pos)
            except _Mismatch:
                grown = joined.plus(_SlowDoc(self, base, segment), base, segment)
                chunks, next_pos, next_covered = self._windows_of(grown, pos, covered, final=False)
            for chunk in chunks:
                yield chunk, grown.text(chunk)
            joined = grown.drop(next_pos)
            pos, covered = 0, next_covered - next_pos
        for chunk in self._windows_of(joined, pos, covered, final=True)[0]:
            yield chunk, joined.text(chunk)

    def _segment_doc(self, base: int, segment: str) -> _Doc:
        """One segment through nanotoken, its offsets counted from the text's start."""
        cuts = self._cut_points(segment)
        pieces = [segment[a:b] for a, b in zip(cuts, cuts[1:])]
        flat, rows = self._nt.encode_batch(pieces, add_special_tokens=False, parallel=False)
        return _Doc(self._edges, [c + base for c in cuts], pieces, flat, rows.tolist())

    def chunk_many(self, texts: list[str]) -> list[list[Chunk]]:
        """The chunks of each text, as :meth:`Chunker.chunk` gives them; the texts' pieces
        go through nanotoken a group at a time."""
        if self._nt is None:
            return super().chunk_many(texts)
        out: list[list[Chunk] | None] = [None] * len(texts)
        group: list[tuple[int, list[int], int]] = []  # (text index, cuts, first row)
        pieces: list[str] = []
        for i, text in enumerate(texts):
            cuts = self._cut_points(text)
            group.append((i, cuts, len(pieces)))
            pieces.extend(text[a:b] for a, b in zip(cuts, cuts[1:]))
            if len(pieces) >= GROUP_PIECES:
                self._encode_group(texts, group, pieces, out)
                group, pieces = [], []
        if group:
            self._encode_group(texts, group, pieces, out)
        return out

    def _cut_points(self, text: str) -> list[int]:
        """0, the cuts, len(text): pieces of about :data:`PIECE_CHARS` characters, each
        cut just before a space, tab or line break (where the text's tokens do not
        change). A stretch with none of them is cut where the reference chunker cuts it
        (:meth:`Chunker._cut_at`, from the same start: the whitespace before the stretch
        or the text's start), so both give the same tokens there too."""
        longest = self.piece_chars
        size = min(PIECE_CHARS, longest)
        cuts, a, n = [0], 0, len(text)
        while n - a > size:
            m = _UP_TO_LAST_SPACE.match(text, a + 1, a + size)
            if m:
                c = m.end() - 1
            else:  # text[a + 1:a + size] is part of a stretch without whitespace
                after = _SPACE.search(text, a + size)
                c = after.start() if after else n
                k = a
                while c >= k + longest and n - k > longest:
                    k = self._cut_at(text, k, n)
                    if k >= c:
                        break
                    cuts.append(k)
                if c >= n:
                    break
            cuts.append(c)
            a = c
        cuts.append(n)
        return cuts

    def _reference(self, text: str) -> list[Chunk]:
        return list(Chunker.iter_chunks(self, text))

    def _encode_group(self, texts, group, pieces, out) -> None:
        flat, rows = self._nt.encode_batch(pieces, add_special_tokens=False, parallel=False)
        rows = rows.tolist()
        for i, cuts, first in group:
            last = first + len(cuts) - 1
            a, b = rows[first], rows[last]
            doc = _Doc(self._edges, cuts, pieces[first:last], flat[a:b],
                       [r - a for r in rows[first:last + 1]])
            try:
                out[i] = list(self._fast_windows(doc))
            except _Mismatch:
                out[i] = self._reference(texts[i])

    def _fast_windows(self, doc: _Doc) -> list[Chunk]:
        """The windows of :meth:`Chunker._windows`, asking for offsets only where needed."""
        return self._windows_of(doc, 0, 0, final=True)[0]

    def _windows_of(self, doc: _Doc | _Joined, pos: int, covered: int, final: bool
                    ) -> tuple[list[Chunk], int, int]:
        """``(windows, pos, covered)``: the windows of ``doc`` from token ``pos`` (tokens
        before ``covered`` are in a window already), and where the next starts. Unless
        ``final``, more tokens may follow: a window that could still grow is left out."""
        out: list[Chunk] = []
        n = len(doc.ids)
        budget, max_chars = self.budget, self.max_chars
        if self.arrays:
            prefix, suffix = self._special_arrays

            def window(a: int, b: int) -> np.ndarray:
                return np.concatenate((prefix, doc.ids[a:b], suffix))
        else:
            prefix, suffix = self.prefix, self.suffix

            def window(a: int, b: int) -> list[int]:
                return prefix + doc.ids[a:b].tolist() + suffix
        rest = None  # the span of the last window when the loop found it (a text's only one, often)
        while pos < n:
            hi = min(pos + budget, n)
            start = doc.start(pos)
            limit = start + max_chars
            last_end = doc.end(hi - 1)
            if last_end <= limit:
                if hi == n:
                    rest = (start, last_end)
                    break
                end = hi
            else:  # the first token past the character bound (rare: long words or gaps)
                end = bisect_right(range(hi), limit, pos + 1, hi, key=doc.end)
                last_end = doc.end(end - 1)
            out.append(Chunk(window(pos, end), start, last_end))
            pos, covered = self._next_start(pos, end), end
        if final and n > covered:
            out.append(Chunk(window(pos, n), *(rest or (doc.start(pos), doc.end(n - 1)))))
        return out, pos, covered


class _Mismatch(Exception):
    """nanotoken and the model's tokenizer gave different ids for a piece."""


class _Doc:
    """One text's ids and pieces, with the offsets of a token computed on demand."""

    __slots__ = ("edges", "cuts", "pieces", "ids", "rows", "_slow")

    def __init__(self, edges: _EdgeOffsets, cuts: list[int], pieces: list[str],
                 ids: np.ndarray, rows: list[int]):
        self.edges, self.cuts, self.pieces, self.ids, self.rows = edges, cuts, pieces, ids, rows
        self._slow: dict[int, list[tuple[int, int]]] = {}  # pieces the model's tokenizer placed

    def _offset(self, i: int, side: int) -> int:
        p = bisect_right(self.rows, i) - 1
        r = self.rows[p]
        offsets = self._slow.get(p)
        if offsets is None:
            ids = self.ids[r:self.rows[p + 1]].tolist()
            x = self.edges.plain(self.pieces[p], ids, i - r, side)
            if x is not None:
                return self.cuts[p] + x
            offsets = self._slow[p] = self.edges.slow(self.pieces[p], ids)
        return self.cuts[p] + offsets[i - r][side]

    def start(self, i: int) -> int:
        return self._offset(i, 0)

    def end(self, i: int) -> int:
        return self._offset(i, 1)

    def check_from(self, i: int) -> None:
        """Check, with the model's tokenizer, the ids of every piece from the one that
        holds token ``i`` whose offsets would come from it (not plain ASCII, or holding
        the unknown token), so no later offset of them can disagree."""
        for p in range(max(bisect_right(self.rows, i) - 1, 0), len(self.pieces)):
            r, s = self.rows[p], self.rows[p + 1]
            if p in self._slow or r == s:
                continue
            ids = self.ids[r:s].tolist()
            if not self.edges.is_plain(self.pieces[p]) or self.edges.unk in ids:
                self._slow[p] = self.edges.slow(self.pieces[p], ids)


class _SlowDoc:
    """A segment tokenized by the model's own tokenizer, a reference piece at a time
    (:meth:`Chunker._pieces`), with every token's offsets: :class:`_Doc`'s interface."""

    __slots__ = ("ids", "starts", "ends")

    def __init__(self, chunker: FastChunker, base: int, segment: str):
        ids: list[int] = []
        self.starts: list[int] = []
        self.ends: list[int] = []
        for offset, piece in chunker._pieces(segment):
            enc = chunker._tok.encode(piece, add_special_tokens=False)
            ids.extend(enc.ids)
            self.starts.extend(a + base + offset for a, _ in enc.offsets)
            self.ends.extend(b + base + offset for _, b in enc.offsets)
        self.ids = np.array(ids, dtype=np.int64)

    def start(self, i: int) -> int:
        return self.starts[i]

    def end(self, i: int) -> int:
        return self.ends[i]

    def check_from(self, i: int) -> None:
        """Nothing to check: these are the model's own tokens."""


class _Joined:
    """Consecutive segments of a streamed text as one document: their tokens in a row,
    offsets from the text's start, and their text for the chunks'."""

    __slots__ = ("docs", "firsts", "texts", "ids")

    def __init__(self, docs: list, firsts: list[int] | None = None,
                 texts: list[tuple[int, str]] | None = None, ids: np.ndarray | None = None):
        self.docs = docs
        self.firsts = firsts or []  # the join's index of each doc's first token
        self.texts = texts or []  # (offset, segment) of each doc
        self.ids = ids if ids is not None else np.empty(0, np.int64)

    def plus(self, doc: _Doc | _SlowDoc, base: int, segment: str) -> _Joined:
        return _Joined(self.docs + [doc], self.firsts + [len(self.ids)],
                       self.texts + [(base, segment)], np.concatenate((self.ids, doc.ids)))

    def drop(self, pos: int) -> _Joined:
        """The join from token ``pos`` on (token ``pos`` becomes 0): the docs before it go."""
        keep = [k for k, (doc, first) in enumerate(zip(self.docs, self.firsts))
                if first + len(doc.ids) > pos or first > pos]
        return _Joined([self.docs[k] for k in keep], [self.firsts[k] - pos for k in keep],
                       [self.texts[k] for k in keep], self.ids[pos:])

    def _at(self, i: int) -> tuple[_Doc | _SlowDoc, int]:
        k = bisect_right(self.firsts, i) - 1
        return self.docs[k], i - self.firsts[k]

    def start(self, i: int) -> int:
        doc, j = self._at(i)
        return doc.start(j)

    def end(self, i: int) -> int:
        doc, j = self._at(i)
        return doc.end(j)

    def check_from(self, i: int) -> None:
        for doc, first in zip(self.docs, self.firsts):
            if first + len(doc.ids) > i:
                doc.check_from(max(i - first, 0))

    def text(self, chunk: Chunk) -> str:
        return _cut(self.texts, chunk)


class _EdgeOffsets:
    """Where one token of a piece starts or ends: from the ids for plain ASCII, else
    from the model's tokenizer."""

    def __init__(self, tok, spec: dict):
        """``spec``: the tokenizer.json of ``tok``, parsed."""
        prefix = spec["model"].get("continuing_subword_prefix") or "##"
        vocab = spec["model"]["vocab"]
        self.piece_len = [0] * (max(vocab.values()) + 1)
        for text, i in vocab.items():
            self.piece_len[i] = len(text) - len(prefix) if text.startswith(prefix) else len(text)
        self.unk = tok.token_to_id(spec["model"]["unk_token"])
        added = [re.escape(t["content"]) for t in spec.get("added_tokens", []) if t.get("content")]
        self.added = re.compile("|".join(added), re.IGNORECASE) if added else None
        self.tok = tok

    def slow(self, piece: str, ids: list[int]) -> list[tuple[int, int]]:
        """The offsets of every token of ``piece`` from the model's tokenizer, whose ids
        must be nanotoken's."""
        enc = self.tok.encode(piece, add_special_tokens=False)
        if enc.ids != ids:
            raise _Mismatch(piece)
        return enc.offsets

    def is_plain(self, piece: str) -> bool:
        """Whether ``piece`` is plain printable ASCII holding no added token as text."""
        return piece.isascii() and not _CONTROL.search(piece) and not (
            self.added is not None and self.added.search(piece))

    def plain(self, piece: str, ids: list[int], j: int, side: int) -> int | None:
        """Where token ``j`` of ``piece`` starts (``side`` 0) or ends (1), from the ids;
        None unless the piece is plain printable ASCII.

        Such a piece's tokens cover its characters other than whitespace, in order, each
        as many as its vocabulary string holds; the unknown token covers a whole word
        (letters and digits, or one punctuation character)."""
        if not self.is_plain(piece):
            return None
        if len(ids) <= j:
            return None
        plen = self.piece_len
        if self.unk in ids:
            return self._walk(piece, ids, j, side)
        # a window's first token (a text's start) and last one (a text's end): the piece's
        # first character that is not a space, and the end of its last
        if j == 0 and not side:
            return len(piece) - len(piece.lstrip(_SPACES))
        if j == len(ids) - 1 and side:
            return len(piece.rstrip(_SPACES))
        kept = _NOT_SPACE[np.frombuffer(piece.encode("ascii"), np.uint8)].nonzero()[0]
        before = sum(map(plen.__getitem__, ids[:j]))
        if side:
            return int(kept[before + plen[ids[j]] - 1]) + 1
        return int(kept[before])

    def _walk(self, piece: str, ids: list[int], j: int, side: int) -> int | None:
        plen, unk, k, n = self.piece_len, self.unk, 0, len(ids)
        for m in _ASCII_PRE.finditer(piece):
            a, b = m.span()
            if k >= n:
                return None
            if ids[k] == unk:
                if k == j:
                    return b if side else a
                k += 1
                continue
            while a < b and k < n:
                e = a + plen[ids[k]]
                if k == j:
                    return e if side else a
                a = e
                k += 1
        return None


def _nanotoken_for(tok, spec_text: str) -> tuple[object | None, str | None]:
    """``(nanotoken tokenizer, None)`` for a tokenizer the fast path covers
    (:func:`_spec_problem` found none), else ``(None, why not)``."""
    try:
        import nanotoken
        from nanotoken.nanotoken_rs import UnsupportedTokenizerError, WordPieceTokenizer
    except ImportError:
        return None, "nanotoken is not installed"
    try:
        nt = WordPieceTokenizer.from_json(spec_text)
    except (UnsupportedTokenizerError, ValueError) as exc:
        return None, f"nanotoken refuses this tokenizer: {exc}"
    flat, rows = nt.encode_batch(_CHECK, add_special_tokens=False, parallel=False)
    got = [flat[a:b].tolist() for a, b in zip(rows[:-1], rows[1:])]
    if got != [e.ids for e in tok.encode_batch(_CHECK, add_special_tokens=False)]:
        return None, "nanotoken's ids differ from the model's tokenizer on the start-up check"
    nanotoken.set_cache_entries(NANOTOKEN_CACHE)
    return nt, None


def _spec_problem(spec: dict) -> str | None:
    """Why the fast path does not cover this tokenizer.json, or None: the rules it relies
    on (whitespace and ASCII punctuation cut words, a word piece covers its own
    characters) are those of BERT's normalizer, pre-tokenizer and WordPiece."""
    model = spec.get("model") or {}
    if model.get("type") != "WordPiece":
        return f"the model is {model.get('type')}, not WordPiece"
    if not bert_text_rules(spec):
        return "the pre-tokenizer or the normalizer is not BERT's"
    for added in spec.get("added_tokens", []):
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            return f"the added token {added.get('content')!r} strips or matches whole words"
        if any(c.isspace() for c in added.get("content", "")):
            return f"the added token {added.get('content')!r} holds whitespace"
    return None

"""Cut text into overlapping windows of tokens that fit the encoder.

Chunks are windows over the token sequence of the text, not over characters, so each
one fills the model's input exactly; the offsets of a *fast* tokenizer map every chunk
back to its character span, which is what search results show and cite.

A chunk is bounded in characters as well as in tokens: it spans at most ``max_chars``
characters (by default :data:`CHARS_PER_TOKEN` per token of ``max_tokens``). Ordinary
text never comes near (a few characters a token); a text with no whitespace does: a
tokenizer such as BERT's makes one unknown token of a whole word, however long, and
once made chunks of 25 MB out of a file of ``a\\x01`` repeated. A window that would
pass the bound ends at the token before, and the next window overlaps it by the same
share of its tokens that ``overlap`` is of a full window. Spans stay exact: they are the
first and last token's offsets, as for any chunk.

Texts of any length pass in linear time and bounded memory: the text is tokenized in
pieces of at most ``piece_chars`` (and ``max_chars``) characters, cut just before a
space, tab or line break (for the usual pre-tokenizers, which split there, this gives
the same tokens as tokenizing the whole text), and chunks are produced while the next
piece is read. A piece with no such character is cut where the tokenizer would cut a word
anyway: for BERT's normalizer and pre-tokenizer, just before its last ASCII punctuation
character (one that no added token holds). Only a piece with neither is cut hard,
splitting one word of more than a piece's length (a word BERT would make one unknown token
of); so no token is longer than a piece, and no chunk passes the bound. Everywhere else
the chunks are the windows of the model's tokenizer over the whole text, ids and spans. A text may also come as an iterable of parts (a file read a block at a time,
:meth:`Chunker.iter_text`): it gives the same chunks as the whole string.
"""

from __future__ import annotations

import bisect
import json
import re
import string
from collections import deque
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from ..errors import ConfigError

DEFAULT_PIECE_CHARS = 100_000
CHARS_PER_TOKEN = 32  # the default bound of a chunk: this many characters per token

# The whitespace every pre-tokenizer splits at: a Unicode space such as U+001C or a form
# feed is a control character to BERT, which drops it and joins the words around it.
_UP_TO_LAST_SPACE = re.compile(r".*[ \t\n\r]", re.DOTALL)


class Chunk(NamedTuple):
    """One model input: ``input_ids`` with the special tokens, and the span
    ``text[char_start:char_end]`` its content tokens came from."""

    input_ids: list[int]
    char_start: int
    char_end: int


class Chunker:
    """Token windows of at most ``max_tokens`` (special tokens included) and ``max_chars``
    characters, each sharing ``overlap`` tokens with the one before (fewer when the
    characters bound the window), so no sentence is only ever seen cut."""

    def __init__(self, tokenizer, max_tokens: int = 256, overlap: int = 32,
                 piece_chars: int = DEFAULT_PIECE_CHARS, max_chars: int | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"Chunker needs a fast tokenizer (with offsets), got "
                              f"{type(tokenizer).__name__}; load it with embedingest.stages.tokenizer.load_tokenizer()")
        self._tok = _plain_copy(tokenizer.backend_tokenizer)
        self.prefix, self.suffix = _special_tokens(tokenizer.backend_tokenizer)
        n_special = len(self.prefix) + len(self.suffix)
        limit = getattr(tokenizer, "model_max_length", None)
        if not isinstance(max_tokens, int) or max_tokens <= n_special:
            raise ConfigError(f"max_tokens={max_tokens!r} must be an integer above the "
                              f"{n_special} special tokens the model adds")
        if isinstance(limit, int) and limit < 1_000_000 and max_tokens > limit:
            raise ConfigError(f"max_tokens={max_tokens} is more than the model accepts "
                              f"({limit}); lower max_tokens")
        self.budget = max_tokens - n_special
        if not isinstance(overlap, int) or not 0 <= overlap < self.budget:
            raise ConfigError(f"overlap={overlap!r} must be at least 0 and smaller than "
                              f"max_tokens={max_tokens} minus the {n_special} special "
                              f"tokens ({self.budget}); lower overlap or raise max_tokens")
        if not isinstance(piece_chars, int) or piece_chars < 1:
            raise ConfigError(f"piece_chars={piece_chars!r} must be a positive integer")
        max_chars = CHARS_PER_TOKEN * max_tokens if max_chars is None else max_chars
        if not isinstance(max_chars, int) or max_chars < 1:
            raise ConfigError(f"max_chars={max_chars!r} must be a positive integer")
        self.max_tokens = max_tokens
        self.overlap = overlap
        self.max_chars = max_chars
        # No token is longer than the piece it came from, so no single token passes max_chars.
        self.piece_chars = min(piece_chars, max_chars)
        self._up_to_last_break = _word_breaks(self._tok)

    def chunk(self, text: str) -> list[Chunk]:
        """All chunks of ``text`` (none when it has no tokens, e.g. only whitespace)."""
        return list(self.iter_chunks(text))

    def chunk_many(self, texts: list[str]) -> list[list[Chunk]]:
        """The chunks of each text, as :meth:`chunk` gives them, tokenizing the texts that
        fit one piece in a single batch call (one crossing of the Python boundary instead
        of one per text)."""
        out: list[list[Chunk] | None] = [None] * len(texts)
        short = [i for i, t in enumerate(texts) if len(t) <= self.piece_chars]
        encs = self._tok.encode_batch([texts[i] for i in short], add_special_tokens=False)
        for i, enc in zip(short, encs):
            offsets = enc.offsets
            out[i] = list(self._windows(enc.ids, [a for a, _ in offsets], [b for _, b in offsets]))
        for i, t in enumerate(texts):
            if out[i] is None:
                out[i] = self.chunk(t)
        return out

    def _window_end(self, starts: list[int], ends: list[int], pos: int, n: int) -> int | None:
        """The end (exclusive) of the window that starts at token ``pos``, or None when
        the ``n`` tokens known so far leave it open (it may be the text's last window)."""
        if pos >= n:
            return None
        hi = min(pos + self.budget, n)
        limit = starts[pos] + self.max_chars
        if ends[hi - 1] <= limit:
            return hi if hi < n else None
        return bisect.bisect_right(ends, limit, pos + 1, hi)  # the first token past the bound

    def _next_start(self, pos: int, end: int) -> int:
        """Where the window after ``[pos, end)`` starts: ``overlap`` tokens back for a
        full window, the same share of a window the characters cut short."""
        return end - self.overlap * (end - pos) // self.budget

    def _windows(self, ids: list[int], starts: list[int], ends: list[int]) -> Iterator[Chunk]:
        """The chunks of one text tokenized whole (the same windows as :meth:`iter_chunks`)."""
        pos, covered, n = 0, 0, len(ids)
        while (end := self._window_end(starts, ends, pos, n)) is not None:
            yield self._make(ids, starts, ends, pos, end)
            pos, covered = self._next_start(pos, end), end
        if n > covered:
            yield self._make(ids, starts, ends, pos, n)

    def iter_chunks(self, text: str) -> Iterator[Chunk]:
        """The chunks of ``text`` one at a time; memory stays bounded by one piece."""
        if not text or text.isspace():
            return
        for chunk, _ in self._stream(self._pieces(text), with_text=False):
            yield chunk

    def iter_text(self, text: str | Iterable[str]) -> Iterator[tuple[Chunk, str]]:
        """``(chunk, its text)`` for every chunk of ``text``: a string, or an iterable of
        string parts that together make the text (a file decoded a block at a time), with
        the same chunks and spans. Memory stays bounded by a few pieces and one chunk,
        whatever the length of the text."""
        if isinstance(text, str):
            for chunk in self.iter_chunks(text):
                yield chunk, text[chunk.char_start:chunk.char_end]
        else:
            yield from self._stream(self._stream_pieces(text), with_text=True)

    def _stream(self, pieces: Iterable[tuple[int, str]], with_text: bool
                ) -> Iterator[tuple[Chunk, str | None]]:
        """Windows over the tokens of ``(offset, piece)`` pieces, made as pieces come;
        with their text when ``with_text`` (cut from the pieces still held)."""
        ids: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        held: deque[tuple[int, str]] = deque()  # the pieces that chunks to come may span
        pos = covered = 0
        for offset, piece in pieces:
            enc = self._tok.encode(piece, add_special_tokens=False)
            ids.extend(enc.ids)
            starts.extend([s + offset for s, _ in enc.offsets])
            ends.extend([e + offset for _, e in enc.offsets])
            if with_text:
                held.append((offset, piece))
            while (end := self._window_end(starts, ends, pos, len(ids))) is not None:
                chunk = self._make(ids, starts, ends, pos, end)
                yield chunk, _cut(held, chunk) if with_text else None
                pos, covered = self._next_start(pos, end), end
            del ids[:pos], starts[:pos], ends[:pos]
            covered -= pos
            pos = 0
            keep = starts[0] if starts else offset + len(piece)
            while held and held[0][0] + len(held[0][1]) <= keep:
                held.popleft()
        if len(ids) > covered:
            chunk = self._make(ids, starts, ends, 0, len(ids))
            yield chunk, _cut(held, chunk) if with_text else None

    def _make(self, ids, starts, ends, a: int, b: int) -> Chunk:
        return Chunk(self.prefix + ids[a:b] + self.suffix, starts[a], ends[b - 1])

    def _cut_at(self, text: str, a: int, n: int) -> int:
        """Where the piece of ``text`` that starts at ``a`` ends (``n - a`` is more than a
        piece): just before its last space or line break, else before the last character
        the tokenizer cuts words at, else a full piece."""
        limit = a + self.piece_chars
        m = _UP_TO_LAST_SPACE.match(text, a + 1, limit)
        if m is None and self._up_to_last_break is not None:
            m = self._up_to_last_break.match(text, a + 1, limit)
        return m.end() - 1 if m else limit

    def _pieces(self, text: str) -> Iterator[tuple[int, str]]:
        """``(offset, piece)`` covering ``text``; each cut is at a whitespace character,
        which starts the next piece (byte-level BPE attaches a space to the next word)."""
        a, n = 0, len(text)
        while n - a > self.piece_chars:
            cut = self._cut_at(text, a, n)
            yield a, text[a:cut]
            a = cut
        yield a, text[a:]

    def _stream_pieces(self, parts: Iterable[str]) -> Iterator[tuple[int, str]]:
        """The pieces :meth:`_pieces` cuts from the text the ``parts`` make, read in turn."""
        buf, base = "", 0
        for part in parts:
            buf += part
            while len(buf) > self.piece_chars:
                cut = self._cut_at(buf, 0, len(buf))
                yield base, buf[:cut]
                base += cut
                buf = buf[cut:]
        if buf:
            yield base, buf


def _cut(held: deque[tuple[int, str]], chunk: Chunk) -> str:
    """The text of ``chunk`` from the pieces that hold it."""
    a, b = chunk.char_start, chunk.char_end
    return "".join(piece[max(a - off, 0):b - off] for off, piece in held
                   if off < b and off + len(piece) > a)


def _plain_copy(backend):
    """A copy of the Rust tokenizer with no truncation and no padding (tokenizer.json
    files often carry both, e.g. a fixed padding to 128)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(backend.to_str())
    tok.no_truncation()
    tok.no_padding()
    return tok


def bert_text_rules(spec: dict) -> bool:
    """Whether a tokenizer.json cuts and normalizes text as BERT does: its pre-tokenizer
    is BERT's, and its normalizer BERT's, lower-casing or both (each maps one character
    at a time)."""
    if (spec.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer":
        return False
    norm = spec.get("normalizer") or {}
    parts = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
    return bool(parts) and all(p.get("type") in ("BertNormalizer", "Lowercase") for p in parts)


def _word_breaks(backend) -> re.Pattern | None:
    """A pattern up to the last character a text can be cut before without changing its
    tokens, besides whitespace; None when there is none known for this tokenizer.

    BERT's pre-tokenizer makes every punctuation character a word of its own, and its
    normalizer maps each character alone, so a cut just before an ASCII punctuation
    character keeps the tokens, unless it falls inside an added token written as text.
    """
    spec = json.loads(backend.to_str())
    if not bert_text_rules(spec):
        return None
    taken = set("".join(t.get("content", "") for t in spec.get("added_tokens", [])))
    breaks = "".join(c for c in string.punctuation if c not in taken)
    return re.compile(f".*[{re.escape(breaks)}]", re.DOTALL) if breaks else None


def special_token_count(tokenizer) -> int:
    """How many special tokens the model puts around every chunk (BERT's [CLS] and [SEP]:
    2), which :class:`Chunker` counts against ``max_tokens``: build-index checks its
    chunk size against it before the first write, not in a loader worker."""
    prefix, suffix = _special_tokens(tokenizer.backend_tokenizer)
    return len(prefix) + len(suffix)


def _special_tokens(backend) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a single sequence."""
    tok = _plain_copy(backend)
    bare = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    raise ConfigError("cannot tell which special tokens this tokenizer adds around a text; "
                      "use a tokenizer whose post-processor only adds tokens around it")

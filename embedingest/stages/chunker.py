"""Cut text into overlapping windows of tokens that fit the encoder.

Chunks are windows over the token sequence of the text, not over characters, so each
one fills the model's input exactly; the offsets of a *fast* tokenizer map every chunk
back to its character span, which is what search results show and cite.

Texts of any length pass in linear time and bounded memory: the text is tokenized in
pieces of about ``piece_chars`` characters cut just before a whitespace character (for
the usual pre-tokenizers, which split at whitespace, this gives the same tokens as
tokenizing the whole text), and chunks are produced while the next piece is read. A
piece with no whitespace at all is cut hard, which may split one word in two.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import NamedTuple

from ..errors import ConfigError

DEFAULT_PIECE_CHARS = 100_000

_UP_TO_LAST_SPACE = re.compile(r".*\s", re.DOTALL)


class Chunk(NamedTuple):
    """One model input: ``input_ids`` with the special tokens, and the span
    ``text[char_start:char_end]`` its content tokens came from."""

    input_ids: list[int]
    char_start: int
    char_end: int


def load_tokenizer(model_dir: str | os.PathLike):
    """Load the fast (Rust) tokenizer of a local model folder; never downloads."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from model folder {str(model_dir)!r}: "
                          f"{exc}; pass a folder that holds tokenizer.json") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"the tokenizer in {str(model_dir)!r} is not a fast tokenizer, so it "
                          f"has no character offsets; add a tokenizer.json to the folder")
    return tokenizer


class Chunker:
    """Token windows of at most ``max_tokens`` (special tokens included), each sharing
    ``overlap`` tokens with the one before, so no sentence is only ever seen cut."""

    def __init__(self, tokenizer, max_tokens: int = 256, overlap: int = 32,
                 piece_chars: int = DEFAULT_PIECE_CHARS):
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"Chunker needs a fast tokenizer (with offsets), got "
                              f"{type(tokenizer).__name__}; load it with load_tokenizer()")
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
        self.max_tokens = max_tokens
        self.overlap = overlap
        self.piece_chars = piece_chars

    def chunk(self, text: str) -> list[Chunk]:
        """All chunks of ``text`` (none when it has no tokens, e.g. only whitespace)."""
        return list(self.iter_chunks(text))

    def chunk_many(self, texts: list[str]) -> list[list[Chunk]]:
        """The chunks of each text, as :meth:`chunk` gives them, tokenizing the texts that
        fit one piece in a single batch call (one crossing of the Python boundary instead
        of one per text).

        Tokenizing is the host's heaviest work, so the batch call skips character offsets
        (``encode_batch_fast``, about a fifth cheaper): a text that fits one chunk spans
        the whole text but its edge whitespace; only longer texts are tokenized again,
        with offsets, to place their windows.
        """
        out: list[list[Chunk] | None] = [None] * len(texts)
        short = [i for i, t in enumerate(texts) if len(t) <= self.piece_chars]
        fast = getattr(self._tok, "encode_batch_fast", None)
        encode = fast or self._tok.encode_batch
        encs = encode([texts[i] for i in short], add_special_tokens=False)
        prefix, suffix, budget = self.prefix, self.suffix, self.budget
        for i, enc in zip(short, encs):
            ids = enc.ids
            if not ids:
                out[i] = []
            elif len(ids) <= budget:  # the usual case: the whole text is one chunk
                text = texts[i]
                start, end = len(text) - len(text.lstrip()), len(text.rstrip())
                out[i] = [Chunk(prefix + ids + suffix, start, end)]
            else:
                if fast is not None:
                    enc = self._tok.encode(texts[i], add_special_tokens=False)
                offsets = enc.offsets
                out[i] = list(self._windows(enc.ids, [a for a, _ in offsets], [b for _, b in offsets]))
        for i, t in enumerate(texts):
            if out[i] is None:
                out[i] = self.chunk(t)
        return out

    def _windows(self, ids: list[int], starts: list[int], ends: list[int]) -> Iterator[Chunk]:
        """The chunks of one text tokenized whole (the same windows as :meth:`iter_chunks`)."""
        budget, stride = self.budget, self.budget - self.overlap
        pos = 0
        while len(ids) - pos > budget:
            yield self._make(ids, starts, ends, pos, pos + budget)
            pos += stride
        if len(ids) > pos and (pos == 0 or len(ids) - pos > self.overlap):
            yield self._make(ids, starts, ends, pos, len(ids))

    def iter_chunks(self, text: str) -> Iterator[Chunk]:
        """The chunks of ``text`` one at a time; memory stays bounded by one piece."""
        if not text or text.isspace():
            return
        ids: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        pos = 0
        emitted = False
        budget, stride = self.budget, self.budget - self.overlap
        for offset, piece in self._pieces(text):
            enc = self._tok.encode(piece, add_special_tokens=False)
            ids.extend(enc.ids)
            starts.extend([s + offset for s, _ in enc.offsets])
            ends.extend([e + offset for _, e in enc.offsets])
            while len(ids) - pos > budget:
                yield self._make(ids, starts, ends, pos, pos + budget)
                emitted = True
                pos += stride
            del ids[:pos], starts[:pos], ends[:pos]
            pos = 0
        if ids and (not emitted or len(ids) > self.overlap):
            yield self._make(ids, starts, ends, 0, len(ids))

    def _make(self, ids, starts, ends, a: int, b: int) -> Chunk:
        return Chunk(self.prefix + ids[a:b] + self.suffix, starts[a], ends[b - 1])

    def _pieces(self, text: str) -> Iterator[tuple[int, str]]:
        """``(offset, piece)`` covering ``text``; each cut is at a whitespace character,
        which starts the next piece (byte-level BPE attaches a space to the next word)."""
        a, n = 0, len(text)
        while n - a > self.piece_chars:
            limit = a + self.piece_chars
            m = _UP_TO_LAST_SPACE.match(text, a + 1, limit)
            cut = m.end() - 1 if m else limit
            yield a, text[a:cut]
            a = cut
        yield a, text[a:]


def _plain_copy(backend):
    """A copy of the Rust tokenizer with no truncation and no padding (tokenizer.json
    files often carry both, e.g. a fixed padding to 128)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(backend.to_str())
    tok.no_truncation()
    tok.no_padding()
    return tok


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

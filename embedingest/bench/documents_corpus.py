"""Real documents nobody on the project wrote, for the long-document and tokenizer benchmarks.

Gathered from what this machine holds: manual pages (gzip'd roff, in many languages:
accents, Cyrillic, Chinese, Japanese, Korean), /usr/share/doc (changelogs, copyright files,
READMEs, Markdown), the Python standard library's sources and the docs of installed
packages (reStructuredText, Markdown, METADATA). The choice is deterministic (sorted
paths, a hash to pick files), duplicates are dropped, and each source gets a share of the
bytes, so the mix of sizes and kinds stays the same from run to run on the same machine.

``hard_cases`` adds documents made from real ones to stress exactness: CRLF line ends,
long words (> 100 characters, which WordPiece maps to [UNK]), runs with no whitespace,
and inserted emoji, CJK, control and zero-width characters, combining accents and the
model's own special tokens written as text.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import random
import sys

TEXT_SUFFIXES = (".md", ".rst", ".txt", ".py", ".html", "METADATA", "README", "NEWS",
                 "copyright", "changelog", "changelog.Debian", "CHANGES", "AUTHORS")


def _walk(root: str):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                yield path


def _read(path: str, max_bytes: int) -> str | None:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read(max_bytes + 1)
        else:
            with open(path, "rb") as f:
                data = f.read(max_bytes + 1)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if len(data) > max_bytes or b"\x00" in data[:4096]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _sources() -> dict[str, list[str]]:
    pylib = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    man = [p for p in _walk("/usr/share/man") if p.endswith(".gz")]
    doc = [p for p in _walk("/usr/share/doc")
           if os.path.basename(p).removesuffix(".gz").endswith(TEXT_SUFFIXES)]
    stdlib, pkgdocs = [], []
    for p in _walk(pylib):
        if "site-packages" in p or "dist-packages" in p:
            if p.endswith((".md", ".rst", "METADATA", ".txt")) and "embedingest" not in p:
                pkgdocs.append(p)
        elif p.endswith(".py"):
            stdlib.append(p)
    return {"man": man, "doc": doc, "stdlib": stdlib, "pkgdocs": pkgdocs}


SHARES = {"man": 0.25, "doc": 0.35, "stdlib": 0.2, "pkgdocs": 0.2}


def build_corpus(target_bytes: int = 8_000_000, max_doc_bytes: int = 3_000_000) -> list[str]:
    """Documents adding up to about ``target_bytes`` of UTF-8, mixed from all sources."""
    docs: list[str] = []
    seen: set[bytes] = set()
    for name, paths in _sources().items():
        budget = SHARES[name] * target_bytes
        ranked = sorted(paths, key=lambda p: hashlib.sha1(p.encode()).digest())
        for path in ranked:
            if budget <= 0:
                break
            text = _read(path, max_doc_bytes)
            if not text or len(text) < 200:
                continue
            digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()
            if digest in seen:
                continue
            seen.add(digest)
            docs.append(text)
            budget -= len(text.encode("utf-8"))
    return docs


SPECIAL_AS_TEXT = ["[CLS]", "[SEP]", "[UNK]", "[MASK]", "[PAD]", "[cls]", "x[SEP]y", "[CLS][SEP]"]
ODD_CHARS = (
    ["\u00e9", "e\u0301", "\u0130", "\u00df", "\ufb01", "\u03a3", "\u00c5", "\u212b", "\u1e9e"]
    + [chr(c) for c in range(0x4E00, 0x4E00 + 40, 3)]  # CJK ideographs
    + ["\u3042\u3044", "\ud55c\uad6d\uc5b4", "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22"]
    + ["\U0001F600", "\U0001F44D\U0001F3FD", "\U0001F468\u200d\U0001F469\u200d\U0001F467",
       "\u2764\ufe0f", "\U0001F1EB\U0001F1F7"]
    + ["\x00", "\x01", "\x07", "\x0b", "\x0c", "\x1b", "\x1c", "\x1f", "\x7f", "\x85"]
    + ["\u200b", "\u200d", "\ufeff", "\u00a0", "\u2028", "\u3000", "\u00ad", "\ufffd"]
    + ["\uff21\uff22\uff23", "\u0410\u0411\u0412", "\u05d0\u05d1", "\u0627\u0644"]
)


HARD_KINDS = ("crlf", "long-words", "no-whitespace", "odd-chars", "special-tokens",
              "odd-whitespace", "random-unicode")


def _random_char(rng: random.Random) -> str:
    while True:
        c = rng.choice([rng.randrange(0x20, 0x7F), rng.randrange(0, 0x300),
                        rng.randrange(0, 0x3000), rng.randrange(0x3000, 0x10000),
                        rng.randrange(0x10000, 0x30000)])
        if not 0xD800 <= c <= 0xDFFF:
            return chr(c)


def hard_cases(docs: list[str], n: int = 280, seed: int = 18) -> list[tuple[str, str]]:
    """``(kind, text)``: documents derived from real ones that stress a tokenizer's
    exactness (kinds in :data:`HARD_KINDS`), then two large ones: about 300k characters
    of real text, and the same with no whitespace at all."""
    rng = random.Random(seed)
    pool = [d for d in docs if 1_000 <= len(d) <= 60_000]
    out: list[tuple[str, str]] = []
    for i in range(n):
        text = rng.choice(pool)
        kind = i % len(HARD_KINDS)
        if kind == 0:  # CRLF and CR line ends
            text = text.replace("\n", "\r\n" if i % 12 == 0 else "\r")
        elif kind == 1:  # long words: real words glued together, some over 100 characters
            words = text.split()
            glued, k = [], 0
            while k < len(words):
                step = rng.choice([1, 1, 1, 8, 20, 40])
                glued.append("".join(words[k:k + step]))
                k += step
            text = " ".join(glued)
        elif kind == 2:  # a run with no whitespace at all
            text = "".join(text.split())
        elif kind == 3:  # odd characters inserted anywhere, next to spaces too
            chars = list(text)
            for _ in range(max(10, len(chars) // 50)):
                pos = rng.randrange(len(chars) + 1)
                chars.insert(pos, rng.choice(ODD_CHARS))
            text = "".join(chars)
        elif kind == 4:  # the special tokens written as text, glued and spaced
            chars = text.split(" ")
            for _ in range(max(5, len(chars) // 40)):
                pos = rng.randrange(len(chars))
                chars[pos] = chars[pos] + rng.choice(SPECIAL_AS_TEXT) + rng.choice(["", " "])
            text = " ".join(chars)
        elif kind == 5:  # decomposed accents, tabs, odd whitespace between words
            text = "".join(rng.choice(["\t", "  ", "\u00a0", " \u0301", " "]) if c == " " else c
                           for c in text)
        else:  # one character in eight replaced by any code point (no lone surrogates)
            text = "".join(_random_char(rng) if rng.random() < 0.125 else c for c in text)
        out.append((HARD_KINDS[kind], text))
    big, size = [], 0
    for d in pool:
        if size > 300_000:
            break
        big.append(d)
        size += len(d)
    out.append(("large", "\n\n".join(big)))
    out.append(("large-no-whitespace", "".join("\n\n".join(big).split())))
    return out

"""embedingest.bench.text: the paragraph corpus the text benchmark writes."""

import json

from embedingest.bench.text import read_corpus, write_corpus


def test_write_corpus_writes_no_empty_files_when_paragraphs_are_fewer_than_files(tmp_path):
    # 10 paragraphs over 8 files: 2 a file fill 5 files; the 3 files left would be empty,
    # which build-index skips as "empty" (a warning each, and the bench's build row exits 3)
    paragraphs = [f"paragraph {i}" for i in range(10)]
    folder = write_corpus(paragraphs, tmp_path / "corpus", files=8)
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    assert list(sizes) == [f"part-{f:04d}.jsonl" for f in range(5)]
    assert all(size > 0 for size in sizes.values())
    assert read_corpus(folder) == paragraphs
    first = [json.loads(line) for line in (folder / "part-0000.jsonl").read_text().splitlines()]
    assert first == [{"id": 0, "text": "paragraph 0"}, {"id": 1, "text": "paragraph 1"}]


def test_write_corpus_fills_every_file_when_paragraphs_are_many(tmp_path):
    paragraphs = [f"p{i}" for i in range(9)]
    folder = write_corpus(paragraphs, tmp_path / "corpus", files=3)
    assert sorted(p.name for p in folder.iterdir()) == ["part-0000.jsonl", "part-0001.jsonl",
                                                         "part-0002.jsonl"]
    assert read_corpus(folder) == paragraphs

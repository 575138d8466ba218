"""build-index and segment over inputs in object storage, against a real S3-compatible
server on 127.0.0.1 (moto's): the same index and masks as the same files on disk, runs
resumed by the objects' keys, bad objects skipped and reported, and a bucket that cannot
be read a clear error before anything is written."""

from __future__ import annotations

import functools
import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from click.testing import CliRunner
from corpus_fixtures import TOPICS as ALL_TOPICS
from PIL import Image
from s3_fixtures import s3, s3_endpoint  # noqa: F401 (fixtures)
from segment_fixtures import small  # noqa: F401 (fixture)
from segment_fixtures import bad_files, image_tree, noise, small_config

from embedingest import SegmentConfig, build_index, open_index, segment
from embedingest.errors import ConfigError
from embedingest.sinks.masks import output_paths

FAST = {"num_workers": 0, "num_consumers": 1, "batch_size": 8, "chunk_tokens": 32, "overlap": 8}
# One forked DataLoader worker: it must reach the store on its own (fsspec's instances
# are per process).
FORKED = {**FAST, "num_workers": 1}
TOPICS = ALL_TOPICS[:6]


def text_corpus(root):
    """Plain text, JSON lines plain and as .zst and .gz, CSV, Parquet, in subfolders."""
    lines = "\n".join(json.dumps({"id": f"r{i}", "text": t}) for i, t in enumerate(TOPICS)).encode()
    files = {
        "intro.txt": " ".join(TOPICS).encode(),
        "docs.jsonl.zst": zstandard.ZstdCompressor().compress(lines),
        "sub/more.jsonl.gz": gzip.compress(lines.replace(b'"r', b'"g')),
        "sub/plain.jsonl": lines,
        "sub/deep/t.csv": ("id,text\n" + "".join(f"c{i},\"{t}\"\n" for i, t in enumerate(TOPICS))).encode(),
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    pq.write_table(pa.table({"id": ["p0", "p1"], "text": TOPICS[4:]}), root / "sub" / "rows.parquet")
    return root


def everything(out) -> list:
    """Every hit of every topic over the whole index, by id: scores (so the vectors) and
    each chunk's row, whatever the index's file format."""
    with open_index(out) as index:
        return [sorted((h.id, round(h.score, 5), h.source, h.record_id, h.chunk_no, h.char_start,
                        h.char_end, h.text) for h in hits)
                for hits in index.search(TOPICS, k=len(index))]


@pytest.mark.slow
def test_build_index_over_a_prefix_equals_the_local_build_and_resumes_by_key(s3, tmp_path):
    corpus = text_corpus(tmp_path / "corpus")
    url = s3.upload(corpus, "texts/corpus")
    local, remote = tmp_path / "local", tmp_path / "remote"
    s1 = build_index(str(corpus), out=str(local), **FAST)
    s2 = build_index(url, out=str(remote), **FORKED)
    for key in ("units_seen", "units_indexed", "docs", "chunks", "vectors_total", "skipped",
                "exit_code"):
        assert s2[key] == s1[key], key
    assert s1["units_indexed"] == 6 and s1["chunks"] > 6 and s1["exit_code"] == 0
    assert everything(remote) == everything(local)
    assert json.loads((remote / "manifest.json").read_text())["corpus_path"] == url

    again = build_index(url, out=str(remote), **FAST)
    assert (again["units_unchanged"], again["units_indexed"]) == (6, 0)
    s3.put("texts/corpus/intro.txt", " ".join(reversed(TOPICS)).encode())  # same size
    s3.fs.rm_file(f"{s3.name}/texts/corpus/sub/plain.jsonl")
    s3.put("texts/corpus/sub/new.md", TOPICS[0].encode())
    changed = build_index(url, out=str(remote), **FAST)
    assert (changed["units_indexed"], changed["units_removed"], changed["units_unchanged"]) == (2, 1, 4)
    (corpus / "intro.txt").write_text(" ".join(reversed(TOPICS)))
    (corpus / "sub" / "plain.jsonl").unlink()
    (corpus / "sub" / "new.md").write_text(TOPICS[0])
    build_index(str(corpus), out=str(local), **FAST)
    assert everything(remote) == everything(local)


def test_bad_objects_are_skipped_and_reported_with_their_urls(s3, tmp_path):
    good = json.dumps({"id": "a", "text": TOPICS[0]}).encode()
    url = s3.upload(text_corpus(tmp_path / "c"), "c")
    whole = zstandard.ZstdCompressor().compress(good * 200)
    s3.put("c/cut.jsonl.zst", whole[: len(whole) // 2])
    s3.put("c/bad.txt.gz", b"not gzip")
    s3.put("c/empty.txt", b"")
    out = tmp_path / "out"
    summary = build_index(url, out=str(out), **FAST)
    assert summary["exit_code"] == 3 and summary["units_indexed"] == 9
    report = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    reasons = {entry["path"]: entry["reason"].split(":")[0] for entry in report}
    assert reasons == {f"{url}/cut.jsonl.zst": "decompress", f"{url}/bad.txt.gz": "decompress",
                       f"{url}/empty.txt": "empty"}


def test_a_missing_bucket_or_prefix_is_an_error_naming_it_before_anything_is_written(s3, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"cannot list 's3://no-such-bucket-x/docs': no such bucket"):
        build_index("s3://no-such-bucket-x/docs", out=str(out), **FAST)
    with pytest.raises(ConfigError, match=rf"cannot list '{s3.url('none')}'"):
        segment(SegmentConfig(images=s3.url("none"), out=str(out), device="cpu"), progress=False)
    assert not out.exists()


def test_the_cli_takes_a_url(s3, tmp_path):
    from embedingest.cli import main

    url = s3.upload(text_corpus(tmp_path / "c"), "c")
    result = CliRunner().invoke(main, ["build-index", url, "--out", str(tmp_path / "out"), "--json",
                                       "--num-workers", "0", "--num-consumers", "1"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["units_indexed"] == 6
    missing = CliRunner().invoke(main, ["build-index", "s3://no-such-bucket-x/docs"])
    assert missing.exit_code == 1 and "no such bucket" in missing.output


segment_config = functools.partial(small_config, num_workers=1, num_consumers=1)


@pytest.mark.slow
def test_segment_over_a_prefix_writes_the_local_masks_and_resumes(s3, tmp_path, small):
    images = tmp_path / "images"
    sizes = image_tree(images)
    bad = bad_files(images)
    url = s3.upload(images, "photos")
    local, remote = tmp_path / "local", tmp_path / "remote"
    s1 = segment(segment_config(images, local, small, num_workers=0), progress=False)
    s2 = segment(segment_config(url, remote, small, overlay=True), progress=False)
    assert s2["written"] == s1["written"] == len(sizes) and s2["skipped"] == len(bad)
    for rel, size in sizes.items():
        mask = np.asarray(Image.open(output_paths(remote, rel)["mask"]))
        assert mask.shape == size[::-1]
        assert np.array_equal(mask, np.asarray(Image.open(output_paths(local, rel)["mask"]))), rel
    report = [json.loads(line) for line in (remote / "skipped.jsonl").read_text().splitlines()]
    assert sorted(entry["path"] for entry in report) == sorted(f"{url}/{rel}" for rel in bad)

    s3.put("photos/late.png", _png(noise(20, 30, seed=3)))
    again = segment(segment_config(url, remote, small, num_workers=0), progress=False)
    assert (again["written"], again["already_done"]) == (1, len(sizes))
    one = segment(segment_config(f"{url}/late.png", tmp_path / "one", small, num_workers=0),
                  progress=False)
    assert one["written"] == 1 and output_paths(tmp_path / "one", "late.png")["mask"].is_file()


def _png(array) -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()

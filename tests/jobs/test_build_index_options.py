"""build-index options that change what a run does, each checked by its effect: --overwrite,
--metric l2 (against brute force), --text-field/--id-field, --sort-window, --num-slots,
--no-cuda-graphs, --timeline, the --json phases and timing, and memory against the
corpus size."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from corpus_fixtures import chunk_rows, vectors_by_id
from test_build_index import PARAGRAPHS, make_corpus

from embedingest import build_index, open_index
from embedingest.cli import main
from embedingest.errors import ConfigError
from embedingest.index.shard_store import ShardStore
from embedingest.stages.encoder import TextEncoder

FAST = dict(num_workers=0, num_consumers=1, batch_size=8)
RECORDS = [{"id": f"r{i}", "text": p} for i, p in enumerate(PARAGRAPHS)]


def test_overwrite_starts_a_fresh_index(tmp_path):
    out = tmp_path / "idx"
    build_index(RECORDS[:6], out=str(out), **FAST)
    old_segments = {p.name for p in (out / "shards").glob("shard-*")}
    with pytest.raises(ConfigError, match="use --overwrite to rebuild it"):
        build_index(RECORDS[6:], out=str(out), metric="l2", **FAST)
    s = build_index(RECORDS[6:], out=str(out), metric="l2", overwrite=True, **FAST)
    # nothing of the first build is left: not its units (none counted removed or
    # unchanged), not its vectors, not its segment files
    assert (s["units_indexed"], s["units_unchanged"], s["units_removed"]) == (6, 0, 0)
    assert s["vectors_total"] == 6 and len(vectors_by_id(out)) == 6
    assert old_segments.isdisjoint(p.name for p in (out / "shards").glob("shard-*"))
    assert json.loads((out / "manifest.json").read_text())["metric"] == "l2"
    with open_index(out) as index:
        found = {h[0].record_id for h in index.search([r["text"] for r in RECORDS], k=1)}
    assert found == {r["id"] for r in RECORDS[6:]}
    again = build_index(RECORDS[6:], out=str(out), metric="l2", overwrite=True, **FAST)
    assert again["units_indexed"] == 6 and again["units_unchanged"] == 0  # redone, not kept
    assert again["vectors_total"] == 6


def test_metric_l2_equals_brute_force(tmp_path):
    out = tmp_path / "l2"
    build_index(RECORDS, out=str(out), metric="l2", **FAST)
    stored = vectors_by_id(out)
    ids = np.array(sorted(stored))
    emb = np.stack([stored[i] for i in ids])
    queries = ["how does bread rise", "the tallest mountain", "a tragedy by Shakespeare"]
    with open_index(out) as index:
        q = index.encoder.encode(queries)
        hits = index.search(queries, k=5)
    dist = ((q[:, None, :] - emb[None]) ** 2).sum(-1)
    for row, h in zip(dist, hits):
        order = np.argsort(row)[:5]
        assert [x.id for x in h] == ids[order].tolist()
        np.testing.assert_allclose([x.score for x in h], row[order], rtol=1e-4, atol=1e-5)
        assert h[0].score < h[-1].score  # distances: smallest first


def test_text_and_id_fields_name_the_record_fields(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with open(corpus / "a.jsonl", "w") as fh:
        for i, p in enumerate(PARAGRAPHS[:4]):
            fh.write(json.dumps({"key": f"k{i}", "body": p, "text": "not this", "id": "nor this"}) + "\n")
    records = [{"key": f"m{i}", "body": p} for i, p in enumerate(PARAGRAPHS[4:8])]
    for corpus_in, out in ((corpus, tmp_path / "files"), (records, tmp_path / "mem")):
        s = build_index(corpus_in, out=str(out), text_field="body", id_field="key", **FAST)
        assert s["chunks"] == 4 and s["skipped"] == 0
        with open_index(out) as index:
            hits = [h[0] for h in index.search(PARAGRAPHS[:8], k=1)]
        got = {(h.record_id, h.text) for h in hits}
        want = ({(f"k{i}", p) for i, p in enumerate(PARAGRAPHS[:4])} if out.name == "files"
                else {(f"m{i}", p) for i, p in enumerate(PARAGRAPHS[4:8])})
        assert want <= got
    r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(tmp_path / "cli"),
                                  "--text-field", "body", "--id-field", "key", "--num-workers", "0",
                                  "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["chunks"] == 4, r.output


@pytest.fixture
def forward_spy(monkeypatch):
    """Record the attention mask of every batch the encoder runs (in this process)."""
    masks = []
    forward = TextEncoder.forward

    def spy(self, input_ids, attention_mask):
        masks.append(attention_mask.clone())
        return forward(self, input_ids, attention_mask)

    monkeypatch.setattr(TextEncoder, "forward", spy)
    return masks


def test_sort_window_sorts_chunks_by_length_across_batches(tmp_path, forward_spy):
    """Records of alternating lengths: sorted over a window of 8 batches, each batch
    holds chunks of one length and pads little; with a window of one batch, every batch
    pads its short chunks to the long ones. Same vectors either way."""
    rng = np.random.default_rng(0)
    records = [{"id": f"r{i}", "text": " ".join(rng.choice(PARAGRAPHS, 1 + 5 * (i % 2)))}
               for i in range(64)]
    padded, real, vectors = {}, {}, {}
    for window in (1, 8):
        forward_spy.clear()
        out = tmp_path / f"w{window}"
        build_index(records, out=str(out), sort_window=window, **FAST)
        real[window] = sum(int(m.sum()) for m in forward_spy)
        padded[window] = sum(m.numel() - int(m.sum()) for m in forward_spy)
        vectors[window] = vectors_by_id(out)
    assert real[1] == real[8] and padded[8] < padded[1] / 2, (padded, real)
    assert vectors[1].keys() == vectors[8].keys()
    assert max(float(np.abs(vectors[1][k] - vectors[8][k]).max()) for k in vectors[1]) < 1e-4


def test_no_fast_tokenizer_reaches_the_chunker_with_the_same_index(tmp_path, monkeypatch):
    """--no-fast-tokenizer makes the workers chunk with the model's own tokenizer; the
    index is the same (vectors and stored chunks), hard text included."""
    from embedingest.sources import text_dataset

    asked = []

    class Spy(text_dataset.FastChunker):
        def __init__(self, *args, fast=True, **kwargs):
            asked.append(fast)
            super().__init__(*args, fast=fast, **kwargs)

    monkeypatch.setattr(text_dataset, "FastChunker", Spy)
    records = RECORDS + [{"id": "odd", "text": "Crème brûlée\r\nx[SEP]y 東京 \x0b\u200b "
                          + "glued" * 40 + " " + " ".join(PARAGRAPHS)}]
    stored = {}
    for fast in (True, False):
        out = tmp_path / f"fast-{fast}"
        build_index(records, out=str(out), chunk_tokens=32, overlap=8, fast_tokenizer=fast, **FAST)
        with ShardStore(out) as store:
            ids = sorted(vectors_by_id(out))
            rows = [(i, c.record_id, c.char_start, c.char_end, c.text)
                    for i, c in sorted(store.chunks(ids).items())]
        stored[fast] = (vectors_by_id(out), rows)
    assert asked == [True, False]
    (vec_a, rows_a), (vec_b, rows_b) = stored[True], stored[False]
    assert rows_a == rows_b and len(rows_a) > len(records)
    assert vec_a.keys() == vec_b.keys()
    for i in vec_a:
        np.testing.assert_allclose(vec_a[i], vec_b[i], rtol=0, atol=1e-6)


def test_num_slots_reaches_the_engine(tmp_path):
    s = build_index(RECORDS, out=str(tmp_path / "a"), num_slots=3, **FAST)
    assert s["engine"]["num_slots"] == 3 and s["engine"]["num_consumers"] == 1
    s = build_index(RECORDS, out=str(tmp_path / "b"), **FAST | {"num_consumers": 3})
    assert s["engine"]["num_slots"] == 6  # 0: twice the consumers


def test_no_cuda_graphs_reaches_the_encoder(tmp_path, monkeypatch):
    seen = []
    load = TextEncoder.from_facts.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("cuda_graphs"))
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(TextEncoder, "from_facts", classmethod(spy))
    for flag, want in (("--no-cuda-graphs", False), ("--cuda-graphs", True)):
        seen.clear()
        r = CliRunner().invoke(main, ["build-index", str(make_corpus(tmp_path / want.__repr__())),
                                      "--out", str(tmp_path / f"idx{want}"), "--num-workers", "0",
                                      flag, "--json"])
        assert r.exit_code == 0, r.output
        assert seen == [want]


@pytest.mark.needs_cuda
def test_no_cuda_graphs_on_a_gpu_runs_eager_with_the_same_vectors(tmp_path, monkeypatch):
    made = []
    load = TextEncoder.from_facts.__func__
    monkeypatch.setattr(TextEncoder, "from_facts", classmethod(
        lambda cls, *a, **k: made.append(load(cls, *a, **k)) or made[-1]))
    runs = {}
    for graphs in (True, False):
        made.clear()
        out = tmp_path / f"g{graphs}"
        build_index(RECORDS, out=str(out), device="cuda", dtype="fp16", cuda_graphs=graphs,
                    num_workers=0, batch_size=8)
        assert [e.uses_cuda_graphs for e in made] == [graphs]
        runs[graphs] = vectors_by_id(out)
    assert runs[True].keys() == runs[False].keys()
    assert min(float(runs[True][k] @ runs[False][k]) for k in runs[True]) > 0.999


def test_timeline_draws_the_run(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    png = tmp_path / "t.png"
    r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(tmp_path / "idx"),
                                  "--num-workers", "0", "--batch-size", "2", "--timeline", str(png)])
    assert r.exit_code == 0, r.output
    img = Image.open(png)
    assert img.format == "PNG" and img.width == 1600
    # lanes: compute, d2h, hand-off, each of the two consumers, each one's close and the
    # engine's wait for the consumers to end, 34 pixels each; and the loop's waits for
    # input, where one in the drawn batches' window was over WAIT_SPAN_MIN
    assert img.height in (50 + 34 * 8 + 40, 50 + 34 * 9 + 40)
    assert len(img.getcolors(maxcolors=1 << 16)) > 5
    # a report inside the index folder (named manifest.json, it replaced the manifest) is refused first
    before = {p: p.read_bytes() for p in (tmp_path / "idx").rglob("*") if p.is_file()}
    for option, name in (("--timeline", "manifest.json"), ("--trace", "notes.json")):
        inside = tmp_path / "idx" / name
        r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(tmp_path / "idx"), option, str(inside)])
        assert r.exit_code == 1 and r.output == (
            f"Error: {option} {str(inside)!r} is inside the output folder {str(tmp_path / 'idx')!r}, whose files the "
            "run writes and reads back; write it elsewhere (beside the folder)\n"), r.output
    assert {p: p.read_bytes() for p in (tmp_path / "idx").rglob("*") if p.is_file()} == before


def test_json_phases_and_timing_add_up(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(tmp_path / "idx"),
                                  "--num-workers", "1", "--batch-size", "4", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    phases, loop = s["phases"], s["timing"]
    assert set(phases) == {"load_model_s", "plan_s", "train_s", "encode_s", "finish_s"}
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) == pytest.approx(s["seconds"], abs=0.003 * len(phases))
    parts = ("start_s", "first_batch_s", "input_wait_s", "first_forward_s", "forward_submit_s", "close_s")
    assert set(loop) == set(parts)
    spent = sum(loop[k] for k in parts)
    # the main loop is the encode phase but for setting up the loader, sinks and engine objects
    assert 0.8 * phases["encode_s"] <= spent <= phases["encode_s"] + 0.003 * len(parts), (spent, phases)
    assert loop["first_batch_s"] > 0 and loop["forward_submit_s"] > 0 and loop["close_s"] > 0
    # an unchanged re-run encodes nothing: no main loop
    r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(tmp_path / "idx"),
                                  "--num-workers", "1", "--json"])
    again = json.loads(r.stdout)
    assert again["timing"] is None and again["phases"]["encode_s"] < phases["encode_s"]


MEMORY_PROBE = textwrap.dedent("""
    import json, os, sys, threading, time
    from embedingest import build_index

    def rss():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def build(corpus, bad_records):
        filler = ("lorem ipsum dolor sit amet " * 40_000)[: 1 << 20]
        os.makedirs(corpus)
        with open(os.path.join(corpus, "big.jsonl"), "w") as fh:
            fh.write(json.dumps({"id": "a", "text": "A first good record, about bread."}) + "\\n")
            for i in range(bad_records):
                fh.write(json.dumps({"id": f"x{i}", "txt": filler}) + "\\n")
            fh.write(json.dumps({"id": "b", "text": "A second good record, about ships."}) + "\\n")
        base, peak, stop = rss(), [0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.002)

        thread = threading.Thread(target=sample)
        thread.start()
        s = build_index(corpus, out=corpus + "-idx", num_workers=0, num_consumers=1, batch_size=8)
        stop.set()
        thread.join()
        assert s["chunks"] == 2 and s["skipped_by_reason"] == {"field": bad_records}, s
        return peak[0] - base

    if __name__ == "__main__":
        root = sys.argv[1]
        build(os.path.join(root, "warm-up"), 1)  # model, libraries, allocator pools
        print(build(os.path.join(root, "small"), 4), build(os.path.join(root, "big"), 64))
""")


@pytest.mark.slow
def test_memory_grows_with_the_index_not_the_corpus(tmp_path):
    """The same index (two vectors) from a 4-MiB and a 64-MiB file of records (all but
    two with their text under the wrong field: read, parsed and reported, never
    indexed). What a build adds to the process's memory, sampled while it runs, is the
    same for both within a few MiB; holding the file, its lines or its records adds
    about 55 MiB more for the big one (measured with the lines held in a list). Memory
    does not depend on the machine's load."""
    script = tmp_path / "probe.py"
    script.write_text(MEMORY_PROBE)
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    small, big = map(int, out.stdout.split()[-2:])
    assert big - small < 24 << 20, (small >> 20, big >> 20)


def test_workers_tokenize_while_the_weights_load_and_an_unchanged_run_loads_none(tmp_path, monkeypatch):
    """On one device the loader's worker processes are running (and have batches ready),
    and the engine's consumers started, before the weights start loading; phases are
    listed in the order they ran. A re-run with nothing to encode does not load the
    weights at all."""
    from embedingest.engine.egress import EgressEngine
    from embedingest.jobs.build_index import encode

    corpus = make_corpus(tmp_path / "corpus")
    loads = []
    load = TextEncoder.from_facts.__func__
    start = encode.start_batches
    engine_start = EgressEngine.start

    def started(*args, **kwargs):
        batches = start(*args, **kwargs)
        loads.append(("workers", [w.pid for w in batches.inner._workers if w.is_alive()]))
        return batches

    def consumers(engine):
        engine_start(engine)
        loads.append(("consumers", [p.pid for p in engine._consumers.procs if p.is_alive()]))
        return engine

    def spy(cls, *args, **kwargs):
        loads.append(("weights", None))
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(encode, "start_batches", started)
    monkeypatch.setattr(EgressEngine, "start", consumers)
    monkeypatch.setattr(TextEncoder, "from_facts", classmethod(spy))
    s = build_index(corpus, out=str(tmp_path / "idx"), num_workers=2, num_consumers=1, batch_size=4)
    assert [kind for kind, _ in loads] == ["workers", "consumers", "weights"]
    assert len(loads[0][1]) == 2 and len(loads[1][1]) == 1
    assert list(s["phases"]) == ["plan_s", "load_model_s", "train_s", "encode_s", "finish_s"]
    assert s["phases"]["load_model_s"] > 0 and s["chunks"] == 12
    loads.clear()
    again = build_index(corpus, out=str(tmp_path / "idx"), num_workers=2, num_consumers=1)
    assert loads == [] and again["units_unchanged"] == 4 and again["phases"]["load_model_s"] == 0
    # the same keys in the same order (the README's), the unloaded weights' 0 in its place
    assert list(again["phases"]) == ["plan_s", "load_model_s", "train_s", "encode_s", "finish_s"]
    assert again["model"] == s["model"]


def test_weights_that_fail_to_load_stop_the_workers_and_consumers_started_before(
        tmp_path, monkeypatch, no_leaks):
    """The loader's workers and the engine's consumers start before the weights load; a
    load that fails stops them all, and the error is the load's."""
    corpus = make_corpus(tmp_path / "corpus")

    def broken(cls, *args, **kwargs):
        raise ConfigError("model.safetensors is damaged: cannot read tensor 'embeddings'")

    monkeypatch.setattr(TextEncoder, "from_facts", classmethod(broken))
    with pytest.raises(ConfigError, match="model.safetensors is damaged"):
        build_index(corpus, out=str(tmp_path / "idx"), num_workers=2, num_consumers=2, batch_size=4)
    with ShardStore(tmp_path / "idx") as store:
        assert store.committed() == []


@pytest.mark.parametrize("existing", [False, True])
def test_a_width_the_config_gets_wrong_is_put_right(tmp_path, monkeypatch, existing):
    """The plan runs on the model's facts, its width taken from the config; where the
    weights give another, the manifest says the weights' (a new index), or the run loads
    them to check the folder's index against (an existing one): no error either way."""
    from embedingest.stages.encoder import ModelFacts

    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "idx"
    if existing:
        build_index(corpus, out=str(out), **FAST)
        (corpus / "e.txt").write_text("Glaciers carve valleys as they flow downhill under their own weight.")
    monkeypatch.setattr(ModelFacts, "dim", property(lambda self: 999))
    s = build_index(corpus, out=str(out), **FAST)
    with ShardStore(out) as store:
        assert store.read_manifest().dim == 384
    assert s["vectors_total"] == (13 if existing else 12)
    (hit,), = open_index(out).search([PARAGRAPHS[1]], k=1)
    assert hit.text == PARAGRAPHS[1]


def test_loader_workers_count_the_parts_of_large_files(tmp_path, monkeypatch):
    """One large JSON lines file gets as many workers as it has parts (it used to get
    one); --no-split-files, in-memory records and small files keep the old count."""
    from embedingest.config import IndexConfig
    from embedingest.jobs.build_index.encode import loader_workers
    from embedingest.sources import file_parts
    from embedingest.sources.text_dataset import Unit

    monkeypatch.setattr(file_parts, "PART_BYTES", 1000)
    big, small = tmp_path / "big.jsonl", tmp_path / "small.txt"
    big.write_bytes(b'{"text": "x"}\n' * 800)  # 11,200 bytes: up to 11 parts
    small.write_text("small")
    units = [Unit(0, "big.jsonl", path=str(big))]
    assert loader_workers(IndexConfig(num_workers=6), units) == 6
    assert loader_workers(IndexConfig(num_workers=6, split_files=False), units) == 1
    assert loader_workers(IndexConfig(num_workers=6), [Unit(1, "small.txt", path=str(small))]) == 1
    assert loader_workers(IndexConfig(num_workers=6), [Unit(2, "m", text="t")]) == 0
    assert loader_workers(IndexConfig(num_workers=1), units) == 1


def _spans(out) -> set[tuple]:
    """(record, chunk number, character span) of every stored chunk."""
    return {row[1:5] for row in chunk_rows(out, list(vectors_by_id(out))).values()}


def test_an_update_cuts_texts_as_the_index_was_cut(tmp_path):
    """Before: a later run with other (or the default) --chunk-tokens/--overlap added chunks
    of another size to the index without a word."""
    out, alone = tmp_path / "idx", tmp_path / "alone"
    build_index(RECORDS[:6], out=str(out), chunk_tokens=12, overlap=4, **FAST)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["chunking"] == {"tokens": 12, "overlap": 4}
    s = build_index(RECORDS, out=str(out), **FAST)  # no settings given: the index's
    assert s["units_indexed"] == 6 and s["chunks"] > 6  # several chunks a paragraph: 12 tokens, not 256
    build_index(RECORDS[6:], out=str(alone), chunk_tokens=12, overlap=4, **FAST)
    assert _spans(alone) <= _spans(out)
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "index.lock"}
    for given, asked in (({"chunk_tokens": 64}, "not 64 by 4"), ({"overlap": 0}, "not 12 by 0"),
                         ({"chunk_tokens": 64, "overlap": 8}, "not 64 by 8")):
        with pytest.raises(ConfigError, match=f"cuts texts into chunks of 12 tokens overlapping by 4, {asked}: "
                                              "leave out --chunk-tokens and --overlap"):
            build_index(RECORDS + [{"id": "new", "text": "a record the refused run must not add"}],
                        out=str(out), **given, **FAST)
    after = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "index.lock"}
    assert after == before  # refused before anything was written
    assert build_index(RECORDS, out=str(out), chunk_tokens=12, overlap=4, **FAST)["units_unchanged"] == 12
    s = build_index(RECORDS, out=str(out), chunk_tokens=64, overwrite=True, **FAST)
    assert s["chunks"] == 12
    assert json.loads((out / "manifest.json").read_text())["chunking"] == {"tokens": 64, "overlap": 32}


def test_a_chunking_the_model_cannot_take_is_refused_before_the_folder_is_made(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(ConfigError, match=r"overlap=32 must be smaller than the chunk size 16 .*give a smaller --overlap"):
        build_index(RECORDS, out=str(out), chunk_tokens=16, **FAST)
    with pytest.raises(ConfigError, match=r"overlap=300 must be smaller than the chunk size 256 \(chunk-tokens 1000, "
                                          r"the model takes at most 256\)"):
        build_index(RECORDS, out=str(out), chunk_tokens=1000, overlap=300, **FAST)
    assert not out.exists()


def _files(out) -> dict:
    """Every file of an index folder with its modification time (the run lock aside)."""
    return {p.relative_to(out).as_posix(): p.stat().st_mtime_ns for p in out.rglob("*")
            if p.is_file() and p.name != "index.lock"}


def test_chunk_tokens_that_leave_no_room_for_text_are_refused_before_the_folder_is_made(tmp_path):
    """--chunk-tokens 2 (MiniLM adds [CLS] and [SEP]) was refused in a DataLoader worker's
    traceback after the manifest had recorded it, so every later run failed or was refused
    until --overwrite. The count of special tokens is the tokenizer's own."""
    corpus, out, idx = make_corpus(tmp_path / "docs"), tmp_path / "ick", tmp_path / "idx"
    with pytest.raises(ConfigError) as err:
        build_index(RECORDS, out=str(out), chunk_tokens=2, overlap=0, **FAST)
    assert str(err.value) == ("--chunk-tokens 2 leaves no token of a chunk for text: each chunk holds the 2 "
                              "special tokens the model adds; give --chunk-tokens 3 or more")
    with pytest.raises(ConfigError) as err:  # the overlap counts too
        build_index(RECORDS, out=str(out), chunk_tokens=10, overlap=8, **FAST)
    assert str(err.value) == ("--chunk-tokens 10 leaves no token of a chunk for text: each chunk holds the 2 "
                              "special tokens the model adds and the 8 it shares with the one before "
                              "(--overlap); give --chunk-tokens 11 or more")
    r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(out), "--device", "cpu",
                                  "--chunk-tokens", "2", "--overlap", "0"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1] == (
        "Error: --chunk-tokens 2 leaves no token of a chunk for text: each chunk holds the 2 special tokens "
        "the model adds; give --chunk-tokens 3 or more")
    assert not out.exists()
    build_index(corpus, out=str(idx), chunk_tokens=3, overlap=0, **FAST)  # the smallest allowed builds
    before = _files(idx)
    r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(idx), "--chunk-tokens", "2",
                                  "--overlap", "0", "--overwrite"])
    assert r.exit_code == 2 and "give --chunk-tokens 3 or more" in r.output and _files(idx) == before


def test_a_document_prompt_longer_than_a_chunk_is_refused_before_the_folder_is_made(tmp_path):
    """A refused --doc-prompt still wrote manifest.json (recording it), shards/ and
    units.sqlite, so the next run without it was refused; and its advice, "raise
    --chunk-tokens", could not work for a prompt longer than the model reads."""
    corpus, out = make_corpus(tmp_path / "docs"), tmp_path / "idp"
    long = "represent this passage for retrieval " * 60  # 300 tokens; MiniLM reads 256
    for given in ({}, {"chunk_tokens": 512}):
        with pytest.raises(ConfigError) as err:
            build_index(corpus, out=str(out), doc_prompt=long, **given, **FAST)
        assert str(err.value) == (
            f"the document prompt {long[:60] + '...'!r} takes 300 of the 256 tokens of a chunk, leaving no token "
            "for new text (a chunk also holds the 2 special tokens the model adds and the 32 it shares with the "
            "one before (--overlap)); shorten the prompt (--doc-prompt) to at most 221 tokens or lower --overlap: "
            "the model reads at most 256 tokens, so no --chunk-tokens makes room for it")
    assert not out.exists()
    short = "represent this passage for retrieval "  # 5 tokens: a larger chunk makes room
    r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(out), "--doc-prompt", short,
                                  "--chunk-tokens", "10", "--overlap", "4"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1] == (
        f"Error: the document prompt {short!r} takes 5 of the 10 tokens of a chunk, leaving no token for new "
        "text (a chunk also holds the 2 special tokens the model adds and the 4 it shares with the one before "
        "(--overlap)); raise --chunk-tokens to 12 or more, or shorten the prompt (--doc-prompt)")
    assert not out.exists()
    s = build_index(corpus, out=str(out), doc_prompt=short, chunk_tokens=12, overlap=4, **FAST)  # as advised
    assert s["chunks"] > s["docs"] and s["skipped"] == 0
    assert build_index(corpus, out=str(out), **FAST)["units_unchanged"] == 4  # the index's prompt, kept


def test_the_record_fields_are_kept_and_another_one_is_refused(tmp_path):
    """--text-field/--id-field were not recorded: a later run with another field kept the
    unchanged files read with the old one and read new files with the new one, mixing two
    fields in one index without a word."""
    corpus, out = tmp_path / "corpus", tmp_path / "idx"
    corpus.mkdir()

    def write(name, rows):
        with open(corpus / name, "w") as fh:
            fh.writelines(json.dumps({"key": f"{name}{i}", "text": p, "body": p.upper()}) + "\n"
                          for i, p in enumerate(rows))

    write("a.jsonl", PARAGRAPHS[:3])
    build_index(corpus, out=str(out), id_field="key", **FAST)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["record_fields"] == {"text": "text", "id": "key"}
    write("b.jsonl", PARAGRAPHS[3:5])
    before = _files(out)
    with pytest.raises(ConfigError) as err:
        build_index(corpus, out=str(out), text_field="body", **FAST)
    assert str(err.value) == (f"the index at {str(out)!r} reads the text of its records from the field 'text', "
                              "not 'body': leave out --text-field (or give --text-field text) to update it, or "
                              "--overwrite to rebuild it with the new field")
    with pytest.raises(ConfigError, match="reads the id of its records from the field 'key', not 'id': leave out "
                                          "--id-field"):
        build_index([{"id": "r", "text": "a record"}], out=str(out), id_field="id", **FAST)
    r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(out), "--text-field", "body"])
    assert r.exit_code == 1 and "not 'body': leave out --text-field" in r.output
    assert _files(out) == before  # refused before anything was written
    s = build_index(corpus, out=str(out), **FAST)  # none given: the index's
    assert (s["units_indexed"], s["units_unchanged"]) == (1, 1)
    with open_index(out) as index:
        hits = {h[0].record_id: h[0].text for h in index.search(PARAGRAPHS[:5], k=1)}
    assert hits == {f"{n}{i}": p for n, rows in (("a.jsonl", PARAGRAPHS[:3]), ("b.jsonl", PARAGRAPHS[3:5]))
                    for i, p in enumerate(rows)}  # every text the 'text' field's, every id the 'key' field's
    s = build_index(corpus, out=str(out), text_field="body", overwrite=True, **FAST)
    assert s["units_indexed"] == 2
    assert json.loads((out / "manifest.json").read_text())["record_fields"] == {"text": "body", "id": "id"}


def test_an_index_from_before_the_record_fields_were_kept_opens_and_updates(tmp_path):
    out = tmp_path / "idx"
    build_index(RECORDS[:6], out=str(out), **FAST)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["record_fields"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    with open_index(out) as index:
        assert index.search([RECORDS[0]["text"]], k=1)[0][0].record_id == "r0"
    s = build_index(RECORDS, out=str(out), **FAST)  # the defaults, recorded from now on
    assert (s["units_indexed"], s["units_unchanged"]) == (6, 6)
    assert json.loads((out / "manifest.json").read_text())["record_fields"] == {"text": "text", "id": "id"}


def test_an_index_from_before_chunking_was_kept_takes_the_runs_and_keeps_it(tmp_path):
    """An index an older embedingest made records no chunking: a plain update cut its new
    texts at the default and wrote that into the manifest, for good. Now the chunking it
    was built with must be given, once."""
    out = tmp_path / "idx"
    build_index(RECORDS[:6], out=str(out), **FAST)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["chunking"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    for given in ({}, {"chunk_tokens": 64}, {"overlap": 8}):
        with pytest.raises(ConfigError, match=r"does not record how its texts were cut into chunks \(an older "
                                              r"embedingest made it\): give the --chunk-tokens and --overlap"):
            build_index(RECORDS, out=str(out), **given, **FAST)
    assert "chunking" not in json.loads((out / "manifest.json").read_text())
    build_index(RECORDS, out=str(out), chunk_tokens=64, overlap=8, **FAST)
    assert json.loads((out / "manifest.json").read_text())["chunking"] == {"tokens": 64, "overlap": 8}
    assert build_index(RECORDS, out=str(out), **FAST)["units_unchanged"] == 12  # the index's, kept
    with pytest.raises(ConfigError, match="cuts texts into chunks of 64 tokens overlapping by 8, not 256 by 8"):
        build_index(RECORDS, out=str(out), chunk_tokens=256, **FAST)


def test_the_cli_refuses_another_chunking_naming_the_index(tmp_path):
    corpus = make_corpus(tmp_path / "docs")
    out = tmp_path / "idx"
    run = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(out), "--num-workers", "0",
                                    "--chunk-tokens", "12", "--overlap", "4"])
    assert run.exit_code == 0, run.output
    run = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(out), "--chunk-tokens", "100"])
    assert run.exit_code == 1
    assert (f"Error: the index at {str(out)!r} cuts texts into chunks of 12 tokens overlapping by 4, "
            "not 100 by 4") in run.output
    help_text = CliRunner().invoke(main, ["build-index", "--help"]).output
    assert "256, or the index's when it updates one" in " ".join(help_text.split())


def test_a_trained_factory_with_a_transform_faiss_cannot_clone_builds(tmp_path):
    """``L2norm,IVF4,Flat``: each shard writer cloned the trained index, and faiss clones no
    L2norm transform: every consumer failed with a traceback."""
    records = [{"id": f"r{i}", "text": f"note {i} about topic {i % 7} and item {i * 31 % 97}"} for i in range(120)]
    out = tmp_path / "idx"
    s = build_index(records, out=str(out), index="L2norm,IVF4,Flat", train_size=120, search_params="nprobe=4",
                    **FAST)
    assert s["vectors_total"] == 120
    with open_index(out) as index:
        hits = index.search([r["text"] for r in records[:20]], k=1)
        exact = index.encoder.encode([r["text"] for r in records])
    assert [h[0].record_id for h in hits] == [r["id"] for r in records[:20]]
    assert np.allclose(np.linalg.norm(exact, axis=1), 1, atol=1e-3)


def test_an_update_keeps_the_index_s_metric(tmp_path):
    """An l2 index was refused on every update without --metric l2."""
    out = tmp_path / "idx"
    build_index(RECORDS[:6], out=str(out), metric="l2", **FAST)
    assert build_index(RECORDS, out=str(out), **FAST)["units_indexed"] == 6
    assert json.loads((out / "manifest.json").read_text())["metric"] == "l2"
    with pytest.raises(ConfigError, match="metric l2.*not .*metric ip"):
        build_index(RECORDS, out=str(out), metric="ip", **FAST)
    fresh = tmp_path / "fresh"
    build_index(RECORDS[:2], out=str(fresh), **FAST)
    assert json.loads((fresh / "manifest.json").read_text())["metric"] == "ip"


def test_an_update_keeps_the_index_s_factory(tmp_path):
    """Before: an update without --index of an HNSW8 index (or one reindexed) was refused,
    asking for --index 'HNSW8' each time; now it keeps the index's, as its chunking."""
    from embedingest.index.reindex import reindex

    out = tmp_path / "idx"
    build_index(RECORDS[:6], out=str(out), index="HNSW8", search_params="efSearch=32", save_embeddings=True,
                **FAST)
    s = build_index(RECORDS, out=str(out), **FAST)  # no --index: the index's
    assert s["units_indexed"] == 6 and s["vectors_total"] == 12
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["factory"], manifest["search"]) == ("HNSW8", {"params": "efSearch=32"})
    with open_index(out) as index:
        assert {type(faiss_inner(seg)).__name__ for seg in index.shards} == {"IndexHNSWFlat"}
    reindex(out, "IVF2,Flat", train_size=12)
    more = RECORDS + [{"id": "new", "text": "A record added after the reindex."}]
    assert build_index(more, out=str(out), **FAST)["units_indexed"] == 1
    assert json.loads((out / "manifest.json").read_text())["factory"] == "IVF2,Flat"
    with pytest.raises(ConfigError, match=r"leave out --index \(or pass --index 'IVF2,Flat'\) to update it as it is"):
        build_index(more, out=str(out), index="Flat", **FAST)


def faiss_inner(index):
    import faiss

    return faiss.downcast_index(faiss.downcast_index(index).index)


def test_a_model_that_takes_fewer_tokens_than_the_index_s_chunks_is_named(tmp_path):
    """A copy of the model with a smaller max_seq_length: the refusal said to give the
    index's values, which the model cannot take, in a loop."""
    from model_fixtures import copy_model

    model = copy_model(tmp_path / "m128")
    config = json.loads((model / "sentence_bert_config.json").read_text())
    (model / "sentence_bert_config.json").write_text(json.dumps(config | {"max_seq_length": 128}))
    out = tmp_path / "idx"
    build_index(RECORDS[:4], out=str(out), **FAST)
    for given in ({}, {"chunk_tokens": 256, "overlap": 32}):
        with pytest.raises(ConfigError, match=r"cuts texts into chunks of 256 tokens, more than this model takes "
                                              r"\(128\): use the model it was built with, or --overwrite"):
            build_index(RECORDS, out=str(out), model=str(model), **given, **FAST)


def test_save_embeddings_asked_of_an_index_that_kept_none_is_refused_before_the_work(tmp_path):
    """An update given --save-embeddings of an index built without it saved the new
    files' embeddings only, without a word: reindex and export still lacked the others.
    It is refused, naming what to do; an index that keeps them keeps them for all."""
    out = tmp_path / "idx"
    build_index(RECORDS[:6], out=str(out), **FAST)
    shards = sorted(p.name for p in (out / "shards").iterdir())
    with pytest.raises(ConfigError, match=r"keeps no embeddings of its 6 vectors .*leave out "
                                          r"--save-embeddings .* or --overwrite"):
        build_index(RECORDS, out=str(out), save_embeddings=True, **FAST)
    assert sorted(p.name for p in (out / "shards").iterdir()) == shards  # nothing indexed, nothing removed
    s = build_index(RECORDS, out=str(out), **FAST)
    assert (s["units_indexed"], s["units_unchanged"], s["vectors_total"]) == (len(RECORDS) - 6, 6, len(RECORDS))
    with ShardStore(out) as store:
        assert not any(shard.has_embeddings for shard in store.committed())
    kept = tmp_path / "kept"
    build_index(RECORDS[:6], out=str(kept), save_embeddings=True, **FAST)
    assert build_index(RECORDS, out=str(kept), save_embeddings=True, **FAST)["vectors_total"] == len(RECORDS)
    rebuilt = build_index(RECORDS, out=str(out), save_embeddings=True, overwrite=True, **FAST)
    assert rebuilt["vectors_total"] == len(RECORDS)
    with ShardStore(out) as store:
        assert all(shard.has_embeddings for shard in store.committed() if shard.rows)

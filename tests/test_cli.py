"""The command line itself: presets against options, -v, --version, search's outputs and
--params, the bench commands (small, on the CPU)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tomllib
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from embedingest import __version__, build_index
from embedingest.cli import main
from embedingest.errors import ConfigError
from embedingest.config import IndexConfig, SearchConfig, SegmentConfig, ServeConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "Bread rises because yeast ferments sugars and releases carbon dioxide into the dough.",
    "TCP provides reliable, ordered delivery of a stream of bytes between applications.",
    "Whales are marine mammals that breathe air through blowholes on top of their heads.",
    "Volcanoes form where magma from the mantle reaches the surface through cracks in the crust.",
    "Gradient descent updates parameters in the direction that most reduces the loss function.",
    "Mount Everest, at 8,849 metres, is the highest mountain above sea level on Earth.",
]
FAST = dict(num_workers=0, num_consumers=1, batch_size=8)


@pytest.fixture(scope="module")
def flat_index(tmp_path_factory):
    out = tmp_path_factory.mktemp("flat") / "idx"
    s = build_index([{"id": f"r{i}", "text": t} for i, t in enumerate(TEXTS)], out=str(out), **FAST)
    assert s["vectors_total"] == len(TEXTS)
    return out


def captured_config(monkeypatch) -> list:
    """Replace the build job by a recorder of the config the CLI hands it."""
    import embedingest.jobs.build_index as job

    seen = []

    def fake_build_index(corpus, cfg, progress=False, timeline=None, trace=None):
        seen.append(cfg)
        return {"exit_code": 0}

    monkeypatch.setattr(job, "build_index", fake_build_index)
    return seen


def test_options_on_the_command_line_win_over_the_preset(tmp_path, monkeypatch):
    preset = tmp_path / "preset.toml"
    preset.write_text('batch_size = 64\nnum_consumers = 3\ncuda_graphs = true\noverlap = 5\nindex = "HNSW16"\n')
    seen = captured_config(monkeypatch)
    r = CliRunner().invoke(main, ["build-index", str(tmp_path), "--config", str(preset), "--json",
                                  "--batch-size", "8", "--no-cuda-graphs", "--index", "Flat"])
    assert r.exit_code == 0, r.output
    (cfg,) = seen
    # given on the command line: theirs; only in the preset: the preset's; in neither: the default
    assert (cfg.batch_size, cfg.cuda_graphs, cfg.index) == (8, False, "Flat")
    assert (cfg.num_consumers, cfg.overlap) == (3, 5)
    assert cfg.chunk_tokens == IndexConfig().chunk_tokens
    assert load_config(IndexConfig, preset, batch_size=8, overlap=None) == \
        IndexConfig(batch_size=8, num_consumers=3, cuda_graphs=True, overlap=5, index="HNSW16")


def test_unknown_preset_key_is_an_error_naming_it(tmp_path):
    preset = tmp_path / "preset.toml"
    preset.write_text("batch_sise = 64\n")
    r = CliRunner().invoke(main, ["build-index", str(tmp_path), "--config", str(preset)])
    assert r.exit_code == 2 and "\nError: unknown setting(s) batch_sise" in r.output  # refused before any work


@pytest.mark.parametrize("line, message", [
    ('batch_size = "big"', "batch_size='big': must be an integer"),
    ("chunk_tokens = 2.5", "chunk_tokens=2.5: must be an integer or none"),
    ("chunk_tokens = 1e400", "chunk_tokens=inf: must be an integer or none"),
    ("num_workers = true", "num_workers=True: must be an integer"),
    ('search_k = "3"', "search_k='3': must be an integer or none"),
    ("index = 5", "index=5: must be text or none"),
])
def test_a_preset_value_of_the_wrong_type_is_an_error_naming_it(tmp_path, line, message):
    """Before: a TypeError deep in the run (``"big" < 0``), or the value used as it was."""
    preset = tmp_path / "preset.toml"
    preset.write_text(line + "\n")
    r = CliRunner().invoke(main, ["build-index", str(tmp_path), "--config", str(preset)])
    assert r.exit_code == 2 and r.output.endswith(f"\n\nError: {message}\n"), r.output


@pytest.mark.parametrize("kind", ["fifo", "utf16", "deep"])
def test_a_preset_that_is_not_a_toml_file_is_one_error_and_a_usage_status(tmp_path, kind):
    """Before: a named pipe hung the command for good; bytes that are not UTF-8 and
    nesting deeper than the parser's recursion gave tracebacks."""
    import os

    preset = tmp_path / "preset.toml"
    if kind == "fifo":
        os.mkfifo(preset)
    elif kind == "utf16":
        preset.write_bytes("batch_size = 8\n".encode("utf-16"))
    else:
        preset.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    r = CliRunner().invoke(main, ["build-index", str(tmp_path), "--config", str(preset)])
    assert r.exit_code == 2 and f"\n\nError: cannot read config preset {str(preset)!r}: " in r.output, r.output
    assert r.output.endswith("; give a TOML file (see configs/)\n") and "Traceback" not in r.output


def test_overwrite_given_as_the_text_false_wipes_nothing(tmp_path, flat_index):
    """``overwrite = "false"`` is a true string: it deleted the index it meant to keep."""
    before = sorted(p.name for p in flat_index.rglob("*"))
    preset = tmp_path / "preset.toml"
    preset.write_text(f'overwrite = "false"\nout = "{flat_index}"\n')
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(TEXTS[0])
    r = CliRunner().invoke(main, ["build-index", str(tmp_path / "corpus"), "--config", str(preset)])
    assert r.exit_code == 2 and r.output.endswith("\n\nError: overwrite='false': must be true or false\n")
    assert sorted(p.name for p in flat_index.rglob("*")) == before


def test_library_settings_take_numpy_integers_and_paths(tmp_path):
    import numpy as np

    from embedingest.config import SegmentConfig, check_types

    cfg = IndexConfig(batch_size=np.int64(8), out=tmp_path / "x", overlap=np.int32(4), search_k=np.int64(3),
                      chunk_tokens=np.int16(64))
    check_types(cfg)
    # they become Python's own numbers: numpy's failed the checks after (``isinstance(x, int)``)
    # and the manifest's JSON (a build stopped after its shards were committed)
    assert [(v, type(v)) for v in (cfg.batch_size, cfg.overlap, cfg.search_k, cfg.chunk_tokens)] == [
        (8, int), (4, int), (3, int), (64, int)]
    cfg.validate()
    check_types(SegmentConfig(overlay_alpha=1, images=tmp_path))
    with pytest.raises(ConfigError, match=r"^overlay_alpha=nan: must be a number$"):
        SegmentConfig(overlay_alpha=float("nan")).validate()


def test_version_is_the_package_version():
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert r.output == f"embedingest, version {version}\n" and __version__ == version


@pytest.mark.parametrize("verbose", [True, False])
def test_verbose_logs_progress_to_stderr(tmp_path, monkeypatch, verbose):
    # pytest puts its own handler on the root logger, which makes basicConfig a no-op
    monkeypatch.setattr(logging.root, "handlers", [])
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXTS[0])
    args = ["build-index", str(corpus), "--out", str(tmp_path / "idx"), "--num-workers", "0",
            "--num-consumers", "1", "--json"]
    r = CliRunner().invoke(main, (["-v"] if verbose else []) + args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["chunks"] == 1  # the log goes to stderr only
    line = f"INFO embedingest: {tmp_path / 'idx'}: 1 units to index, 0 unchanged, 0 deleted"
    assert (line in r.stderr) is verbose, r.stderr


def test_search_prints_rank_score_source_and_text(flat_index):
    r = CliRunner().invoke(main, ["search", str(flat_index), "why", "does", "bread", "rise", "-k", "2"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert len(lines) == 4
    m = re.fullmatch(r"  1  (\d\.\d{4})  record:r0 \[r0\] #0", lines[0])
    assert m and 0.3 < float(m.group(1)) <= 1.0, lines[0]
    assert lines[1] == "     " + TEXTS[0]
    assert re.fullmatch(r"  2  \d\.\d{4}  record:r\d \[r\d\] #0", lines[2]) and lines[2][5:11] < lines[0][5:11]
    assert lines[3].startswith("     ") and lines[3][5:] in TEXTS[1:]


def test_a_query_with_a_byte_that_is_not_utf8_is_one_error_line(flat_index):
    """A query typed in a Latin-1 terminal (``caf\\xe9``) reaches Python as a lone
    surrogate; it stopped search with the tokenizer's TypeError and a traceback."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "embedingest", "search", str(flat_index), b"caf\xe9"],
                         capture_output=True, timeout=120)
    assert run.returncode == 1 and run.stdout == b"", run.stderr
    assert run.stderr.decode() == ("Error: texts[0] holds a lone surrogate (U+DCE9 at character 3), not Unicode "
                                   "text (a byte that is not UTF-8, decoded with 'surrogateescape', becomes "
                                   "one); pass UTF-8 text\n")


def test_an_index_in_a_folder_named_in_another_encoding_builds_searches_and_updates(tmp_path):
    """A corpus folder named in Latin-1 (``caf\\xe9``: Python holds the byte as a
    surrogate) gave an index named so by default: its manifest could not be written
    (UnicodeEncodeError), and faiss's and Arrow's bindings, which take UTF-8 text, could
    not open its files (search, the next build's removals, export)."""
    import subprocess
    import sys

    root = os.fsencode(tmp_path)
    corpus, out = root + b"/caf\xe9", root + b"/index-caf\xe9"
    os.mkdir(corpus)
    for i, text in enumerate(TEXTS[:3]):
        with open(corpus + b"/doc\xe9%d.txt" % i, "w") as f:
            f.write(text)

    def run(*args):
        done = subprocess.run([sys.executable, "-m", "embedingest", *args], capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr.decode(errors="replace")
        return done.stdout

    build = [b"build-index", corpus, b"--out", out, b"--num-workers", b"0", b"--num-consumers", b"1", b"--json"]
    assert json.loads(run(*build))["chunks"] == 3
    manifest = json.loads(open(out + b"/manifest.json", "rb").read())
    assert os.fsencode(manifest["corpus_path"]) == os.path.realpath(corpus)
    hits = json.loads(run(b"search", out, b"whales", b"-k", b"1", b"--json"))
    assert hits[0]["source"] == "doc\\xe92.txt" and hits[0]["text"] == TEXTS[2]
    os.unlink(corpus + b"/doc\xe92.txt")
    assert json.loads(run(*build))["units_removed"] == 1
    hits = json.loads(run(b"search", out, b"whales", b"-k", b"3", b"--json"))
    assert sorted(h["source"] for h in hits) == ["doc\\xe90.txt", "doc\\xe91.txt"]
    run(b"export", out, b"--to", root + b"/exported\xe9")


def test_search_shows_what_the_corpus_controls_escaped_one_line_each(tmp_path):
    """A record id and a text holding a newline, terminal escape sequences and a
    bidirectional override: each hit is still two lines, with those characters written
    as escapes; the JSON output keeps them as they are."""
    out = tmp_path / "idx"
    rid = "r\x1b[2J\nWARNING forged"
    text = "Whales breathe air \x1b]0;pwned\x07 through blowholes \u202eon top of their heads."
    build_index([{"id": rid, "text": text}], out=str(out), **FAST)
    r = CliRunner().invoke(main, ["search", str(out), "whales", "-k", "1"])
    assert r.exit_code == 0, r.output
    first, preview = r.output.splitlines()
    assert re.fullmatch(r"  1  \d\.\d{4}  (.*)", first).group(1) == (
        "record:r\\x1b[2J\\x0aWARNING forged [r\\x1b[2J\\x0aWARNING forged] #0")
    assert preview == "     Whales breathe air \\x1b]0;pwned\\x07 through blowholes \\u202eon top of their heads."
    hits = json.loads(CliRunner().invoke(main, ["search", str(out), "whales", "--json"]).stdout)
    assert (hits[0]["record_id"], hits[0]["text"]) == (rid, text)


def test_search_of_an_empty_index_says_so(tmp_path):
    out = tmp_path / "idx"
    build_index([], out=str(out), **FAST)
    r = CliRunner().invoke(main, ["search", str(out), "anything"])
    assert r.exit_code == 0 and r.output == "no results (the index is empty)\n"


def test_search_params_reach_every_segment(tmp_path):
    """IVF2 over six vectors: one probed list holds fewer than six, both lists (nprobe=2,
    the index's own: a new IVF index probes up to 16) hold all, ranked as exact search
    ranks them."""
    out = tmp_path / "ivf"
    records = [{"id": f"r{i}", "text": t} for i, t in enumerate(TEXTS)]
    build_index(records, out=str(out), index="IVF2,Flat", train_size=6, **FAST)
    exact = tmp_path / "flat"
    build_index(records, out=str(exact), **FAST)

    def ranked(folder, *extra):
        r = CliRunner().invoke(main, ["search", str(folder), "breathing under water", "-k", "6",
                                      "--json", *extra])
        assert r.exit_code == 0, r.output
        return [h["record_id"] for h in json.loads(r.output)]

    assert len(ranked(out, "--params", "nprobe=1")) < 6
    assert ranked(out) == ranked(out, "--params", "nprobe=2") == ranked(exact)
    r = CliRunner().invoke(main, ["search", str(out), "x", "--params", "efSearch=16"])
    assert r.exit_code == 2 and "search parameters 'efSearch=16' do not apply" in r.output


@pytest.mark.slow
def test_bench_text_on_the_cpu_writes_its_rows(tmp_path, monkeypatch):
    import embedingest.bench.text as bench_text

    # the corpus's sentences from this file instead of parsing the whole standard library
    monkeypatch.setattr(bench_text, "_sentences", lambda: TEXTS)
    path = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["bench", "text", "--docs", "40", "--batch-size", "16", "--device", "cpu",
                                  "--num-workers", "0", "--num-consumers", "1", "--json", str(path)])
    assert r.exit_code == 0, r.output
    assert "| loop | docs/s | x bound | x sentence-transformers |" in r.stdout
    data = json.loads(path.read_text())
    rows = {row["kind"]: row for row in data["rows"]}
    assert set(rows) == {"bound", "loader", "engine", "reference"}  # fp32: no second reference
    assert rows["bound"]["vs_bound"] == 1.0 and rows["reference"]["vs_st"] == 1.0
    assert rows["engine"]["vectors"] == rows["reference"]["vectors"] == 40
    (summary,) = data["build_index_summaries"]
    assert summary["docs"] == 40 and summary["device"] == "cpu" and summary["dtype"] == "fp32"
    assert data["config"]["docs"] == 40 and data["config"]["device"] == "cpu"


def test_bench_segmentation_without_a_gpu_says_so(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(main, ["bench", "segmentation", "--steps", "1"])
    assert r.exit_code == 1 and "this benchmark needs a CUDA GPU" in r.output


@pytest.mark.parametrize("command, cls", [("build-index", IndexConfig), ("segment", SegmentConfig),
                                          ("search", SearchConfig), ("serve", ServeConfig)])
def test_options_are_the_config_fields_with_their_docs(command, cls):
    """Each field is a kebab-case option whose help is the field's doc; it defaults to None
    so a preset (or the dataclass default) applies unless the option is given."""
    params = {p.name: p for p in main.commands[command].params}
    for f in dataclasses.fields(cls):
        if f.name == "images":  # segment's argument
            continue
        option = params[f.name]
        assert option.help.startswith(f.metadata["doc"]) and option.default is None, f.name
        assert f.metadata.get("flags", [f"--{f.name.replace('_', '-')}"])[0] in option.opts, f.name


def test_build_index_help_reads_the_field_docs_choices_and_defaults():
    command = main.commands["build-index"]
    ctx = click.Context(command, info_name="build-index")
    lines = {p.name: p.get_help_record(ctx) for p in command.params if isinstance(p, click.Option)}
    assert lines["metric"] == ("--metric [ip|l2]", "Similarity: ip (inner product: cosine on the normalised "
                               "vectors) or l2 (for models trained for euclidean distance). An update keeps the "
                               "index's.  [default: ip, or the index's when it updates one]")
    assert lines["cuda_graphs"][0] == "--cuda-graphs / --no-cuda-graphs"
    assert lines["cuda_graphs"][1].startswith("On a GPU, replay") and lines["cuda_graphs"][1].endswith("  [default: on]")
    assert lines["out"] == ("--out DIRECTORY", "Output folder.  [default: indexes/<the corpus folder's or file's name>]")
    assert lines["commit_every"][1].endswith("  [default: 200000]")
    assert "[default:" not in lines["devices"][1]
    r = CliRunner().invoke(main, ["build-index", "--help"])
    assert r.exit_code == 0 and "Similarity: ip (inner product" in r.output


def test_a_value_outside_the_choices_is_a_usage_error_naming_them(tmp_path):
    r = CliRunner().invoke(main, ["build-index", str(tmp_path), "--metric", "cosine"])
    assert r.exit_code == 2 and "'cosine' is not one of 'ip', 'l2'" in r.output
    r = CliRunner().invoke(main, ["segment", str(tmp_path), "--arch", "unet"])
    assert r.exit_code == 2 and "'unet' is not one of 'deeplabv3_mobilenet_v3_large'" in r.output


@pytest.mark.parametrize("args", [[], ["bench"], ["bench", "text"], ["bench", "segmentation"],
                                  ["build-index"], ["segment"], ["search"], ["serve"]])
def test_every_option_of_every_command_has_help(args):
    command = main
    for name in args:
        command = command.commands[name]
    ctx = click.Context(command, info_name="embedingest")
    for param in command.get_params(ctx):
        if isinstance(param, click.Option):
            assert param.help, f"{' '.join(args)} {param.opts[0]} has no help"


def test_corpus_and_images_take_a_path_or_a_url(tmp_path):
    import click

    from embedingest.cli.common import InputPath

    kind = InputPath()
    assert kind.convert("s3://bucket/docs/", None, None) == "s3://bucket/docs/"
    assert kind.convert(f"file://{tmp_path}", None, None) == str(tmp_path)
    assert kind.convert(str(tmp_path), None, None) == str(tmp_path)
    with pytest.raises(click.BadParameter, match="does not exist"):
        kind.convert(str(tmp_path / "missing"), None, None)
    with pytest.raises(click.BadParameter, match="does not exist"):
        kind.convert(f"file://{tmp_path}/missing", None, None)


def test_search_gives_as_many_hits_as_the_library_and_serve_by_default(tmp_path):
    """One default k (10) for the CLI's search, open_index and serve when neither the
    search nor the index says (the CLI showed 5, the library and serve 10)."""
    import json as json_mod

    from embedingest.config import DEFAULT_SEARCH_K
    from embedingest.index.search import open_index

    texts = [f"note {i}: the cache keeps {i} entries of the index in memory" for i in range(14)]
    out = tmp_path / "idx"
    build_index([{"id": f"n{i}", "text": t} for i, t in enumerate(texts)], out=str(out), **FAST)
    r = CliRunner().invoke(main, ["search", str(out), "cache entries", "--json"])
    assert r.exit_code == 0, r.output
    with open_index(out) as index:
        assert len(json_mod.loads(r.output)) == len(index.search("cache entries")[0]) == DEFAULT_SEARCH_K == 10


def test_a_bench_table_s_first_line_names_the_machine_without_empty_fields():
    """On a machine without a GPU the text bench printed ``# CPU , torch ...``."""
    from embedingest.cli.bench import machine_line

    date = "2026-12-05 04:14 UTC"
    assert machine_line({"torch": "2.9", "date": date}) == f"# CPU, torch 2.9, {date}"
    assert machine_line({"gpu": "NVIDIA H200", "driver": "570.1", "torch": "2.9", "date": date}) == (
        f"# NVIDIA H200 driver 570.1, torch 2.9, {date}")


@pytest.mark.parametrize("command", [
    ["segment", "{images}", "--out", "{out}", "--random-weights", "--trace", "{missing}/t.json"],
    ["build-index", "{images}", "--out", "{out}", "--timeline", "{missing}/t.png"],
    ["bench", "text", "--docs", "10", "--device", "cpu", "--json", "{missing}/rows.json"],
])
def test_a_file_written_at_the_end_in_a_folder_that_does_not_exist_is_refused_before_any_work(tmp_path, command):
    """A --trace, --timeline or bench --json in a folder that does not exist failed only
    after the whole run, naming a temporary file (`.t.json.tmp-5924`), the summary lost."""
    (tmp_path / "images").mkdir()
    values = {"images": tmp_path / "images", "out": tmp_path / "out", "missing": tmp_path / "nope"}
    r = CliRunner().invoke(main, [arg.format(**values) for arg in command])
    option = next(a for a in command if a in ("--trace", "--timeline", "--json"))
    target = next(a for a in command if a.startswith("{missing}")).format(**values)
    assert r.exit_code == 2, r.output
    assert r.output.endswith(f"Error: Invalid value for '{option}': '{target}': the folder "
                             f"'{tmp_path / 'nope'}' does not exist; create it or give another path\n")
    assert "Traceback" not in r.output and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["segmentation", "--photos", "2", "--photo-sides", "100"],
     "Invalid value for '--photo-sides': '100' is not MIN,MAX (two whole numbers of pixels, e.g. 240,1600)"),
    (["segmentation", "--photos", "2", "--photo-sides", "300,200"],
     "Invalid value for '--photo-sides': '300,200': MIN must be at least 16 and at most MAX"),
    (["segmentation", "--photos", "0"], "Invalid value for '--photos': 0 is not in the range x>=1."),
    (["segmentation", "--photo-odd-share", "2"], "Invalid value for '--photo-odd-share': 2.0 is not in the range"),
    (["text", "--docs", "0"], "Invalid value for '--docs': 0 is not in the range x>=1."),
    (["text", "--num-consumers", "0"], "Invalid value for '--num-consumers': 0 is not in the range x>=1."),
    (["text", "--device", "foo", "--docs", "10"], "device='foo' is not a device; use auto, cuda, cuda:N or cpu"),
    (["segmentation", "--photos", "2", "--device", "foo"], "device='foo' is not a device"),
])
def test_bench_options_out_of_range_are_one_error_line_before_any_work(args, message):
    """--photo-sides 100 ended in a ValueError's traceback, --docs 0 in a ZeroDivisionError's
    after the corpus was made, --photos 0 said the benchmark needs a GPU, and bench text
    --device foo in torch's RuntimeError traceback."""
    r = CliRunner().invoke(main, ["bench", *args])
    assert r.exit_code in (1, 2) and message in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert r.output.strip().splitlines()[-1].startswith("Error: ")
    assert "# " not in r.output, "no table line before the error"


def test_build_index_closing_lines_say_one_of_a_kind_in_the_singular():
    from embedingest.cli.index import _index_paragraph

    one = {"skipped": 1, "skipped_by_reason": {"binary": 1}, "report": "idx/skipped.jsonl", "report_run": "r1",
           "skipped_earlier": 1, "units_indexed": 1, "docs": 1, "chunks": 1, "seconds": 1.0, "docs_per_s": 1.0,
           "chunks_per_s": 1.0, "device": "cpu", "dtype": "fp32", "units_unchanged": 1, "units_removed": 0,
           "index": "idx", "vectors_total": 1, "segments": 1}
    text = _index_paragraph(one)
    assert text.startswith("Read 1 file (1 document, 1 chunk) in 1.0 s")
    assert "1 file unchanged, 0 removed; 1 input skipped (binary: 1; reasons in idx/skipped.jsonl, run r1)" in text
    assert "(1 skip of earlier runs kept in" in text and "holds 1 vector in 1 shard;" in text
    two = _index_paragraph({**one, "skipped": 2, "units_indexed": 2, "docs": 3, "vectors_total": 4, "segments": 2})
    assert two.startswith("Read 2 files (3 documents, 1 chunk)") and "holds 4 vectors in 2 shards;" in two


def test_build_index_closing_hint_is_a_command_the_shell_runs_as_shown():
    """The search hint named an --out folder with a space unquoted (`search o ut/ü "your
    question"`), which the shell splits in two; reindex's hint was quoted."""
    import shlex

    from embedingest.cli.index import _index_paragraph

    s = {"skipped": 0, "skipped_by_reason": {}, "report": "o ut/ü/skipped.jsonl", "report_run": "r1",
         "units_indexed": 1, "docs": 1, "chunks": 1, "seconds": 1.0, "docs_per_s": 1.0, "chunks_per_s": 1.0,
         "device": "cpu", "dtype": "fp32", "units_unchanged": 0, "units_removed": 0, "index": "o ut/ü",
         "vectors_total": 1, "segments": 1}
    hint = _index_paragraph(s).split("query it with: ", 1)[1]
    assert hint == "embedingest search 'o ut/ü' \"your question\""
    assert shlex.split(hint) == ["embedingest", "search", "o ut/ü", "your question"]
    assert _index_paragraph({**s, "index": "idx"}).endswith("query it with: embedingest search idx \"your question\"")


@pytest.mark.parametrize("command", [
    ["build-index", "{c}", "--out", "{o}", "--chunk-tokens", "0"],
    ["build-index", "{c}", "--out", "{o}", "--overlap", "-1"],
    ["build-index", "{c}", "--out", "{o}", "--search-k", "0"],
    ["build-index", "{c}", "--out", "{o}", "--chunk-tokens", "2"],  # no room for text: the job's own refusal
    ["segment", "{c}"],  # no --out
    ["segment", "{c}", "--out", "{o}", "--overlay-alpha", "1.5"],
])
def test_settings_refused_before_any_work_exit_with_the_usage_status(tmp_path, command):
    """The README's status 2, 'a command line refused before any work', for every setting the
    config refuses, as for --chunk-tokens without room: before, most of them exited 1."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text(TEXTS[0])
    args = [a.format(c=tmp_path / "c", o=tmp_path / "o") for a in command]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "\n\nError: " in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "o").exists()

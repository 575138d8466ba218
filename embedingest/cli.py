"""The ``embedingest`` command line: a thin layer over the library's jobs.

Each command's options map one-to-one onto the fields of the job's config dataclass;
``--config FILE.toml`` fills the same fields from a preset. Library errors become
``click.ClickException`` (exit code 1) with the library's message.
"""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
import sys
from typing import NoReturn

import click

from . import __version__
from .config import IndexConfig, load_config
from .errors import EmbedingestError
from .exit_codes import EXIT_INTERRUPTED
from .report import passed_over_sentence
from .jobs.segment_cli import segment_command


def library_errors(fn):
    """Turn embedingest's own errors into clean CLI messages instead of tracebacks."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EmbedingestError as exc:
            raise click.ClickException(str(exc)) from exc
        except FileNotFoundError as exc:
            raise click.ClickException(str(exc)) from exc
        except (OSError, sqlite3.Error) as exc:  # disk full, permissions, I/O errors, in a sink too
            raise click.ClickException(f"{exc}; what was committed before is kept: fix the "
                                       "cause and run the same command again") from exc

    return wrapper


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="embedingest")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details to stderr.")
def main(verbose: bool) -> None:
    """Run models on a GPU over large batches and get their outputs off the GPU fast."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")


main.add_command(segment_command)


@main.group()
def bench() -> None:
    """Side-by-side benchmarks (the GPU parts need a CUDA GPU)."""


@bench.command("segmentation")
@click.option("--steps", default=30, show_default=True, help="Timed steps for the fast loops.")
@click.option("--warmup", default=5, show_default=True, help="Steps before the clock starts.")
@click.option("--batch-size", type=int, help="[64; with --photos the job's 16]")
@click.option("--image-size", default=512, show_default=True)
@click.option("--consumers", default=8, show_default=True, help="Consumer processes.")
@click.option("--slots", default=12, show_default=True, help="Engine host slots.")
@click.option("--loader-workers", default=8, show_default=True)
@click.option("--only", default="", help="Comma list of row groups: bound, seed, engine.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
@click.option("--timeline", type=click.Path(dir_okay=False),
              help="PNG timeline of the segment stage's bf16 full-logits run.")
@click.option("--photos", type=int, help="Instead: the segment job on this many real photographs "
                                         "(varied sizes and aspect ratios) against the forward "
                                         "alone at the shapes it ran.")
@click.option("--photo-sides", default="240,1600", show_default=True,
              help="With --photos: the range of the photographs' long side, in pixels.")
@click.option("--photo-odd-share", default=0.1, show_default=True,
              help="With --photos: the share cropped to any ratio and size (each a shape of its own).")
@click.option("--photo-dir", type=click.Path(file_okay=False),
              help="With --photos: keep the photographs here (reused when it holds as many).")
@click.option("--arch", default="deeplabv3_resnet50", show_default=True, help="With --photos.")
@click.option("--size", default=520, show_default=True, help="With --photos: the short side.")
@click.option("--device", default="auto", show_default=True, help="With --photos (cpu to try it).")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="Chrome trace (JSON) of the segment stage's bf16 full-logits run, every batch.")
@library_errors
def bench_segmentation(steps, warmup, batch_size, image_size, consumers, slots, loader_workers,
                       only, json_path, timeline, photos, photo_sides, photo_odd_share, photo_dir,
                       arch, size, device, trace) -> None:
    """The seed article's DeepLabV3 workload: its five loops, the forward-only bound and
    embedingest's engine, in one run. With --photos: the segment job end to end on real
    photographs against the model's forward alone at the shapes the job ran."""
    import torch

    if photos:
        from .bench.report import machine_info, write_json
        from .bench.segment_photos import PhotoBenchConfig, run, table

        low, high = (int(v) for v in photo_sides.split(","))
        cfg = PhotoBenchConfig(photos=photos, min_side=low, max_side=high, odd_share=photo_odd_share,
                               arch=arch, size=size, batch_size=batch_size or 16, device=device,
                               folder=photo_dir)
        info = machine_info()
        click.echo(f"# {info.get('gpu', 'no GPU')}, torch {info.get('torch')}, {info['date']}")
        result = run(cfg, log=lambda m: click.echo(m, err=True))
        click.echo(table(result))
        if json_path:
            write_json(json_path, {"machine": info, "config": cfg.__dict__, "result": result})
        return
    batch_size = batch_size or 64

    if not torch.cuda.is_available():
        raise click.ClickException("this benchmark needs a CUDA GPU; torch sees none here")
    from .bench.report import machine_info, table, write_json
    from .bench.segmentation import SegBenchConfig, run_all

    cfg = SegBenchConfig(batch_size=batch_size, image_size=image_size, loader_workers=loader_workers,
                         consumers=consumers, slots=slots, warmup=warmup, steps=steps)
    select = {s.strip() for s in only.split(",") if s.strip()} or None
    info = machine_info()
    click.echo(f"# {info.get('gpu', '?')} driver {info.get('driver', '?')}, torch {info.get('torch')}, {info['date']}")
    rows = run_all(cfg, select, log=lambda m: click.echo(m, err=True))
    click.echo(table(rows, "steps/s"))
    drawn = next((r for r in rows if r["name"] == "segment stage, bf16, logits, sink=devnull"), None)
    if timeline and drawn:
        from .engine.timeline import render_timeline

        render_timeline(drawn["records"], timeline, spans=drawn["spans"], last_n=12,
                        title=f"segment stage, bf16, full logits, {info.get('gpu', '')}")
    if trace and drawn:
        from .engine.telemetry import EngineStats
        from .engine.trace import write_trace

        stats = EngineStats(device="cuda", records=drawn["records"], spans=drawn["spans"])
        write_trace(trace, [("cuda", stats)], title=f"segment stage, bf16, full logits, {info.get('gpu', '')}")
    for r in rows:
        r.pop("records", None)
        r.pop("spans", None)
    if json_path:
        write_json(json_path, {"machine": info, "config": cfg.__dict__, "rows": rows})


def _config_options(cls, skip=()):
    """One click option per dataclass field (kebab-case), defaulting to None so a preset
    or the dataclass default applies unless the option is given."""
    import dataclasses

    def decorate(fn):
        for f in reversed(dataclasses.fields(cls)):
            if f.name in skip:
                continue
            name = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                opt = click.option(f"{name}/--no-{name[2:]}", f.name, default=None,
                                   help=f"[default: {f.default}]")
            else:
                kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
                opt = click.option(name, f.name, type=kind, default=None,
                                   help=f"[default: {f.default}]")
            fn = opt(fn)
        return fn

    return decorate


@main.command("build-index")
@click.argument("corpus", type=click.Path(exists=True, path_type=str))
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="TOML preset with IndexConfig fields (configs/*.toml).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--timeline", type=click.Path(dir_okay=False), help="Write a PNG timeline of the last batches.")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="Write the run's phases and every batch's engine records (compute, copy, hand-off, "
                   "consumers) as a Chrome trace (JSON; open it in Perfetto or chrome://tracing).")
@_config_options(IndexConfig)
@library_errors
def build_index_cmd(corpus, config_path, as_json, timeline, trace, **options) -> None:
    """Index the text files under CORPUS (or one file) into FAISS shards.

    Re-running adds only new or changed files and drops deleted ones. Exit status: 0 all
    inputs indexed; 3 finished but some inputs were skipped (see skipped.jsonl in the
    index folder); 1 error; 130 interrupted (re-run the same command to resume).
    """
    cfg = load_config(IndexConfig, config_path, **options)
    try:
        build_index = import_interruptibly("embedingest.jobs.build_index").build_index
        summary = build_index(corpus, cfg, progress=not as_json and sys.stderr.isatty(),
                              timeline=timeline, trace=trace)
    except KeyboardInterrupt:
        click.echo("\ninterrupted: every file finished so far is saved in the index; run the "
                   "same command again to resume (only unfinished files are redone)", err=True)
        exit_quickly(EXIT_INTERRUPTED)
    if as_json:
        emit_json(summary)
    else:
        click.echo(_index_paragraph(summary))
    sys.exit(summary["exit_code"])


def exit_quickly(code: int) -> NoReturn:
    """Exit with ``code`` once the run is over (its files written, its processes gone),
    without the interpreter's last garbage collection over torch, transformers and the
    model: seconds on a loaded machine, which pushed an interrupted run past the 5 s it
    promises. Objects are still finalized as modules are torn down."""
    import gc

    gc.freeze()
    sys.exit(code)


def import_interruptibly(module: str):
    """Import a job's module (torch, numpy, faiss, transformers: seconds) with SIGINT
    held back until it is done, so a Ctrl-C meanwhile arrives as a KeyboardInterrupt
    right after it, where the command turns it into exit 130. Inside those imports it
    is not safe: torch imports numpy from C and takes any error for "no numpy" (the
    Ctrl-C is lost, numpy left half imported), and pybind11 aborts the process."""
    import importlib
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        return importlib.import_module(module)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return importlib.import_module(module)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _index_paragraph(s: dict) -> str:
    skipped = (f"{s['skipped']} inputs skipped ({', '.join(f'{k}: {v}' for k, v in s['skipped_by_reason'].items())}; "
               f"reasons in {s['report']}, run {s['report_run']})" if s["skipped"] else "nothing skipped")
    if s.get("skipped_earlier"):
        skipped += f" ({s['skipped_earlier']} skips of earlier runs kept in {s['report']})"
    return (f"Indexed {s['units_indexed']} files ({s['docs']} documents, {s['chunks']} chunks) in "
            f"{s['seconds']:.1f} s: {s['docs_per_s']:,.0f} docs/s, {s['chunks_per_s']:,.0f} chunks/s "
            f"on {s['device']} ({s['dtype']}). {s['units_unchanged']} files unchanged, "
            f"{s['units_removed']} removed; {skipped}.{passed_over_sentence(s)} The index at {s['index']} holds "
            f"{s['vectors_total']} vectors in {s['segments']} segments; query it with: "
            f"embedingest search {s['index']} \"your question\"")


@main.command()
@click.argument("index_dir", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("query", nargs=-1, required=True)
@click.option("-k", "k", type=click.IntRange(min=1), default=None,
              help="Results to show [default: the index's, from build-index --search-k, else 5].")
@click.option("--device", default="cpu", show_default=True, help="Device for the query encoder.")
@click.option("--params", default=None,
              help="faiss search parameters, e.g. nprobe=16 [default: the index's, from "
                   "build-index --search-params]; '' for none.")
@click.option("--query-prompt", default=None,
              help="Text put before the query [default: the index's query prompt].")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of hits.")
@library_errors
def search(index_dir, query, k, device, params, query_prompt, as_json) -> None:
    """Search INDEX_DIR for QUERY; prints rank, score, source and the chunk's text."""
    from .index.search import open_index

    text = " ".join(query)
    index = open_index(index_dir, device=device, params=params, query_prompt=query_prompt)
    try:
        (hits,) = index.search([text], k=k or index.manifest.search.get("k") or 5)
    finally:
        index.close()
    if as_json:
        import dataclasses

        emit_json([dataclasses.asdict(h) for h in hits])
        return
    if not hits:
        click.echo("no results (the index is empty)")
    for h in hits:
        where = f"{h.source}" + (f" [{h.record_id}]" if h.record_id else "") + f" #{h.chunk_no}"
        click.echo(f"{h.rank:>3}  {h.score:.4f}  {where}")
        click.echo("     " + (h.text or "").replace("\n", " ")[:300])


@main.command()
@click.argument("index_dir", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; any but 127.0.0.1 lets other machines query the index and read its files.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="Device for the query encoder.")
@click.option("--params", default=None,
              help="faiss search parameters, e.g. nprobe=16 [default: the index's]; '' for none.")
@click.option("--query-prompt", default=None,
              help="Text put before every query [default: the index's query prompt].")
@click.option("--max-query-chars", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Longer queries are refused (422).")
@click.option("--max-k", type=click.IntRange(min=1), default=100, show_default=True,
              help="Most results one request may ask for.")
@click.option("--threads", type=click.IntRange(min=0), default=1, show_default=True,
              help="torch threads of the query encoder; 0: torch's default (every core).")
@library_errors
def serve(index_dir, host, port, device, params, query_prompt, max_query_chars, max_k, threads) -> None:
    """Serve INDEX_DIR over HTTP: a search page at / and JSON at /search?q=...&k=...

    The model and the index stay loaded between requests. Needs the serve extra
    (pip install 'embedingest[serve]').
    """
    from .serve import serve as run_server

    try:
        run_server(index_dir, host, port, device=device, params=params, query_prompt=query_prompt,
                   max_query_chars=max_query_chars, max_k=max_k, threads=threads or None,
                   on_ready=lambda url: click.echo(f"serving {index_dir} at {url} (Ctrl-C stops)", err=True))
    except KeyboardInterrupt:  # how a server is stopped: not an error
        click.echo("stopped", err=True)


@bench.command("text")
@click.option("--docs", default=200_000, show_default=True, help="Paragraphs (~50 tokens each).")
@click.option("--batch-size", default=256, show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="auto: fp16 on CUDA, fp32 on CPU.")
@click.option("--model", default=None,
              help="Model folder or Hugging Face id in the local cache (default: the bundled all-MiniLM-L6-v2).")
@click.option("--num-workers", default=-1, show_default=True)
@click.option("--num-consumers", default=2, show_default=True)
@click.option("--st-fp32/--no-st-fp32", default=True, show_default=True,
              help="Also time sentence-transformers in fp32.")
@click.option("--compare-eager/--no-compare-eager", default=True, show_default=True,
              help="On CUDA, also time the rows without CUDA graphs.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="Chrome trace (JSON) of the build-index row: its phases and every batch.")
@library_errors
def bench_text(docs, batch_size, device, dtype, model, num_workers, num_consumers, st_fp32,
               compare_eager, json_path, trace) -> None:
    """sentence-transformers encode() + faiss.add against build-index end to end, with the
    encoder's forward alone as the bound, on one corpus (runs on CPU too)."""
    import torch

    from .bench.report import TEXT_COLUMNS, machine_info, table, write_json
    from .bench.text import TextBenchConfig, run_all

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "fp16" if device.startswith("cuda") else "fp32"
    cfg = TextBenchConfig(docs=docs, batch_size=batch_size, device=device, dtype=dtype, model=model,
                          num_workers=num_workers, num_consumers=num_consumers, st_fp32=st_fp32,
                          compare_eager=compare_eager, trace=trace)
    info = machine_info()
    click.echo(f"# {info.get('gpu', 'CPU')} {info.get('driver', '')}, torch {info.get('torch')}, {info['date']}")
    rows = run_all(cfg, log=lambda m: click.echo(m, err=True))
    click.echo(table(rows, "docs/s", TEXT_COLUMNS))
    if json_path:
        write_json(json_path, {"machine": info, "config": cfg.__dict__,
                               "rows": [{k: v for k, v in r.items() if k != "summary"} for r in rows],
                               "build_index_summaries": [r["summary"] for r in rows if "summary" in r]})

"""``embedingest build-index``: text files to an index; ``reindex`` and ``export`` of one."""

from __future__ import annotations

import sys

import click

from ..config import IndexConfig
from ..exit_codes import exit_status_help
from ..report import passed_over_sentence
from ..terminal import counted, rate, shell_quote
from .common import (IndexPath, InputPath, command_config, config_options, emit_json, library_errors, run_job,
                     run_options, stops_as_exits)


@click.command("build-index", help=f"""Index the text files under CORPUS (or one file) into FAISS shards.
    CORPUS may be a URL (s3://bucket/prefix, gs://..., hf://datasets/...), with credentials
    from the environment.

    Re-running adds only new or changed files and drops deleted ones.

    {exit_status_help("all inputs indexed", "inputs", "the index folder")}""")
@click.argument("corpus", type=InputPath())
@config_options(IndexConfig)
@run_options("configs/*.toml", timeline="Write a PNG timeline of the last batches.",
             trace="Write the run's phases and every batch's engine records (compute, copy, "
                   "hand-off, consumers) as a Chrome trace (JSON; open it in Perfetto or "
                   "chrome://tracing).")
@library_errors
def build_index_cmd(corpus, config_path, as_json, timeline, trace, **options) -> None:
    cfg = command_config(IndexConfig, config_path, **options)

    def build(job) -> dict:
        return job.build_index(corpus, cfg, progress=not as_json and sys.stderr.isatty(),
                               timeline=timeline, trace=trace)

    run_job("embedingest.jobs.build_index", build, as_json=as_json, paragraph=_index_paragraph,
            interrupted=("the index is as it was before this run (--overwrite puts the old one back "
                         "when a rebuild stops); run the same command again to rebuild it"
                         if cfg.overwrite else
                         "every file finished so far is saved in the index; run the same command "
                         "again to resume (only unfinished files are redone)"))


def _index_paragraph(s: dict) -> str:
    skipped = (f"{counted(s['skipped'], 'input')} skipped ({', '.join(f'{k}: {v}' for k, v in s['skipped_by_reason'].items())}; "
               f"reasons in {s['report']}, run {s['report_run']})" if s["skipped"] else "nothing skipped")
    if s.get("skipped_earlier"):
        skipped += f" ({counted(s['skipped_earlier'], 'skip')} of earlier runs kept in {s['report']})"
    return (f"Read {counted(s['units_indexed'], 'file')} ({counted(s['docs'], 'document')}, "
            f"{counted(s['chunks'], 'chunk')}) in "
            f"{s['seconds']:.1f} s: {rate(s['docs_per_s'])} docs/s, {rate(s['chunks_per_s'])} chunks/s "
            f"on {s['device']} ({s['dtype']}). {counted(s['units_unchanged'], 'file')} unchanged, "
            f"{s['units_removed']} removed; {skipped}.{passed_over_sentence(s)} The index at {s['index']} holds "
            f"{counted(s['vectors_total'], 'vector')} in {counted(s['segments'], 'shard')}; query it with: "
            f"embedingest search {shell_quote(s['index'])} \"your question\"")


@click.command()
@click.argument("index_dir", type=IndexPath())
@click.option("--index", "factory", required=True, metavar="FACTORY",
              help="faiss index_factory string of the new index, e.g. 'IVF4096,PQ32' or HNSW32.")
@click.option("--train-size", type=click.IntRange(min=1), default=50_000, show_default=True,
              help="Saved vectors sampled to train factories that need training.")
@click.option("--search-params", default=None, metavar="PARAMS",
              help="faiss search parameters kept as the index's default, e.g. nprobe=16 "
                   "[default: the kept ones when they apply to the new factory; a factory that becomes IVF or "
                   "HNSW gets nprobe=16 or efSearch=64]; '' for none.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@library_errors
def reindex(index_dir, factory, train_size, search_params, as_json) -> None:
    """Rebuild INDEX_DIR's vectors (a folder, or s3://bucket/prefix) as another faiss index
    from the embeddings it kept (built with --save-embeddings): no model, no corpus."""
    from ..index.reindex import reindex as run_reindex

    with stops_as_exits("the index is as it was (a reindex replaces it only once it is whole); run "
                        "the same command again"):
        s = run_reindex(index_dir, factory, train_size=train_size, search_params=search_params)
    if as_json:
        emit_json(s)
        return
    click.echo(f"{s['index']}: {counted(s['vectors'], 'vector')} in {counted(s['shards'], 'shard')} are now {s['factory']!r} "
               f"(were {s['previous_factory']!r}; generation {s['generation']})"
               + (f"; search defaults: {s['search_params']}" if s["search_params"] else ""))


@click.command("export")
@click.argument("index_dir", type=IndexPath())
@click.option("--to", "to", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Folder for the Parquet files (new or empty; see --overwrite).")
@click.option("--embeddings/--no-embeddings", default=None,
              help="With the embedding column [default: when the index kept its embeddings].")
@click.option("--overwrite", is_flag=True, help="Replace an earlier export's files in --to (Parquet files named as shards are, and "
                   "_SUCCESS); other files stay, other Parquet files are refused.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@library_errors
def export(index_dir, to, embeddings, overwrite, as_json) -> None:
    """Write INDEX_DIR's chunks (id, source, record_id, chunk_no, span, text, embedding)
    as Parquet files that pandas, DuckDB or Spark read as they are; INDEX_DIR may be
    s3://bucket/prefix, --to is a local folder."""
    from ..index.export import export_index

    s = export_index(index_dir, to, embeddings=embeddings, overwrite=overwrite)
    if as_json:
        emit_json(s)
        return
    click.echo(f"{counted(s['rows'], 'row')} in {counted(s['files'], 'Parquet file')} in {s['to']}"
               + (" (with embeddings)" if s["embeddings"] else ""))

"""``embedingest build-index``: text files to a FAISS index."""

from __future__ import annotations

import sys

import click

from ..config import IndexConfig, load_config
from ..exit_codes import exit_status_help
from ..report import passed_over_sentence
from .common import config_options, library_errors, run_job, run_options


@click.command("build-index", help=f"""Index the text files under CORPUS (or one file) into FAISS shards.

    Re-running adds only new or changed files and drops deleted ones.

    {exit_status_help("all inputs indexed", "inputs", "the index folder")}""")
@click.argument("corpus", type=click.Path(exists=True, path_type=str))
@config_options(IndexConfig)
@run_options("configs/*.toml", timeline="Write a PNG timeline of the last batches.",
             trace="Write the run's phases and every batch's engine records (compute, copy, "
                   "hand-off, consumers) as a Chrome trace (JSON; open it in Perfetto or "
                   "chrome://tracing).")
@library_errors
def build_index_cmd(corpus, config_path, as_json, timeline, trace, **options) -> None:
    cfg = load_config(IndexConfig, config_path, **options)
    run_job("embedingest.jobs.build_index",
            lambda job: job.build_index(corpus, cfg, progress=not as_json and sys.stderr.isatty(),
                                        timeline=timeline, trace=trace),
            as_json=as_json, paragraph=_index_paragraph,
            interrupted="every file finished so far is saved in the index; run the same command "
                        "again to resume (only unfinished files are redone)")


def _index_paragraph(s: dict) -> str:
    skipped = (f"{s['skipped']} inputs skipped ({', '.join(f'{k}: {v}' for k, v in s['skipped_by_reason'].items())}; "
               f"reasons in {s['report']}, run {s['report_run']})" if s["skipped"] else "nothing skipped")
    if s.get("skipped_earlier"):
        skipped += f" ({s['skipped_earlier']} skips of earlier runs kept in {s['report']})"
    return (f"Indexed {s['units_indexed']} files ({s['docs']} documents, {s['chunks']} chunks) in "
            f"{s['seconds']:.1f} s: {s['docs_per_s']:,.0f} docs/s, {s['chunks_per_s']:,.0f} chunks/s "
            f"on {s['device']} ({s['dtype']}). {s['units_unchanged']} files unchanged, "
            f"{s['units_removed']} removed; {skipped}.{passed_over_sentence(s)} The index at {s['index']} holds "
            f"{s['vectors_total']} vectors in {s['segments']} shards; query it with: "
            f"embedingest search {s['index']} \"your question\"")

"""``embedingest search`` and ``embedingest serve``: query an index once, or over HTTP."""

from __future__ import annotations

import click

from .common import emit_json, library_errors


@click.command()
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
    from ..index.search import open_index

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


@click.command()
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
    from ..serve import serve as run_server

    try:
        run_server(index_dir, host, port, device=device, params=params, query_prompt=query_prompt,
                   max_query_chars=max_query_chars, max_k=max_k, threads=threads or None,
                   on_ready=lambda url: click.echo(f"serving {index_dir} at {url} (Ctrl-C stops)", err=True))
    except KeyboardInterrupt:  # how a server is stopped: not an error
        click.echo("stopped", err=True)

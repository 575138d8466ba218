"""``embedingest search`` and ``embedingest serve``: query an index once, or over HTTP."""

from __future__ import annotations

import contextlib

import click

from ..config import SearchConfig, ServeConfig
from ..errors import ConfigError, SettingError
from ..terminal import printable
from .common import IndexPath, command_config, config_options, emit_json, library_errors


@contextlib.contextmanager
def params_named(option: str, given: str | None):
    """Search parameters the index does not take, named as the command's ``option`` the
    user typed (the library names its keyword argument, ``params=``). Those ``given``
    with it are a bad option (a SettingError: usage status 2, as the README's exit codes
    say); the index's own stored ones, refused when none are given, are the index's
    fault (status 1)."""
    from ..index.search import SearchParamsRefused

    try:
        yield
    except SearchParamsRefused as exc:
        refused = SettingError if given is not None and given.strip() else ConfigError
        raise refused(exc.worded(option)) from exc


@click.command()
@click.argument("index_dir", type=IndexPath())
@click.argument("query", nargs=-1, required=True)
@config_options(SearchConfig)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of hits.")
@library_errors
def search(index_dir, query, as_json, **options) -> None:
    """Search INDEX_DIR (a folder, or s3://bucket/prefix) for QUERY; prints rank, score,
    source and the chunk's text."""
    from ..index.lookup import IndexChanged
    from ..index.search import open_index

    cfg = command_config(SearchConfig, **options)
    text = " ".join(query)
    for last in (False, True):  # a build that replaced a shard meanwhile: opened once more
        with params_named("--params", cfg.params):
            index = open_index(index_dir, device=cfg.device, params=cfg.params, query_prompt=cfg.query_prompt,
                               cache_dir=cfg.cache_dir, cache_size=cfg.cache_size)
        try:
            (hits,) = index.search([text], k=cfg.k or index.default_k)
            break
        except IndexChanged:
            if last:
                raise
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
        click.echo(f"{h.rank:>3}  {h.score:.4f}  {printable(where)}")
        click.echo("     " + printable(" ".join((h.text or "").split())[:300]))


@click.command()
@click.argument("index_dir", type=IndexPath())
@config_options(ServeConfig)
@library_errors
def serve(index_dir, **options) -> None:
    """Serve INDEX_DIR (a folder, or s3://bucket/prefix) over HTTP: a search page at / and
    JSON at /search?q=...&k=...

    The model and the index stay loaded between requests. Needs the serve extra
    (pip install 'embedingest[serve]').
    """
    from ..serve import serve as run_server

    cfg = command_config(ServeConfig, **options)
    try:
        with params_named("--params", cfg.params):
            run_server(index_dir, cfg.host, cfg.port, device=cfg.device, params=cfg.params,
                       query_prompt=cfg.query_prompt, max_query_chars=cfg.max_query_chars, max_k=cfg.max_k,
                       threads=cfg.threads or None, cache_dir=cfg.cache_dir, cache_size=cfg.cache_size,
                       query_runtime=cfg.query_runtime,
                       on_ready=lambda url: click.echo(f"serving {index_dir} at {url} (Ctrl-C stops)", err=True))
    except KeyboardInterrupt:  # how a server is stopped: not an error
        click.echo("stopped", err=True)

"""The search server's ASGI app: one open index, its model loaded once, JSON and a page.

* ``GET /search?q=...&k=...``: the top ``k`` chunks as JSON (score, source, record id,
  span, text, and a link to the source file where the index's corpus is on this machine).
* ``GET /``: the search page (``static/index.html``: a box, results with their source and
  the query's words highlighted in the chunk's text).
* ``GET /files/{id}``: the source file of the chunk with vector id ``id``, only when it is
  a file of the index's corpus folder (never a path the client names), as plain text.
* ``GET /info``: what is served (vectors, model, prompts, search defaults).

A build that changes the index while it is served is picked up by the next request
(:mod:`.live`).

Bad requests get a 4xx with a message: an empty or too long query, ``k`` out of
``1..max_k``, wrong types (FastAPI checks them). Requests run in the server's thread
pool; the index encodes one query at a time (its tokenizer is not safe to share between
threads) and reads the metadata through one connection per thread.
"""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path
from urllib.parse import urlencode

from fastapi import FastAPI, HTTPException, Query
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse

from ..config import ServeConfig
from ..errors import ConfigError
from ..index.lookup import IndexChanged
from ..index.search import Hit, Index, blank_query
from ..sources.names import name_as_text, text_as_name
from .live import LiveIndex

MAX_QUERY_CHARS = ServeConfig.max_query_chars
MAX_K = ServeConfig.max_k
# a hit's source in its file link: a path of up to PATH_MAX bytes, each perhaps escaped (\\xNN)
MAX_SOURCE_CHARS = 16_384
# Suffixes a browser may show as text; anything else is offered as a download.
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".html", ".htm", ".json", ".jsonl", ".ndjson", ".csv", ".tsv"}


def corpus_file(index: Index, source: str | None) -> Path | None:
    """The file of unit ``source`` inside the index's corpus folder, or None when there is
    none: records held in memory, a corpus not on this machine, a file gone, or a path
    that leads out of the corpus folder (a link, a key with ``..``). An index of one file
    records that file, its key its name: it serves that file alone, from its folder."""
    root = index.manifest.corpus_path
    if not root or not source or source.startswith("record:"):
        return None
    recorded = Path(root)
    one_file = not recorded.is_dir()
    if one_file and text_as_name(source) != recorded.name:
        return None
    try:
        base = (recorded.parent if one_file else recorded).resolve(strict=True)
        path = (base / text_as_name(source)).resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    if not path.is_relative_to(base) or not path.is_file():
        return None
    return path


def hit_json(index: Index, hit: Hit) -> dict:
    return {"rank": hit.rank, "score": hit.score, "id": hit.id, "source": hit.source,
            "record_id": hit.record_id, "chunk_no": hit.chunk_no, "char_start": hit.char_start,
            "char_end": hit.char_end, "text": hit.text,
            "file": f"/files/{hit.id}?{urlencode({'source': hit.source})}" if corpus_file(index, hit.source) else None}


def create_app(index: Index | LiveIndex, *, max_query_chars: int = MAX_QUERY_CHARS,
               max_k: int = MAX_K) -> FastAPI:
    """The app serving ``index`` (opened by the caller, who closes it); a
    :class:`~.live.LiveIndex` is looked at by each request, which answers from the index
    it gives (opened again after a build changed it)."""
    live = index if isinstance(index, LiveIndex) else LiveIndex(index)
    app = FastAPI(title="embedingest search", docs_url=None, redoc_url=None, openapi_url=None)
    page = resources.files(__package__).joinpath("static/index.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    def search_page() -> str:
        return page

    @app.get("/info")
    def info() -> dict:
        index = live.current()
        m = index.manifest
        return {"index": str(index.store.folder), "vectors": index.ntotal, "model": m.model.get("name"),
                "dim": m.dim, "factory": m.factory, "query_prompt": index.query_prompt,
                "params": index.params, "query_runtime": index.query_runtime_in_use,
                "default_k": min(index.default_k, max_k), "max_k": max_k,
                "max_query_chars": max_query_chars}

    @app.get("/search")
    def search(q: str = Query(..., description="the question"),
               k: int | None = Query(None, ge=1, le=max_k, description="results")) -> dict:
        if blank_query(q):
            raise HTTPException(422, "the query is empty: give it some words (q=...)")
        if len(q) > max_query_chars:
            raise HTTPException(422, f"the query has {len(q):,} characters, more than the "
                                     f"{max_query_chars:,} this server takes; shorten it")
        index = live.current()
        k = k if k is not None else min(index.default_k, max_k)
        t0 = time.perf_counter()
        try:
            try:
                (hits,) = index.search([q], k=k)
            except IndexChanged:  # a build replaced a shard since it was opened: once more, opened anew
                index = live.refresh()
                (hits,) = index.search([q], k=k)
        except IndexChanged as exc:
            raise HTTPException(503, f"{exc} (the index is being updated)") from exc
        except ConfigError as exc:
            raise HTTPException(422, str(exc)) from exc
        took = time.perf_counter() - t0
        return {"query": q, "k": k, "took_ms": round(took * 1e3, 3),
                "hits": [hit_json(index, h) for h in hits]}

    @app.get("/files/{vector_id}")
    def source_file(vector_id: int = PathParam(..., ge=0, le=2**63 - 1),
                    source: str | None = Query(None, max_length=MAX_SOURCE_CHARS)) -> FileResponse:
        """The file of the chunk ``vector_id``, which must still be of ``source`` (the hit's,
        in the link): a rebuild numbers the files again, and an old link named another."""
        if source is None:
            raise HTTPException(404, f"a file link gives the hit's source (/files/{vector_id}?source=...): this "
                                     "one is from before links did; search again for a current link")
        index = live.current()
        try:
            chunk = index.chunks([vector_id]).get(vector_id)
        except IndexChanged:
            index = live.refresh()
            chunk = index.chunks([vector_id]).get(vector_id)
        if chunk is not None and chunk.source != source:
            raise HTTPException(404, f"id {vector_id} is not a chunk of {source!r} in the index now (rebuilt "
                                     "since this link was made, or the link was changed); search again")
        path = corpus_file(index, chunk.source if chunk else None)
        if path is None:
            raise HTTPException(404, f"no file of the corpus for id {vector_id}: the id is unknown, "
                                     "its text came from records, or the corpus is not on this machine")
        headers = {"X-Content-Type-Options": "nosniff", "Content-Security-Policy": "sandbox"}
        name = name_as_text(path.name)  # a header takes text: a name that is not UTF-8 as the hit names it
        if path.suffix.lower() in TEXT_SUFFIXES:
            return FileResponse(path, media_type="text/plain; charset=utf-8", headers=headers,
                                content_disposition_type="inline", filename=name)
        return FileResponse(path, media_type="application/octet-stream", headers=headers, filename=name)

    return app

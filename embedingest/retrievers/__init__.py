"""Retrievers over an index folder for LangChain and LlamaIndex (the ``retrievers`` extra).

    from embedingest.retrievers.langchain import EmbedingestRetriever      # langchain-core
    from embedingest.retrievers.llama_index import EmbedingestNodeRetriever  # llama-index-core

Both search through :func:`~embedingest.open_index` (the index's query prompt and search
defaults included) and hand back each chunk's text with its metadata: score, rank, vector
id, source (the file below the corpus folder, or ``record:<id>``), record id, chunk number
and character span.
"""

from __future__ import annotations

from ..index.search import Hit, Index


def hit_metadata(hit: Hit) -> dict:
    """What a retrieved document carries besides its text."""
    return {"score": hit.score, "rank": hit.rank, "id": hit.id, "source": hit.source,
            "record_id": hit.record_id, "chunk_no": hit.chunk_no, "char_start": hit.char_start,
            "char_end": hit.char_end}


def open_index_given(index: object, retriever: str) -> Index:
    """``index`` when it is an open :class:`Index`; else a TypeError saying how to make
    ``retriever`` from a folder (a path given as ``index`` failed only at the first query,
    deep in the framework's call)."""
    if isinstance(index, Index):
        return index
    raise TypeError(f"{retriever} takes an open index (embedingest.open_index(folder)), not "
                    f"{type(index).__name__} {index!r}: for an index folder use {retriever}.from_path(folder)")

"""A LangChain retriever (``langchain_core.retrievers.BaseRetriever``) over an embedingest index."""

from __future__ import annotations

import os
from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, field_validator

from ..index.search import Index, open_index
from . import hit_metadata, open_index_given


class EmbedingestRetriever(BaseRetriever):
    """``retriever.invoke("question")`` gives the top ``k`` chunks as Documents (text as
    ``page_content``, the hit's fields as ``metadata``, the vector id as ``id``).

    Make it with :meth:`from_path`, or pass an open :class:`~embedingest.index.search.Index`
    as ``index``; ``k`` None takes the index's default (``build-index --search-k``, else 10).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    index: Any
    k: int | None = None

    @field_validator("index", mode="before")
    @classmethod
    def _open_index(cls, index: Any) -> Index:
        return open_index_given(index, cls.__name__)

    @classmethod
    def from_path(cls, path: str | os.PathLike, k: int | None = None, **open_kwargs) -> EmbedingestRetriever:
        """Open the index folder ``path`` (``open_kwargs`` as for :func:`~embedingest.open_index`)."""
        return cls(index=open_index(path, **open_kwargs), k=k)

    def _get_relevant_documents(self, query: str, *,
                                run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        index: Index = self.index
        (hits,) = index.search([query], k=self.k)
        return [Document(page_content=h.text or "", metadata=hit_metadata(h), id=str(h.id)) for h in hits]

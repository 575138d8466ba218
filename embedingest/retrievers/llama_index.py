"""A LlamaIndex retriever (``llama_index.core.retrievers.BaseRetriever``) over an embedingest index."""

from __future__ import annotations

import os

from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from ..index.search import Index, open_index
from . import hit_metadata, open_index_given


class EmbedingestNodeRetriever(BaseRetriever):
    """``retriever.retrieve("question")`` gives the top ``k`` chunks as scored TextNodes
    (the vector id as ``id_``, the hit's fields as ``metadata``).

    Make it with :meth:`from_path`, or pass an open :class:`~embedingest.index.search.Index`;
    ``k`` None takes the index's default (``build-index --search-k``, else 10).
    """

    def __init__(self, index: Index, k: int | None = None, **kwargs):
        self._index = open_index_given(index, type(self).__name__)
        self._k = k
        super().__init__(**kwargs)

    @classmethod
    def from_path(cls, path: str | os.PathLike, k: int | None = None, **open_kwargs) -> EmbedingestNodeRetriever:
        """Open the index folder ``path`` (``open_kwargs`` as for :func:`~embedingest.open_index`)."""
        return cls(open_index(path, **open_kwargs), k=k)

    @property
    def index(self) -> Index:
        return self._index

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        (hits,) = self._index.search([query_bundle.query_str], k=self._k)
        return [NodeWithScore(node=TextNode(id_=str(h.id), text=h.text or "", metadata=hit_metadata(h)),
                              score=h.score) for h in hits]

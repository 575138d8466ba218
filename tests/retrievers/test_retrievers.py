"""The LangChain and LlamaIndex retrievers, through the real libraries."""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from embedingest import build_index, open_index  # noqa: E402

RECORDS = [
    ("whales", "Whales are marine mammals that breathe air through blowholes on top of their heads."),
    ("bread", "Bread rises because yeast ferments sugars and releases carbon dioxide into the dough."),
    ("tcp", "TCP provides reliable, ordered delivery of a stream of bytes between applications."),
    ("everest", "Mount Everest is the highest mountain above sea level on Earth."),
]


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("retrievers") / "idx"
    build_index(RECORDS, out=str(out), num_workers=0, num_consumers=1, batch_size=8, search_k=3)
    return out


def expected(index_dir, question, k):
    with open_index(index_dir) as index:
        (hits,) = index.search([question], k=k)
    return hits


def test_langchain_retriever(index_dir):
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    from embedingest.retrievers.langchain import EmbedingestRetriever

    retriever = EmbedingestRetriever.from_path(index_dir)
    assert isinstance(retriever, BaseRetriever)
    docs = retriever.invoke("how does dough rise?")
    want = expected(index_dir, "how does dough rise?", 3)
    assert len(docs) == 3 and all(isinstance(d, Document) for d in docs)  # the index's stored k
    first = docs[0]
    assert first.page_content == RECORDS[1][1] and first.id == str(want[0].id)
    assert first.metadata == {"score": pytest.approx(want[0].score), "rank": 1, "id": want[0].id,
                              "source": "record:bread", "record_id": "bread", "chunk_no": 0,
                              "char_start": 0, "char_end": len(RECORDS[1][1])}
    assert [d.metadata["id"] for d in docs] == [h.id for h in want]
    two = EmbedingestRetriever(index=retriever.index, k=2)
    assert [d.metadata["record_id"] for d in asyncio.run(two.ainvoke("highest mountain"))][:1] == ["everest"]
    assert len(two.batch(["whales", "networks"])) == 2
    retriever.index.close()


def test_llama_index_retriever(index_dir):
    pytest.importorskip("llama_index.core")
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore

    from embedingest.retrievers.llama_index import EmbedingestNodeRetriever

    retriever = EmbedingestNodeRetriever.from_path(index_dir, k=2)
    assert isinstance(retriever, BaseRetriever)
    nodes = retriever.retrieve("reliable byte streams between programs")
    want = expected(index_dir, "reliable byte streams between programs", 2)
    assert len(nodes) == 2 and all(isinstance(n, NodeWithScore) for n in nodes)
    assert nodes[0].node.get_content() == RECORDS[2][1] and nodes[0].node.node_id == str(want[0].id)
    assert nodes[0].score == pytest.approx(want[0].score)
    assert nodes[0].node.metadata["source"] == "record:tcp" and nodes[0].node.metadata["rank"] == 1
    assert [n.node.metadata["id"] for n in nodes] == [h.id for h in want]
    aretrieved = asyncio.run(retriever.aretrieve("whales breathing"))
    assert aretrieved[0].node.metadata["record_id"] == "whales"
    retriever.index.close()


@pytest.mark.parametrize("framework", ["langchain", "llama_index"])
def test_a_folder_given_as_the_index_is_refused_when_the_retriever_is_made(tmp_path, framework):
    """A path passed as ``index`` was taken, and failed only at the first query, deep in
    the framework's call ('str' object has no attribute 'search')."""
    if framework == "langchain":
        pytest.importorskip("langchain_core")
        from embedingest.retrievers.langchain import EmbedingestRetriever as Retriever

        make = lambda index: Retriever(index=index)  # noqa: E731
    else:
        pytest.importorskip("llama_index.core")
        from embedingest.retrievers.llama_index import EmbedingestNodeRetriever as Retriever

        make = Retriever
    with pytest.raises(TypeError) as err:
        make(str(tmp_path))
    assert str(err.value) == (f"{Retriever.__name__} takes an open index (embedingest.open_index(folder)), not "
                              f"str {str(tmp_path)!r}: for an index folder use {Retriever.__name__}.from_path(folder)")

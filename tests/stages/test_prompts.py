"""Prompts declared by a model folder, against sentence-transformers' encode(prompt_name=...)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from corpus_fixtures import chunk_rows, vectors_by_id  # noqa: E402
from model_fixtures import copy_model  # noqa: E402

from embedingest import build_index, open_index  # noqa: E402
from embedingest.cli import main  # noqa: E402
from embedingest.errors import ConfigError  # noqa: E402
from embedingest.sources.text_dataset import TextChunkDataset, Unit  # noqa: E402
from embedingest.stages.encoder import TextEncoder  # noqa: E402
from embedingest.stages.prompts import Prompts, chunk_prompt, with_prompt  # noqa: E402
from embedingest.stages.tokenizer import load_tokenizer  # noqa: E402

sentence_transformers = pytest.importorskip("sentence_transformers")

PROMPTS = {"query": "query: ", "passage": "passage: "}
DOCS = [
    "Whales are marine mammals that breathe air through blowholes on top of their heads.",
    "Bread rises because yeast ferments sugars and releases carbon dioxide into the dough.",
    "TCP provides reliable, ordered delivery of a stream of bytes between applications.",
    "Volcanoes form where magma from the mantle reaches the surface through cracks in the crust.",
]
QUERIES = ["how do whales breathe", "why does dough rise", "reliable network streams", "magma"]
FAST = dict(num_workers=0, num_consumers=1, batch_size=4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return copy_model(tmp_path_factory.mktemp("m") / "e5-like", prompts=PROMPTS)


@pytest.fixture(scope="module")
def st_model(folder):
    return sentence_transformers.SentenceTransformer(str(folder), device="cpu", local_files_only=True)


def stored_vectors(out) -> tuple[np.ndarray, list[str], list[tuple]]:
    """Every vector of the index with its chunk's text and (record, span)."""
    found = vectors_by_id(out)
    rows = chunk_rows(out, list(found))
    return (np.stack(list(found.values())), [rows[i][5] for i in found],
            [(rows[i][1], rows[i][3], rows[i][4]) for i in found])


def test_roles_pick_the_declared_prompts(tmp_path):
    def declared(**config):
        model = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        model.mkdir()
        (model / "config_sentence_transformers.json").write_text(json.dumps(config))
        return Prompts.read(model)

    p = declared(prompts={"query": "q: ", "corpus": "c: ", "passage": "p: "})
    assert p.resolve() == {"document": "p: ", "query": "q: "}  # passage before corpus
    assert p.resolve(document="", query="Q ") == {"document": "", "query": "Q "}
    p = declared(prompts={"classification": "x: ", "query": "q: "}, default_prompt_name="classification")
    assert p.resolve() == {"document": "x: ", "query": "q: "}  # the default fills a missing role
    assert Prompts.read(tmp_path / "nothing-here").resolve() == {"document": "", "query": ""}
    with pytest.raises(ConfigError, match="default_prompt_name 'nope'"):
        declared(prompts={"query": "q: "}, default_prompt_name="nope")


def test_encode_with_prompt_equals_sentence_transformers(folder, st_model):
    encoder = TextEncoder.load(folder)
    assert encoder.prompts.named == PROMPTS
    for role, name in (("query", "query"), ("document", "passage")):
        ours = encoder.encode(QUERIES, prompt=encoder.prompts.for_role(role))
        ref = st_model.encode(QUERIES, prompt_name=name, convert_to_numpy=True)
        np.testing.assert_allclose(ours, ref, atol=2e-5)
    plain = encoder.encode(QUERIES)
    assert np.abs(plain - ours).max() > 1e-2  # the prompt changes the vectors


def test_chunks_get_the_prompt_tokens_and_keep_their_spans():
    from embedingest.stages.chunker import Chunker

    tokenizer = load_tokenizer()
    texts = ["Short text about rivers.", " ".join(f"word{i}" for i in range(200))]
    units = [Unit(i, f"u{i}", text=t) for i, t in enumerate(texts)]

    def batches(prompt):
        cp = chunk_prompt(tokenizer, prompt, 48, 8)
        ds = TextChunkDataset(units, _bundled(), batch_size=64, max_tokens=cp.max_tokens, overlap=8,
                              pad_multiple=1)
        return cp, [item for item in with_prompt(ds, cp) if len(item["ids"])]

    (_, (plain,)), (cp, (prompted,)) = batches(""), batches("passage: ")
    prompt_ids = tokenizer("passage: ", add_special_tokens=False)["input_ids"]
    assert cp.ids == tuple(prompt_ids) and cp.after == 1 and cp.max_tokens == 48 - len(prompt_ids)
    windows = {(i, c.char_start): c.input_ids
               for i, t in enumerate(texts) for c in Chunker(tokenizer, cp.max_tokens, 8).chunk(t)}
    rows = list(prompted["chunks"])
    assert len(rows) == len(windows) > 3
    for r, ids, mask in zip(rows, prompted["input_ids"], prompted["attention_mask"]):
        window = windows[(r["unit_no"], r["char_start"])]
        got = ids[mask.bool()].tolist()
        assert got == window[:1] + prompt_ids + window[1:] and len(got) <= 48
        assert r["text"] == texts[r["unit_no"]][r["char_start"]:r["char_end"]]  # the source's span
    short = next(i for i, r in enumerate(rows) if r["unit_no"] == 0)
    got = prompted["input_ids"][short][prompted["attention_mask"][short].bool()].tolist()
    assert got == tokenizer("passage: " + texts[0])["input_ids"]  # as sentence-transformers has it
    # the same budget of 48 tokens holds fewer text tokens, so there are more chunks
    assert len(rows) > len(list(plain["chunks"]))
    assert chunk_prompt(tokenizer, "", 48, 8).ids == ()


def _bundled():
    from embedingest.stages.model_folder import resolve_model

    return resolve_model(None)[0]


def test_build_and_search_equal_sentence_transformers_prompt_names(tmp_path, folder, st_model):
    out = tmp_path / "idx"
    build_index([(str(i), d) for i, d in enumerate(DOCS)], out=str(out), model=str(folder), **FAST)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompts"] == {"document": "passage: ", "query": "query: "}
    vectors, texts, _ = stored_vectors(out)
    assert sorted(texts) == sorted(DOCS)  # the stored text is the source's, without the prompt
    ref = st_model.encode(texts, prompt_name="passage", convert_to_numpy=True)
    assert ((vectors * ref).sum(1)).min() >= 0.9999
    doc_ref = dict(zip(texts, ref))
    query_ref = st_model.encode(QUERIES, prompt_name="query", convert_to_numpy=True)
    with open_index(out) as index:  # applies the query prompt by itself
        assert index.query_prompt == "query: "
        hits = index.search(QUERIES, k=2)
    with open_index(out, query_prompt="") as bare:
        bare_hits = bare.search(QUERIES, k=1)
    for q, doc, h, b in zip(query_ref, DOCS, hits, bare_hits):
        assert h[0].text == doc
        assert h[0].score == pytest.approx(float(q @ doc_ref[doc]), abs=1e-4)
        assert abs(b[0].score - h[0].score) > 1e-3


@pytest.mark.slow
def test_cli_prompt_overrides_are_recorded_and_kept(tmp_path, folder):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, d in enumerate(DOCS):
        (corpus / f"{i}.txt").write_text(d)
    out = tmp_path / "idx"
    base = ["build-index", str(corpus), "--out", str(out), "--model", str(folder),
            "--num-workers", "0", "--batch-size", "4"]
    runner = CliRunner()
    r = runner.invoke(main, base + ["--doc-prompt", "search_document: ", "--query-prompt", "search_query: "])
    assert r.exit_code == 0, r.output
    manifest = lambda: json.loads((out / "manifest.json").read_text())  # noqa: E731
    assert manifest()["prompts"] == {"document": "search_document: ", "query": "search_query: "}
    vectors, texts, _ = stored_vectors(out)
    encoder = TextEncoder.load(folder)
    np.testing.assert_allclose(vectors, encoder.encode(texts, prompt="search_document: "), atol=2e-5)
    r = runner.invoke(main, base + ["--doc-prompt", "passage: "])
    assert r.exit_code == 1 and "built with document prompt 'search_document: '" in r.output
    (corpus / "4.txt").write_text("A new file, embedded with the index's own document prompt.")
    r = runner.invoke(main, base + ["--query-prompt", "Q: "])  # no --doc-prompt: the index's
    assert r.exit_code == 0, r.output
    assert manifest()["prompts"] == {"document": "search_document: ", "query": "Q: "}
    vectors, texts, _ = stored_vectors(out)
    np.testing.assert_allclose(vectors, encoder.encode(texts, prompt="search_document: "), atol=2e-5)
    r = runner.invoke(main, ["search", str(out), "whales", "--json", "-k", "1"])
    assert r.exit_code == 0, r.output
    (hit,) = json.loads(r.output)
    want = float(encoder.encode(["Q: whales"])[0] @ encoder.encode([DOCS[0]], prompt="search_document: ")[0])
    assert hit["text"] == DOCS[0] and hit["score"] == pytest.approx(want, abs=1e-4)


def test_pooling_that_leaves_the_prompt_out_is_refused(tmp_path):
    folder = copy_model(tmp_path / "instructor-like", prompts={"query": "Represent the query: "})
    pooling = folder / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "include_prompt": False}))
    encoder = TextEncoder.load(folder)
    with pytest.raises(ConfigError, match="include_prompt"):
        encoder.encode(["x"], prompt="Represent the query: ")
    with pytest.raises(ConfigError, match="include_prompt"):
        build_index([("1", "text")], out=str(tmp_path / "idx"), model=str(folder),
                    doc_prompt="Represent the document: ", **FAST)


def test_a_prompt_longer_than_the_chunk_is_refused(tmp_path, folder):
    with pytest.raises(ConfigError, match="takes .* of the 16 tokens"):
        build_index([("1", "text")], out=str(tmp_path / "idx"), model=str(folder), chunk_tokens=16,
                    overlap=2, doc_prompt="a very long prompt " * 3, **FAST)


def test_a_query_prompt_that_fills_the_model_is_refused_by_build_index(tmp_path, folder):
    """Recorded before, it left an index whose every search was refused (or, before that,
    gave every query the same hits); the build now refuses it before it writes anything."""
    out = tmp_path / "idx"
    with pytest.raises(ConfigError) as err:
        build_index([("1", "text")], out=str(out), model=str(folder), query_prompt="a " * 254, **FAST)
    assert str(err.value) == (
        f"the query prompt {'a ' * 30 + '...'!r} is 256 tokens long (with the model's own), and the model "
        "reads 256: no word of a query would be read, and every query would get the same hits; give a "
        "shorter prompt (--query-prompt, query_prompt=)")
    assert not (out / "manifest.json").exists()
    r = CliRunner().invoke(main, ["build-index", str(tmp_path), "--out", str(out), "--model", str(folder),
                                  "--query-prompt", "a " * 254])
    assert r.exit_code == 1 and "is 256 tokens long" in r.output and not (out / "manifest.json").exists()
    with pytest.raises(ConfigError, match="is 256 tokens long"):  # the parent holds no encoder then
        build_index([("1", "text")], out=str(out), model=str(folder), query_prompt="a " * 254,
                    devices="cpu,cpu", **FAST)
    assert not (out / "manifest.json").exists()
    build_index([("1", "text")], out=str(out), model=str(folder), query_prompt="a " * 253, **FAST)
    with open_index(out) as index:  # one token of a query is read
        assert index.query_prompt == "a " * 253 and len(index.search(["text"], k=1)[0]) == 1

"""The search server's app through Starlette's TestClient: results equal the library's,
files only from the corpus, bad requests a 4xx with a message."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from embedingest import build_index, open_index  # noqa: E402
from embedingest.serve.app import corpus_file, create_app  # noqa: E402

PARAGRAPHS = {
    "bread.txt": "Bread rises because yeast ferments sugars and releases carbon dioxide into the dough.",
    "net/tcp.md": "TCP provides reliable, ordered delivery of a stream of bytes between applications.",
    "whales.txt": "Whales are marine mammals that breathe air through blowholes on top of their heads.",
}
RECORDS = [{"id": "v1", "text": "Volcanoes form where magma reaches the surface through the crust."},
           {"id": "e1", "text": "Mount Everest is the highest mountain above sea level on Earth."}]


def make_corpus(root):
    for name, text in PARAGRAPHS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    corpus = make_corpus(root / "corpus")
    build_index(corpus, out=str(root / "idx"), num_workers=0, num_consumers=1, batch_size=8)
    with open_index(root / "idx") as index:
        yield index


@pytest.fixture(scope="module")
def client(index):
    with TestClient(create_app(index)) as client:
        yield client


def test_search_json_equals_the_library(client, index):
    r = client.get("/search", params={"q": "how does bread rise", "k": 3})
    assert r.status_code == 200
    data = r.json()
    (want,) = index.search(["how does bread rise"], k=3)
    assert data["k"] == 3 and data["query"] == "how does bread rise" and data["took_ms"] > 0
    assert [(h["id"], h["source"], h["text"]) for h in data["hits"]] == [(h.id, h.source, h.text) for h in want]
    first = data["hits"][0]
    assert first["text"] == PARAGRAPHS["bread.txt"] and first["source"] == "bread.txt"
    assert first["score"] == pytest.approx(want[0].score, abs=1e-6)
    assert (first["char_start"], first["char_end"]) == (0, len(PARAGRAPHS["bread.txt"]))
    assert first["file"] == f"/files/{first['id']}?source=bread.txt" and first["rank"] == 1


def test_files_of_the_corpus_only(client, index):
    hits = {h["source"]: h for h in client.get("/search", params={"q": "volcano magma tcp", "k": 10}).json()["hits"]}
    r = client.get(hits["net/tcp.md"]["file"])
    assert r.status_code == 200 and r.text == PARAGRAPHS["net/tcp.md"]
    assert r.headers["content-type"].startswith("text/plain")
    assert r.headers["x-content-type-options"] == "nosniff"
    jsonl = hits["records.jsonl"]
    assert jsonl["record_id"] in ("v1", "e1") and jsonl["file"] is not None
    assert client.get("/files/12345678?source=bread.txt").status_code == 404
    r = client.get(f"/files/{hits['net/tcp.md']['id']}")  # no source: a link from before they had one
    assert r.status_code == 404 and "search again for a current link" in r.json()["detail"]
    for bad in ("-1", "99999999999999999999999", "abc", "..%2F..%2Fetc%2Fpasswd"):
        assert client.get(f"/files/{bad}?source=bread.txt").status_code in (404, 422), bad
    # another file's name with this chunk's id: refused, not served (the id decides the file)
    r = client.get(f"/files/{hits['net/tcp.md']['id']}", params={"source": "bread.txt"})
    assert r.status_code == 404 and "is not a chunk of 'bread.txt' in the index now" in r.json()["detail"]


def test_a_link_made_before_a_rebuild_serves_no_other_file(tmp_path):
    """--overwrite numbers the files again: the link to b.txt's chunk named a.txt's (a
    file added since) and served it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "b.txt").write_text("Bananas are yellow and grow in bunches on large plants.")
    (corpus / "c.txt").write_text("Cars have four wheels and an engine under the bonnet.")
    out = tmp_path / "idx"
    build_index(corpus, out=str(out), num_workers=0, num_consumers=1)
    with open_index(out) as first, TestClient(create_app(first)) as c:
        link = c.get("/search", params={"q": "bananas", "k": 1}).json()["hits"][0]["file"]
        assert c.get(link).text.startswith("Bananas")
    (corpus / "a.txt").write_text("Apples: a private diary entry.")
    build_index(corpus, out=str(out), num_workers=0, num_consumers=1, overwrite=True)
    with open_index(out) as rebuilt, TestClient(create_app(rebuilt)) as c:
        r = c.get(link)
        assert r.status_code == 404 and "rebuilt since this link was made" in r.json()["detail"]
        assert c.get(c.get("/search", params={"q": "bananas", "k": 1}).json()["hits"][0]["file"]).text.startswith(
            "Bananas")


def test_files_whose_names_are_not_utf8_or_hold_a_backslash_are_their_own(tmp_path):
    """A key holding an escape (``caf\\xe9.txt`` for the byte 0xe9) was joined to the corpus
    folder as it is, naming another file, one named with those four characters."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    try:
        (corpus / os.fsdecode(b"caf\xe9.txt")).write_text("Elephants and giraffes live on the savanna.")
    except (OSError, UnicodeError):
        pytest.skip("this file system takes only UTF-8 names")
    (corpus / "caf\\xe9.txt").write_text("SECRET database passwords")
    (corpus / "back\\slash.txt").write_text("Backslashes separate folders on another system.")
    out = tmp_path / "idx"
    build_index(corpus, out=str(out), num_workers=0, num_consumers=1)
    with open_index(out) as index, TestClient(create_app(index)) as c:
        for query, source, text in (("elephants on the savanna", "caf\\xe9.txt", "Elephants"),
                                    ("database passwords", "caf\\\\xe9.txt", "SECRET"),
                                    ("backslashes separate folders", "back\\\\slash.txt", "Backslashes")):
            hit = c.get("/search", params={"q": query, "k": 1}).json()["hits"][0]
            assert hit["source"] == source and hit["file"] is not None, hit
            assert c.get(hit["file"]).text.startswith(text), source


def test_corpus_file_never_leaves_the_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "in.txt").write_text("inside")
    (tmp_path / "secret.txt").write_text("outside")
    (corpus / "link.txt").symlink_to(tmp_path / "secret.txt")
    index = SimpleNamespace(manifest=SimpleNamespace(corpus_path=str(corpus)))
    assert corpus_file(index, "in.txt") == (corpus / "in.txt").resolve()
    for source in ("../secret.txt", "link.txt", "/etc/passwd", "missing.txt", "record:1", None, "", "."):
        assert corpus_file(index, source) is None, source
    assert corpus_file(SimpleNamespace(manifest=SimpleNamespace(corpus_path=None)), "in.txt") is None


def test_an_index_of_one_file_serves_that_file_alone(tmp_path):
    """build-index FILE records the file itself: its hits link to it, and to no file beside it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "notes.txt").write_text("the notes")
    (corpus / "other.txt").write_text("another file")
    (tmp_path / "secret.txt").write_text("outside")
    (corpus / "link.txt").symlink_to(tmp_path / "secret.txt")
    index = SimpleNamespace(manifest=SimpleNamespace(corpus_path=str(corpus / "notes.txt")))
    assert corpus_file(index, "notes.txt") == (corpus / "notes.txt").resolve()
    for source in ("other.txt", "../secret.txt", "link.txt", "notes.txt/..", "", None):
        assert corpus_file(index, source) is None, source
    linked = SimpleNamespace(manifest=SimpleNamespace(corpus_path=str(corpus / "link.txt")))
    assert corpus_file(linked, "link.txt") is None, "a link out of the folder is never followed"


@pytest.mark.parametrize("params,fragment", [
    ({}, "Field required"),
    ({"q": ""}, "empty"),
    ({"q": "   \n\t "}, "empty"),
    ({"q": "\x00\x01 \x7f"}, "empty"),  # control characters only: the tokenizer drops them
    ({"q": "\ufffd"}, "nothing the model reads"),  # printable, but the tokenizer drops it
    ({"q": "\u0301\u0302 \u00ad"}, "nothing the model reads"),  # lone accents, a soft hyphen
    ({"q": "\U0001f600\U0001f600"}, "knows none of its characters"),  # [UNK] only: arbitrary hits before
    ({"q": "x" * 50_000}, "50,000 characters"),  # 10 MB: see test_server.py (the client refuses it)
    ({"q": "bread", "k": 0}, "greater than or equal to 1"),
    ({"q": "bread", "k": 10**9}, "less than or equal to 100"),
    ({"q": "bread", "k": -3}, "greater than or equal to 1"),
    ({"q": "bread", "k": "ten"}, "valid integer"),
    ({"q": "bread", "k": 2.5}, "valid integer"),
])
def test_bad_requests_get_a_4xx_with_a_message(client, params, fragment):
    t0 = time.perf_counter()
    r = client.get("/search", params=params)
    assert r.status_code == 422, r.text
    assert fragment in json.dumps(r.json()["detail"])
    assert time.perf_counter() - t0 < 10


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(q=st.text(max_size=300), k=st.one_of(st.integers(-5, 200), st.text(max_size=5), st.none()))
def test_any_query_is_answered_or_refused_never_a_500(client, q, k):
    params = {"q": q} if k is None else {"q": q, "k": k}
    r = client.get("/search", params=params)
    assert r.status_code in (200, 422), (r.status_code, r.text)
    if r.status_code == 200:
        assert len(r.json()["hits"]) <= min(5, int(k) if k is not None else 10)


def test_concurrent_requests_agree(client):
    queries = ["bread", "whales breathe", "tcp streams", "highest mountain"] * 3

    def ask(q):
        return client.get("/search", params={"q": q, "k": 2}).json()["hits"][0]["id"]

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, queries))
    assert got == [ask(q) for q in queries]


def test_page_and_info(client, index):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="q"' in page.text and "/search?q=" in page.text
    info = client.get("/info").json()
    assert info["vectors"] == index.ntotal == 5 and info["model"] == "sentence-transformers/all-MiniLM-L6-v2"


def test_a_build_that_changes_the_served_index_is_picked_up_by_the_next_request(tmp_path, caplog):
    """build-index while serving: the next request answers from the changed index (a
    removed file's text gone, an edited file's new text, its /files link serving what the
    hit says), with the same query encoder; an index that cannot be opened again leaves
    the old one answering, logged. Before, the server answered from the index it started
    with until restarted."""
    from embedingest.serve.live import LiveIndex

    corpus = make_corpus(tmp_path / "corpus")
    out = str(tmp_path / "idx")
    build_index(corpus, out=out, num_workers=0, num_consumers=1, batch_size=8)

    def reopen(encoder):
        return open_index(out, encoder=encoder)

    live = LiveIndex(open_index(out), reopen, check_every=0)
    with TestClient(create_app(live)) as client:
        first = client.get("/search", params={"q": "marine mammals breathing air", "k": 1}).json()["hits"][0]
        assert first["source"] == "whales.txt"
        encoder = live.current().loaded_encoder
        assert encoder is not None
        (corpus / "whales.txt").unlink()
        (corpus / "bread.txt").write_text("Sourdough starters keep wild yeast and lactobacilli alive for years.")
        build_index(corpus, out=out, num_workers=0, num_consumers=1, batch_size=8)
        hits = client.get("/search", params={"q": "marine mammals breathing air", "k": 5}).json()["hits"]
        assert "whales.txt" not in [h["source"] for h in hits] and len(hits) == 4
        (bread,) = [h for h in client.get("/search", params={"q": "wild yeast", "k": 5}).json()["hits"]
                    if h["source"] == "bread.txt"]
        assert bread["text"].startswith("Sourdough starters")
        assert client.get(bread["file"]).text == bread["text"]
        assert live.current().loaded_encoder is encoder  # same model: not loaded again
        assert client.get("/info").json()["vectors"] == 4

        manifest = tmp_path / "idx" / "manifest.json"
        good = manifest.read_bytes()
        manifest.write_text("not json")
        hits = client.get("/search", params={"q": "wild yeast", "k": 5}).json()["hits"]
        assert [h["source"] for h in hits if h["source"] == "bread.txt"] == ["bread.txt"]
        assert any("changed but cannot be opened again" in r.getMessage() for r in caplog.records)
        manifest.write_bytes(good)
    live.close()

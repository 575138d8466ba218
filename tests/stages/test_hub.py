"""Hugging Face ids: found in a local hub cache made in a temporary folder, never downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from model_fixtures import BUNDLED, REVISION, hub_cache  # noqa: E402

from embedingest.errors import ConfigError  # noqa: E402
from embedingest.stages.encoder import TextEncoder  # noqa: E402
from embedingest.stages.hub import cache_folder, is_hub_id  # noqa: E402
from embedingest.stages.model_folder import BUNDLED_NAME, resolve_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache that this process's huggingface_hub reads."""
    from huggingface_hub import constants

    folder = tmp_path / "hf" / "hub"
    folder.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    return folder


def test_the_layout_is_huggingface_hubs_own(cache):
    from huggingface_hub import scan_cache_dir

    snapshot = hub_cache(cache, "acme/mini")
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == "acme/mini" and repo.repo_type == "model"
    (rev,) = repo.revisions
    assert rev.commit_hash == REVISION and rev.snapshot_path == snapshot
    assert {f.file_name for f in rev.files} >= {"config.json", "model.safetensors", "modules.json"}


def test_hub_id_loads_the_cached_snapshot(cache):
    snapshot = hub_cache(cache, "acme/mini")
    assert cache_folder() == cache
    assert resolve_model("acme/mini") == (snapshot.resolve(), "acme/mini")
    # the snapshot folder given as a path keeps the hub id as its name
    assert resolve_model(str(snapshot)) == (snapshot.resolve(), "acme/mini")
    encoder = TextEncoder.load("acme/mini")
    assert encoder.info()["name"] == "acme/mini" and encoder.model_dir == snapshot.resolve()
    texts = ["a hub id is how users name a model", "the cache is read, never filled"]
    np.testing.assert_allclose(encoder.encode(texts), TextEncoder.load().encode(texts), atol=1e-6)


def test_missing_id_names_the_cache_and_the_id(cache):
    hub_cache(cache, "acme/mini")
    with pytest.raises(ConfigError) as err:
        resolve_model("acme/other-model")
    assert "'acme/other-model'" in str(err.value) and str(cache) in str(err.value)
    assert "never downloads" in str(err.value)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model("./no/such/folder/here")


def test_bundled_id_needs_no_cache_entry(cache):
    assert not any(cache.iterdir())
    assert resolve_model(BUNDLED_NAME) == (BUNDLED, BUNDLED_NAME)
    assert TextEncoder.load(BUNDLED_NAME).info()["name"] == BUNDLED_NAME


@pytest.mark.parametrize("value,expected", [
    ("acme/mini", True), ("bert-base-uncased", True), (BUNDLED_NAME, True),
    ("a/b/c", False), ("./model", False), ("../model", False), ("~/model", False),
    ("/abs/path", False), ("has space/x", False), ("", False)])
def test_is_hub_id(value, expected):
    assert is_hub_id(value) is expected


@pytest.mark.slow
def test_cli_build_by_hub_id_reads_hf_home(tmp_path):
    """HF_HOME as users set it, in a fresh process: huggingface_hub reads it at import."""
    hub_cache(tmp_path / "hf" / "hub", "acme/mini")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Bread rises because yeast ferments sugars into carbon dioxide.")
    (corpus / "b.txt").write_text("TCP delivers an ordered stream of bytes between programs.")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_HUB_CACHE", None)
    out = tmp_path / "idx"
    cli = [sys.executable, "-m", "embedingest"]
    done = subprocess.run(
        [*cli, "build-index", str(corpus), "--out", str(out), "--model",
         "acme/mini", "--num-workers", "0", "--json"], env=env, capture_output=True, text=True,
        timeout=240)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["name"] == "acme/mini"
    assert manifest["model"]["path"].startswith(str(tmp_path / "hf" / "hub"))
    missing = subprocess.run(
        [*cli, "build-index", str(corpus), "--out", str(tmp_path / "x"),
         "--model", "acme/absent"], env=env, capture_output=True, text=True, timeout=240)
    assert missing.returncode == 1
    assert "Traceback" not in missing.stderr and "'acme/absent'" in missing.stderr and str(tmp_path / "hf" / "hub") in missing.stderr


def test_a_moved_index_finds_its_model_by_hub_id(tmp_path, cache):
    from embedingest import build_index, open_index

    hub_cache(cache, "acme/mini")
    out = tmp_path / "idx"
    build_index([("1", "whales breathe air through blowholes"), ("2", "volcanoes erupt magma")],
                out=str(out), model="acme/mini", num_workers=0, num_consumers=1, batch_size=4)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["model"]["path"] = "/built/on/another/machine"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with open_index(out) as index:
        (hits,) = index.search("how do whales breathe", k=1)
        assert index.encoder.info()["name"] == "acme/mini"
    assert hits[0].record_id == "1"

